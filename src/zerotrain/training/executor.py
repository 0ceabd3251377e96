"""One optimizer step's micro-batches: each one's forward, its objective's loss over the global batch, its backward.

Every method feeds its loss to this one loop (sft's token loss, dpo's pair losses, grpo's policy-gradient loss),
so none keeps its own copy of what makes accumulation exact. An objective supplies, for one step:

    micro_batches   this rank's micro-batches in order, each a Micro: the rows of the global batch it holds (LoRA's
                    dropout masks are keyed by them, so they do not depend on the split), what its forward and loss
                    read, and how many there are
    forward(model, data) -> scored     the micro-batch through the model and its head: what autograd keeps for the
                    backward here is the micro-batch's activations (the first one's are measured for the memory plan)
    loss(data, scored) -> MicroLoss    its loss summed over its units (target tokens, pairs, completion tokens), how
                    many units (a count from the data or a device tensor: never read here), the figures it sums for
                    the step's all-reduce, and a term already at the step's scale (a mixture of experts' balancing)
    normaliser      the global batch's units, all ranks together, known from the data before the first forward

and the executor, for each micro-batch: no communication until the last one (engine.no_sync), the forward, the loss
times the fault drills' `loss_factor`, the backward of summed / normaliser (+ term), so that the gradients summed over
micro-batches and ranks are those of the global batch's mean loss whatever the split; it sums the losses (x the
normaliser for a term, back to the summed scale), the units and the figures on the device. Nothing here reads the
device: the step's totals go into its all-reduce on the device, and the loop reads them at its log steps
(--log-every) only (engine.reduce_grads, engine.apply and the clip never wait for the host).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, NamedTuple, Sequence

import torch

from zerotrain.model.lora import dropout_rows

from .activations import saved_for_backward

# The rank's loss sum stays on the device until the step's all-reduce: float64, as the Python float it replaced, so
# the same additions in the same order give the same bits without a host sync per micro-batch
LOSS_SUM_DTYPE = torch.float64


class Micro(NamedTuple):
    """One micro-batch as its objective hands it over."""

    rows: Sequence[int]  # its rows' places in the step's global batch (LoRA's dropout masks)
    data: Any  # what the objective's forward and loss read: the micro-batch on the device, and what goes with it


@dataclass
class MicroLoss:
    """What an objective's loss gives for one micro-batch."""

    summed: torch.Tensor  # 0-d: the loss summed over the micro-batch's units, with its graph
    units: torch.Tensor | int  # how many units it is summed over
    metrics: torch.Tensor | None = None  # float64 sums of the objective's figures, for the step's all-reduce
    term: torch.Tensor | None = None  # 0-d, already over the global batch (a mixture of experts' balancing term)


@dataclass
class StepTotals:
    """This rank's sums over the step's micro-batches, on the device."""

    loss_sum: torch.Tensor  # 0-d float64: the summed losses (terms at the summed scale); / normaliser once reduced
    units: torch.Tensor | int  # the rank's share of the normaliser
    metrics: torch.Tensor | None  # the objective's figures, summed


def micro_batch_loss(summed: torch.Tensor, units, normaliser: int, term: torch.Tensor | None) -> torch.Tensor:
    """What a micro-batch backpropagates: its summed loss over the global batch's units, never its own `units`, so
    that the accumulated gradient is the global batch's mean's whatever the split; with a term already at that scale."""
    scaled = summed / normaliser
    return scaled if term is None else scaled + term


def run_micro_batches(engine, micro_batches: Iterable[Micro], count: int,
                      forward: Callable[[torch.nn.Module, Any], Any], loss: Callable[[Any, Any], MicroLoss],
                      normaliser: int, *, model: torch.nn.Module | None = None, loss_factor: float = 1.0,
                      saved: list | None = None) -> StepTotals:
    """Forward and backward the `count` micro-batches of this rank's share of one step; their totals.

    `model` is what the forward runs (the engine's model, or its compiled forward); `loss_factor` is 1 except when a
    fault drill injects a NaN. With a `saved` list, the bytes the first micro-batch's forward keeps for its backward
    are counted (saved-tensor hooks) and appended to it.
    """
    model = engine.model if model is None else model
    loss_sum = torch.zeros((), dtype=LOSS_SUM_DTYPE, device=engine.device)
    units, metrics = 0, None
    for i, micro in enumerate(micro_batches):
        # communicate once per step, after the last micro-batch
        with engine.no_sync(i < count - 1), dropout_rows(engine.model, engine.mesh.world.step, micro.rows):
            if saved is not None and i == 0:
                # every parameter is held anyway, a LoRA run's frozen base too (its linears save their weights)
                nbytes, scored = saved_for_backward(lambda: forward(model, micro.data),
                                                    list(engine.model.parameters()))
                saved.append(nbytes)
            else:
                scored = forward(model, micro.data)
            out = loss(micro.data, scored)
            summed = out.summed if loss_factor == 1.0 else out.summed * loss_factor
            micro_batch_loss(summed, out.units, normaliser, out.term).backward()
        loss_sum += summed.detach().to(LOSS_SUM_DTYPE)
        if out.term is not None:
            loss_sum += out.term.detach().to(LOSS_SUM_DTYPE) * normaliser
        units = units + out.units
        if out.metrics is not None:  # from zeros, as a sum kept across the micro-batches
            metrics = (torch.zeros_like(out.metrics) if metrics is None else metrics) + out.metrics
    return StepTotals(loss_sum, units, metrics)
