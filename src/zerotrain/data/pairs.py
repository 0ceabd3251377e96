"""Preference pairs: records of a prompt with a chosen and a rejected completion, as token ids cut to the window.

    {"prompt": "...", "chosen": "...", "rejected": "..."}                       plain text
    {"prompt": [messages], "chosen": [messages], "rejected": [messages]}        conversational
    {"chosen": [messages], "rejected": [messages]}                              an implicit prompt: the messages the
                                                                                two have in common from the start

(TRL's preference formats.) The prompt and each completion are encoded as TRL's DPOTrainer encodes them: the prompt
alone (a conversation rendered with the model's chat template and its generation prompt; plain text with the
tokenizer's BOS) and the prompt followed by each completion as one text (a conversation: prompt and completion
rendered together; plain text: with the end-of-text token after it, unless the completion ends with it). A
completion's tokens are those its encoding adds after the prompt's: where the encodings of the prompt and of the
prompt with it first differ (the common prefix of the three), so a token the tokenizer merges across the boundary
belongs to the completion. BOS and the end-of-turn token are where the template puts them: a template that writes
BOS gets none added (data.jsonl.missing_bos), and nothing is added after its end of turn.

A pair is cut to the training window of seq_len + 1 tokens (seq_len inputs and their targets) keeping the
boundary: the prompt is cut from the left first (the context nearest the completion stays), down to one token;
then both completions from the right, never below one token each. Chosen and rejected keep the same prompt, so
they are scored on the same context. A record whose chosen or rejected completion adds no token (or whose prompt
has none: its first completion token would follow nothing) is dropped. The
start line counts the pairs, the prompts and completions cut and the records dropped.
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass

import numpy as np
import torch

from zerotrain.errors import ConfigError

from .batches import IGNORE, BatchSchedule, MicroBatch, StepBatch
from .chat import ChatTemplate, check_messages
from .jsonl import SplitOf, common_prefix, iter_records, missing_bos, record_tokenizer, split_stem

SHAPE = '{"prompt", "chosen", "rejected"} (text, or lists of {"role", "content"} messages; without "prompt", ' \
    'chosen and rejected conversations sharing their first messages)'


@dataclass(frozen=True)
class Pair:
    """One preference pair's token ids: the shared prompt, and the two completions that follow it."""

    prompt: tuple[int, ...]
    chosen: tuple[int, ...]
    rejected: tuple[int, ...]


@dataclass
class PairCounts:
    """What encoding and cutting did to the records: for the start line."""

    records: int = 0
    dropped: int = 0  # a completion that adds no token
    prompts_cut: int = 0
    completions_cut: int = 0

    def describe(self) -> str:
        return (f"{self.records - self.dropped:,} pairs ({self.prompts_cut} prompt{'s' * (self.prompts_cut != 1)} cut "
                f"from the left, {self.completions_cut} pair{'s' * (self.completions_cut != 1)} with completions cut, "
                f"{self.dropped} record{'s' * (self.dropped != 1)} dropped: a completion without tokens or a prompt "
                "without one)")


def parse_pair(record, where: str) -> tuple[str, object, object, object]:
    """("text", prompt, chosen, rejected) with strings, or ("chat", prompt, chosen, rejected) with message lists (an
    implicit prompt split off); ConfigError naming `where` for anything else."""
    if not isinstance(record, dict) or "chosen" not in record or "rejected" not in record:
        keys = ", ".join(sorted(record)) if isinstance(record, dict) else type(record).__name__
        raise ConfigError(f"{where}: not a preference pair ({keys}): --method dpo reads {SHAPE}")
    chosen, rejected, prompt = record["chosen"], record["rejected"], record.get("prompt")
    if isinstance(chosen, str) and isinstance(rejected, str):
        if not isinstance(prompt, str):
            raise ConfigError(f"{where}: plain-text chosen and rejected need a \"prompt\" string, got {prompt!r}")
        return ("text", prompt, chosen, rejected)
    messages = [_messages(v, name, where) for name, v in (("chosen", chosen), ("rejected", rejected))]
    if prompt is None or isinstance(prompt, str):  # implicit: the messages both start with (TRL's extract_prompt)
        common = 0
        while common < min(map(len, messages)) and messages[0][common] == messages[1][common]:
            common += 1
        prompt, chosen, rejected = messages[0][:common], messages[0][common:], messages[1][common:]
    else:
        prompt, (chosen, rejected) = _messages(prompt, "prompt", where, assistant=False), messages
    if not prompt:
        raise ConfigError(f"{where}: no prompt: chosen and rejected share no first message and there is no "
                          "\"prompt\"")
    if not chosen or not rejected:
        raise ConfigError(f"{where}: chosen and rejected are the same conversation: nothing to prefer")
    return ("chat", prompt, chosen, rejected)


def _messages(value, name: str, where: str, assistant: bool = True) -> list[dict]:
    if not isinstance(value, list):
        raise ConfigError(f"{where}: \"{name}\" is {value!r}: text in all three fields, or message lists")
    if not value:
        return []
    if assistant:
        return check_messages({"messages": value}, f"{where} ({name})")[0]
    return check_messages({"messages": value + [{"role": "assistant", "content": ""}]}, f"{where} ({name})")[0][:-1]


def encode_pair(parsed: tuple, tok, chat: ChatTemplate | None, where: str) -> Pair:
    """The pair's prompt and completions as token ids (the module docstring's rule)."""
    kind, prompt, chosen, rejected = parsed
    prefix, eot = list(tok.prefix_ids), tok.eot_id
    if kind == "chat":
        texts = [chat.prompt(prompt, where), chat.render(prompt + chosen, where)[0],
                 chat.render(prompt + rejected, where)[0]]
        ids = [e.ids for e in tok.encode_pieces(texts)]
        ids = [missing_bos(i, prefix) + i for i in ids]
    else:
        ids = [prefix + e.ids for e in tok.encode_pieces([prompt, prompt + chosen, prompt + rejected])]
        ids[1:] = [i if i[-1:] == [eot] else i + [eot] for i in ids[1:]]
    p = min(common_prefix(ids[0], ids[1]), common_prefix(ids[0], ids[2]))
    return Pair(tuple(ids[0][:p]), tuple(ids[1][p:]), tuple(ids[2][p:]))


def fit(pair: Pair, length: int) -> tuple[Pair, bool, bool]:
    """The pair cut to `length` tokens a row (prompt + the longer completion), and whether its prompt and its
    completions were cut: the prompt from the left first, down to one token, then each completion from the right,
    never below one token."""
    longest = max(len(pair.chosen), len(pair.rejected))
    keep = max(1, min(len(pair.prompt), length - longest))
    room = length - keep
    prompt = pair.prompt[len(pair.prompt) - keep :]
    chosen, rejected = pair.chosen[: max(1, room)], pair.rejected[: max(1, room)]
    return Pair(prompt, chosen, rejected), keep < len(pair.prompt), longest > room


def read_pairs(path: str, tokenizer_folder: str, seq_len: int, split: str | None = None, val_fraction: float = 0.0,
               flag: str = "--data") -> tuple[list[Pair], PairCounts]:
    """Every pair of the records in `path` (with `split`, those of its "train" or "val" split: a record's split is
    SplitOf's rule over its index, as `zerotrain prepare` splits records, with `val_fraction`), encoded with the
    tokenizer (and chat template) of `tokenizer_folder` and cut to seq_len + 1 tokens a row; ConfigError naming the
    first bad record, or a file without pairs."""
    if not os.path.isfile(path):
        raise ConfigError(f"{flag} {path}: --method dpo reads a file of preference records: {SHAPE}")
    tok = record_tokenizer(tokenizer_folder)
    if not hasattr(tok, "prefix_ids"):
        raise ConfigError(f"--init-from {tokenizer_folder}: --method dpo needs the model's tokenizer.json")
    records = list(iter_records(path))
    if split is not None:
        split_of = SplitOf(split_stem(path), len(records), val_fraction)
        records = [r for i, r in enumerate(records) if split_of(i) == split]
    chat, counts, pairs = None, PairCounts(), []
    for where, value in records:
        parsed = parse_pair(value, where)
        if parsed[0] == "chat":
            chat = chat or ChatTemplate.of(tok, where)
        pair = encode_pair(parsed, tok, chat, where)
        counts.records += 1
        if not (pair.prompt and pair.chosen and pair.rejected):  # nothing to score, or no token to score it after
            counts.dropped += 1
            continue
        pair, prompt_cut, completion_cut = fit(pair, seq_len + 1)
        counts.prompts_cut += prompt_cut
        counts.completions_cut += completion_cut
        pairs.append(pair)
    if not pairs:
        held = f" in its {split} split (--val-fraction {val_fraction:g})" if split else ""
        raise ConfigError(f"{flag} {path}: no preference pairs{held} ({counts.records} records, {counts.dropped} "
                          "dropped)")
    return pairs, counts


def read_splits(source: str, val_data: str, val_fraction: float, held_out: bool, tokenizer_folder: str,
                seq_len: int) -> tuple[tuple[list[Pair], PairCounts], tuple[list[Pair], PairCounts] | None]:
    """The training pairs and, when `held_out` (--eval-every), the validation pairs with their counts: --val-data's
    pairs (--data's all train), or --data's records split by --val-fraction."""
    if not held_out:
        return read_pairs(source, tokenizer_folder, seq_len), None
    if val_data:
        return (read_pairs(source, tokenizer_folder, seq_len),
                read_pairs(val_data, tokenizer_folder, seq_len, flag="--val-data"))
    return (read_pairs(source, tokenizer_folder, seq_len, "train", val_fraction),
            read_pairs(source, tokenizer_folder, seq_len, "val", val_fraction))


def pairs_digest(pairs: list[Pair]) -> str:
    """sha256 of the pairs' token ids as training reads them: what the stored reference log-probs are keyed by."""
    h = hashlib.sha256()
    for pair in pairs:
        for ids in pair.prompt, pair.chosen, pair.rejected:
            h.update(np.asarray(ids, dtype="<i8").tobytes())
            h.update(b"|")
    return h.hexdigest()


def _rng(seed: int, epoch: int) -> np.random.Generator:
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, 0xD90])))


class PreferenceSource:
    """The pairs in epochs: row i of step s's global batch of G pairs is pair order[(s G + i) mod N] of epoch
    (s G + i) // N, each epoch a seeded permutation of the N pairs; a pure function of (seed, step, G, i), as every
    source is. A micro-batch of B pairs is 2B rows: the chosen rows, then the rejected rows, each padded to
    seq_len."""

    unit = ("pairs", 2)  # what the global batch counts, and the rows each is

    def __init__(self, pairs: list[Pair], counts: PairCounts, seq_len: int, seed: int, global_batch: int, name: str):
        self.pairs, self.counts, self.seq_len, self.seed = pairs, counts, seq_len, seed
        self.global_batch, self.name = global_batch, name
        self._orders: dict[int, np.ndarray] = {}
        self.held_out = ""  # the validation pairs, as the start line says them

    def describe(self) -> str:
        return f"{self.name}: {self.counts.describe()}" + (f"; {self.held_out}" if self.held_out else "")

    def pair_index(self, step: int, index: int) -> int:
        position = step * self.global_batch + index
        epoch, k = divmod(position, len(self.pairs))
        if epoch not in self._orders:
            self._orders[epoch] = _rng(self.seed, epoch).permutation(len(self.pairs))
        return int(self._orders[epoch][k])

    def rows(self, ids: list[int]) -> MicroBatch:
        """The micro-batch of pairs `ids`: chosen rows, then rejected rows; labels are the completions' tokens."""
        T, B = self.seq_len, len(ids)
        inputs = torch.zeros((2 * B, T), dtype=torch.int64)
        labels = torch.full((2 * B, T), IGNORE, dtype=torch.int64)
        for row, (j, side) in enumerate([(j, "chosen") for j in ids] + [(j, "rejected") for j in ids]):
            pair = self.pairs[j]
            tokens = pair.prompt + getattr(pair, side)
            n = len(tokens) - 1
            inputs[row, :n] = torch.tensor(tokens[:-1])
            labels[row, len(pair.prompt) - 1 : n] = torch.tensor(tokens[len(pair.prompt) :])
        return MicroBatch(inputs, labels)

    def sequences(self, step: int, indices: range) -> MicroBatch:
        return self.rows([self.pair_index(step, i) for i in indices])

    def token_count(self, step: int, global_batch: int) -> int:
        """The completion tokens the step scores, both sides of every pair."""
        return sum(len(p.chosen) + len(p.rejected) for p in (self.pairs[self.pair_index(step, i)]
                                                              for i in range(global_batch)))


@dataclass
class PairBatch(StepBatch):
    """A step's micro-batches of pairs, with the pair ids of each (the reference is looked up by them)."""

    pair_ids: list[list[int]] | None = None
    global_pairs: int = 0


class PreferenceSchedule(BatchSchedule):
    """The batch schedule over pairs: --micro-batch pairs (2 x rows) per micro-batch; the global batch counts pairs."""

    def batch(self, step: int) -> PairBatch:
        per_rank = self.micro_batch * self.accum
        first = self.rank * per_rank
        ids = [[self.source.pair_index(step, i) for i in range(lo, lo + self.micro_batch)]
               for lo in range(first, first + per_rank, self.micro_batch)]
        rows = [self.source.rows(i) for i in ids]  # --cp: this rank's part of each (BatchSchedule's `part`)
        return PairBatch([self.part(r) for r in rows] if self.part else rows,
                         self.source.token_count(step, self.global_batch),
                         pair_ids=ids, global_pairs=self.global_batch)
