"""A mixture of experts' balancing loss in the training loss, per sequence, whatever the split; the step's routing
figures.

Each row of a micro-batch is a sequence: its balancing loss pools the routing of every MoE layer over the row's
tokens (model.moe.balancing_loss, transformers' load_balancing_loss_func over a forward of that row alone). The
step's balancing loss is the mean over the global batch's rows that hold a trained token: each micro-batch adds the
sum over its such rows divided by their count in the global batch (StepBatch.global_rows, counted from the data as
the global token count is), as the token loss divides by the global token count, so neither the ranks nor the
accumulation change it (docs/models.md says why a row, packed records and all). Under --cp C a row's C parts are on
C ranks: their expert counts, tokens and trained flags are summed over the cp group first (one all-reduce of B x
(E + 2) numbers a micro-batch), so that each part's loss is its share of the whole row's, not a loss of its own. A row
without a trained token (the empty rows that fill an epoch's last step) counts for nothing: no loss, no gradient, no
expert load. Its weight is --moe-aux-coef, or the model's router_aux_loss_coef.

The term joins the token loss before the one backward of the micro-batch (executor.micro_batch_loss): the
gradient order the engine follows is the model output's graph, which the routing's probabilities are part of.
"""

from __future__ import annotations

import torch

from zerotrain.config import Config
from zerotrain.data import IGNORE
from zerotrain.model.moe import balancing_loss, moe_layers


class Balancing:
    """This rank's balancing losses and expert loads over one step's micro-batches."""

    def __init__(self, cfg: Config):
        self.coef = cfg.objective.aux_coef(cfg.model)
        self.sequences = cfg.global_batch  # rows of the global batch: DP replicas x micro-batch x accumulation
        self.layers = [i for i in range(cfg.model.n_layer) if cfg.model.has_experts(i)]
        self.experts = cfg.model.n_experts
        self._reset()

    def _reset(self) -> None:
        # On the model's device until the step's all-reduce reads them, so a micro-batch costs no host sync
        self.aux_sum = torch.zeros((), dtype=torch.float64)  # the rank's rows' balancing losses, summed
        self.loads = torch.zeros(len(self.layers), self.experts, dtype=torch.float64)  # tokens each expert got

    def rows(self, global_rows: int | None) -> int:
        """The rows the step's balancing loss is the mean over: those of the global batch with a trained token
        (`global_rows`; None: every row)."""
        return max(1, self.sequences if global_rows is None else global_rows)

    def term(self, model: torch.nn.Module, labels: torch.Tensor, global_rows: int | None) -> torch.Tensor | None:
        """What the micro-batch the model just computed (its `labels`) adds to the step's loss: coef x the sum of the
        balancing losses of its rows with a trained token / the global batch's such rows (None: a model without
        experts)."""
        cp = getattr(model, "context_parallel", None)  # --cp: the routing, the tokens and the labels of a row's part
        taken = balancing_loss(model, rows=(labels != IGNORE).any(-1), whole_rows=cp.sum_over_rows if cp else None)
        if taken is None:
            return None
        per_row, loads = taken
        self.aux_sum = self.aux_sum.to(per_row.device) + per_row.detach().sum().double()
        self.loads = self.loads.to(loads.device) + loads.double()
        return self.coef * per_row.sum() / self.rows(global_rows)

    def extras(self) -> torch.Tensor:
        """[the rank's summed balancing losses, its expert loads] for the step's all-reduce; starts the next step."""
        out = torch.cat([self.aux_sum.reshape(1).to(self.loads.device), self.loads.reshape(-1)])  # on the device
        self._reset()
        return out

    def figures(self, totals: list[float], global_rows: int | None) -> dict:
        """The step's record: aux_loss (the balancing loss, unweighted, mean over the global batch's sequences with a
        trained token) and expert_load (per MoE layer, the most tokens one expert got over the mean: 1 is even)."""
        # the read values, in Python: a tensor made of them would be read again
        E = self.experts
        loads = [totals[1 + i * E : 1 + (i + 1) * E] for i in range(len(self.layers))]
        return {"aux_loss": totals[0] / self.rows(global_rows),
                "expert_load": [round(max(row) / (sum(row) / E), 4) if sum(row) else 0.0 for row in loads]}


def balancing_for(cfg: Config, model: torch.nn.Module) -> Balancing | None:
    """The run's Balancing, for a model with experts (None without)."""
    return Balancing(cfg) if moe_layers(model) else None
