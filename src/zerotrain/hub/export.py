"""Exported model folders: a Hugging Face folder (of the model's family) or bare safetensors with a config, written and read.

`hf` is what `transformers.GPT2LMHeadModel` / `LlamaForCausalLM.from_pretrained(folder)` loads: config.json in
Hugging Face's format, written by hand (transformers is not needed to export), with the weights' dtype (the model's:
model_dtype), the weights in Hugging Face's names and layouts through the architecture's table in mapping.py, in
that dtype, as save_pretrained cuts them (model.safetensors, or shards and their index: weight_shards.py), each
tensor read from a checkpoint's shards as it is written, by one process or several, and the tokenizer (tokenizer.json): a BPE's
as trained or as the --init-from model had it, the byte tokenizer's built as its `tokenizers` twin
(data.tokenizer.ByteTokenizer.to_hf), so that `transformers.AutoTokenizer.from_pretrained(folder)` gives
zerotrain's ids either way. An --init-from model's tokenizer_config.json (chat template, special tokens),
special_tokens_map.json, chat_template.jinja and generation_config.json are written as it had them, and its
context length and special ids into config.json: the training window is a training setting, the model keeps
its context. A model of zerotrain's own gets zerotrain's tokenizer_config.json, special_tokens_map.json and
generation_config.json (its end-of-text token as bos and eos).
`safetensors` is zerotrain's own state dict (in the same dtype and shards) with a config.json that
`zerotrain.load_model` reads.
Both store the tied head once, as transformer.wte.weight. The folder and its files get the modes the
process umask gives, as checkpoints do. Read back (read_export_config, tensor_files), a folder's weights
may also be the shards a model.safetensors.index.json names, as Hugging Face saves large models.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import secrets
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import torch

from zerotrain.checkpoint import CheckpointError, ShardedModel
from zerotrain.checkpoint.stream import read_header
from zerotrain.config import Config, ModelConfig, merge, validate
from zerotrain.data.tokenizer import BYTES_VOCAB, ByteTokenizer, read_json_object
from zerotrain.data.tokenizer_config import CONFIG_FILES, SPECIAL_IDS, config_files
from zerotrain.durable import check_writable_beside
from zerotrain.errors import ConfigError
from zerotrain.model import meta_model

from .mapping import BY_MODEL_TYPE, MAPPINGS, hf_config, model_config_from_hf
from .mtp_layers import MTPLayers, mtp_layers_of, shared_copies
from .weight_shards import (DEFAULT_SHARD_SIZE, DTYPE_NAMES, DTYPES, INDEX_FILE, MODEL_FILE, SHARD_PATTERN, Group,
                            ShardPlan, hf_groups, missing_shard, parse_shard_size, plan_shards, write_index,
                            write_shards)

FORMATS = ("hf", "safetensors", "peft")  # peft: a LoRA run's adapters (adapter.export_peft)
CONFIG_FILE = "config.json"  # beside MODEL_FILE, or the shards INDEX_FILE names (weight_shards.py)
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_CONFIG, SPECIAL_TOKENS_MAP, GENERATION_CONFIG = "tokenizer_config.json", "special_tokens_map.json", \
    "generation_config.json"  # of data.tokenizer_config.CONFIG_FILES, those zerotrain writes when a model lacks them
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")  # tokenizer_config.json's, as the map has them
ZEROTRAIN_FORMAT = "zerotrain-model"
# Every file an export writes: with --overwrite these are replaced or removed, nothing else is touched.
EXPORT_FILES = (MODEL_FILE, INDEX_FILE, CONFIG_FILE, TOKENIZER_FILE, *CONFIG_FILES)  # and the shards (SHARD_PATTERN)


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


def tensor_files(folder: str, headers: dict[str, dict] | None = None) -> dict[str, str]:
    """Tensor name -> file: model.safetensors, or the shards a model.safetensors.index.json names. `headers`, if
    given, keeps the safetensors header read to list model.safetensors (by path), so that it is not read again.

    CheckpointError, saying what the folder holds instead, when it has neither.
    """
    single, index = os.path.join(folder, MODEL_FILE), os.path.join(folder, INDEX_FILE)
    if os.path.isfile(single):
        header = read_header(single)
        if headers is not None:
            headers[single] = header
        return {name: single for name in header}
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


@dataclass(frozen=True)
class CheckpointModel:
    """A checkpoint's model left where it lies: its config, and its shards, read one tensor at a time as the export
    writes (checkpoint.ShardedModel); a process of a parallel export opens them itself."""

    folder: str
    manifest: dict
    cfg: ModelConfig


@dataclass(frozen=True)
class ShardJob:
    """What each of `nproc` processes of an export writes: the shards of `plan` that `owners` gives its rank."""

    source: CheckpointModel
    plan: ShardPlan
    nproc: int
    owners: tuple[int, ...]
    groups: tuple[Group, ...]
    folder: str
    fmt: str
    mtp: MTPLayers | None = None  # the multi-token-prediction layers (DeepSeek-V3's, Qwen3.5's), copied as they are
    copies: tuple[tuple[str, str], ...] = ()  # (a trained MTP layer's copy of a shared tensor, that tensor's name)


def export_model(model: torch.nn.Module | CheckpointModel, out: str, fmt: str, *, tokenizer_folder: str | None,
                 eot_id: int | None, tokenizer_info: dict | None = None, source: dict | None = None,
                 overwrite: bool = False, config_folder: str | None = None, dtype: torch.dtype = torch.float32,
                 max_shard_size: int | str = DEFAULT_SHARD_SIZE, nproc: int = 1,
                 launch: Callable[[Callable, int], object] | None = None, init_from: str | None = None) -> list[str]:
    """Write `model` (a model in memory, or a checkpoint's: CheckpointModel) to folder `out` in format `fmt`, its
    weights in `dtype`, cut into shards of at most `max_shard_size` bytes (weight_shards.py) that `nproc` processes
    write (a checkpoint's only: each reads what it writes); the names of the files written. `launch(job, nproc)`
    runs job(cfg, comm) on nproc local processes (the command gives runtime.launch.run_job).

    `tokenizer_folder` holds tokenizer.json for a BPE model; None is the byte tokenizer, for which `hf`
    writes its tokenizers twin when the model's vocabulary holds the 256 bytes. The files that configure the
    tokenizer and generation which `config_folder` holds (a checkpoint keeps an --init-from model's:
    tokenizer_config.json, special_tokens_map.json, chat_template.jinja, generation_config.json) are copied as
    they are; `hf` writes zerotrain's own for those it lacks. `tokenizer_info` is the tokenizer record, with the
    special ids of the model (written to config.json); the model's context is its seq_len, which
    pretrained.load_from gives back to a Llama fine-tuned on a shorter window. `init_from`: the folder a model in
    memory came from (a LoRA run's merged model: its checkpoint's --init-from), whose multi-token-prediction layers an
    hf export keeps (mtp_layers.py; a checkpoint's manifest names its own).
    The files are written into a temporary folder beside `out` and moved into place when all are written.
    """
    check_destination(out, fmt, overwrite)
    if nproc > 1 and (not isinstance(model, CheckpointModel) or launch is None):
        raise ConfigError(f"--nproc {nproc}: only a checkpoint of a run that trained every weight is exported by "
                          "several processes (a LoRA run's merged model, or an exported folder, is built whole in "
                          "one); give --nproc 1")
    info, cfg = tokenizer_info or {}, model.cfg
    if isinstance(model, CheckpointModel):
        shapes = {n: p for n, p in meta_model(cfg).named_parameters()}
        _check_fits(model, shapes)
    else:
        shapes = {n: torch.empty(p.shape, device="meta") for n, p in model.named_parameters()}
    groups, stored = hf_groups(MAPPINGS[cfg.arch] if fmt == "hf" else None, shapes)
    mtp = None
    if fmt == "hf":  # layers zerotrain does not train, kept from the folder the model came from
        base = (model.manifest.get("init_from") or {}).get("path") if isinstance(model, CheckpointModel) else init_from
        mtp = mtp_layers_of(cfg, base or config_folder, tensor_files)
    if mtp is not None:
        groups += [Group((n,), (n,)) for n in mtp.shapes]
        stored.update({n: torch.empty(shape, device="meta") for n, shape in mtp.shapes.items()})
    copies = shared_copies(cfg) if fmt == "hf" else {}  # trained MTP layers' copies of the embedding and the head
    groups += [Group((n,), (n,)) for n in copies]
    stored.update({n: shapes[ours] for n, ours in copies.items()})
    plan = plan_shards({n: torch.empty(t.shape, dtype=dtype, device="meta") for n, t in stored.items()},
                       parse_shard_size(max_shard_size))
    nproc = min(nproc, len(plan.shards))  # a process with no shard to write is not started
    tmp = make_staging_folder(out)
    try:
        for name, path in (config_files(config_folder) if config_folder else {}).items():
            shutil.copyfile(path, os.path.join(tmp, name))
        if tokenizer_folder is not None:
            shutil.copyfile(os.path.join(tokenizer_folder, TOKENIZER_FILE), os.path.join(tmp, TOKENIZER_FILE))
        if fmt == "hf":
            special = {key: info[key] for key in SPECIAL_IDS if key in info}
            # the Llama family's pad_token_id is its embedding's padding row (hf_config's), whatever generation pads
            # with (generation_config.json, kept as it is); "dtype" is what transformers 5 reads and writes,
            # "torch_dtype" what transformers 4 reads (5 takes it silently where "dtype" is absent); from_pretrained
            # loads the weights in it (5's default dtype="auto")
            dtype_name = DTYPE_NAMES[dtype]
            pad = {"pad_token_id": cfg.padding_idx} if cfg.llama_family else {}
            _write_json(os.path.join(tmp, CONFIG_FILE), {**hf_config(cfg, eot_id), **special, **pad,
                                                         "dtype": dtype_name, "torch_dtype": dtype_name})
            if tokenizer_folder is None and cfg.vocab_size >= BYTES_VOCAB:  # smaller: synthetic data, no text fits
                ByteTokenizer().to_hf().save(os.path.join(tmp, TOKENIZER_FILE))
            _write_missing_hf_configs(tmp, eot_id, cfg.positions, bytes_tokenizer=tokenizer_folder is None,
                                      special=special)
        else:
            _write_json(os.path.join(tmp, CONFIG_FILE), {
                "format": ZEROTRAIN_FORMAT, "version": 1, "model": dataclasses.asdict(cfg),
                "tokenizer": tokenizer_info, "source": source})
        _write_weights(model, ShardJob(model, plan, nproc, tuple(plan.owners(nproc)), tuple(groups), tmp, fmt, mtp,
                                       tuple(copies.items())),
                       launch)
        problem = missing_shard(plan, tmp)
        if problem:  # whole or absent: a folder missing a shard is never moved into place
            raise CheckpointError(f"export {out}: {problem}")
        write_index(plan, tmp)
        written = sorted(os.listdir(tmp))
        _move_into_place(tmp, out, written)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return written


def _check_fits(model: CheckpointModel, shapes: dict[str, torch.Tensor]) -> None:
    """CheckpointError naming the first tensor the checkpoint holds that the model its config describes lacks, or
    lacks in that shape, or the other way round (as loading it strictly would)."""
    where = f"the shards of {model.folder}"
    held = ShardedModel(model.folder, model.manifest).shapes
    for name, shape in held.items():
        if name not in shapes:
            raise CheckpointError(f"{where} does not fit the model its config describes: unexpected tensor {name}")
        if tuple(shape) != tuple(shapes[name].shape):
            raise CheckpointError(f"{where} does not fit the model its config describes: {name} has shape "
                                  f"{tuple(shape)}, the model {tuple(shapes[name].shape)}")
    missing = [n for n in shapes if n not in held]
    if missing:
        raise CheckpointError(f"{where} does not fit the model its config describes: missing tensor {missing[0]}")


def _write_weights(model: torch.nn.Module | CheckpointModel, job: ShardJob, launch) -> None:
    """The weight files of `job`: by the processes its owners name (launched), or here."""
    if job.nproc > 1:
        launch(functools.partial(write_shards_job, job=job), job.nproc)
        return
    every = list(range(len(job.plan.shards)))
    mapping, mode_of = MAPPINGS[model.cfg.arch] if job.fmt == "hf" else None, os.path.join(job.folder, CONFIG_FILE)
    if isinstance(model, CheckpointModel):
        with ShardedModel(model.folder, model.manifest) as shards:
            write_shards(job.plan, every, job.folder, list(job.groups), _with_mtp(shards.tensor, job), mapping,
                         mode_of)
    else:
        params = dict(model.named_parameters())
        write_shards(job.plan, every, job.folder, list(job.groups),
                     _with_mtp(lambda n: params[n].detach().float(), job), mapping, mode_of)


def _with_mtp(read: Callable[[str], torch.Tensor], job: ShardJob) -> Callable[[str], torch.Tensor]:
    """`read` (the model's tensors by name), the kept MTP layers' tensors from their folder, and trained MTP layers'
    copies of the embedding and the head from those."""
    mtp, copies = job.mtp, dict(job.copies)
    if copies:
        return lambda name: read(copies.get(name, name))
    if mtp is None:
        return read
    return lambda name: mtp.read(name) if name in mtp.files else read(name)


def write_shards_job(cfg: Config, comm, *, job: ShardJob) -> None:
    """One process of a parallel export (what `launch` runs): the shards `job.owners` gives its rank, read from
    the checkpoint's shards where their tensors lie."""
    mine = [k for k, rank in enumerate(job.owners) if rank == comm.rank]
    mapping = MAPPINGS[job.source.cfg.arch] if job.fmt == "hf" else None
    with ShardedModel(job.source.folder, job.source.manifest) as shards:
        write_shards(job.plan, mine, job.folder, list(job.groups), _with_mtp(shards.tensor, job), mapping,
                     os.path.join(job.folder, CONFIG_FILE))


def model_dtype(source, choice: str = "auto") -> tuple[torch.dtype, str]:
    """The dtype to export `source` (pretrained.ModelSource) in, and why, as the export's line says it.

    `choice` bf16, fp16 or fp32 is the user's. auto is the model's own: a run from --init-from gives back the dtype
    its model came in (its config.json's dtype, or torch_dtype as transformers 4 writes it; a zerotrain checkpoint's
    precision), as a fine-tune of a bf16 model is expected back in bf16 whatever it trained in; any other run the dtype
    it trained its parameters in (--precision: bf16, else fp32); an exported folder its config.json's dtype.
    """
    if choice != "auto":
        return DTYPES[choice], f"{choice} (--dtype)"
    manifest = source.manifest or {}
    base = (manifest.get("init_from") or {}).get("path")
    if base:
        found = _folder_dtype(base)
        if found is not None:
            return found, f"{_short(found)} (the dtype of its --init-from model, {base})"
    if manifest:
        precision = manifest.get("precision", "fp32")
        return DTYPES.get(precision, torch.float32), f"{precision} (the run's --precision)"
    found = _folder_dtype(source.folder)
    return (found, f"{_short(found)} (its config.json's dtype)") if found is not None else (torch.float32, "fp32")


def _folder_dtype(folder: str) -> torch.dtype | None:
    """The dtype a model folder's weights are in: a checkpoint's precision, a config.json's dtype / torch_dtype."""
    manifest, config = (read_json_object(folder, name) for name in ("manifest.json", CONFIG_FILE))
    if manifest:
        return DTYPES.get(manifest.get("precision"))
    named = config.get("dtype") or config.get("torch_dtype")
    return next((d for d, name in DTYPE_NAMES.items() if name == named), None)


def _short(dtype: torch.dtype) -> str:
    return next(k for k, d in DTYPES.items() if d == dtype)


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
    for name in os.listdir(out):
        if (name in EXPORT_FILES or SHARD_PATTERN.fullmatch(name)) and name not in written:
            os.remove(os.path.join(out, name))  # e.g. the tokenizer of an earlier BPE export
    for name in written:
        os.replace(os.path.join(tmp, name), os.path.join(out, name))


def _write_json(path: str, obj: dict) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=2)
        f.write("\n")
