"""The checkpoint format: folder and file names, the manifest, and the low-level file helpers.

A checkpoint is a folder `step_{step:08d}/` holding `manifest.json`, `model.safetensors` (the full
fp32 model, loadable without torch.distributed) and one `optim-rank{r}-of-{W}.safetensors` per rank.
Safetensors and JSON only: nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import json
import os

from ..errors import ZeroTrainError

FORMAT, VERSION = "zerotrain-checkpoint", 1
MODEL_FILE, MANIFEST, LATEST = "model.safetensors", "manifest.json", "latest"
STATE_KEYS = ("master", "exp_avg", "exp_avg_sq")


class CheckpointError(ZeroTrainError):
    pass


def step_name(step: int) -> str:
    return f"step_{step:08d}"


def shard_name(rank: int, world_size: int) -> str:
    return f"optim-rank{rank:05d}-of-{world_size:05d}.safetensors"


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def read_manifest(path: str) -> dict:
    file = os.path.join(path, MANIFEST)
    try:
        with open(file) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise CheckpointError(f"{path} is not a checkpoint: {MANIFEST} is missing") from None
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{file} is not valid JSON ({e})") from None
    if manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise CheckpointError(
            f"{file}: format {manifest.get('format')!r} version {manifest.get('version')!r} "
            f"is not {FORMAT!r} version {VERSION}"
        )
    return manifest


def incompatibility(manifest: dict, model_config: dict) -> str | None:
    """Why a checkpoint cannot initialise this model, or None."""
    theirs = manifest["config"]["model"]
    for key, value in model_config.items():
        if theirs.get(key) != value:
            return f"checkpoint has model.{key}={theirs.get(key)}, this run has {value}"
    return None
