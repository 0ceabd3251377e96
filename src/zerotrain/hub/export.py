"""Exported model folders: a Hugging Face folder (GPT-2 or Llama) or bare safetensors with a config, written and read.

`hf` is what `transformers.GPT2LMHeadModel` / `LlamaForCausalLM.from_pretrained(folder)` loads: config.json in
Hugging Face's format, written by hand (transformers is not needed to export), model.safetensors in Hugging Face's
names and layouts through the architecture's table in mapping.py, and the tokenizer (tokenizer.json, tokenizer_config.json): a BPE's as trained, the byte
tokenizer's built as its `tokenizers` twin (data.tokenizer.ByteTokenizer.to_hf), so that
`transformers.AutoTokenizer.from_pretrained(folder)` gives zerotrain's ids either way.
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
from zerotrain.errors import ConfigError

from .mapping import BY_MODEL_TYPE, MAPPINGS, hf_config, model_config_from_hf

FORMATS = ("hf", "safetensors")
MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"
INDEX_FILE = "model.safetensors.index.json"  # a sharded folder's: which shard holds each tensor
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILE, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
ZEROTRAIN_FORMAT = "zerotrain-model"
# Every file an export writes: with --overwrite these are replaced or removed, nothing else is touched.
EXPORT_FILES = (MODEL_FILE, CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG, "special_tokens_map.json",
                "generation_config.json")


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
                 tokenizer_info: dict | None = None, source: dict | None = None, overwrite: bool = False) -> list[str]:
    """Write `model` to folder `out` in format `fmt`; the names of the files written.

    `tokenizer_folder` holds tokenizer.json for a BPE model; None is the byte tokenizer, for which `hf`
    writes its tokenizers twin when the model's vocabulary holds the 256 bytes. The files are written
    into a temporary folder beside `out` and moved into place when all are written.
    """
    check_destination(out, fmt, overwrite)
    tmp = make_staging_folder(out)
    try:
        if fmt == "hf":
            _write_json(os.path.join(tmp, CONFIG_FILE), hf_config(model.cfg, eot_id))
            _save_model_file(MAPPINGS[model.cfg.arch].to_hf(dict(model.named_parameters())), tmp)
            if tokenizer_folder is not None:
                shutil.copyfile(os.path.join(tokenizer_folder, TOKENIZER_FILE), os.path.join(tmp, TOKENIZER_FILE))
            elif model.cfg.vocab_size >= BYTES_VOCAB:  # smaller: synthetic data, no text tokenizer fits
                ByteTokenizer().to_hf().save(os.path.join(tmp, TOKENIZER_FILE))
            if os.path.isfile(os.path.join(tmp, TOKENIZER_FILE)):
                _write_hf_tokenizer_config(tmp, eot_id, model.cfg.seq_len)
        else:
            _write_json(os.path.join(tmp, CONFIG_FILE), {
                "format": ZEROTRAIN_FORMAT, "version": 1, "model": dataclasses.asdict(model.cfg),
                "tokenizer": tokenizer_info, "source": source})
            _save_model_file({n: p.detach().float().contiguous() for n, p in model.named_parameters()}, tmp)
            if tokenizer_folder is not None:
                shutil.copyfile(os.path.join(tokenizer_folder, TOKENIZER_FILE), os.path.join(tmp, TOKENIZER_FILE))
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


def _write_hf_tokenizer_config(out: str, eot_id: int | None, seq_len: int) -> None:
    """A tokenizer_config.json that makes out/tokenizer.json a PreTrainedTokenizerFast with its end-of-text token."""
    with open(os.path.join(out, TOKENIZER_FILE)) as f:
        added = json.load(f).get("added_tokens", [])
    eot = next((t["content"] for t in added if t.get("id") == eot_id), None)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": seq_len,
              "clean_up_tokenization_spaces": False}
    if eot is not None:
        config.update(bos_token=eot, eos_token=eot, unk_token=eot)
    _write_json(os.path.join(out, TOKENIZER_CONFIG), config)


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
