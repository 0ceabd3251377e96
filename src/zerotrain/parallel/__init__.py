"""Data and tensor parallelism: the ZeRO engine (stage 1 or 2), its flat shard layout, the TP x DP mesh, counted
collectives."""

from .comm import Comm
from .engine import GradientOrderError, StaleParameterError, ZeroEngine, layout_of, stage2_bucket_budget
from .layout import Bucket, ParamSlot, ShardLayout
from .mesh import Mesh

__all__ = ["Bucket", "Comm", "GradientOrderError", "Mesh", "ParamSlot", "ShardLayout", "StaleParameterError",
           "ZeroEngine", "layout_of", "stage2_bucket_budget"]
