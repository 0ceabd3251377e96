"""Data parallelism: the ZeRO-1 engine, its flat shard layout, and the counted collectives it runs on."""

from .comm import Comm
from .engine import GradientOrderError, StaleParameterError, ZeroOneEngine
from .layout import Bucket, ParamSlot, ShardLayout

__all__ = ["Bucket", "Comm", "GradientOrderError", "ParamSlot", "ShardLayout", "StaleParameterError", "ZeroOneEngine"]
