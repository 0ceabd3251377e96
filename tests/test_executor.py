"""sft and dpo accumulate through the one micro-batch executor (training/executor.py): a step's loss and gradient do
not depend on how its global batch is split into micro-batches, and a bug planted in the executor's loss scaling
(each micro-batch's loss over its own units, not the global batch's) breaks that for both methods at once.

One step of `train` on one rank, a global batch of 4 (sequences; pairs) as 4 x 1 and 2 x 2 and 1 x 4 (micro-batch x
accumulation): the loss and gradient norm of each split are the 4 x 1 step's within float noise. The planted bug is
a no-op at 4 x 1 (one micro-batch: its units are the global batch's) and doubles or quadruples the gradient of the
other splits.
"""

from __future__ import annotations

import pytest
from conftest import tiny_config, world_of_one
from model_folders import llama_folder, write_jsonl

from zerotrain.hub.init_from import adopt, weight_source
from zerotrain.training import executor
from zerotrain.training.loop import train

pytestmark = pytest.mark.timeout(300)
SPLITS = {"4 x 1": (4, 1), "2 x 2": (2, 2), "1 x 4": (1, 4)}
PAIRS = [{"prompt": f"Question {i}: what is {i} plus {i}?" + " Think." * (i % 3), "chosen": f" Answer: {2 * i}.",
          "rejected": f" Answer: {2 * i + 1}, or so."} for i in range(8)]


@pytest.fixture(scope="module")
def group():
    with world_of_one() as comm:
        yield comm


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("executor-data")
    llama_folder(tmp / "base")
    return {"base": str(tmp / "base"), "pairs": write_jsonl(tmp / "pairs.jsonl", PAIRS)}


def config(method, out, base, micro, accum):
    if method == "sft":  # token losses of every length, so that micro-batches hold different token counts
        return tiny_config(out, micro=micro, accum=accum, steps=1, data="synthetic-varlen")
    cfg = tiny_config(out, micro=micro, accum=accum, steps=1, seq_len=32, data=base["pairs"], init_from=base["base"],
                      method="dpo", peak_flops=1e12)
    cfg.model = adopt(cfg.model, weight_source(base["base"]), {"seq_len"})
    return cfg


def first_step(method, out, base, split, group) -> dict:
    record = train(config(method, out, base, *SPLITS[split]), group, announce=False).records[0]
    return {"loss": record["loss"], "grad_norm": record["grad_norm"]}


def close(a: dict, b: dict, rel: float) -> bool:
    return all(abs(a[k] - b[k]) <= rel * abs(b[k]) for k in ("loss", "grad_norm"))


@pytest.mark.parametrize("method", ["sft", "dpo"])
def test_every_split_gives_the_step_of_one_micro_batch_and_a_per_micro_batch_scaling_in_the_executor_is_caught(
        method, base, group, tmp_path, monkeypatch):
    steps = {split: first_step(method, tmp_path / split.replace(" ", ""), base, split, group) for split in SPLITS}
    whole = steps["4 x 1"]
    assert whole["grad_norm"] > 0
    for split, got in steps.items():
        assert close(got, whole, 1e-6), (split, got, whole)

    real = executor.micro_batch_loss
    # planted in the executor every method runs: each micro-batch's loss over its own units (tokens; pairs)
    monkeypatch.setattr(executor, "micro_batch_loss",
                        lambda summed, units, normaliser, term: real(summed, units, units, term))
    planted = {split: first_step(method, tmp_path / f"planted{split.replace(' ', '')}", base, split, group)
               for split in ("4 x 1", "2 x 2")}
    assert close(planted["4 x 1"], whole, 1e-6)  # one micro-batch: its units are the global batch's
    assert abs(planted["2 x 2"]["grad_norm"] - whole["grad_norm"]) > 0.5 * whole["grad_norm"], planted
