"""Each token's log-prob of its target computed by the head (model/vocab.py token_logps, DPO's sequence log-probs):
equal to log_softmax of the full logits and its gradients (any upstream gradient per token), chunked, soft-capped,
through the model with and without recompute, and at TP 2 equal to TP 1 with a largest activation that halves;
planted bugs (a forgotten soft-cap derivative, a target missed, a chunk dropped in the backward, a missing
all-reduce, a vocabulary left whole) caught."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from test_checkpoint import spawn
from test_vocab_parallel import (CONFIGS, LARGE_VOCAB, SMALL_CHUNKS, B, T, batch, largest_at_tp1_tp2_and_planted,
                                 largest_created, rel)

from zerotrain.model import build_model, parallelize, vocab
from zerotrain.model.activation_memory import activation_bytes
from zerotrain.model.loss import head_loss
from zerotrain.training.activations import saved_for_backward, saved_storages
from zerotrain.training.preference import sequence_logps

pytestmark = pytest.mark.timeout(300)


def full_logits_logps(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The oracle: log_softmax of the full logits, gathered at the targets (0 where ignored)."""
    lp = logits.float().log_softmax(-1).gather(-1, y.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    return torch.where(y != -100, lp, 0.0)


def inputs(seed: int = 0, tokens: int = 37, width: int = 16, rows: int = 50):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(tokens, width, generator=g, requires_grad=True)
    w = (3 * torch.randn(rows, width, generator=g)).requires_grad_()
    y = torch.randint(0, rows, (tokens,), generator=g)
    y[:4] = -100
    upstream = torch.randn(tokens, generator=g)  # arbitrary per token, as DPO's non-linear loss gives
    return h, w, y, upstream


def against_full_logits(softcap: float) -> tuple[float, float]:
    """(relative error of the log-probs, of the gradients of h and the weight) against the full logits' autograd."""
    h, w, y, upstream = inputs()
    got = vocab.token_logps(h, w, y, softcap=softcap, chunk=8)  # 5 chunks, the last of 5 tokens
    grads = torch.autograd.grad((got * upstream).sum(), [h, w])
    want = full_logits_logps(vocab.capped(h @ w.T, softcap), y)
    want_grads = torch.autograd.grad((want * upstream).sum(), [h, w])
    assert torch.equal(got[:4], torch.zeros(4))  # ignored targets: 0
    return rel(got, want), max(rel(a, b) for a, b in zip(grads, want_grads))


@pytest.mark.parametrize("softcap", [0.0, 5.0])
def test_token_logps_and_their_gradients_equal_the_full_logits_and_a_missed_target_is_caught(softcap, monkeypatch):
    values, grads = against_full_logits(softcap)
    assert values <= 1e-6 and grads <= 1e-6, (values, grads)
    # planted: no target is found among the head's rows (the one-hot and the target's logit lost)
    monkeypatch.setattr(vocab, "owned_targets", lambda y, start, rows: (y.clamp(0, rows - 1), y < -1000))
    values, grads = against_full_logits(softcap)
    assert values > 1e-2 and grads > 1e-2


def test_a_forgotten_soft_cap_derivative_in_the_backward_is_caught(monkeypatch):
    logits = vocab.chunk_logits
    monkeypatch.setattr(vocab, "chunk_logits", lambda hc, w, cap: (logits(hc, w, cap)[0], None))  # planted
    values, grads = against_full_logits(5.0)
    assert values <= 1e-6 and grads > 1e-2


def model_logps_and_grads(model, x, y, recompute: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DPO's sequence log-probs as the step computes them, and the gradients of a loss non-linear in them."""
    model.zero_grad(set_to_none=True)
    logps = head_loss(model, x, y, sequence_logps, recompute)
    (F.logsigmoid(0.1 * (logps[0, 0] - logps[0, 1])) + (logps[0] / logps[1]).square().sum()).backward()
    return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def full_logits_reference(model, x, y) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The same from the full logits (the model's call without targets)."""
    model.zero_grad(set_to_none=True)
    token = full_logits_logps(model(x), y)
    logps = torch.stack([token.sum(dim=1), (y != -100).sum(dim=1).float()])
    (F.logsigmoid(0.1 * (logps[0, 0] - logps[0, 1])) + (logps[0] / logps[1]).square().sum()).backward()
    return logps.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_dpo_sequence_logps_from_the_head_equal_the_full_logits_with_recompute_and_a_chunk_dropped_is_caught(
        arch, monkeypatch):
    cfg = CONFIGS[arch]
    x, y = batch(cfg)
    model = build_model(cfg, seed=0)
    want, want_grads = full_logits_reference(model, x, y)
    monkeypatch.setattr(vocab, "chunk_tokens", lambda tokens, rows, width: SMALL_CHUNKS)
    for recompute in (False, True):
        got, grads = model_logps_and_grads(model, x, y, recompute)
        assert got.shape == (2, B) and torch.equal(got[1], want[1])
        assert rel(got[0], want[0]) <= 1e-6 and max(rel(grads[n], want_grads[n]) for n in want_grads) <= 1e-6
    with torch.no_grad():  # the reference's scoring: no graph, the same values
        assert rel(head_loss(model, x, y, sequence_logps, False)[0], want[0]) <= 1e-6
    # planted: the backward's chunks miss the last one (the forward's are whole)
    cut = vocab.chunk_bounds
    model.zero_grad(set_to_none=True)
    logps = head_loss(model, x, y, sequence_logps, False)
    with mock.patch.object(vocab, "chunk_bounds", lambda tokens, chunk: cut(tokens, chunk)[:-1]):
        (F.logsigmoid(0.1 * (logps[0, 0] - logps[0, 1])) + (logps[0] / logps[1]).square().sum()).backward()
    head = "lm_head.weight" if "lm_head.weight" in want_grads else "transformer.wte.weight"
    assert not rel(dict(model.named_parameters())[head].grad, want_grads[head]) <= 1e-3


# ----------------------------------------------------------------------------- two ranks: TP 2 against TP 1


def largest_dpo_activation(model, x, y) -> dict[str, int]:
    """The largest tensor saved for the backward and the largest created in the forward and backward of DPO's
    sequence log-probs."""
    saved = {}

    def step():
        storages, logps = saved_storages(lambda: head_loss(model, x, y, sequence_logps, False), model.parameters())
        saved.update(storages)
        (logps[0] / logps[1]).square().sum().backward()

    return {"created": largest_created(step), "saved": max(saved.values())}


def dpo_tp_job(rank, comm, tmp_path):
    """At TP 2 and TP 1 on each rank: DPO's sequence log-probs and every gradient (this rank's slice), correct and
    with the sum-exp all-reduce missing (planted); the bytes saved for the backward, per precision and recompute; the
    largest activation of the 32,000-token vocabulary, split and (planted) whole."""
    out = {}
    chunks = mock.patch.object(vocab, "chunk_tokens", lambda tokens, rows, width: SMALL_CHUNKS)
    for arch, cfg in CONFIGS.items():
        x, y = batch(cfg, seed=1)
        with chunks:
            want, want_grads = model_logps_and_grads(build_model(cfg, seed=0), x, y, False)
        split = build_model(cfg, seed=0)
        slices = parallelize(split, 2, rank, comm)
        assert isinstance(split.lm_head, vocab.VocabParallelHead)

        def against_tp1(recompute, split=split, slices=slices, x=x, y=y, want=want, want_grads=want_grads):
            got, grads = model_logps_and_grads(split, x, y, recompute)
            worst = max(rel(grads[n], slices[n].take(want_grads[n], rank) if n in slices else want_grads[n])
                        for n in grads)
            return {"logps": rel(got[0], want[0]), "grads": worst}

        with chunks:
            out[arch] = against_tp1(False)
            out[arch + " recompute"] = against_tp1(True)
            with mock.patch.object(vocab, "global_sums", lambda sums, comm: sums):  # planted: no all-reduce
                out[arch + " planted"] = against_tp1(False)
        for precision in ("fp32", "bf16"):
            for recompute in ("none", "blocks", "full"):
                model = build_model(cfg, seed=0)
                parallelize(model, 2, rank, comm)
                if precision == "bf16":
                    model.to(torch.bfloat16)
                model.recompute_blocks = recompute != "none"
                saved, _ = saved_for_backward(lambda: head_loss(model, x, y, sequence_logps, recompute == "full"),
                                              model.parameters())
                out[f"bytes {arch} {precision} {recompute}"] = saved
    return {**out, **largest_at_tp1_tp2_and_planted(largest_dpo_activation, rank, comm)}


@pytest.fixture(scope="module")
def tp_results(tmp_path_factory):
    codes, results = spawn(dpo_tp_job, 2, tmp_path_factory.mktemp("tp"), timeout=240)
    assert codes == [0, 0] and all(r is not None and "error" not in r for r in results), results
    return results


def test_tp2_dpo_logps_and_gradients_equal_tp1_with_recompute_and_a_missing_all_reduce_is_caught(tp_results):
    for rank, r in enumerate(tp_results):
        for arch in CONFIGS:
            for case in (arch, arch + " recompute"):
                assert r[case]["logps"] <= 1e-6 and r[case]["grads"] <= 1e-6, (rank, case, r[case])
            assert r[arch + " planted"]["logps"] > 1e-2 and r[arch + " planted"]["grads"] > 1e-2, (rank, arch)


def test_tp2_dpo_saved_bytes_equal_the_plan_and_the_sft_formula_is_caught(tp_results):
    for r in tp_results:
        for case, saved in r.items():
            if not case.startswith("bytes "):
                continue
            _, arch, precision, recompute = case.split()
            kw = dict(tp=2, precision=precision, recompute=recompute)
            assert activation_bytes(CONFIGS[arch], B, T, objective="dpo", **kw)["total"] == saved, case
            if recompute != "full":  # the summed loss's count (its gradients, not the input and log-sum-exp)
                assert activation_bytes(CONFIGS[arch], B, T, **kw)["total"] != saved, case


def test_the_largest_dpo_activation_of_a_32000_token_vocabulary_at_tp2_is_at_most_055x_tp1s_and_a_whole_one_is_caught(
        tp_results):
    V = LARGE_VOCAB.vocab_size
    for r in tp_results:
        assert r["tp2"]["created"] <= 0.55 * r["tp1"]["created"], r
        assert r["tp2 planted"]["created"] > 0.9 * r["tp1"]["created"], r
        for case in ("tp1", "tp2"):  # nothing of the logits' size is kept for the backward
            assert r[case]["saved"] < B * T * V * 4 // 8, (case, r[case])
    plan = {tp: activation_bytes(LARGE_VOCAB, B, T, tp=tp, objective="dpo") for tp in (1, 2)}
    assert plan[2]["working"] <= 0.55 * plan[1]["working"]
