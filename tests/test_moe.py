"""Mixtures of experts against transformers: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE; the router, the experts' two paths.

Every model is a tiny random transformers model built locally (model_folders.moe_folder: fp32, hidden 64, 4-8
experts), read through --init-from's path. For each family: the logits within 1e-5 of transformers', and a planted bug
of what sets it apart (renormalisation skipped, the shared expert's gate dropped, the window ignored, OLMoE's q/k norms
taken per head) caught by the same comparison. The experts' grouped path (torch._grouped_mm) equals the per-expert
loop, forward and backward, and a planted offset is caught.
"""

from __future__ import annotations

import pytest
import torch
import transformers  # a [test] dependency: missing, the module fails to import, loudly
from model_folders import MOE_FAMILIES, WINDOW, moe_folder

from zerotrain.hub import init_from
from zerotrain.model import build_model, llama as llama_module, moe

pytestmark = pytest.mark.timeout(300)

SEQ, VOCAB = 32, 96
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
EXACT, CAUGHT = 1e-5, 1e-3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (folder, the transformers model saved there)}."""
    root = tmp_path_factory.mktemp("moe")
    return {family: (root / family, moe_folder(root / family, family)) for family in MOE_FAMILIES}


def init_from_model(folder):
    """The folder's model as --init-from reads it, on one process."""
    source = init_from.weight_source(str(folder))
    model = build_model(source.model, 0)
    init_from.load_local(model, source, {}, 0)
    return model.eval()


def logits_gap(folder, hf) -> float:
    with torch.no_grad():
        return (init_from_model(folder)(IDS) - hf(IDS).logits).abs().max().item()


def test_each_family_computes_the_logits_transformers_does(folders):
    read = {}
    for family in MOE_FAMILIES:
        folder, hf = folders[family]
        assert logits_gap(folder, hf) < EXACT, family
        cfg = init_from.weight_source(str(folder)).model
        read[family] = (cfg.n_experts, cfg.experts_per_token, cfg.renormalizes, cfg.shared_expert_width,
                        cfg.sliding_window, cfg.dense_layers)
    assert read == {"qwen3_moe": (8, 2, True, 0, 0, (1,)), "qwen2_moe": (4, 2, False, 40, 0, ()),
                    "mixtral": (4, 2, True, 0, WINDOW, ()), "olmoe": (8, 2, False, 0, 0, ())}


def per_head_norms(mp):
    """Planted: OLMoE's q/k norms taken per head (as Qwen3's), their gains cut to a head's width."""
    real = llama_module.LlamaAttention.__init__

    def init(self, cfg, layer=0):
        real(self, cfg, layer)
        self.whole_qk_norm = False

    mp.setattr(llama_module.LlamaAttention, "__init__", init)
    mp.setattr(llama_module, "normalize_heads", lambda norm, x, comm: norm(x, norm.weight[: x.shape[-1]]))


PLANTED = {  # family: the bug, planted in zerotrain's own code
    "qwen3_moe": lambda mp: mp.setattr(moe.MoE, "route", unrenormalised(moe.MoE.route)),
    "qwen2_moe": lambda mp: dropped_shared_gate(mp),
    "mixtral": lambda mp: mp.setattr(llama_module, "window_attention", lambda *a: None),
    "olmoe": per_head_norms,
}


def dropped_shared_gate(mp):
    """Planted: the reading path gives zeros for the shared expert's gate (a gate of 1/2 for every token)."""
    read = init_from._read_rows
    mp.setattr(init_from, "_read_rows", lambda f, name, *a: torch.zeros_like(read(f, name, *a))
               if name.endswith("shared_expert_gate.weight") else read(f, name, *a))


def unrenormalised(route):
    def planted(self, flat, B, T):
        self.renormalize = False
        return route(self, flat, B, T)
    return planted


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_planted_bug_of_each_family_changes_the_logits(folders, monkeypatch, family):
    folder, hf = folders[family]
    PLANTED[family](monkeypatch)
    assert logits_gap(folder, hf) > CAUGHT


def run_paths(model, path: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The model's logits on IDS and its gradients of their sum of squares, with every MoE layer on `path`."""
    for layer in moe.moe_layers(model):
        layer.path = path
    model.zero_grad()
    logits = model(IDS)
    logits.pow(2).sum().backward()
    return logits.detach(), [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def test_the_grouped_experts_equal_the_per_expert_loop_and_a_planted_offset_is_caught(folders, monkeypatch):
    assert moe.grouped_mm_works("cpu", torch.float32), "torch 2.13's CPU build runs _grouped_mm"
    model = init_from_model(folders["qwen3_moe"][0]).train()
    calls = []
    real = moe.expert_grouped
    monkeypatch.setattr(moe, "expert_grouped", lambda *a: calls.append(1) or real(*a))
    loop, grouped = run_paths(model, "loop"), run_paths(model, "grouped")
    assert calls, "the grouped path was taken"
    assert (loop[0] - grouped[0]).abs().max() < 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(loop[1], grouped[1])) < 1e-4
    # planted: the offsets one row off (the first expert's last row computed by the second)
    monkeypatch.setattr(moe, "expert_grouped", lambda experts, tokens, counts: real(
        experts, tokens, counts + torch.nn.functional.one_hot(torch.tensor(0), len(counts)) * -1
        + torch.nn.functional.one_hot(torch.tensor(1), len(counts))))
    assert (run_paths(model, "grouped")[0] - loop[0]).abs().max() > CAUGHT
