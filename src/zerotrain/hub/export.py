"""Exported model folders: a Hugging Face GPT-2 folder or bare safetensors with a config, written and read.

`hf` is what `transformers.GPT2LMHeadModel.from_pretrained(folder)` loads: config.json in GPT-2's
format, written by hand (transformers is not needed to export), model.safetensors in GPT-2's
names, which are zerotrain's, with the four per-block matrices transposed to Conv1D's (in, out)
layout, and the tokenizer (tokenizer.json, tokenizer_config.json): a BPE's as trained, the byte
tokenizer's built as its `tokenizers` twin (data.tokenizer.ByteTokenizer.to_hf), so that
`transformers.AutoTokenizer.from_pretrained(folder)` gives zerotrain's ids either way.
`safetensors` is zerotrain's own state dict with a config.json that `zerotrain.load_model` reads.
Both store the tied head once, as transformer.wte.weight. The folder and its files get the modes the
process umask gives, as checkpoints do.
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
from zerotrain.config import ModelConfig
from zerotrain.data.tokenizer import BYTES_VOCAB, ByteTokenizer
from zerotrain.errors import ConfigError
from zerotrain.model.gpt2 import GPT

FORMATS = ("hf", "safetensors")
MODEL_FILE, CONFIG_FILE = "model.safetensors", "config.json"
TOKENIZER_FILE, TOKENIZER_CONFIG = "tokenizer.json", "tokenizer_config.json"
ZEROTRAIN_FORMAT = "zerotrain-model"
# Hugging Face's GPT-2 keeps these as Conv1D, whose weight is (in, out): nn.Linear's transposed.
CONV1D_WEIGHTS = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Every file an export writes: with --overwrite these are replaced or removed, nothing else is touched.
EXPORT_FILES = (MODEL_FILE, CONFIG_FILE, TOKENIZER_FILE, TOKENIZER_CONFIG, "special_tokens_map.json",
                "generation_config.json")


def is_conv1d(name: str) -> bool:
    return name.endswith(CONV1D_WEIGHTS) and name.startswith("transformer.h.")


def to_hf_state_dict(model: GPT) -> dict[str, torch.Tensor]:
    """The model's tensors in GPT-2's layout, fp32, the tied head stored once."""
    return {n: (p.detach().t() if is_conv1d(n) else p.detach()).float().contiguous()
            for n, p in model.named_parameters()}


def from_hf_state_dict(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """GPT-2's tensors in zerotrain's layout; the attention-mask buffers some versions save are dropped."""
    return {n: (t.t().contiguous() if is_conv1d(n) else t) for n, t in tensors.items()
            if not n.endswith((".attn.bias", ".attn.masked_bias"))}


def hf_config(cfg: ModelConfig, eot_id: int | None) -> dict:
    """GPT-2's config.json for this model: the architecture zerotrain trains, nothing left to defaults that differ."""
    eot = eot_id if eot_id is not None and 0 <= eot_id < cfg.vocab_size else None
    return {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
        "vocab_size": cfg.vocab_size, "n_positions": cfg.seq_len, "n_embd": cfg.n_embd, "n_layer": cfg.n_layer,
        "n_head": cfg.n_head, "n_inner": None,  # None: 4 * n_embd, as zerotrain's MLP
        "activation_function": "gelu_new",  # GELU with the tanh approximation, as model.MLP
        "layer_norm_epsilon": 1e-5,  # nn.LayerNorm's default
        "tie_word_embeddings": True,
        "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,  # zerotrain trains without dropout
        "initializer_range": 0.02, "use_cache": True,
        "bos_token_id": eot, "eos_token_id": eot,
        "dtype": "float32",
    }


def model_config_from_hf(config: dict, where: str) -> ModelConfig:
    """zerotrain's ModelConfig for a GPT-2 config.json; CheckpointError for a GPT-2 variant zerotrain does not build."""
    unsupported = [(k, config.get(k, default), want) for k, default, want in (
        ("activation_function", "gelu_new", ("gelu_new", "gelu_pytorch_tanh")),
        ("n_inner", None, (None, 4 * config.get("n_embd", 0))),
        ("layer_norm_epsilon", 1e-5, (1e-5,)), ("tie_word_embeddings", True, (True,)),
        ("scale_attn_weights", True, (True,)), ("scale_attn_by_inverse_layer_idx", False, (False,)),
        ("add_cross_attention", False, (False,)))
        if config.get(k, default) not in want]
    if unsupported:
        key, value, want = unsupported[0]
        raise CheckpointError(f"{where}: {key} = {value!r}; zerotrain's GPT has {want[0]!r}")
    try:
        return ModelConfig(n_layer=config["n_layer"], n_head=config["n_head"], n_embd=config["n_embd"],
                           seq_len=config["n_positions"], vocab_size=config["vocab_size"])
    except KeyError as e:
        raise CheckpointError(f"{where}: no {e.args[0]!r}") from None


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
        try:
            return "safetensors", ModelConfig(**config["model"]), config
        except (KeyError, TypeError) as e:
            raise CheckpointError(f"{path}: 'model' is not a zerotrain model config ({e})") from None
    if config.get("model_type") == "gpt2":
        return "hf", model_config_from_hf(config, path), config
    raise CheckpointError(f"{path}: neither a zerotrain export (format {ZEROTRAIN_FORMAT!r}) nor a GPT-2 config "
                          f"(model_type 'gpt2')")


def export_model(model: GPT, out: str, fmt: str, *, tokenizer_folder: str | None, eot_id: int | None,
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
            _save_model_file(to_hf_state_dict(model), tmp)
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
