"""Chat records: a conversation rendered with a chat template, and the spans of it the loss trains on.

    {"messages": [{"role": "system", "content": "..."}, {"role": "user", ...}, {"role": "assistant", ...}, ...],
     "tools": [...], "documents": [...]}

Messages reach the template as transformers' `apply_chat_template(messages, tools=..., documents=...)` passes them:
each with every key a template reads (MESSAGE_KEYS: the reasoning, tool calls, the id and name of a tool result;
content as a string or a list of text parts), the record's `tools` (JSON schemas) and `documents` beside them. A
message's `weight` (axolotl's, on ShareGPT turns) is zerotrain's and never reaches the template: 0 makes the turn
context only, an assistant turn the loss does not count; 1 (the default) trains it as its role is trained. A key
outside these is refused naming the record, and so is a value the template drops: after rendering, each
message's reasoning, each tool call's name, each text part and each tool's name must be in the text (a template that
does not write them would train a turn without them). The `tool` role is context, never trained.

The template is the one templates.py chooses (the user's file, a training variant of a known template, or the model
folder's own) and transformers renders it (its sandboxed jinja2 environment, with the `{% generation %}` extension),
given the folder's special tokens as transformers gives them (bos_token, eos_token, ...). The loss counts the
assistant's turns, the end-of-turn token the template puts inside them included:

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

import json
import os

from zerotrain.errors import ConfigError

from . import templates
from .templates import GENERATION_TAG, TemplateChoice, choose_template
from .tokenizer import CHAT_TEMPLATE_FILE, TOKENIZER_CONFIG, read_json_object

ROLES = ("system", "user", "assistant", "tool")
REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers gives a template each of these names
MESSAGE_KEYS = ("role", "content", *REASONING_KEYS, "tool_calls", "tool_call_id", "name")
WEIGHT = "weight"  # a training record's message: 0 context only, 1 trained as its role is (not a template's key)
CONTEXT_KEYS = ("tools", "documents")  # a record's, passed beside its messages
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


def check_messages(record: dict, where: str, weighted: bool = False, *, to_reply: bool = False
                   ) -> tuple[list[dict], dict]:
    """The record's messages, each with the keys it gives (MESSAGE_KEYS, and with `weighted` a training record's
    WEIGHT), and its context (`tools`, `documents`: the keys it has, to pass beside them); ConfigError naming `where`
    (file:line) if they are not a conversation to train on (`to_reply`: to generate the assistant's next turn
    after), or hold a key zerotrain does not know."""
    messages = record["messages"]
    if not isinstance(messages, list) or not messages:
        raise ConfigError(f"{where}: \"messages\" is {messages!r}, not a list of {{\"role\", \"content\"}} objects")
    known = (*MESSAGE_KEYS, WEIGHT) if weighted else MESSAGE_KEYS
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m or not ("content" in m or m.get("tool_calls")):
            raise ConfigError(f"{where}: message {k} is {_short(m)}, not an object with \"role\" and \"content\"")
        if m["role"] not in ROLES:
            raise ConfigError(f"{where}: message {k} has role {m['role']!r}; a role is one of {', '.join(ROLES)}")
        unknown = [key for key in m if key not in known]
        if unknown:
            raise ConfigError(f"{where}: message {k} ({m['role']}) has the key {unknown[0]!r}, which zerotrain does "
                              f"not read (a message's keys: {', '.join(known)}): leave it out, or write it as one of "
                              "these")
        if WEIGHT in m and (isinstance(m[WEIGHT], bool) or m[WEIGHT] not in (0, 1)):
            raise ConfigError(f"{where}: message {k} ({m['role']}) has weight {_short(m[WEIGHT])}: a turn's weight is "
                              "0 (context, not trained) or 1 (trained as its role is, the default)")
        _check_content(m, k, where)
        _check_tool_calls(m, k, where)
        for key in (*REASONING_KEYS, "tool_call_id", "name"):
            if m.get(key) is not None and not isinstance(m[key], str):
                raise ConfigError(f"{where}: message {k} ({m['role']}) has {key} {_short(m[key])}, not a string")
    if to_reply and messages[-1]["role"] not in ("user", "tool"):
        raise ConfigError(f"{where}: the last message is the {messages[-1]['role']}'s; the reply is generated after "
                          "a user's message or a tool's result")
    if not to_reply and not any(m["role"] == "assistant" for m in messages):
        raise ConfigError(f"{where}: no assistant message: the loss trains on the assistant's turns, and this "
                          "conversation has none")
    if not to_reply and not any(m["role"] == "assistant" and is_trained(m) for m in messages):
        raise ConfigError(f"{where}: every assistant message has weight 0: the loss trains on the assistant's turns, "
                          "and this conversation leaves none to train on")
    context = {key: list_of_objects(record[key], key, where) for key in CONTEXT_KEYS if record.get(key) is not None}
    return [dict(m) for m in messages], context


def check_prompt_completion(record: dict, where: str) -> tuple[list[dict], list[dict], dict]:
    """A conversational prompt/completion record's prompt, completion and context (TRL's format: both lists of
    messages, the record's `tools` beside them); ConfigError naming `where` if the completion is not the assistant's
    messages, a message has a `weight` (TRL trains the whole completion and reads none), or the two are not both
    message lists."""
    prompt, completion = record["prompt"], record["completion"]
    for name, value in (("prompt", prompt), ("completion", completion)):
        if not isinstance(value, list) or not value:
            raise ConfigError(f"{where}: \"{name}\" is {_short(value)}, not a list of {{\"role\", \"content\"}} "
                              "messages: a conversational prompt/completion has both as message lists (or both as "
                              "text)")
    for name, messages in (("prompt", prompt), ("completion", completion)):
        for k, m in enumerate(messages):
            if isinstance(m, dict) and WEIGHT in m:
                raise ConfigError(f"{where}: {name} message {k} has a weight: a prompt/completion record trains its "
                                  "whole completion, as TRL's SFTTrainer does (it reads no weight); put a turn kept "
                                  "as context in the prompt, or write the record as \"messages\" with weights")
    other = next(((k, m) for k, m in enumerate(completion) if isinstance(m, dict) and m.get("role") != "assistant"),
                 None)
    if other is not None:
        raise ConfigError(f"{where}: completion message {other[0]} is the {other[1].get('role')!r}'s: the completion "
                          "is what the model is trained to write, the assistant's messages; put the others in the "
                          "prompt")
    messages, context = check_messages({**record, "messages": prompt + completion}, where)
    return messages[: len(prompt)], messages[len(prompt) :], context


def is_trained(message: dict) -> bool:
    """Whether the loss may count the message: any but one of weight 0 (an assistant turn kept as context)."""
    return message.get(WEIGHT, 1) != 0


def _short(value, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _check_content(m: dict, k: int, where: str) -> None:
    """Content is a string, a list of text parts ({"type": "text", "text": ...}), or absent or null beside tool calls
    (OpenAI's shape of a turn that only calls tools)."""
    content = m.get("content")
    if isinstance(content, str) or (content is None and m.get("tool_calls")):
        return
    if isinstance(content, list) and content:
        for j, part in enumerate(content):
            if not (isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)):
                kind = part.get("type") if isinstance(part, dict) else None
                why = f"a {kind!r} part: zerotrain trains on text" if kind not in (None, "text") else \
                    f"{_short(part)}, not a text part {{\"type\": \"text\", \"text\": ...}}"
                raise ConfigError(f"{where}: message {k} ({m['role']}) has content part {j} {why}")
        return
    raise ConfigError(f"{where}: message {k} ({m['role']}) has content {_short(content)}, not a string or a list of "
                      "text parts")


def _check_tool_calls(m: dict, k: int, where: str) -> None:
    calls = m.get("tool_calls")
    if calls is None:
        return
    if m["role"] != "assistant" or not isinstance(calls, list):
        raise ConfigError(f"{where}: message {k} ({m['role']}) has tool_calls {_short(calls)}: tool calls are a list "
                          "on an assistant message")
    for j, call in enumerate(calls):
        function = call.get("function", call) if isinstance(call, dict) else None
        if not (isinstance(function, dict) and isinstance(function.get("name"), str)
                and isinstance(function.get("arguments", {}), (dict, str))):
            raise ConfigError(f"{where}: message {k} (assistant) has tool call {j} {_short(call)}, not "
                              "{\"type\": \"function\", \"function\": {\"name\": ..., \"arguments\": {...}}}")


def list_of_objects(value, key: str, where: str) -> list[dict]:
    """A record's `tools` or `documents`: a list of objects, or that list written as a JSON string (as data sets
    stored in Parquet often keep it)."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise ConfigError(f"{where}: \"{key}\" is the string {_short(value)}, which is not JSON") from None
    if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
        raise ConfigError(f"{where}: \"{key}\" is {_short(value)}, not a list of objects"
                          + (" (JSON schemas of functions)" if key == "tools" else ""))
    return value


def _tool_name(schema: dict):
    return (schema.get("function") if isinstance(schema.get("function"), dict) else schema).get("name")


def unwritten(text: str, messages: list[dict], context: dict) -> str | None:
    """What of a conversation the template did not write into `text` (a message's reasoning, a tool call, a text part,
    a tool, a document), named for a message; None if all of it is there."""
    for k, m in enumerate(messages):
        for key in REASONING_KEYS:
            if isinstance(m.get(key), str) and m[key].strip() and m[key].strip() not in text:
                return f"message {k}'s {key} ({_short(m[key].strip(), 40)})"
        if isinstance(m.get("content"), list):
            for j, part in enumerate(m["content"]):
                if part["text"].strip() not in text:
                    return f"message {k}'s content part {j} ({_short(part['text'].strip(), 40)})"
    # a name is written once where a tool is described and once where it is called: count them, so that a template
    # that writes the tools but drops a call is seen
    named = [(_tool_name(call), f"message {k}'s tool call {j}") for k, m in enumerate(messages)
             for j, call in enumerate(m.get("tool_calls") or [])]
    named += [(_tool_name(tool), f"the record's tool {j}") for j, tool in enumerate(context.get("tools") or [])]
    names: dict[str, list[str]] = {}
    for name, what in named:
        if isinstance(name, str):
            names.setdefault(name, []).append(what)
    for name, whats in names.items():
        count, what = len(whats), whats[0]
        if text.count(name) < count:
            return f"{what} ({name!r}: written {text.count(name)} of the {count} times the record names it)"
    for j, document in enumerate(context.get("documents") or []):
        said = document.get("text", document.get("content"))
        if isinstance(said, str) and said.strip() and said.strip() not in text:
            return f"the record's document {j} ({_short(said.strip(), 40)})"
    return None


class ChatTemplate:
    """A chat template and a model folder's special tokens: conversation -> (text, character spans trained on)."""

    def __init__(self, template: str, folder: str, tokens: dict[str, str], specials: list[str],
                 choice: TemplateChoice | None = None):
        self.template, self.folder, self.tokens = template, folder, tokens
        self.specials = [s for s in specials if s]  # the end of an assistant turn without markers: the last of these
        self.marked = bool(GENERATION_TAG.search(template))
        self.choice = choice or TemplateChoice(template, "model", folder)
        self.said = self.choice.describe(self.marked)  # what trains and why
        self.named = (f"the chat template of {folder}" if self.choice.origin == "model" else
                      f"the chat template of --chat-template {self.choice.name}" if self.choice.origin == "file" else
                      f"the training variant of {self.choice.name} from TRL")

    @classmethod
    def of(cls, tokenizer, where: str, template_file: str | None = None, training: bool = False) -> "ChatTemplate":
        """The chat template of the BPE `tokenizer`'s folder; with `training`, the one that trains (templates.py:
        `template_file`, a training variant, or the folder's), without it `template_file` or the folder's. ConfigError
        naming `where` and the folder without one."""
        folder = getattr(tokenizer, "folder", None)
        template = chat_template_of(folder) if folder else None
        choice = choose_template(template, folder, template_file) if training and folder else \
            choose_template(None, folder, template_file) if template_file and folder else None
        if template is None and choice is None:
            named = f"{folder} has" if folder else "the byte tokenizer has"
            raise ConfigError(f"{where}: a chat record, and {named} no chat template (\"chat_template\" in "
                              f"{TOKENIZER_CONFIG} or {CHAT_TEMPLATE_FILE}): fine-tune an instruct model's folder "
                              "(--init-from, or prepare's --tokenizer), give one with --chat-template FILE, or write "
                              "records as {\"prompt\", \"completion\"}")
        config = read_json_object(folder, TOKENIZER_CONFIG)
        hf = tokenizer.tokenizer
        tokens = {k: v.get("content") if isinstance(v, dict) else v for k in TEMPLATE_TOKENS
                  if isinstance(v := config.get(k), (str, dict))}
        tokens.setdefault("eos_token", hf.id_to_token(tokenizer.eot_id))
        if tokenizer.prefix_ids:
            tokens.setdefault("bos_token", hf.id_to_token(tokenizer.prefix_ids[0]))
        specials = [hf.id_to_token(i) for i in tokenizer.special_ids]
        return cls(choice.text if choice else template, folder, tokens, specials, choice)

    def render(self, messages: list[dict], where: str, **context) -> tuple[str, list[tuple[int, int]]]:
        """The conversation as the template writes it (`context`: the record's tools and documents), and the
        [start, end) character spans of its assistant turns, but those of weight 0. ConfigError naming `where` when
        the template leaves out part of it (unwritten)."""
        trained = [is_trained(m) for m in messages if m["role"] == "assistant"]
        messages = [{key: value for key, value in m.items() if key != WEIGHT} for m in messages]
        if self.marked:
            texts, spans = self._render([messages], where, return_assistant_tokens_mask=True, **context)
            text, spans = texts[0], [tuple(s) for s in spans[0]]
            if not all(trained):
                if len(spans) != len(trained):
                    raise ConfigError(f"{where}: {self.named} marks {len(spans)} generation blocks for the "
                                      f"{len(trained)} assistant messages, so the one of weight 0 cannot be told "
                                      "apart: give a template with one {% generation %} block per assistant turn")
                spans = [span for span, kept in zip(spans, trained) if kept]
        else:
            text, spans, kept = self._text(messages, where, **context), [], iter(trained)
            for k, m in enumerate(messages):
                if m["role"] != "assistant" or not next(kept):  # weight 0: its text stays, the loss skips it
                    continue
                before = self._text(messages[:k], where, add_generation_prompt=True, **context)
                after = self._text(messages[: k + 1], where, **context)
                if not (after.startswith(before) and text.startswith(after)):
                    raise ConfigError(f"{where}: {self.named} does not render this conversation as a growing prefix "
                                      f"(assistant message {k} changes what comes before it), so its assistant turns "
                                      f"cannot be told apart: {self._variant_hint()}")
                turn = after[len(before) :]
                ends = [turn.rfind(s) + len(s) for s in self.specials if s in turn]
                spans.append((len(before), len(before) + (max(ends) if ends else len(turn))))
        missing = unwritten(text, messages, context)
        if missing:
            raise ConfigError(f"{where}: {self.named} does not write {missing}, so the conversation would be trained "
                              "on without it: leave it out of the record, or give a template that writes it with "
                              "--chat-template FILE")
        return text, spans

    def prompt_completion(self, prompt: list[dict], completion: list[dict], where: str, **context) -> tuple[str, str]:
        """A conversational prompt/completion as TRL's SFTTrainer renders it: the prompt with the generation prompt,
        and prompt and completion as one conversation; ConfigError naming `where` when the template leaves out part
        of it (unwritten)."""
        whole = self._text(prompt + completion, where, **context)
        missing = unwritten(whole, prompt + completion, context)
        if missing:
            raise ConfigError(f"{where}: {self.named} does not write {missing}, so the completion would be trained "
                              "on without it: leave it out of the record, or give a template that writes it with "
                              "--chat-template FILE")
        return self.prompt(prompt, where, **context), whole

    def _variant_hint(self) -> str:
        where_from = "TRL keeps no training variant of it" if templates.trl_folder() else \
            "pip install 'zerotrain[chat]' for TRL's training variants of the common templates (Qwen3, Llama 3, " \
            "Gemma, gpt-oss, ...), swapped in when the model's template is one of them, or"
        return (f"{where_from}; give a training variant with --chat-template FILE (the template with "
                "{% generation %} ... {% endgeneration %} around the assistant's part, earlier turns written as the "
                "last one)")

    def prompt(self, messages: list[dict], where: str, **context) -> str:
        """The conversation with the assistant's turn opened (the generation prompt): what a reply is generated after,
        and what training reads as the context of an assistant turn."""
        return self._text(messages, where, add_generation_prompt=True, **context)

    def _text(self, messages: list[dict], where: str, add_generation_prompt: bool = False, **context) -> str:
        return self._render([messages], where, add_generation_prompt=add_generation_prompt, **context)[0][0]

    def _render(self, conversations: list[list[dict]], where: str, **options):
        try:
            from jinja2 import TemplateError
            from transformers.utils.chat_template_utils import render_jinja_template
        except ImportError:
            raise ConfigError(f"{where}: chat records are rendered by transformers, which is not installed: "
                              "pip install 'zerotrain[chat]'") from None

        try:
            return render_jinja_template(conversations, chat_template=self.template, **options, **self.tokens)
        except (TemplateError, TypeError, ValueError) as e:  # jinja's raise_exception, or a value it cannot handle
            raise ConfigError(f"{where}: {self.named} refuses this conversation "
                              f"({str(e).splitlines()[0] if str(e) else type(e).__name__})") from None
