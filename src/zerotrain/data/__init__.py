"""Training data: token sources (pure functions of seed, step and index), records in epochs, the batch schedule,
tokenizers, corpora."""

from .batches import IGNORE, BatchSchedule, MicroBatch, StepBatch, on_device
from .mixture import MixtureSource
from .packing import RecordSource
from .resolve import DataSpec, check_source, checkpoint_tokenizer, prepare_source, resolve_data
from .sources import SyntheticSource, TokenSource, epoch_steps, make_source, packs_records
from .tokenizer import load_tokenizer

__all__ = ["IGNORE", "BatchSchedule", "DataSpec", "MicroBatch", "MixtureSource", "RecordSource", "StepBatch",
           "SyntheticSource", "TokenSource", "check_source", "checkpoint_tokenizer", "epoch_steps", "load_tokenizer",
           "make_source", "on_device", "packs_records", "prepare_source", "resolve_data"]
