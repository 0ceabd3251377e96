"""Chat records: a conversation rendered with the model folder's chat template, and the spans of it the loss trains on.

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", ...}, {"role": "assistant", ...}, ...]}

The template is the folder's (`chat_template` in tokenizer_config.json, or chat_template.jinja) and
transformers renders it (its sandboxed jinja2 environment, with the `{% generation %}` extension),
given the folder's special tokens as transformers gives them (bos_token, eos_token, ...). The loss
counts the assistant's turns, the end-of-turn token the template puts inside them included:

- a template with `{% generation %}` markers says which characters those are itself (what
  transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` reads);
- a template without them (most shipped ones) is rendered on growing prefixes of the conversation:
  assistant turn k is what rendering messages[:k + 1] adds to messages[:k] with the generation prompt
  (its `<|im_start|>assistant\\n` is context, as at inference), up to the last special token it holds
  (its end-of-turn token: what comes after it, a newline between turns, is never generated). That
  needs each rendering to be a prefix of the next, checked on every record; a template that is not
  (one that rewrites earlier turns once a later one exists) is refused naming the record.

The characters become tokens in jsonl.py: a token is trained on when it overlaps a span, as transformers decides.
"""

from __future__ import annotations

import os
import re

from zerotrain.errors import ConfigError

from .tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG, read_json_object

ROLES = ("system", "user", "assistant")
GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
TEMPLATE_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # what templates read besides messages


def chat_template_of(folder: str) -> str | None:
    """The folder's chat template: tokenizer_config.json's `chat_template` (a string, or a list of named templates,
    of which "default"), else chat_template.jinja; None if it has neither."""
    config = read_json_object(folder, TOKENIZER_CONFIG)
    template = config.get("chat_template")
    if isinstance(template, list):
        template = next((t.get("template") for t in template if isinstance(t, dict) and t.get("name") == "default"),
                        None)
    if isinstance(template, str):
        return template
    path = os.path.join(folder, CHAT_TEMPLATE_FILE)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    return None


def check_messages(record: dict, where: str) -> list[dict]:
    """The record's messages; ConfigError naming `where` (file:line) if they are not a conversation to train on."""
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: \"messages\" is {messages!r}, not a list of {{\"role\", \"content\"}} objects")
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or "content" not in m:
            raise ConfigError(f"{where}: message {k} is {m!r}, not an object with \"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise ConfigError(f"{where}: message {k} has role {m['role']!r}; a role is one of {', '.join(ROLES)}")
        if not isinstance(m["content"], str):
            raise ConfigError(f"{where}: message {k} ({m['role']}) has content {m['content']!r}, not a string")
    if not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: no assistant message: the loss trains on the assistant's turns, and this "
                          "conversation has none")
    return [{"role": m["role"], "content": m["content"]} for m in messages]


class ChatTemplate:
    """A model folder's chat template and special tokens: conversation -> (text, character spans trained on)."""

    def __init__(self, template: str, folder: str, tokens: dict[str, str], specials: list[str]):
        self.template, self.folder, self.tokens = template, folder, tokens
        self.specials = [s for s in specials if s]  # the end of an assistant turn without markers: the last of these
        self.marked = bool(GENERATION_TAG.search(template))

    @classmethod
    def of(cls, tokenizer, where: str) -> "ChatTemplate":
        """The chat template of the BPE `tokenizer`'s folder; ConfigError naming `where` and the folder without one."""
        folder = getattr(tokenizer, "folder", None)
        template = chat_template_of(folder) if folder else None
        if template is None:
            named = f"{folder} has" if folder else "the byte tokenizer has"
            raise ConfigError(f"{where}: a chat record, and {named} no chat template (\"chat_template\" in "
                              f"{TOKENIZER_CONFIG} or {CHAT_TEMPLATE_FILE}): fine-tune an instruct model's folder "
                              "(--init-from, or prepare's --tokenizer), or write records as {\"prompt\", "
                              "\"completion\"}")
        config = read_json_object(folder, TOKENIZER_CONFIG)
        hf = tokenizer.tokenizer
        tokens = {k: v.get("content") if isinstance(v, dict) else v for k in TEMPLATE_TOKENS
                  if isinstance(v := config.get(k), (str, dict))}
        tokens.setdefault("eos_token", hf.id_to_token(tokenizer.eot_id))
        if tokenizer.prefix_ids:
            tokens.setdefault("bos_token", hf.id_to_token(tokenizer.prefix_ids[0]))
        specials = [hf.id_to_token(i) for i in tokenizer.special_ids]
        return cls(template, folder, tokens, specials)

    def render(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """The conversation as the template writes it, and the [start, end) character spans of its assistant turns."""
        if self.marked:
            texts, spans = self._render([messages], where, return_assistant_tokens_mask=True)
            return texts[0], [tuple(s) for s in spans[0]]
        text = self._text(messages, where)
        spans = []
        for k, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            before = self._text(messages[:k], where, add_generation_prompt=True)
            after = self._text(messages[: k + 1], where)
            if not (after.startswith(before) and text.startswith(after)):
                raise ConfigError(f"{where}: the chat template of {self.folder} does not render this conversation as "
                                  f"a growing prefix (assistant message {k} changes what comes before it), so its "
                                  "assistant turns cannot be told apart: mark them with {% generation %} ... "
                                  "{% endgeneration %} in the template")
            turn = after[len(before) :]
            ends = [turn.rfind(s) + len(s) for s in self.specials if s in turn]
            spans.append((len(before), len(before) + (max(ends) if ends else len(turn))))
        return text, spans

    def prompt(self, messages: list[dict], where: str) -> str:
        """The conversation with the assistant's turn opened (the generation prompt): what a reply is generated after,
        and what training reads as the context of an assistant turn."""
        return self._text(messages, where, add_generation_prompt=True)

    def _text(self, messages: list[dict], where: str, add_generation_prompt: bool = False) -> str:
        return self._render([messages], where, add_generation_prompt=add_generation_prompt)[0][0]

    def _render(self, conversations: list[list[dict]], where: str, **options):
        try:
            from jinja2 import TemplateError
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError:
            raise ConfigError(f"{where}: chat records are rendered by transformers, which is not installed: "
                              "pip install 'zerotrain[hf]'") from None

        try:
            return render_jinja_template(conversations, chat_template=self.template, **options, **self.tokens)
        except TemplateError as e:
            raise ConfigError(f"{where}: the chat template of {self.folder} refuses this conversation "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
