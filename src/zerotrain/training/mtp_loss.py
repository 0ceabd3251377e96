"""--mtp train's MTP loss as a figure of its own (mtp_loss), apart from the loss it joins weighted by lambda.

Each training forward leaves the MTP depths' summed token losses on the device (model/decoder.py's mtp_summed);
this rank's micro-batches add them up there, and the step's one all-reduce (control.reduce_step's extras) sums the
ranks' (once per TP group, as the loss), so no step reads the device for it. The figure is the mean over the D depths
of each depth's summed loss over the step's global token count (the main loss's: the normaliser of model/mtp.py), so
that the step's loss is the main loss + lambda x mtp_loss, as Megatron-LM logs its "mtp_1 loss" beside the loss.
"""

from __future__ import annotations

import torch

from zerotrain.config import Config


class MTPLoss:
    """This rank's MTP depths' summed token losses over one step's micro-batches."""

    def __init__(self, cfg: Config):
        self.depths = cfg.model.mtp_layers
        self.summed = torch.zeros((), dtype=torch.float64)

    def add(self, model: torch.nn.Module) -> None:
        """The micro-batch the model just computed: its depths' summed token losses (on the device, unread)."""
        self.summed = self.summed.to(model.mtp_summed.device) + model.mtp_summed.double()

    def extras(self) -> torch.Tensor:
        """[the rank's summed depth losses] for the step's all-reduce; starts the next step."""
        out, self.summed = self.summed.reshape(1), torch.zeros((), dtype=torch.float64)
        return out

    def figures(self, total: float, global_tokens: int) -> dict:
        """The step's record: mtp_loss, the mean over the depths of each one's token loss over the global tokens."""
        return {"mtp_loss": total / global_tokens / self.depths}  # the loss's normaliser (loop.py)


def mtp_loss_for(cfg: Config) -> MTPLoss | None:
    """The run's MTPLoss with --mtp train (None without)."""
    return MTPLoss(cfg) if cfg.model.mtp == "train" and cfg.model.mtp_layers else None
