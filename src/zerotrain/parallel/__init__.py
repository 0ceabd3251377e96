"""Data and tensor parallelism: the ZeRO engine (stages 1, 2 and 3), its flat shard layout, the TP x DP mesh, counted
collectives."""

from .comm import Comm
from .engine import GradientOrderError, StaleParameterError, ZeroEngine, layout_of, stage2_bucket_budget
from .layout import Bucket, ParamSlot, ShardLayout, ShardPiece
from .mesh import Mesh
from .zero3 import ReleasedParameterError, ZeroThreeEngine

__all__ = ["Bucket", "Comm", "GradientOrderError", "Mesh", "ParamSlot", "ReleasedParameterError", "ShardLayout", "ShardPiece",
           "StaleParameterError",
           "ZeroEngine", "ZeroThreeEngine", "layout_of", "stage2_bucket_budget"]
