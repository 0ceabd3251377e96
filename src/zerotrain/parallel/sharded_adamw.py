"""The sharded AdamW: AdamW over this rank's owned chunks (masters, moments, step count) and its checkpoint shard."""

from __future__ import annotations

import torch

from zerotrain.config import OptimConfig

from .layout import shard_values
from .optim import build_adamw
from .params import OwnedPiece

MOMENT_BYTES = 8  # AdamW's exp_avg and exp_avg_sq per owned value, fp32 in either precision


def state_bytes_per_value(precision: str) -> int:
    """The ZeRO formula's optimizer state per owned value: the two fp32 moments and, in bf16, the fp32 master (in fp32
    the masters are the parameter buffer's own chunks): 8 in fp32, 12 in bf16. The plan (parts.ShardedAdamW) and the
    invariant (c) both ask this."""
    return MOMENT_BYTES + (4 if precision == "bf16" else 0)


class AdamWShard:
    """AdamW on this rank's shard of an engine's flat layout: one AdamW parameter per owned piece."""

    def __init__(self, engine, grads, optim: OptimConfig):
        """Over `engine`'s layout and placement, with `grads` (its GradientReducer) holding the gradient shard."""
        self.layout, self.dp, self.placement, self.params = engine.layout, engine.dp, engine.placement, engine.params
        self.device, self.precision, self.optim_cfg, self.grads = engine.device, engine.precision, optim, grads
        self.state_bytes_per_value = state_bytes_per_value(self.precision)
        self._build_optimizer()

    def _build_optimizer(self) -> None:
        """AdamW over this rank's owned chunks: master views, moments as views of two flat shard tensors."""
        L, device = self.layout, self.device
        W, rank = self.dp.world_size, self.dp.rank
        self._pieces: list[OwnedPiece] = []
        if self.grads.grads_in_params:  # one piece per parameter, whose .grad is its gradient (the shard is the buffer)
            self._pieces = [OwnedPiece(s.offset, s.offset + s.numel, s.offset, s.decay) for s in L.slots]
        else:
            for b in L.buckets:
                lo, hi = b.chunk(rank, W)
                for a, z, decay in ((lo, min(hi, b.decay_end), True), (max(lo, b.decay_end), hi, False)):
                    if z > a:
                        self._pieces.append(OwnedPiece(a, z, b.shard_offset + a - lo, decay))
        self.master = torch.empty(L.shard_numel, device=device) if self.precision == "bf16" else None
        self.exp_avg = torch.zeros(L.shard_numel, device=device)
        self.exp_avg_sq = torch.zeros(L.shard_numel, device=device)
        self._master_views = []
        decayed, plain = [], []
        for pc in self._pieces:
            # the fp32 master values of the piece: in fp32 the owned parameter values themselves (an alias)
            m = self.placement.owned_values(pc)
            if self.master is not None:
                m = self.master[pc.shard_lo : pc.shard_hi].copy_(m)
            if not self.grads.grads_in_params:  # otherwise each step's are the parameters' (apply)
                m.grad = self.grads.grad_shard[pc.shard_lo : pc.shard_hi]
            self._master_views.append(m)
            (decayed if pc.decay else plain).append(m)
        groups = [g for g in ({"params": decayed, "weight_decay": self.optim_cfg.weight_decay},
                              {"params": plain, "weight_decay": 0.0}) if g["params"]]
        self.optimizer = build_adamw(groups, self.optim_cfg)
        # Fused AdamW keeps its step counters on the parameters' device, the others on the CPU.
        self._step_device = device if self.optimizer.defaults.get("fused") else torch.device("cpu")
        # AdamW's moments become views into two flat shard tensors: one allocation each, and the
        # shard's state is exactly what a checkpoint stores. AdamW uses state it finds present.
        for pc, m in zip(self._pieces, self._master_views):
            self.optimizer.state[m] = {
                "step": torch.tensor(0.0, device=self._step_device),
                "exp_avg": self.exp_avg[pc.shard_lo : pc.shard_hi],
                "exp_avg_sq": self.exp_avg_sq[pc.shard_lo : pc.shard_hi],
            }

    def step(self, lr: float, grad_norm: torch.Tensor | float) -> None:
        """Clip the gradients by the global norm on the device (no host read: docs/design.md), and AdamW's step on
        the shard at learning rate `lr`."""
        clip = self.optim_cfg.grad_clip
        in_params = self.grads.grads_in_params
        if in_params:
            for m, p in zip(self._master_views, self.params):
                m.grad = p.grad.reshape(-1)
        if clip > 0:
            grads = [m.grad for m in self._master_views] if in_params else [self.grads.grad_shard]
            norm = torch.as_tensor(grad_norm, dtype=torch.float64, device=grads[0].device)
            clipped = norm > clip  # a nan norm leaves the gradients as they are, as the host's comparison did
            if isinstance(self.optimizer, torch.optim.AdamW) and self.optimizer.defaults.get("fused"):
                # divided as fused AdamW reads them: multiplying the shard took 80 ms of a 124M step on one thread
                self.optimizer.grad_scale = torch.where(clipped, (norm + 1e-6) / clip, 1.0).float()
            else:
                factor = torch.where(clipped, clip / (norm + 1e-6), 1.0)
                for g in grads:
                    g.mul_(factor)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.optimizer.step()
        if in_params:
            for m in self._master_views:
                m.grad = None  # the parameters' .grad alone hold them, until zero_grad lets them go

    def round_into_params(self) -> None:
        """In bf16, the fp32 masters rounded into the owned parameter values (in fp32 they are those values)."""
        if self.master is not None:
            for pc in self._pieces:
                self.placement.owned_values(pc).copy_(self.master[pc.shard_lo : pc.shard_hi])

    def register_update_pre_hook(self, hook) -> None:
        """`hook()` runs before every update of this state (AdamW's step on the shard)."""
        self.optimizer.register_step_pre_hook(lambda *_: hook())

    def optimizer_state_tensors(self) -> list[torch.Tensor]:
        """Every tensor held for the optimizer of this rank's shard: the master values, the flat moments and whatever
        state AdamW keeps now (its 0-dim step counters left out: the ZeRO formula counts per-value state)."""
        return [*self._master_views, self.exp_avg, self.exp_avg_sq,
                *(t for state in self.optimizer.state.values() for t in state.values()
                  if isinstance(t, torch.Tensor) and t.dim() > 0)]

    def master_shard(self) -> torch.Tensor:
        """This rank's fp32 master values as one shard-length tensor: in bf16 the master itself; in fp32 a copy of the
        owned values (master_views concatenated, once the all-gathers are done)."""
        if self.master is not None:
            return self.master
        self.placement.wait()
        return torch.cat(self.placement.owned_views())

    def master_views(self) -> list[torch.Tensor]:
        """This rank's fp32 master values, in shard order, as views where they lie (no copy). Call wait_params()
        first: a background save reads them on its own thread."""
        return [self.master] if self.master is not None else self.placement.owned_views()

    @property
    def step_count(self) -> int:
        return int(self.optimizer.state[self._master_views[0]]["step"]) if self._master_views else 0

    def state_dict(self) -> dict[str, torch.Tensor]:
        """This rank's shard: its masters (an independent copy in fp32), moments and step count."""
        return {
            "master": self.master_shard().float().contiguous(),
            "exp_avg": self.exp_avg,
            "exp_avg_sq": self.exp_avg_sq,
            "step": torch.tensor([self.step_count], dtype=torch.int64),
        }

    def load_state_dict(self, sd: dict) -> None:
        """Restore the shard's state from `sd`, once checked to be this rank's shard of this layout (else ValueError):
        AdamW's moments and step count, and the masters (in fp32 into the owned parameter values); the caller then has
        the parameters follow (engine.py)."""
        for key in ("master", "exp_avg", "exp_avg_sq"):
            given = sd[key]
            shape = (sum(p.numel() for p in given),) if isinstance(given, (list, tuple)) else tuple(given.shape)
            if shape != (self.layout.shard_numel,):
                raise ValueError(f"optimizer shard {key} has shape {shape}, expected ({self.layout.shard_numel},)")
        self.exp_avg.copy_(sd["exp_avg"])
        self.exp_avg_sq.copy_(sd["exp_avg_sq"])
        step = float(sd["step"].item())
        for m in self._master_views:
            self.optimizer.state[m]["step"] = torch.tensor(step, device=self._step_device)
        for m, pc in zip(self._master_views, self._pieces):  # the pieces cover the shard where there is a master
            m.copy_(shard_values(sd["master"], pc.shard_lo, pc.shard_hi))
