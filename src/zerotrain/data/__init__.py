"""Training data: token sources (pure functions of seed, step and index) and the batch schedule."""

from .batches import BatchSchedule, StepBatch
from .sources import IGNORE, SyntheticSource, TextSource, check_source, make_source, text_shortfall

__all__ = ["IGNORE", "BatchSchedule", "StepBatch", "SyntheticSource", "TextSource", "check_source", "make_source",
           "text_shortfall"]
