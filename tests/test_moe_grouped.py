"""The experts' grouped path (model/moe.py's GroupedLinear), the one CUDA takes: it keeps for the backward what the
memory plan counts, to the byte (no stacked copy of the experts' weights), equals the per-expert loop forward and
backward with biases, and reads the device at most once per MoE layer (the all-to-all's split sizes under --ep).

Run on CPU, where torch 2.13's _grouped_mm runs the same op (fp32 and bf16); the path is forced to "grouped", as
CUDA's "auto" picks it. Not measured on CUDA here.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_activation_bytes import measured_bytes

from zerotrain.config import PRESETS, ModelConfig
from zerotrain.model import activation_memory, build_model, moe

pytestmark = pytest.mark.timeout(300)

BASE = ModelConfig(**PRESETS["qwen3-moe-tiny"])  # width 32, 4 experts of width 32: rows aligned in fp32 and bf16


def grouped_model(cfg: ModelConfig) -> torch.nn.Module:
    model = build_model(cfg, seed=0)
    for layer in moe.moe_layers(model):
        layer.path = "grouped"
    return model


def planned_on_the_grouped_path(cfg: ModelConfig, precision: str, monkeypatch) -> int:
    """The plan's activations as a CUDA run of this model plans them: every local expert on the grouped path (the
    rest of the count is the CPU kernels', which the measurement here runs)."""
    with monkeypatch.context() as m:
        m.setattr(activation_memory, "grouped_offsets", lambda cfg, *a, **k: 4 * cfg.n_experts)
        return activation_memory.activation_bytes(cfg, 2, 16, precision=precision)["total"]


def stacked_under_autograd(experts, tokens, counts):
    """Planted: the grouped path as it was, torch.stack of the weights under autograd, which _grouped_mm saves."""
    offsets = counts.cumsum(0).to(torch.int32)

    def grouped(x, name):
        return torch._grouped_mm(x, torch.stack([getattr(e, name).weight for e in experts]).transpose(1, 2),
                                 offs=offsets)

    return grouped(experts[0].activation(grouped(tokens, "gate_proj"), grouped(tokens, "up_proj")), "down_proj")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_grouped_path_keeps_what_the_plan_counts_and_a_saved_stacked_copy_is_caught(precision, monkeypatch):
    assert moe.grouped_mm_works("cpu", torch.float32) and moe.grouped_mm_works("cpu", torch.bfloat16)
    configs = [BASE, dataclasses.replace(BASE, arch="qwen2_moe", norm_topk_prob=False, shared_expert_width=24)]
    for cfg in configs:
        taken = []
        real = moe.GroupedLinear.apply
        monkeypatch.setattr(moe.GroupedLinear, "apply", lambda *a: taken.append(1) or real(*a))
        measured = measured_bytes(grouped_model(cfg), 2, 16, precision, "none")
        monkeypatch.undo()
        assert len(taken) == 3 * sum(map(cfg.has_experts, range(cfg.n_layer))), "every projection took the path"
        planned = planned_on_the_grouped_path(cfg, precision, monkeypatch)
        assert planned == measured, (cfg.arch, precision)
        # the offsets are all the grouped path adds to the loop's count: E int32 per MoE layer
        loop = activation_memory.activation_bytes(cfg, 2, 16, precision=precision)["total"]
        assert planned - loop == 4 * cfg.n_experts * sum(map(cfg.has_experts, range(cfg.n_layer)))
        # planted: the stacked weights saved for the backward, one copy per projection and layer
        monkeypatch.setattr(moe, "expert_grouped", stacked_under_autograd)
        stacked = measured_bytes(grouped_model(cfg), 2, 16, precision, "none")
        monkeypatch.undo()
        weights = 3 * cfg.n_experts * cfg.n_embd * cfg.expert_ffn * (4 if precision == "fp32" else 2)
        assert stacked - measured == sum(map(cfg.has_experts, range(cfg.n_layer))) * weights  # a copy per layer
        assert stacked != planned


def test_the_plan_takes_the_grouped_path_where_a_cuda_run_does():
    cfg = ModelConfig(**PRESETS["qwen3-30b-a3b"])
    if not torch.cuda.is_available():  # planned without a device: assumed to run
        assert activation_memory.grouped_offsets(cfg, "cuda", "bf16") == 128 * 4
        assert activation_memory.grouped_offsets(cfg, "cuda", "bf16", ep=8) == 16 * 4
    assert activation_memory.grouped_offsets(cfg, "cpu", "bf16") == 0  # CPU's auto path is the loop
    odd = dataclasses.replace(cfg, expert_width=770)  # rows of 1540 bytes: not a multiple of 16, the loop
    assert activation_memory.grouped_offsets(odd, "cuda", "bf16") == 0
    assert activation_memory.grouped_offsets(ModelConfig(**PRESETS["llama-tiny"]), "cuda", "bf16") == 0


def run(layer: moe.MoE, x: torch.Tensor, path: str):
    layer.path = path
    layer.zero_grad()
    x = x.clone().requires_grad_()
    out = layer(x)
    out.pow(2).sum().backward()
    grads = {n: p.grad.clone() if p.grad is not None else torch.zeros_like(p) for n, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


def test_the_grouped_path_with_biases_equals_the_loop_forward_and_backward_and_a_misplaced_bias_gradient_is_caught(
        monkeypatch):
    cfg = dataclasses.replace(BASE, arch="gpt_oss")  # biased experts with the clamped SwiGLU
    assert cfg.gpt_oss_experts
    layer = moe.moe_layers(build_model(cfg, seed=0))[0]
    with torch.no_grad():  # biases that differ per expert, so a misplaced one shows
        for e, expert in enumerate(layer.experts):
            for linear in (expert.gate_proj, expert.up_proj, expert.down_proj):
                linear.bias.normal_(generator=torch.Generator().manual_seed(e))
    x = torch.randn(2, 16, cfg.n_embd, generator=torch.Generator().manual_seed(1))
    loop, grouped = run(layer, x, "loop"), run(layer, x, "grouped")
    assert (loop[0] - grouped[0]).abs().max() < 1e-5 and (loop[1] - grouped[1]).abs().max() < 1e-4
    assert max((loop[2][n] - grouped[2][n]).abs().max().item() for n in loop[2]) < 1e-4
    # planted: each expert's bias gradient handed to the next expert
    backward = moe.GroupedLinear.backward

    def rolled(ctx, grad):
        out = list(backward(ctx, grad))
        if ctx.biased:
            db = out[4 + ctx.n_experts:]
            out[4 + ctx.n_experts:] = db[1:] + db[:1]
        return tuple(out)

    monkeypatch.setattr(moe.GroupedLinear, "backward", staticmethod(rolled))
    planted = run(layer, x, "grouped")
    assert max((loop[2][n] - planted[2][n]).abs().max().item() for n in loop[2] if n.endswith("bias")) > 1e-3


class Reads:
    """Every read of a tensor's values by the host (item, tolist, float, int, bool), counted."""

    NAMES = ("item", "tolist", "__float__", "__int__", "__bool__")

    def __init__(self, monkeypatch):
        self.count = 0
        for name in self.NAMES:
            real = getattr(torch.Tensor, name)
            monkeypatch.setattr(torch.Tensor, name, self._counted(real))

    def _counted(self, real):
        def read(tensor, *a, **k):
            self.count += 1
            return real(tensor, *a, **k)
        return read


def test_the_grouped_path_reads_nothing_from_the_device_and_under_ep_one_read_per_layer_and_a_read_is_caught(
        monkeypatch):
    from conftest import world_of_one

    from zerotrain.parallel import experts as ep

    model = grouped_model(BASE)
    ids = torch.randint(0, BASE.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    layers = moe.moe_layers(model)

    def reads_of_a_step() -> int:
        with monkeypatch.context() as m:
            reads = Reads(m)
            model(ids).float().pow(2).sum().backward()
        return reads.count

    assert reads_of_a_step() == 0
    real = moe.expert_grouped
    with monkeypatch.context() as m:  # planted: the loop's read of the counts on the grouped path
        m.setattr(moe, "expert_grouped", lambda experts, tokens, counts: counts.tolist() and real(experts, tokens,
                                                                                                   counts))
        assert reads_of_a_step() == len(layers)
    with world_of_one() as comm:  # an EP group of one: the exchange's own code, its all-to-alls over gloo
        for layer in layers:
            layer.exchange = ep.ExpertExchange(comm, BASE.n_experts)
        assert reads_of_a_step() == len(layers)  # the split sizes, sent and received, in one transfer
