"""Training data: token sources (pure functions of seed, step and index), the batch schedule, tokenizers, corpora."""

from .batches import BatchSchedule, StepBatch
from .resolve import DataSpec, check_source, checkpoint_tokenizer, prepare_source, resolve_data
from .sources import IGNORE, SyntheticSource, TokenSource, make_source
from .tokenizer import load_tokenizer

__all__ = ["IGNORE", "BatchSchedule", "DataSpec", "StepBatch", "SyntheticSource", "TokenSource", "check_source",
           "checkpoint_tokenizer", "load_tokenizer", "make_source", "prepare_source", "resolve_data"]
