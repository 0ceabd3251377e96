"""--init-from: start training from the weights of a local Hugging Face folder or a zerotrain checkpoint or export.

The source decides the architecture, the sizes and the vocabulary (a flag that says otherwise is refused,
naming both values) and brings its tokenizer. Each rank reads only the slices of the tensors it trains
(safetensors' lazy slicing, through the architecture's table in mapping.py), into a model built on the
meta device: no rank ever holds a full copy of a tensor it trains TP-sharded. Weights only: the optimizer
and the schedule start fresh. Pickle files (pytorch_model.bin, *.pt) are refused: nothing is unpickled.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass

import torch
from safetensors import safe_open

from zerotrain.checkpoint import MANIFEST, CheckpointError, read_manifest, verify_or_raise
from zerotrain.checkpoint.stream import read_header, sha256_file
from zerotrain.config import ModelConfig, setting_for
from zerotrain.errors import ConfigError

from .export import MODEL_FILE, read_export_config
from .mapping import MAPPINGS, HFMapping
from .pretrained import model_folder

INDEX_FILE = "model.safetensors.index.json"
PICKLES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


@dataclass(frozen=True)
class WeightSource:
    """Where --init-from's weights are: the folder, what it is, its model, and which file holds each tensor."""

    folder: str
    kind: str  # "hf", "safetensors" (a zerotrain export) or "checkpoint"
    model: ModelConfig
    files: dict[str, str]  # tensor name (zerotrain's) -> the safetensors file holding it
    mapping: HFMapping | None  # hf: the architecture's layouts; a zerotrain folder stores its own
    stored: dict[str, str] = dataclasses.field(default_factory=dict)  # zerotrain's name -> the file's, where they differ

    def record(self) -> dict:
        """What a checkpoint's manifest records of it: the folder, its kind, each weight file's sha256."""
        return {"path": self.folder, "kind": self.kind,
                "files": [{"name": os.path.basename(f), "sha256": sha256_file(f)[1]}
                          for f in sorted(set(self.files.values()))]}


def weight_source(path: str, verify: bool = True) -> WeightSource:
    """The weights `path` names; ConfigError (exit 2) for a folder zerotrain cannot start from, naming why.

    A zerotrain checkpoint is verified first unless `verify` is False: the ranks read a source the launcher
    (or torchrun's rank 0, in config_from_args) has verified already.
    """
    if not os.path.exists(path):
        raise ConfigError(f"--init-from {path}: no such folder")
    if not os.path.isdir(path):
        raise ConfigError(f"--init-from {path}: not a folder (a Hugging Face model folder, a zerotrain checkpoint, "
                          "run folder or export)")
    try:
        folder = os.path.abspath(model_folder(path))
        if os.path.isfile(os.path.join(folder, MANIFEST)):
            if verify:
                verify_or_raise(folder)
            manifest = read_manifest(folder)
            model = ModelConfig(**manifest["config"]["model"])
            return WeightSource(folder, "checkpoint", model, _tensor_files(folder), None)
        kind, model, _ = read_export_config(folder)
    except CheckpointError as e:
        raise ConfigError(f"--init-from {path}: {e}") from None
    files, mapping = _tensor_files(folder), MAPPINGS[model.arch] if kind == "hf" else None
    if mapping is None:
        return WeightSource(folder, kind, model, files, None)
    names = {mapping.canonical(n): n for n in files}
    return WeightSource(folder, kind, model, {z: files[n] for z, n in names.items()}, mapping,
                        {z: n for z, n in names.items() if z != n})


def _tensor_files(folder: str) -> dict[str, str]:
    """Tensor name -> file: model.safetensors, or the shards a model.safetensors.index.json names."""
    single, index = os.path.join(folder, MODEL_FILE), os.path.join(folder, INDEX_FILE)
    if os.path.isfile(single):
        return {name: single for name in read_header(single)}
    if os.path.isfile(index):
        try:
            with open(index) as f:
                weight_map = json.load(f)["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"--init-from {folder}: {INDEX_FILE} has no readable weight_map ({e})") from None
        files = {}
        for name, file in weight_map.items():
            full = os.path.join(folder, file)
            if os.path.basename(file) != file or not os.path.isfile(full):
                raise ConfigError(f"--init-from {folder}: {INDEX_FILE} names {file!r} for {name}, which is not a "
                                  "file in the folder")
            files[name] = full
        return files
    pickles = sorted(n for n in os.listdir(folder) if n.endswith(PICKLES))
    if pickles:
        raise ConfigError(f"--init-from {folder}: holds {pickles[0]} but no {MODEL_FILE}: zerotrain never unpickles "
                          "weights; save them as safetensors first (transformers: save_pretrained(folder, "
                          "safe_serialization=True))")
    raise ConfigError(f"--init-from {folder}: no {MODEL_FILE} or {INDEX_FILE}")


def adopt(model: ModelConfig, source: WeightSource, given: set[str]) -> ModelConfig:
    """The run's model: the source's, where no flag or TOML key in `given` says otherwise; ConfigError if one does.

    A Llama may train on shorter sequences than its positions (rotary embeddings have no table); a GPT-2's learned
    position table fixes its sequence length.
    """
    theirs = dataclasses.asdict(source.model)
    for key, value in theirs.items():
        mine = getattr(model, key)
        if key not in given or mine == value:
            continue
        if key == "seq_len" and source.model.arch == "llama" and mine <= value:
            theirs[key] = mine
            continue
        raise ConfigError(f"{setting_for(key).flag} {mine} contradicts --init-from {source.folder}, whose model has {key} = "
                          f"{value}: leave it out, the model's comes with it")
    return ModelConfig(**theirs)


def load_local(model: torch.nn.Module, source: WeightSource, tp_slices: dict, tp_rank: int) -> None:
    """Fill `model` (this rank's parameters, TP-sliced by `tp_slices`) from the source, each rank reading its slices.

    CheckpointError naming the first tensor that is missing, extra or of the wrong shape.
    """
    mapping = source.mapping or MAPPINGS[source.model.arch]
    transposed = mapping.is_transposed if source.mapping is not None else (lambda name: False)
    params = dict(model.named_parameters())  # a tied head appears once, under the embedding's name
    ignored = mapping.ignored + (("lm_head.weight",) if source.model.tie_embeddings else ())
    extra = sorted(n for n in source.files if n not in params and not n.endswith(ignored))
    if extra:
        raise CheckpointError(f"--init-from {source.folder}: {os.path.basename(source.files[extra[0]])} holds "
                              f"{extra[0]}, which the {source.model.arch} model it describes does not have")
    opened: dict[str, object] = {}
    try:
        for name, param in params.items():
            file = source.files.get(name)
            if file is None:
                raise CheckpointError(f"--init-from {source.folder}: no tensor {name} in its weight files")
            f = opened.get(file) or opened.setdefault(file, safe_open(file, framework="pt"))
            tp_slice = tp_slices.get(name)
            full = tuple(tp_slice.full_shape) if tp_slice else tuple(param.shape)
            stored = tuple(f.get_slice(source.stored.get(name, name)).get_shape())
            want = tuple(reversed(full)) if transposed(name) else full
            if stored != want:
                raise CheckpointError(f"--init-from {source.folder}: {name} is {list(stored)} in "
                                      f"{os.path.basename(file)}, the model needs {list(want)}")
            local = _read(f, source.stored.get(name, name), tp_slice, tp_rank, transposed(name))
            with torch.no_grad():
                param.copy_(local.to(param.dtype))
    finally:
        opened.clear()


def _read(f, name: str, tp_slice, rank: int, transposed: bool) -> torch.Tensor:
    if tp_slice is None:
        t = f.get_tensor(name)
        return t.t() if transposed else t
    dim = 1 - tp_slice.dim if transposed else tp_slice.dim  # the split dim in the file's layout
    lazy = f.get_slice(name)
    t = torch.cat([lazy[lo:hi] if dim == 0 else lazy[:, lo:hi] for lo, hi in tp_slice.parts[rank]], dim=dim)
    return t.t() if transposed else t
