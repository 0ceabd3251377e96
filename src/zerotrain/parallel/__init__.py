"""Data, tensor and expert parallelism: the ZeRO engine (stages 1, 2 and 3, hybrid sharding), its flat shard layout,
the one named mesh, counted collectives."""

from .comm import Comm
from .experts import ExpertParallelEngine, expert_bytes, shard_experts
from .engine import GradientOrderError, ZeroEngine, layout_of, stage2_bucket_budget
from .layout import Bucket, ParamSlot, ShardLayout, ShardPiece, shard_values
from .mesh import Mesh
from .params import ParameterPlacement, StaleParameterError
from .replicated import ReplicatedParameters
from .zero3 import FrozenCopy, ReleasedParameterError, ShardedParameters, shard_frozen_copy

__all__ = ["Bucket", "Comm", "ExpertParallelEngine", "expert_bytes", "shard_experts", "FrozenCopy", "GradientOrderError", "Mesh", "ParamSlot", "ParameterPlacement", "ReleasedParameterError", "ReplicatedParameters", "ShardLayout", "ShardPiece", "ShardedParameters",
           "StaleParameterError",
           "ZeroEngine", "layout_of", "shard_frozen_copy", "shard_values", "stage2_bucket_budget"]
