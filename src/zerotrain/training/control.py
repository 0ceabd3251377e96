"""The per-step control channel: decisions every rank must share, carried as flags in the step's one all-reduce.

A save by wall clock, a stop signal, a phase of an async save done everywhere: each is a flag that a rank
sets locally and that travels in the scalar all-reduce every step already makes, summed over ranks.
Every rank then reads the same sums and decides the same thing, so no rank waits in a save that
another skipped, no extra collective runs per step, and no background thread issues a collective.

A rank that cannot go on (its async writer or commit failed) says so in the same all-reduce instead of leaving
before it: every rank learns which rank failed at once, on any backend and across nodes, instead of
waiting out the collective timeout for a peer that will never come.

The all-reduce runs every step, but its sums stay on the device: the loop reads them (`read`, one transfer for
every step since the last read) at its log steps only (--log-every N, the last step, a checkpoint's or a
validation's step), and decides there. A flag a rank raised is kept in its Python state until then (a stop
signal, rank 0's clock, a failed or finished async save), so the step that reads carries it: every rank reads the
same sums at the same step and decides the same thing, without a read of the device in the steps between.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from zerotrain.checkpoint import SaveFlags

# Order of the control flags in the reduction, after the loss and the per-rank non-finite flags.
SAVE_BY_CLOCK, STOP_TERM, STOP_INT, SAVE_DONE, ASYNC_SLOWER = range(5)
N_FLAGS = 5
NO_SAVE = SaveFlags(by_clock=False, done=False, error=None, async_slower=False)  # a step no checkpointer takes part in


@dataclass
class Decision:
    """What every rank agreed on this step, read from the summed flags."""

    save_by_clock: bool
    stop_signal: str | None  # "SIGTERM" or "SIGINT" when a stop was asked on any rank (SIGTERM wins)
    save_done: bool  # every rank's part of the async save in flight's current phase is done (written, committed)
    failed_ranks: list[int] = field(default_factory=list)  # ranks that cannot go on (their own error says why)
    async_slower: bool = False  # a rank measured an async save costing more than a synchronous one

    @property
    def stop(self) -> bool:
        return self.stop_signal is not None


@dataclass
class Reduced:
    """The step's one all-reduce, read: global loss sum and gradient norm, bad ranks, the shared decision."""

    loss_sum: float
    grad_norm: float
    nonfinite_ranks: list[int]
    decision: Decision
    extras: list[float] = field(default_factory=list)  # the objective's sums (preference figures), over the ranks


def reduce_step(engine, loss_sum: torch.Tensor | float, *, stop_signal: str | None | Callable[[], str | None],
                saving: SaveFlags, extras: torch.Tensor | None = None) -> torch.Tensor:
    """Finish the gradient reduce-scatter and all-reduce [loss, non-finite flags, failed flags, control flags,
    extras] once (with the gradient norm's square); `saving` is the checkpointer's flags; `extras` the objective's
    sums (counted once per TP group, as the loss). `stop_signal` may be a function: it is called once the
    reduce-scatter is finished, just before the all-reduce (a stop seen until then is saved at once).

    Returns the step's values on the device, unread: [gradient norm, loss, non-finite flags, failed flags, control
    flags, extras]; `read` reads one or several steps' in one transfer. The rank's loss stays on the device (its
    non-finite flag is computed there); the flags come from the host's Python values, a copy towards the device.
    """
    world, tp_rank = engine.mesh.world, engine.mesh.tp_rank
    W, device = world.world_size, engine.device
    loss = torch.as_tensor(loss_sum, dtype=torch.float64, device=device).reshape(1)
    nonfinite = torch.zeros(W, dtype=torch.float64, device=device)  # one-hot: summed over ranks it names every bad rank
    nonfinite[world.rank] = (~torch.isfinite(loss[0])).to(torch.float64)
    # The TP ranks of a replica compute the same loss: only the first one's counts.
    counted_loss = loss if tp_rank == 0 else torch.zeros_like(loss)
    extra = (torch.zeros(0, dtype=torch.float64, device=device) if extras is None
             else extras.to(device, torch.float64).reshape(-1) * (tp_rank == 0))

    def reduced() -> torch.Tensor:
        signal = stop_signal() if callable(stop_signal) else stop_signal
        host = torch.zeros(W + N_FLAGS, dtype=torch.float64)  # failed one-hot, then the control flags
        host[world.rank] = saving.error is not None
        host[W:] = local_flags(save_by_clock=saving.by_clock, stop_signal=signal, save_done=saving.done)
        host[W + ASYNC_SLOWER] = saving.async_slower
        if device.type == "cuda":  # a pinned copy the stream orders, not a pageable one the host waits for
            host = host.pin_memory()
        return torch.cat([counted_loss, nonfinite, host.to(device, non_blocking=True), extra])

    grad_norm, totals = engine.reduce_grads(reduced)
    return torch.cat([grad_norm.reshape(1).to(torch.float64), totals])


def read(steps: list[torch.Tensor], world_size: int) -> list[Reduced]:
    """Several steps' reduce_step values, read by the host in one transfer."""
    if not steps:
        return []
    W = world_size
    out = []
    for values in torch.stack(steps).tolist():
        grad_norm, totals = values[0], values[1:]
        decision = decide(totals[1 + 2 * W : 1 + 2 * W + N_FLAGS], W)
        decision.failed_ranks = [r for r, f in enumerate(totals[1 + W : 1 + 2 * W]) if f != 0]
        bad = [r for r, f in enumerate(totals[1 : 1 + W]) if f != 0]
        out.append(Reduced(totals[0], grad_norm, bad, decision, totals[1 + 2 * W + N_FLAGS :]))
    return out


def local_flags(*, save_by_clock: bool, stop_signal: str | None, save_done: bool) -> torch.Tensor:
    flags = torch.zeros(N_FLAGS, dtype=torch.float64)
    flags[SAVE_BY_CLOCK], flags[SAVE_DONE] = save_by_clock, save_done
    if stop_signal is not None:
        flags[STOP_INT if stop_signal == "SIGINT" else STOP_TERM] = 1
    return flags


def decide(summed: list[float], world_size: int) -> Decision:
    """Any rank's clock or stop flag counts; a save's phase is done only when every rank's part of it is."""
    stop = "SIGTERM" if summed[STOP_TERM] > 0 else "SIGINT" if summed[STOP_INT] > 0 else None
    return Decision(save_by_clock=bool(summed[SAVE_BY_CLOCK] > 0), stop_signal=stop,
                    save_done=bool(summed[SAVE_DONE] == world_size),
                    async_slower=bool(summed[ASYNC_SLOWER] > 0))
