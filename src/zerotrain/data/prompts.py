"""GRPO's prompts: records of a prompt (and the fields its reward functions read), as token ids, drawn per step.

    {"prompt": "...", "answer": "42", ...}                                   plain text
    {"prompt": [{"role": "user", "content": "..."}], ...}                    conversational

(TRL's prompt-only format.) A plain prompt is encoded as TRL's GRPOTrainer encodes it, the tokenizer's own way (its
post-processor's BOS first); a conversation is rendered with the model's chat template and its generation prompt
(data.jsonl.encode_chat_prompt). Every other field of a record is a column: the reward functions get it as a keyword
list, one value per completion (TRL's). A prompt that leaves no room for --max-completion-length tokens in the
model's --seq-len is refused in one line: the loss's forward sees a completion whole, after its whole prompt.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field

import numpy as np

from zerotrain.errors import ConfigError

from .chat import ChatTemplate, check_messages
from .jsonl import encode_chat_prompt, iter_records, record_tokenizer

SHAPE = '{"prompt": text or a list of {"role", "content"} messages, other fields for the rewards}'


@dataclass(frozen=True)
class Prompt:
    """One record: its prompt as given (text or messages: what the reward functions get), its token ids, and its
    other fields."""

    text: object
    ids: tuple[int, ...]
    columns: dict = field(default_factory=dict)

    @property
    def conversational(self) -> bool:
        return isinstance(self.text, list)


def parse_prompt(record, where: str) -> tuple[object, dict]:
    """(the prompt, the record's other fields); ConfigError naming `where` for a record without a usable prompt."""
    if not isinstance(record, dict) or "prompt" not in record:
        keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"{where}: no \"prompt\" ({keys}): --method grpo reads {SHAPE}")
    prompt, columns = record["prompt"], {k: v for k, v in record.items() if k != "prompt"}
    if isinstance(prompt, str):
        if not prompt:
            raise ConfigError(f"{where}: an empty \"prompt\"")
        return prompt, columns
    if not isinstance(prompt, list) or not prompt:
        raise ConfigError(f"{where}: \"prompt\" is {str(prompt)[:80]}: text, or a list of {{\"role\", \"content\"}} "
                          "messages")
    # the messages checked as a conversation that the assistant answers next
    check_messages({"messages": prompt}, where, to_reply=True)
    return prompt, columns


def read_prompts(path: str, tokenizer_folder: str, seq_len: int, max_completion_length: int) -> list[Prompt]:
    """Every prompt of the records in `path`, encoded with the tokenizer (and chat template) of `tokenizer_folder`;
    ConfigError naming the first bad record, a prompt too long, or a file without prompts."""
    if not os.path.isfile(path):
        raise ConfigError(f"--data {path}: --method grpo reads a file of prompt records: {SHAPE}")
    tok = record_tokenizer(tokenizer_folder)
    if not hasattr(tok, "prefix_ids"):
        raise ConfigError(f"--init-from {tokenizer_folder}: --method grpo needs the model's tokenizer.json")
    room = seq_len - max_completion_length
    chat, prompts = None, []
    for where, value in iter_records(path):
        text, columns = parse_prompt(value, where)
        if isinstance(text, list):
            chat = chat or ChatTemplate.of(tok, where)
            ids = encode_chat_prompt(tok, chat, text, where)
        else:
            ids = list(tok.prefix_ids) + tok.encode_pieces([text])[0].ids
        if len(ids) > room:
            raise ConfigError(f"{where}: a prompt of {len(ids)} tokens leaves no room for --max-completion-length "
                              f"{max_completion_length} in --seq-len {seq_len}: shorten it, or raise --seq-len (up to "
                              "the model's positions)")
        prompts.append(Prompt(text, tuple(ids), columns))
    if not prompts:
        raise ConfigError(f"--data {path}: no prompts")
    return prompts


class PromptSource:
    """The prompts in epochs: prompt i of step s's P prompts is order[(s P + i) mod N] of epoch (s P + i) // N, each
    epoch a seeded permutation of the N prompts; a pure function of (seed, step, P, i), as every source is."""

    unit = ("completions", 1)  # what the global batch counts, and the rows each is

    def __init__(self, prompts: list[Prompt], seed: int, per_step: int, name: str):
        self.prompts, self.seed, self.per_step, self.name = prompts, seed, per_step, name
        self._orders: dict[int, np.ndarray] = {}

    def describe(self) -> str:
        kinds = {p.conversational for p in self.prompts}
        kind = "conversations" if kinds == {True} else "texts" if kinds == {False} else "texts and conversations"
        return f"{self.name}: {len(self.prompts)} prompts ({kind}), {self.per_step} a step"

    def prompt_index(self, step: int, index: int) -> int:
        position = step * self.per_step + index
        epoch, k = divmod(position, len(self.prompts))
        if epoch not in self._orders:
            self._orders[epoch] = np.random.Generator(np.random.PCG64(
                np.random.SeedSequence([self.seed, epoch, 0x6290]))).permutation(len(self.prompts))
        return int(self._orders[epoch][k])
