"""A conversation as a model's chat template renders it for the assistant's reply, and the token that ends that reply.

The template is the model's own (tokenizer_config.json's chat_template or chat_template.jinja, which a checkpoint
keeps from its --init-from model), rendered with add_generation_prompt and encoded exactly as training encodes a
chat record up to an assistant turn (the tokenizer's BOS before a template that writes none included), so the
model is sampled in the context it was fine-tuned in. Where the reply ends is read from
the template too: an assistant message rendered by it is followed by the end-of-turn token the template writes
(ChatML's <|im_end|>, Llama 3's <|eot_id|>, Gemma's <end_of_turn>): the first special token after its content.
"""

from __future__ import annotations

import json
import os

from zerotrain.data.chat import ChatTemplate
from zerotrain.data.jsonl import encode_chat_prompt
from zerotrain.errors import ConfigError

PROBE = "zerotrain probes the end of a turn"  # an assistant message's content, found again in the rendering


def chat_tokenizer(folder: str, where: str = "--chat"):
    """transformers' tokenizer of `folder` (which reads the end of a turn); ConfigError naming `where` when the folder
    has no template or transformers is missing."""
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            inline = json.load(f).get("chat_template")
    except (OSError, ValueError, AttributeError):
        inline = None
    if not inline and not os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        raise ConfigError(f"{where}: {folder} has no chat template (tokenizer_config.json's chat_template or "
                          "chat_template.jinja; a run keeps its --init-from model's): use --prompt")
    try:
        import transformers
    except ImportError:
        raise ConfigError(f"{where}: the model's chat template is rendered by transformers: pip install "
                          "'zerotrain[chat]'") from None
    return transformers.AutoTokenizer.from_pretrained(folder)


def chat_prompt(tokenizer, messages: list[dict], where: str = "--chat", **context) -> list[int]:
    """The token ids of `messages` with the assistant's turn opened, rendered and encoded as training renders a chat
    record (data.jsonl.encode_chat_prompt): zerotrain's tokenizer of the model folder (BPETokenizer), its BOS placed
    before a template that writes none, as training placed it."""
    return encode_chat_prompt(tokenizer, ChatTemplate.of(tokenizer, where), messages, where, **context)


def end_of_turn(tokenizer) -> int | None:
    """The id of the first special token the template writes after an assistant message's content, or None."""
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello"},
                                              {"role": "assistant", "content": PROBE}], tokenize=False)
    except Exception:  # noqa: BLE001 - a template may refuse this shape (jinja's raise_exception): the EOS stays
        return None
    at = text.rfind(PROBE)
    if at < 0:
        return None
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    after = tokenizer(text[at + len(PROBE):], add_special_tokens=False)["input_ids"]
    return next((i for i in after if i in special), None)
