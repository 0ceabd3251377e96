"""Sharded checkpoints: the format, the atomic save, and verified loading with resharding."""

from .format import (FORMAT, LATEST, MANIFEST, MODEL_FILE, STATE_KEYS, VERSION, CheckpointError, incompatibility,
                     read_manifest, shard_name, step_name)
from .load import load, resolve_resume, verify_files
from .save import committed_steps, save

__all__ = ["FORMAT", "LATEST", "MANIFEST", "MODEL_FILE", "STATE_KEYS", "VERSION", "CheckpointError", "committed_steps",
           "incompatibility", "load", "read_manifest", "resolve_resume", "save", "shard_name", "step_name",
           "verify_files"]
