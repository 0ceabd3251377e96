"""What a model folder keeps beside tokenizer.json: the files that configure its tokenizer and generation, its
special token ids and its context length, for a checkpoint to carry and an export to write back.

    tokenizer_config.json    bos/eos/pad/unk tokens, model_max_length, the chat template (inline, in older folders)
    special_tokens_map.json  the special tokens again (transformers 4 reads them from it)
    chat_template.jinja      the chat template, where transformers 5 saves it
    generation_config.json   the ids generate() uses: eos may be a list (end of text and end of turn)

The files are copied as the model has them, byte for byte. The ids and the context length come from the folder's
config.json (max_position_embeddings for Llama, n_positions for GPT-2), its ids overridden by those
generation_config.json states; a zerotrain checkpoint or export states them in its tokenizer record, carried from
the model it started from, so a chain of fine-tunes keeps them.
"""

from __future__ import annotations

import os

from .tokenizer import read_json_object

CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja", "generation_config.json")
SPECIAL_IDS = ("bos_token_id", "eos_token_id", "pad_token_id")
CONTEXT_KEYS = ("max_position_embeddings", "n_positions")  # Llama's, GPT-2's


def config_files(folder: str) -> dict[str, str]:
    """{name: path} of the CONFIG_FILES the folder holds."""
    paths = {name: os.path.join(folder, name) for name in CONFIG_FILES}
    return {name: path for name, path in paths.items() if os.path.isfile(path)}


def model_facts(folder: str) -> dict:
    """{"context_length": N, "bos_token_id": ..., "eos_token_id": ..., "pad_token_id": ...}, as far as the folder
    (a Hugging Face model folder, a zerotrain checkpoint or export) states them; eos_token_id may be a list."""
    manifest = read_json_object(folder, "manifest.json")
    config = read_json_object(folder, "config.json")
    if manifest or config.get("format") == "zerotrain-model":  # zerotrain's own: its record, carried forward
        own = manifest or config
        record = own.get("tokenizer") if isinstance(own.get("tokenizer"), dict) else {}
        model = (own.get("config", {}).get("model") if manifest else own.get("model")) or {}
        facts = {key: record[key] for key in SPECIAL_IDS if _is_ids(record.get(key))}
        context = record.get("context_length", model.get("seq_len") if isinstance(model, dict) else None)
    else:
        generation = read_json_object(folder, "generation_config.json")
        facts = {key: source[key] for source in (config, generation) for key in SPECIAL_IDS if _is_ids(source.get(key))}
        context = next((config[key] for key in CONTEXT_KEYS if key in config), None)
    if _is_count(context):
        facts["context_length"] = context
    return facts


def stop_ids(facts: dict) -> list[int]:
    """The end-of-sequence ids of `facts` (model_facts, or a tokenizer record): eos_token_id, one or a list."""
    eos = facts.get("eos_token_id")
    return [eos] if isinstance(eos, int) else list(eos or [])


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _is_ids(value) -> bool:
    """A token id, or a non-empty list of them (generation_config.json's eos_token_id may be one)."""
    def is_id(v):
        return isinstance(v, int) and not isinstance(v, bool) and v >= 0

    return is_id(value) or (isinstance(value, list) and bool(value) and all(map(is_id, value)))
