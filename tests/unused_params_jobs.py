"""A model with parameters unused in some micro-batches, and the jobs that train it (importable by spawned ranks).

`norm_skipped_by_data` patches GPT-2 in this process: a sequence whose first token is even skips block 0's first
LayerNorm (its rows go into the attention unnormalized), so a micro-batch whose sequences all skip it gives the
norm's two parameters no gradient, as a conditional module, or an expert no token was routed to, gives none. They
lie in the last bucket and in block 0's unit, beside parameters that do get gradients. What a sequence computes
does not depend on the micro-batch it is in, so any split of the global batch (and a plain torch model on the whole
batch at once) computes the same loss.
"""

from __future__ import annotations

import contextlib
from unittest import mock

import torch

from zerotrain.config import Config
from zerotrain.model import gpt2
from zerotrain.parallel import Comm
from zerotrain.training.loop import train

SKIPPED = 0  # the layer whose first norm is skipped (tests may set another)


@contextlib.contextmanager
def norm_skipped_by_data(counts: dict | None = None, final: bool = False):
    """Within: block 0's ln_1 (with `final`, the final norm ln_f: first in the backward, in the first bucket) is
    skipped by the sequences whose first token is even. `counts`, if given, counts the forwards with gradients where
    no sequence used the norm ("unused") and the others ("used")."""
    real_forward, real_block = gpt2.GPT.forward, gpt2.Block.forward
    skips: list[torch.Tensor] = []

    def count(skip) -> None:
        if counts is not None and torch.is_grad_enabled() and torch._C._current_graph_task_id() == -1:
            key = "unused" if bool(skip.all()) else "used"
            counts[key] = counts.get(key, 0) + 1

    def forward(self, idx, *args, **kwargs):
        skips.append(idx[:, 0] % 2 == 0)
        norm = self.transformer.ln_f
        if final:
            skip = skips[-1]
            count(skip)
            real_norm = type(norm).forward
            norm.forward = lambda x: x if bool(skip.all()) else torch.where(skip[:, None, None], x, real_norm(norm, x))
        try:
            return real_forward(self, idx, *args, **kwargs)
        finally:
            skips.pop()
            norm.__dict__.pop("forward", None)

    def block_forward(self, x, cache=None, layer=0, documents=None):
        if final or layer != SKIPPED or not skips:
            return real_block(self, x, cache, layer, documents)
        skip = skips[-1]
        if bool(skip.all()):
            h = x  # the norm's parameters take no part: they get no gradient
        else:
            h = torch.where(skip[:, None, None], x, self.ln_1(x))
        count(skip)
        x = x + self.attn(h, cache, layer, documents)
        return x + self.mlp(self.ln_2(x))

    with mock.patch.object(gpt2.GPT, "forward", forward), mock.patch.object(gpt2.Block, "forward", block_forward):
        yield


def trained(cfg: Config, comm: Comm, final: bool = False) -> dict:
    """Train the conditional model; its losses, the final parameters by name, and how many micro-batches (of this
    rank) left the skipped norm unused."""
    counts: dict = {}
    with norm_skipped_by_data(counts, final):
        result = train(cfg, comm)
    return {"losses": [r["loss"] for r in result.records], "params": result.engine.full_state_dict(),
            "counts": counts, "digests": result.digests}


def stages_job(cfg: Config, comm: Comm, *, cfgs: dict[str, Config]) -> dict:
    """`trained` for each config, in turn on these ranks; rank 0's results by name, with every rank's counts."""
    out = {}
    for name, c in cfgs.items():
        result = trained(c, comm)
        counts = comm.io.all_gather_json(result.pop("counts"), "gather_counts")
        out[name] = {**result, "counts": counts}
    return out
