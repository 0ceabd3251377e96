"""Sharded checkpoints: the format, the atomic (sync or async) writer, verification, and verified loading with resharding."""

from .checkpointer import Checkpointer, SaveFlags, WriterHooks
from .commit import point_latest, put_back_moved_aside
from .consolidate import ShardedModel, checkpoint_model, has_model_file, held_bytes, model_tensors
from .format import (FORMAT, LATEST, MANIFEST, MODEL_FILE, STATE_KEYS, VERSION, CheckpointError, committed_folder,
                     committed_step_numbers, committed_steps, incompatibility, read_latest, read_manifest, shard_name,
                     step_folders, step_name, step_of)
from .load import find_resumable, is_checkpoint_root, load_checkpoint, resolve_resume, resume, resume_candidates
from .save import CheckpointWriter, save_checkpoint
from .verify import Check, verify_checkpoint, verify_or_raise

__all__ = ["FORMAT", "LATEST", "MANIFEST", "MODEL_FILE", "STATE_KEYS", "VERSION", "Check", "CheckpointError",
           "Checkpointer", "CheckpointWriter", "SaveFlags", "ShardedModel", "WriterHooks", "checkpoint_model",
           "committed_folder", "committed_step_numbers", "committed_steps", "find_resumable", "has_model_file",
           "held_bytes", "incompatibility", "is_checkpoint_root", "load_checkpoint", "model_tensors", "point_latest",
           "put_back_moved_aside",
           "read_latest", "read_manifest", "resolve_resume", "resume", "resume_candidates", "save_checkpoint",
           "shard_name", "step_folders", "step_name", "step_of", "verify_checkpoint", "verify_or_raise"]
