"""Llama 4 under tensor parallelism, against a plain transformers + AdamW loop: test_llama4's tiny model (rotary and
no-rope layers, dense and expert layers, chunks of 16 in sequences of 80) trained 8 steps from --init-from at --tp 2
(attention by heads, the dense MLP, each expert and the shared expert by rows of their width, the router replicated)
and at --tp 2 --ep 2 on 4 ranks equals test_llama4's transformers loop: losses, gradient norms and the final weights
(reassembled from the checkpoint's TP slices) within 1e-5 relative (measured at TP 2: losses 1.2e-7, gradient norms
2.0e-6, weights 1.4e-6; at TP 2 x EP 2: 1.0e-7, 1.8e-6, 1.3e-6). Each TP rank reads its slices of the folder (the
stacked expert tensors split by rows of their width too). The experts' down_proj slices dealt to the wrong ranks
(each rank the other's half, in the plan the run takes) is caught (losses up to 1.1e-3 off). `zerotrain export
--format hf` of the TP 2 run stitches the slices into a Llama4ForCausalLM that computes the run's logits. Each rank's
slices of the stacked experts equal the full model's; the part read whole and taken by flat position (what
--init-from did before: rank 1's gate_proj and up_proj rows and both ranks' down_proj columns silently wrong, 12 and
36 of the 80 split tensors) is caught.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
import transformers
from dist_jobs import in_turn_job
from test_gemma import one_thread
from test_llama4 import CAUGHT, EXACT, LIMIT, UNGUARDED, hf_model, logits
from test_qwen35 import STEPS, config_for, gaps, transformers_run, weights_of

import zerotrain
from zerotrain.model import TPSlice, llama, llama4
from zerotrain.runtime.launch import run_job

pytestmark = pytest.mark.timeout(900)


def swapped_down_slices_job(cfg, comm):
    """Planted: each TP rank's experts' (and the shared expert's) down_proj slice is the other rank's half, in
    Llama's plan, which Llama 4's parallelize takes (its slices also say what --init-from reads)."""
    from zerotrain.training.loop import train_job

    real = llama.plan
    llama.plan = lambda model, tp: {n: TPSlice(s.dim, s.full_shape, s.parts[::-1]) if "down_proj" in n and
                                     "experts" in n or "shared_expert.down" in n else s
                                     for n, s in real(model, tp).items()}
    try:
        return train_job(cfg, comm)
    finally:
        llama.plan = real


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{"tp2" | "tp2 ep2" | "swapped" | "transformers": {"loss", "grad_norm", "weights"}, "folder", "file bytes"}."""
    from zerotrain.training.loop import train_job

    tmp = tmp_path_factory.mktemp("llama4-tp")
    stack = contextlib.ExitStack()
    stack.enter_context(one_thread())
    path = tmp / "model"
    hf_model(path, 0.02)
    two = {"tp2": config_for(path, tmp / "tp2", *UNGUARDED, "--nproc", "2", "--tp", "2"),
           "swapped": config_for(path, tmp / "swapped", *UNGUARDED, "--nproc", "2", "--tp", "2")}
    jobs = [(train_job, two["tp2"]), (swapped_down_slices_job, two["swapped"])]
    reports = run_job(functools.partial(in_turn_job, jobs=jobs), two["tp2"], time_limit=LIMIT)
    four = config_for(path, tmp / "tp2-ep2", *UNGUARDED, "--nproc", "4", "--tp", "2", "--ep", "2", "--micro-batch",
                      "1")
    reports.append(run_job(train_job, four, time_limit=LIMIT))
    out = {}
    for run, report in zip(["tp2", "swapped", "tp2 ep2"], reports):
        out[run] = {key: [r[key] for r in report["records"]] for key in ("loss", "grad_norm")} | {
            "read": report["summary"]["per_rank"]["init_bytes_read"]}
        if run != "swapped":  # its checkpoint's slices are not the plan's: verification refuses it
            out[run]["weights"] = weights_of(tmp / run.replace(" ", "-"))
    out["folder"], out["model"] = tmp / "tp2", path
    out["file bytes"] = (path / "model.safetensors").stat().st_size
    out["transformers"] = transformers_run(config_for(path, tmp / "oracle"), path,
                                           [r["lr"] for r in reports[0]["records"]], tmp / "oracle-weights", False)
    stack.close()
    return out


@pytest.mark.parametrize("run", ["tp2", "tp2 ep2"])
def test_eight_steps_at_tp_train_as_transformers_and_adamw_do(runs, run):
    theirs, ours = runs["transformers"], runs[run]
    assert len(ours["loss"]) == STEPS
    gap = gaps(ours, theirs)
    assert gap["loss"] <= 1e-5 and gap["grad_norm"] <= 1e-5 and gap["weights"] <= 1e-5, gap
    assert max(theirs["loss"]) != min(theirs["loss"])  # it trained


def test_experts_down_slices_dealt_to_the_wrong_ranks_are_caught(runs):
    ours, theirs = runs["swapped"]["loss"], runs["transformers"]["loss"]
    assert max(abs(a - b) / b for a, b in zip(ours, theirs)) > 1e-4, (ours, theirs)


def test_each_tp_rank_reads_its_slices_of_the_folder(runs):
    """Each rank reads the replicated tensors (norms, routers) whole and its half of the split ones, the stacked
    experts' included (measured: 525,568 of the file's 1,051,880 bytes on each rank; 869,632 when each expert was
    read whole and sliced after)."""
    reads = runs["tp2"]["read"]
    assert len(reads) == 2 and all(0 < r < 0.55 * runs["file bytes"] for r in reads), (reads, runs["file bytes"])


def test_the_tp_run_exports_as_llama4_with_its_logits(runs, tmp_path):
    from zerotrain.cli.main import main

    with one_thread():
        ours = logits(zerotrain.load_model(str(runs["folder"])))
        assert (ours - logits(transformers.AutoModelForCausalLM.from_pretrained(
            str(runs["model"]), attn_implementation="eager").eval())).abs().max() > CAUGHT  # it trained
        assert main(["export", str(runs["folder"]), str(tmp_path / "out"), "--format", "hf", "--dtype", "fp32"]) == 0
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"),
                                                                   attn_implementation="eager").eval()
        assert type(loaded).__name__ == "Llama4ForCausalLM"
        assert (logits(loaded) - ours).abs().max() < EXACT
        exported = {n: p.detach() for n, p in loaded.named_parameters()}
    assert torch.equal(exported["lm_head.weight"], runs["tp2"]["weights"]["lm_head.weight"])


def tp_rank_models(folder) -> tuple[dict, list[tuple[dict, dict]]]:
    """The full model's parameters read from `folder`, and each of 2 TP ranks' (its plan, its parameters)."""
    from zerotrain.hub import init_from
    from zerotrain.model import build_model

    source = init_from.weight_source(str(folder))
    full = build_model(source.model, 0)
    init_from.load_local(full, source, {}, 0)
    ranks = []
    for rank in range(2):
        model = build_model(source.model, 0)
        slices = llama4.parallelize(model, 2, rank, None)
        init_from.load_local(model, source, slices, rank)
        ranks.append((slices, dict(model.named_parameters())))
    return dict(full.named_parameters()), ranks


def wrongly_read(full: dict, ranks: list) -> list[str]:
    return [f"{n} (rank {r})" for r, (slices, params) in enumerate(ranks) for n, s in slices.items()
            if n in params and not torch.equal(s.take(full[n].detach(), r), params[n].detach())]


def test_each_tp_rank_reads_its_slice_of_the_stacked_experts_and_reading_them_whole_is_caught(tmp_path, monkeypatch):
    """The folder's gate_up_proj (E, C, 2F) and down_proj (E, F, C): each rank's rows of gate_proj and up_proj and
    columns of down_proj equal the full model's. Planted: the expert's part read whole and its values taken by
    flat position (what reading the part whole without slicing it gives): rank 1's gate/up and both ranks' down
    are wrong."""
    from zerotrain.hub import init_from

    with one_thread():
        hf_model(tmp_path / "model")
        assert wrongly_read(*tp_rank_models(tmp_path / "model")) == []
        monkeypatch.setattr(init_from, "stacked_rows",
                            lambda lazy, e, split, i, tp_slice, rank, first, last, count: split(lazy[e])[i][first:last])
        wrong = wrongly_read(*tp_rank_models(tmp_path / "model"))
    assert any("gate_proj" in n and "rank 1" in n for n in wrong) and any("down_proj" in n for n in wrong), wrong
