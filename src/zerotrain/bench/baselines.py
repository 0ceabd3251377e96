"""Four data-parallel strategies behind one interface: one optimizer step, its state, its counted bytes.

zerotrain's ZeRO-1 engine, torch DDP + AdamW, DDP + ZeroRedundancyOptimizer(AdamW) and FSDP2
(`fully_shard`, no resharding after forward) train the same model (GPT-2 or Llama) from the same seed on the same
batches with the same AdamW hyperparameters and weight-decay groups, so their final parameters
must agree. Each strategy counts the bytes its own collectives send, under the ring accounting
of comm.py: (W-1)/W of the buffer for reduce-scatter and all-gather, 2(W-1)/W for all-reduce,
the full buffer for a broadcast from this rank.
"""

from __future__ import annotations

import contextlib
from collections import Counter

import torch
import torch.distributed as dist

from zerotrain.config import Config
from zerotrain.data import StepBatch
from zerotrain.hub.mapping import MAPPINGS
from zerotrain.model import build_model
from zerotrain.parallel import Comm
from zerotrain.parallel.optim import adamw_options, adamw_param_groups, build_adamw
from zerotrain.runtime.launch import rank_device
from zerotrain.training.invariants import held_bytes

NAMES = ("zerotrain", "ddp", "ddp_zero", "fsdp2")
LABELS = {
    "zerotrain": "zerotrain ZeRO-1",
    "ddp": "DDP + AdamW",
    "ddp_zero": "DDP + ZeroRedundancyOptimizer",
    "fsdp2": "FSDP2 fully_shard",
}


class CollectiveCounter:
    """Calls and ring bytes per collective, counted at the outermost call only.

    Outermost only, because torch's wrappers call each other (a DDP comm hook calls all_reduce,
    a deprecated name forwards to its replacement) and one collective must count once.
    """

    # torch.distributed function -> (position, keyword) of the tensor that sets the size, ring factor
    RING = {
        "all_reduce": (0, "tensor", lambda W: 2 * (W - 1) / W),
        "all_gather_single": (0, "output_tensor", lambda W: (W - 1) / W),
        "all_gather_into_tensor": (0, "output_tensor", lambda W: (W - 1) / W),
        "all_gather": (0, "tensor_list", lambda W: (W - 1) / W),
        "reduce_scatter_single": (1, "input", lambda W: (W - 1) / W),
        "reduce_scatter_tensor": (1, "input", lambda W: (W - 1) / W),
        "reduce_scatter": (1, "input_list", lambda W: (W - 1) / W),
        "broadcast": (0, "tensor", None),  # full bytes from the source, nothing from the others
    }

    def __init__(self, world_size: int):
        self.world_size = world_size
        self.calls: Counter[str] = Counter()
        self.bytes: Counter[str] = Counter()
        self._depth = 0

    @contextlib.contextmanager
    def collective(self, kind: str, nbytes: float):
        if self._depth == 0:
            self.calls[kind] += 1
            self.bytes[kind] += int(nbytes)
        self._depth += 1
        try:
            yield
        finally:
            self._depth -= 1

    def _ring_bytes(self, kind: str, args: tuple, kwargs: dict) -> float:
        position, keyword, factor = self.RING[kind]
        tensor = args[position] if len(args) > position else kwargs.get(keyword)
        if factor is None:
            src = args[1] if len(args) > 1 else kwargs.get("src")
            # Alone in the group, the source has no one to send to.
            return _nbytes(tensor) if src == dist.get_rank() and self.world_size > 1 else 0
        return _nbytes(tensor) * factor(self.world_size)

    @contextlib.contextmanager
    def patched(self):
        """Count every torch.distributed collective called inside, by wrapping the module's functions."""
        originals = {}
        for kind in self.RING:
            original = getattr(dist, kind, None)
            if original is None:
                continue
            originals[kind] = original

            def counted(*args, _kind=kind, _original=original, **kwargs):
                with self.collective(_kind, self._ring_bytes(_kind, args, kwargs)):
                    return _original(*args, **kwargs)

            setattr(dist, kind, counted)
        try:
            yield
        finally:
            for kind, original in originals.items():
                setattr(dist, kind, original)


def _nbytes(t) -> int:
    if isinstance(t, (list, tuple)):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if t is not None else 0


def _optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Distinct storages behind the optimizer's per-parameter state (the local shard of a DTensor).

    AdamW's scalar step counters are left out, as the engine's own accounting leaves out its own:
    bookkeeping, not state per parameter value.
    """
    tensors = []
    for state in optimizer.state.values():
        for key, t in state.items():
            if key == "step" or not isinstance(t, torch.Tensor):
                continue
            tensors.append(t.to_local() if hasattr(t, "to_local") else t)
    return held_bytes(tensors, exclude=[])


class ZeroTrainStrategy:
    """zerotrain's engine, driven as train.train drives it."""

    def __init__(self, cfg: Config, comm: Comm):
        from zerotrain.training.loop import build_engine

        self.engine = build_engine(cfg, comm)
        self.comm = comm

    def step(self, batch: StepBatch, lr: float) -> None:
        from zerotrain.training.loop import accumulate_gradients

        e = self.engine
        e.zero_grad()
        loss_sum = float(accumulate_gradients(e, batch))
        grad_norm, _ = e.reduce_grads(torch.tensor([loss_sum], dtype=torch.float64))
        e.apply(lr, grad_norm)

    def settle(self) -> None:
        """Finish the all-gather still running behind the next forward (timed, at the end of a block)."""
        self.engine.wait_params()

    def comm_counts(self) -> tuple[Counter, Counter]:
        """Calls and bytes so far, by purpose, from the engine's own Comm counters."""
        return self.comm.snapshot()

    def state_bytes(self) -> int:
        return held_bytes(self.engine.optimizer_state_tensors(), exclude=[self.engine.held_params])

    def full_params(self) -> dict[str, torch.Tensor]:
        return self.engine.full_state_dict()


class _TorchStrategy:
    """The loop shared by the three PyTorch strategies: they average gradients over ranks.

    The loss is scaled by the world size so that their averaged gradient equals zerotrain's summed
    one (sum of token losses / global token count); for a power-of-two world size the scaling is exact.
    """

    def __init__(self, cfg: Config, comm: Comm):
        self.counter = CollectiveCounter(comm.world_size)
        self.world_size, self.clip = comm.world_size, cfg.optim.grad_clip
        self.model = build_model(cfg.model, cfg.loop.seed).to(rank_device(cfg))

    def _sync_context(self, sync: bool):
        raise NotImplementedError

    def step(self, batch: StepBatch, lr: float) -> None:
        with self.counter.patched():
            self.optimizer.zero_grad()
            last = len(batch.micro_batches) - 1
            for i, (x, y, _) in enumerate(batch.micro_batches):  # synthetic rows: no segments
                with self._sync_context(i == last):
                    # the loss as zerotrain's loop computes it (chunked, from the head's input): the strategies are
                    # compared, not two losses whose float noise AdamW's first step turns into lr-sized updates
                    token_loss = self.model(x, targets=y)
                    (token_loss / batch.global_tokens * self.world_size).backward()
                token_loss.item()  # the same host sync per micro-batch as zerotrain's loop
            if self.clip > 0:
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()

    def settle(self) -> None:
        """Nothing of a step outlives it."""

    def comm_counts(self) -> tuple[Counter, Counter]:
        """Calls and bytes so far, by torch.distributed function."""
        return Counter(self.counter.calls), Counter(self.counter.bytes)

    def state_bytes(self) -> int:
        return _optimizer_state_bytes(self.optimizer)

    def full_params(self) -> dict[str, torch.Tensor]:
        module = getattr(self.model, "module", self.model)
        return {n: p.detach().float().cpu().clone() for n, p in module.named_parameters()}


class DDPStrategy(_TorchStrategy):
    """torch DDP (default buckets) + torch.optim.AdamW on every parameter of every rank."""

    def __init__(self, cfg: Config, comm: Comm):
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook
        from torch.nn.parallel import DistributedDataParallel as DDP

        super().__init__(cfg, comm)
        self.model = DDP(self.model, device_ids=[rank_device(cfg).index] if cfg.launch.device == "cuda" else None)
        counter = self.counter

        def counted_allreduce(_, bucket):
            # DDP's reducer calls the hook from C++; the default hook then all-reduces in Python.
            nbytes = _nbytes(bucket.buffer()) * 2 * (counter.world_size - 1) / counter.world_size
            with counter.collective("all_reduce", nbytes):
                return allreduce_hook(None, bucket)

        self.model.register_comm_hook(None, counted_allreduce)
        self.optimizer = self._build_optimizer(cfg)

    def _build_optimizer(self, cfg: Config) -> torch.optim.Optimizer:
        groups = adamw_param_groups(self.model.module.named_parameters(), cfg.optim.weight_decay)
        return build_adamw(groups, cfg.optim)

    def _sync_context(self, sync: bool):
        return contextlib.nullcontext() if sync else self.model.no_sync()


class DDPZeroStrategy(DDPStrategy):
    """DDP's gradient all-reduce, then ZeroRedundancyOptimizer: AdamW on whole parameters assigned to
    this rank, and a broadcast of each updated parameter from its owner."""

    def _build_optimizer(self, cfg: Config) -> torch.optim.Optimizer:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        groups = adamw_param_groups(self.model.module.named_parameters(), cfg.optim.weight_decay)
        return ZeroRedundancyOptimizer(groups,
                                       optimizer_class=torch.optim.AdamW,
                                       **adamw_options(cfg.optim, rank_device(cfg)))

    def state_bytes(self) -> int:
        # The local AdamW holds the state; the wrapper's own `state` is only filled when consolidating.
        return _optimizer_state_bytes(self.optimizer.optim) + _optimizer_state_bytes(self.optimizer)


class FSDP2Strategy(_TorchStrategy):
    """fully_shard on every block and on the root, parameters kept unsharded from forward to backward,
    AdamW on each rank's DTensor shards."""

    def __init__(self, cfg: Config, comm: Comm):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        super().__init__(cfg, comm)
        mesh = init_device_mesh(rank_device(cfg).type, (comm.world_size,))
        # The architecture's table names where its blocks live (transformer.h in GPT-2, model.layers in Llama).
        blocks = self.model.get_submodule(MAPPINGS[cfg.model.arch].block_prefix.rstrip("."))
        for block in blocks:
            fully_shard(block, mesh=mesh, reshard_after_forward=False)
        fully_shard(self.model, mesh=mesh, reshard_after_forward=False)
        self.optimizer = build_adamw(adamw_param_groups(self.model.named_parameters(), cfg.optim.weight_decay),
                                     cfg.optim)

    def _sync_context(self, sync: bool):
        self.model.set_requires_gradient_sync(sync)
        return contextlib.nullcontext()

    def full_params(self) -> dict[str, torch.Tensor]:
        # full_tensor() all-gathers: every rank calls it, in the same order.
        return {n: p.full_tensor().detach().float().cpu().clone() for n, p in self.model.named_parameters()}


def build(name: str, cfg: Config, comm: Comm):
    """A freshly initialised strategy: the same seed gives the same starting parameters to all four."""
    kinds = {"zerotrain": ZeroTrainStrategy, "ddp": DDPStrategy, "ddp_zero": DDPZeroStrategy,
             "fsdp2": FSDP2Strategy}
    return kinds[name](cfg, comm)
