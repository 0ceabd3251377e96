"""Loading a trained model for use: from a checkpoint (folder, root or run folder) or an exported folder.

A checkpoint is verified first (names, sizes, sha256, layout, and a format-1 model.safetensors against the
master shards), then its model is loaded strictly: the model file when its manifest lists one, else the model its
shards' masters assemble to (checkpoint.model_tensors, one tensor at a time into the model built: the model and one
tensor beyond it held) (a Llama that trained on a shorter window than
the model it started from gets that model's context back, from the manifest's tokenizer record); an exported
folder's config.json is checked against the architecture zerotrain builds, and its model.safetensors, or the shards its
model.safetensors.index.json names (export.tensor_files, as --init-from reads them), loaded strictly.
A LoRA run's checkpoint holds its adapters only: its base is rebuilt (the --init-from model its manifest records,
loaded from the same files by sha256, or the random base its seed gives) and the adapters are merged into it.
Safetensors and JSON only: nothing is unpickled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from zerotrain.checkpoint import (LATEST, MANIFEST, MODEL_FILE, CheckpointError, checkpoint_model, committed_folder,
                                   committed_steps, has_model_file, model_tensors, read_latest, read_manifest,
                                   verify_or_raise)
from zerotrain.checkpoint.stream import read_safetensors
from zerotrain.config import Config, ModelConfig
from zerotrain.data.tokenizer import load_tokenizer as tokenizer_of
from zerotrain.errors import ConfigError
from zerotrain.model import build_model, model_class
from zerotrain.model.lora import add_adapters, adapter_names, merge_adapters

from .base_digest import digest_like, shown, tagged_digests
from .export import CONFIG_FILE, INDEX_FILE, TOKENIZER_FILE, read_export_config, tensor_files
from .mapping import MAPPINGS


@dataclass(frozen=True)
class ModelSource:
    """Where a model's files are: a checkpoint step folder or an exported folder."""

    folder: str
    kind: str  # "checkpoint", "hf" or "safetensors"
    manifest: dict | None = None  # the checkpoint's, verified

    @property
    def config(self) -> dict | None:
        """The checkpoint's resolved training config (None for an exported folder)."""
        return self.manifest.get("config") if self.manifest else None


def model_folder(path: str) -> str:
    """The folder holding the model that `path` names.

    A checkpoint folder or an exported folder is itself; a checkpoint root gives what its `latest`
    names (or, without `latest`, its newest committed step); a run folder gives its checkpoints/.
    """
    if not os.path.isdir(path):
        what = "does not exist" if not os.path.exists(path) else "is not a folder"
        raise ConfigError(f"{path} {what}: expected a checkpoint folder, a checkpoint root or an exported model")
    if os.path.isfile(os.path.join(path, MANIFEST)) or os.path.isfile(os.path.join(path, CONFIG_FILE)):
        return path
    root = path
    if read_latest(root) is None and not committed_steps(root) and os.path.isdir(os.path.join(path, "checkpoints")):
        root = os.path.join(path, "checkpoints")  # a run folder
    latest = read_latest(root)
    if latest is not None:
        folder = committed_folder(root, latest)  # step_N.old/ when a re-save of step N stopped between its renames
        if not os.path.isdir(folder):
            raise CheckpointError(f"{os.path.join(root, LATEST)} names {latest}, which does not exist")
        return folder
    steps = committed_steps(root)
    if steps:
        return os.path.join(root, steps[-1])
    raise ConfigError(f"{path} holds no checkpoint (no manifest.json, latest or step folder) and no exported "
                      f"model (no config.json)")


def locate(path: str) -> ModelSource:
    """The verified source of the model `path` names (CheckpointError if a checkpoint does not verify)."""
    folder = model_folder(path)
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        verify_or_raise(folder)
        return ModelSource(folder, "checkpoint", read_manifest(folder))
    kind, _, _ = read_export_config(folder)
    return ModelSource(folder, kind)


def load_model(path: str) -> torch.nn.Module:
    """The model `path` names, in eval mode on the CPU: `model(idx)` maps (B, T) token ids to (B, T, vocab) logits."""
    return load_from(locate(path))


def run_model_config(source: ModelSource) -> ModelConfig:
    """The model config of a checkpoint (its manifest's) or of an exported folder (its config.json's)."""
    if source.kind != "checkpoint":
        return read_export_config(source.folder)[1]
    try:
        return ModelConfig(**source.manifest.get("config", {}).get("model"))
    except TypeError as e:
        raise CheckpointError(f"{os.path.join(source.folder, MANIFEST)}: config.model is not a model config "
                              f"({e})") from None


def load_from(source: ModelSource) -> torch.nn.Module:
    folder, cfg = source.folder, run_model_config(source)
    if source.kind == "checkpoint":  # verified by locate
        where = os.path.join(folder, MODEL_FILE) if has_model_file(source.manifest) else f"the shards of {folder}"
        if source.manifest["config"].get("lora", {}).get("lora_rank"):
            return _lora_model(source, checkpoint_model(folder, source.manifest), where)
        model = model_class(cfg)(cfg)
        _fill(model, model_tensors(folder, source.manifest), where)
        return model.eval().requires_grad_(False)  # for inference: no autograd graph kept
    tensors, where = _read_tensors(folder)
    if source.kind == "hf":
        tensors = MAPPINGS[cfg.arch].from_hf(tensors, cfg)
    model = model_class(cfg)(cfg)
    try:
        model.load_state_dict(tensors, strict=True)
    except RuntimeError as e:  # missing, unexpected or misshapen tensors: name the first
        detail = str(e).split("\n\t")[1] if "\n\t" in str(e) else str(e)
        raise CheckpointError(f"{where} does not fit the model its config describes: {detail.strip()}") from None
    return model.eval().requires_grad_(False)  # for inference: no autograd graph kept


def _fill(model: torch.nn.Module, tensors, where: str) -> None:
    """Copy each (name, tensor) into `model`'s parameter of that name as it comes, strictly (every parameter once, each
    of its shape): the model and one tensor beyond it held at a time."""
    params = dict(model.named_parameters())  # a tied head once, under the embedding's name, as checkpoints hold it
    seen = set()
    with torch.no_grad():
        for name, t in tensors:
            if name not in params:
                raise CheckpointError(f"{where} does not fit the model its config describes: unexpected tensor {name}")
            if tuple(t.shape) != tuple(params[name].shape):
                raise CheckpointError(f"{where} does not fit the model its config describes: {name} has shape "
                                      f"{tuple(t.shape)}, the model {tuple(params[name].shape)}")
            params[name].copy_(t)
            seen.add(name)
            del t  # let the tensor go before the next one is read
    missing = [n for n in params if n not in seen]
    if missing:
        raise CheckpointError(f"{where} does not fit the model its config describes: missing tensor {missing[0]}")


def _lora_model(source: ModelSource, tensors: dict[str, torch.Tensor], where: str) -> torch.nn.Module:
    """A LoRA checkpoint's model: its base with the adapters merged in (the plain architecture, for inference)."""
    run = Config.from_dict(source.config)
    record = source.manifest.get("init_from")
    if record is not None:
        problem = base_problem(record)
        if problem:
            raise CheckpointError(f"{source.folder} is a LoRA run's adapters: {problem}")
        model = load_from(locate(record["path"]))
    else:  # a random base: the one the run's seed builds
        model = build_model(run.model, run.loop.seed)
    add_adapters(model, run.lora, run.loop.seed)
    names = adapter_names(model)
    if sorted(tensors) != sorted(names):
        wrong = sorted(set(tensors) ^ set(names))[0]
        raise CheckpointError(f"{where} does not hold the adapters its config describes: {wrong}")
    model.load_state_dict(tensors, strict=False)
    return merge_adapters(model).eval().requires_grad_(False)


def base_problem(record: dict) -> str | None:
    """Why the files of the base a manifest's init_from `record` names are no longer those it recorded, or None.

    A folder's weight files are hashed again here, in one process, as the record's digests were taken (base_digest:
    by blocks, or whole as an older record's). A base that is a checkpoint is compared with the sha256 its manifest
    records (its model file, or its shards without one), which loading it verifies the files against: its files are
    not hashed twice.
    """
    folder = record["path"]
    if os.path.isfile(os.path.join(folder, MANIFEST)):
        try:
            listed = {f["name"]: f["sha256"] for f in read_manifest(folder)["files"]}
        except CheckpointError as e:
            return f"its base {folder} is no longer a readable checkpoint ({e})"
        for entry in record["files"]:
            file, digest = os.path.join(folder, entry["name"]), listed.get(entry["name"])
            if digest is None:
                return f"its base {file} is missing (its {MANIFEST} does not list it)"
            if digest != entry["sha256"]:
                return (f"its base {file} has changed (sha256 {digest[:12]}... in its {MANIFEST}, the run trained on "
                        f"{entry['sha256'][:12]}...)")
        return None
    try:
        files = {os.path.basename(f): f for f in set(tensor_files(folder).values())} if os.path.isdir(folder) else {}
    except CheckpointError:
        files = {}
    for name, recorded in tagged_digests(record).items():
        file = files.get(name)
        if file is None:
            return f"its base {os.path.join(folder, name)} is missing"
        digest = digest_like(file, recorded)
        if digest != recorded:
            return f"its base {file} has changed ({shown(digest)}, the run trained on {shown(recorded)})"
    return None


def _read_tensors(folder: str) -> tuple[dict[str, torch.Tensor], str]:
    """The folder's tensors, from model.safetensors or the shards its index names, through the same checked reader
    checkpoints are loaded with; and how messages name where they came from."""
    try:
        files = tensor_files(folder)
    except CheckpointError as e:
        raise CheckpointError(f"{folder}: {e}") from None
    tensors, held = {}, sorted(set(files.values()))
    for file in held:
        try:
            read = read_safetensors(file)[0]
        except OSError as e:
            raise CheckpointError(f"{file} is not a readable safetensors file ({e})") from None
        tensors.update((name, read[name]) for name, f in files.items() if f == file and name in read)
    return tensors, held[0] if len(held) == 1 else f"the shards of {os.path.join(folder, INDEX_FILE)}"


def load_tokenizer(path: str):
    """The tokenizer of the model `path` names (its tokenizer.json for BPE, else bytes), or of a data folder.

    data.tokenizer.load_tokenizer, after resolving a run folder or a checkpoint root to its checkpoint.
    """
    if os.path.isdir(path) and not os.path.isfile(os.path.join(path, TOKENIZER_FILE)):
        try:
            path = model_folder(path)
        except ConfigError:  # a prepared data folder of bytes, or any folder without a tokenizer.json
            pass
    return tokenizer_of(path)
