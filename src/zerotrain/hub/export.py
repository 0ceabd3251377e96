"""Exported model folders: a Hugging Face folder (of the model's family) or bare safetensors with a config, written and read.

`hf` is what `transformers.GPT2LMHeadModel` / `LlamaForCausalLM.from_pretrained(folder)` loads: config.json in
Hugging Face's format, written by hand (transformers is not needed to export), model.safetensors in Hugging Face's
names and layouts through the architecture's table in mapping.py, and the tokenizer (tokenizer.json): a BPE's
as trained or as the --init-from model had it, the byte tokenizer's built as its `tokenizers` twin
(data.tokenizer.ByteTokenizer.to_hf), so that `transformers.AutoTokenizer.from_pretrained(folder)` gives
zerotrain's ids either way. An --init-from model's tokenizer_config.json (chat template, special tokens),
special_tokens_map.json, chat_template.jinja and generation_config.json are written as it had them, and its
context length and special ids into config.json: the training window is a training setting, the model keeps
its context. A model of zerotrain's own gets zerotrain's tokenizer_config.json, special_tokens_map.json and
generation_config.json (its end-of-text token as bos and eos).
`safetensors` is zerotrain's own state dict with a config.json that `zerotrain.load_model` reads.
Both store the tied head once, as transformer.wte.weight. The folder and its files get the modes the
process umask gives, as checkpoints do. Read back (read_export_config, tensor_files), a folder's weights
may also be the shards a model.safetensors.index.json names, as Hugging Face saves large models.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil

import torch
from safetensors.torch import save_file

from zerotrain.checkpoint import CheckpointError
from zerotrain.checkpoint.stream import read_header
from zerotrain.config import Config, ModelConfig, merge, validate
from zerotrain.data.tokenizer import BYTES_VOCAB, ByteTokenizer
from zerotrain.data.tokenizer_config import CONFIG_FILES, SPECIAL_IDS, config_files
from zerotrain.durable import check_writable_beside
from zerotrain.errors import ConfigError

from .mapping import BY_MODEL_TYPE, MAPPINGS, hf_config, model_config_from_hf

FORMATS = ("hf", "safetensors", "peft")  # peft: a LoRA run's adapters (adapter.export_peft)
MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"
INDEX_FILE = "model.safetensors.index.json"  # a sharded folder's: which shard holds each tensor
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, GENERATION_CONFIG = "tokenizer_config.json", "special_tokens_map.json", \
    "generation_config.json"  # of data.tokenizer_config.CONFIG_FILES, those zerotrain writes when a model lacks them
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # tokenizer_config.json's, as the map has them
ZEROTRAIN_FORMAT = "zerotrain-model"
# Every file an export writes: with --overwrite these are replaced or removed, nothing else is touched.
EXPORT_FILES = (MODEL_FILE, CONFIG_FILE, TOKENIZER_FILE, *CONFIG_FILES)


def read_export_config(folder: str) -> tuple[str, ModelConfig, dict]:
    """(format, model config, the config.json) of an exported folder; CheckpointError if it is not one."""
    path = os.path.join(folder, CONFIG_FILE)
    try:
        with open(path) as f:
            config = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{folder} is neither a checkpoint nor an exported model: no manifest.json or "
                              f"{CONFIG_FILE}") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path} is not valid JSON ({e})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{path} is not a JSON object")
    if config.get("format") == ZEROTRAIN_FORMAT:
        return "safetensors", _zerotrain_model(config.get("model"), path), config
    kind = config.get("model_type")
    if isinstance(kind, str) and kind in BY_MODEL_TYPE:
        return "hf", model_config_from_hf(config, path), config
    supported = f"model_type {' or '.join(repr(t) for t in BY_MODEL_TYPE)}, or a zerotrain export (format " \
                f"{ZEROTRAIN_FORMAT!r})"
    if kind is None:
        raise CheckpointError(f"{path}: no model_type and no format: zerotrain reads {supported}")
    raise CheckpointError(f"{path}: model_type {kind!r} is not one zerotrain builds: it reads {supported}")


def _zerotrain_model(values, path: str) -> ModelConfig:
    """A zerotrain export's "model", held to the rules and types of the model settings a run's are."""
    if not isinstance(values, dict):
        raise CheckpointError(f"{path}: 'model' is not a zerotrain model config, got {values!r}")
    cfg = Config()
    try:
        merge(cfg, {"model": values}, origin="'model'")
        validate(cfg)
    except ConfigError as e:
        raise CheckpointError(f"{path}: {e}") from None
    return cfg.model


def tensor_files(folder: str) -> dict[str, str]:
    """Tensor name -> file: model.safetensors, or the shards a model.safetensors.index.json names.

    CheckpointError, saying what the folder holds instead, when it has neither.
    """
    single, index = os.path.join(folder, MODEL_FILE), os.path.join(folder, INDEX_FILE)
    if os.path.isfile(single):
        return {name: single for name in read_header(single)}
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
            names = weight_map.items()
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{INDEX_FILE} has no readable weight_map ({e})") from None
        files = {}
        for name, file in names:
            full = os.path.join(folder, file) if isinstance(file, str) else ""
            if os.path.basename(full) != file or not os.path.isfile(full):
                raise CheckpointError(f"{INDEX_FILE} names {file!r} for {name}, which is not a file in the folder")
            files[name] = full
        return files
    pickles = sorted(n for n in os.listdir(folder) if n.endswith(PICKLES))
    if pickles:
        raise CheckpointError(f"holds {pickles[0]} but no {MODEL_FILE}: zerotrain never unpickles weights; convert "
                              "them first (transformers: AutoModelForCausalLM.from_pretrained(folder)"
                              ".save_pretrained(folder) writes model.safetensors)")
    raise CheckpointError(f"no {MODEL_FILE} or {INDEX_FILE}")


def export_model(model: torch.nn.Module, out: str, fmt: str, *, tokenizer_folder: str | None, eot_id: int | None,
                 tokenizer_info: dict | None = None, source: dict | None = None, overwrite: bool = False,
                 config_folder: str | None = None) -> list[str]:
    """Write `model` to folder `out` in format `fmt`; the names of the files written.

    `tokenizer_folder` holds tokenizer.json for a BPE model; None is the byte tokenizer, for which `hf`
    writes its tokenizers twin when the model's vocabulary holds the 256 bytes. The files that configure the
    tokenizer and generation which `config_folder` holds (a checkpoint keeps an --init-from model's:
    tokenizer_config.json, special_tokens_map.json, chat_template.jinja, generation_config.json) are copied as
    they are; `hf` writes zerotrain's own for those it lacks. `tokenizer_info` is the tokenizer record, with the
    special ids of the model (written to config.json); the model's context is its seq_len, which
    pretrained.load_from gives back to a Llama fine-tuned on a shorter window.
    The files are written into a temporary folder beside `out` and moved into place when all are written.
    """
    check_destination(out, fmt, overwrite)
    info, cfg = tokenizer_info or {}, model.cfg
    tmp = make_staging_folder(out)
    try:
        for name, path in (config_files(config_folder) if config_folder else {}).items():
            shutil.copyfile(path, os.path.join(tmp, name))
        if tokenizer_folder is not None:
            shutil.copyfile(os.path.join(tokenizer_folder, TOKENIZER_FILE), os.path.join(tmp, TOKENIZER_FILE))
        if fmt == "hf":
            special = {key: info[key] for key in SPECIAL_IDS if key in info}
            # the Llama family's pad_token_id is its embedding's padding row (hf_config's), whatever generation pads
            # with (generation_config.json, kept as it is)
            _write_json(os.path.join(tmp, CONFIG_FILE), {**hf_config(cfg, eot_id), **special, **(
                {"pad_token_id": cfg.padding_idx} if cfg.llama_family else {})})
            _save_model_file(MAPPINGS[cfg.arch].to_hf(dict(model.named_parameters())), tmp)
            if tokenizer_folder is None and cfg.vocab_size >= BYTES_VOCAB:  # smaller: synthetic data, no text fits
                ByteTokenizer().to_hf().save(os.path.join(tmp, TOKENIZER_FILE))
            _write_missing_hf_configs(tmp, eot_id, cfg.positions, bytes_tokenizer=tokenizer_folder is None,
                                      special=special)
        else:
            _write_json(os.path.join(tmp, CONFIG_FILE), {
                "format": ZEROTRAIN_FORMAT, "version": 1, "model": dataclasses.asdict(cfg),
                "tokenizer": tokenizer_info, "source": source})
            _save_model_file({n: p.detach().float().contiguous() for n, p in model.named_parameters()}, tmp)
        written = sorted(os.listdir(tmp))
        _move_into_place(tmp, out, written)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return written


def check_destination(out: str, fmt: str, overwrite: bool) -> None:
    """ConfigError unless `out` can take an export in `fmt`: absent, an empty folder, or any folder with overwrite."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    if os.path.exists(out) and not os.path.isdir(out):
        raise ConfigError(f"export {out}: exists and is not a folder")
    if os.path.isdir(out) and os.listdir(out) and not overwrite:
        raise ConfigError(f"export {out}: the folder is not empty (pass --overwrite to replace the exported files "
                          f"in it)")
    check_writable_beside(out, "export")  # the export is written into a folder beside it, then renamed


def make_staging_folder(out: str) -> str:
    """A new empty folder beside `out` with a unique name, for the export to be written into.

    os.mkdir, not tempfile.mkdtemp: mkdtemp makes the folder 0700 whatever the umask, and the export
    renamed from it would stay unreadable to the group (a shared model folder, a serving user).
    """
    parent = os.path.dirname(os.path.abspath(out))
    os.makedirs(parent, exist_ok=True)
    while True:
        tmp = os.path.join(parent, f".{os.path.basename(os.path.abspath(out))}.tmp-{secrets.token_hex(4)}")
        try:
            os.mkdir(tmp)  # exclusive: fails rather than share a folder with another export
            return tmp
        except FileExistsError:
            continue


def _save_model_file(tensors: dict[str, torch.Tensor], folder: str) -> None:
    """folder/model.safetensors, with the mode of folder/config.json (written first, by open(), under the umask).

    save_file creates a 0600 temporary file and renames it (safetensors 0.8), so the weights would be
    private whatever the umask; copying config.json's mode is the umask's without changing it process-wide.
    """
    path = os.path.join(folder, MODEL_FILE)
    save_file(tensors, path, metadata={"format": "pt"})
    shutil.copymode(os.path.join(folder, CONFIG_FILE), path)


def _write_missing_hf_configs(out: str, eot_id: int | None, context: int, *, bytes_tokenizer: bool,
                              special: dict) -> None:
    """What transformers needs beside out/tokenizer.json that the model did not bring: tokenizer_config.json (a
    PreTrainedTokenizerFast with its special tokens), special_tokens_map.json and generation_config.json (the ids
    generate() stops at). Nothing is written next to no tokenizer.json but generation_config.json."""
    def has(name: str) -> bool:
        return os.path.isfile(os.path.join(out, name))

    if has(TOKENIZER_FILE) and not has(TOKENIZER_CONFIG):
        _write_json(os.path.join(out, TOKENIZER_CONFIG), _tokenizer_config(out, eot_id, context, bytes_tokenizer))
    if has(TOKENIZER_CONFIG) and not has(SPECIAL_TOKENS_MAP):
        with open(os.path.join(out, TOKENIZER_CONFIG), encoding="utf-8") as f:
            config = json.load(f)
        tokens = {key: config[key] for key in SPECIAL_TOKENS if config.get(key)}
        _write_json(os.path.join(out, SPECIAL_TOKENS_MAP), tokens)
    eot = eot_id if eot_id is not None and eot_id >= 0 else None
    ids = special or ({"bos_token_id": eot, "eos_token_id": eot} if eot is not None else {})
    if ids and not has(GENERATION_CONFIG):
        _write_json(os.path.join(out, GENERATION_CONFIG), ids)


def _tokenizer_config(out: str, eot_id: int | None, context: int, bytes_tokenizer: bool) -> dict:
    """zerotrain's tokenizer_config.json: documents are separated by the end-of-text token, which therefore begins
    and ends each (bos = eos, as GPT-2's); the byte tokenizer's twin maps the NUL byte to it, its unknown token,
    while a byte-level BPE has a token for every byte and so no unknown one."""
    with open(os.path.join(out, TOKENIZER_FILE)) as f:
        added = json.load(f).get("added_tokens", [])
    eot = next((t["content"] for t in added if t.get("id") == eot_id), None)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": context,
              "clean_up_tokenization_spaces": False}
    if eot is not None:
        config.update(bos_token=eot, eos_token=eot, **({"unk_token": eot} if bytes_tokenizer else {}))
    return config


def _move_into_place(tmp: str, out: str, written: list[str]) -> None:
    """A new folder is renamed into place whole; into an existing one each file is replaced, stale exports removed."""
    if not os.path.isdir(out):
        os.rename(tmp, out)
        return
    for name in EXPORT_FILES:
        if name not in written and os.path.isfile(os.path.join(out, name)):
            os.remove(os.path.join(out, name))  # e.g. the tokenizer of an earlier BPE export
    for name in written:
        os.replace(os.path.join(tmp, name), os.path.join(out, name))


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
