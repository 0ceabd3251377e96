"""Data, tensor and expert parallelism: the ZeRO engine (stages 1, 2 and 3, hybrid sharding), its flat shard layout,
the one named mesh, counted collectives."""

from .comm import Comm
from .comm_stream import CommStream, stream_api
from .experts import expert_bytes, shard_experts
from .engine import ZeroEngine, layout_of
from .gradients import GradientOrderError, GradientReducer, stage2_bucket_budget
from .layout import Bucket, ParamSlot, ShardLayout, ShardPiece, shard_values
from .mesh import Mesh
from .params import Placement, StaleParameterError
from .replicated import ReplicatedParameters
from .sharded_adamw import AdamWShard
from .bucket_buffers import ReleasedParameterError
from .frozen_copy import FrozenCopy, shard_frozen_copy
from .sharded import ShardedParameters

__all__ = ["AdamWShard", "Bucket", "Comm", "CommStream", "stream_api", "expert_bytes", "shard_experts", "FrozenCopy", "GradientOrderError", "GradientReducer", "Mesh", "ParamSlot", "Placement", "ReleasedParameterError", "ReplicatedParameters", "ShardLayout", "ShardPiece", "ShardedParameters",
           "StaleParameterError",
           "ZeroEngine", "layout_of", "shard_frozen_copy", "shard_values", "stage2_bucket_budget"]
