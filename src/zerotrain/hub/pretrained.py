"""Loading a trained model for use: from a checkpoint (folder, root or run folder) or an exported folder.

A checkpoint is verified first (names, sizes, sha256, layout, and model.safetensors against the
master shards), then its model.safetensors is loaded strictly (a Llama that trained on a shorter window than
the model it started from gets that model's context back, from the manifest's tokenizer record); an exported
folder's config.json is checked against the architecture zerotrain builds, and its model.safetensors, or the shards its
model.safetensors.index.json names (export.tensor_files, as --init-from reads them), loaded strictly.
Safetensors and JSON only: nothing is unpickled.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from zerotrain.checkpoint import (LATEST, MANIFEST, CheckpointError, committed_steps, read_latest, read_manifest,
                                   verify_or_raise)
from zerotrain.checkpoint.stream import read_safetensors
from zerotrain.config import ModelConfig
from zerotrain.data.tokenizer import load_tokenizer as tokenizer_of
from zerotrain.errors import ConfigError
from zerotrain.model import model_class

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
        if not os.path.isdir(os.path.join(root, latest)):
            raise CheckpointError(f"{os.path.join(root, LATEST)} names {latest}, which does not exist")
        return os.path.join(root, latest)
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


def load_from(source: ModelSource) -> torch.nn.Module:
    folder = source.folder
    if source.kind == "checkpoint":
        model_cfg = source.manifest.get("config", {}).get("model")
        try:
            cfg = ModelConfig(**model_cfg)
        except TypeError as e:
            raise CheckpointError(f"{os.path.join(folder, MANIFEST)}: config.model is not a model config ({e})") from None
    else:
        _, cfg, _ = read_export_config(folder)
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
