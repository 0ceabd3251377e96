"""Qwen3.5's Gated DeltaNet through flash-linear-attention's kernels (model/fused_delta_rule.py) computes what the
torch path computes: the layer's outputs and gradients, packed and unpacked, with and without an initial state, and
through the KV cache.

No GPU here and fla's Triton kernels do not run on CPU: a stand-in `fla` package is put in sys.modules, whose
`chunk_gated_delta_rule` and `causal_conv1d` keep fla's documented contract (time before heads, B T H D; batch 1 with
`cu_seqlens`, each segment from its own initial state or zeros; one final state per segment; q and k L2-normalised in
the kernel) and compute each segment with transformers' own torch path (torch_chunk_gated_delta_rule,
causal_conv1d_fn), and the device check is patched to take the CUDA branch on CPU tensors. What it cannot show is
fla's own arithmetic: scripts/device-check.sh compares the real kernels with the torch path on a GPU.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import sys
import types

import host_reads_jobs
import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from conftest import tiny_config as tiny_config_of_run
from test_gemma import one_thread
from transformers.models.qwen3_5 import modeling_qwen3_5

from zerotrain.cli.main import main
from zerotrain.config import ModelConfig
from zerotrain.data import MicroBatch, StepBatch, on_device
from zerotrain.model import build_model, delta_rule, fused_delta_rule, qwen35
from zerotrain.model.delta_rule_cp import SplitRows, split_causal_conv, split_gated_delta_rule
from zerotrain.model.kv_cache import KVCache
from zerotrain.parallel.context import ContextParallel, part_record_starts
from zerotrain.training import loop, objectives
from zerotrain.training.loop import train

SEQ = 150
RECORDS = (50, 40, 60)  # the second record starts in the first chunk of 64, the third in the second
EXACT, CAUGHT = 1e-6, 1e-3
# transformers' torch paths, undecorated: its decorator would hand them to an importable `fla`, this stand-in
REFERENCE_RULE = inspect.unwrap(modeling_qwen3_5.torch_chunk_gated_delta_rule)
REFERENCE_CONV = inspect.unwrap(modeling_qwen3_5.causal_conv1d_fn)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


class KeepsFp64(TorchFunctionMode):
    """transformers' torch path casts its inputs to fp32: under this mode to fp64, so that in the tests below it
    computes as precisely as zerotrain's torch path it is compared with (which computes in fp64 given fp64)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.Tensor.to:
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs["dtype"] = torch.float64
        return func(*args, **kwargs)


def segment_bounds(cu_seqlens: torch.Tensor | None, cu_seqlens_cpu: torch.Tensor | None, T: int, batch: int
                   ) -> list[tuple[int, int]]:
    """fla's contract for cu_seqlens: batch 1, int64, from 0 to T, strictly increasing; cu_seqlens_cpu (what fla
    reads instead of copying cu_seqlens back) the same values on the host."""
    if cu_seqlens is None:
        assert cu_seqlens_cpu is None
        return [(0, T)]
    assert cu_seqlens_cpu is not None and cu_seqlens_cpu.device.type == "cpu"
    assert torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
    bounds = cu_seqlens.tolist()
    assert batch == 1 and cu_seqlens.dtype == torch.long and bounds[0] == 0 and bounds[-1] == T
    assert all(a < b for a, b in zip(bounds, bounds[1:]))
    return list(zip(bounds, bounds[1:]))


def fake_chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                                use_qk_l2norm_in_kernel=False, cu_seqlens=None, cu_seqlens_cpu=None, **unused):
    """fla.ops.gated_delta_rule.chunk_gated_delta_rule's semantics: q, k (B, T, H, K), v (B, T, HV, V), g and beta
    (B, T, HV); with cu_seqlens each segment on its own; initial and final states (N, HV, K, V), N segments (B
    without cu_seqlens)."""
    B, T, H, K = q.shape
    assert not unused and scale is None and use_qk_l2norm_in_kernel  # zerotrain asks for these
    assert k.shape == q.shape and v.shape[:2] == (B, T) and v.shape[2] % H == 0 and g.shape == beta.shape == v.shape[:3]
    assert q.dtype == k.dtype == v.dtype
    spans = segment_bounds(cu_seqlens, cu_seqlens_cpu, T, B)
    N = B if cu_seqlens is None else len(spans)
    assert initial_state is None or initial_state.shape == (N, v.shape[2], K, v.shape[3])
    outs, states = [], []
    with KeepsFp64() if q.dtype == torch.float64 else contextlib.nullcontext():
        for i, (a, b) in enumerate(spans):
            state = None if initial_state is None else (initial_state if cu_seqlens is None else
                                                        initial_state[i:i + 1])
            out, final = REFERENCE_RULE(q[:, a:b], k[:, a:b], v[:, a:b], g[:, a:b], beta[:, a:b],
                                        initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)
            outs.append(out)
            states.append(final)
    return torch.cat(outs, dim=1), torch.cat(states) if output_final_state else None


def fake_causal_conv1d(x, weight, bias=None, residual=None, initial_state=None, output_final_state=False,
                       activation=None, cu_seqlens=None, cu_seqlens_cpu=None, **unused):
    """fla.modules.convolution.causal_conv1d's semantics: x (B, T, D), weight (D, W), each segment on its own."""
    assert not unused and bias is None and residual is None and initial_state is None and not output_final_state
    assert x.dim() == 3 and weight.shape == (x.shape[-1], weight.shape[-1])
    spans = segment_bounds(cu_seqlens, cu_seqlens_cpu, x.shape[1], x.shape[0])
    out = [REFERENCE_CONV(x[:, a:b].transpose(1, 2), weight, None, activation).transpose(1, 2) for a, b in spans]
    return torch.cat(out, dim=1), None


@pytest.fixture
def fla(monkeypatch):
    """The stand-in fla importable, fused_delta_rule finding it, and CPU tensors taken for CUDA ones."""
    modules = {name: types.ModuleType(name) for name in
               ("fla", "fla.ops", "fla.ops.gated_delta_rule", "fla.modules", "fla.modules.convolution")}
    modules["fla.ops.gated_delta_rule"].chunk_gated_delta_rule = fake_chunk_gated_delta_rule
    modules["fla.modules.convolution"].causal_conv1d = fake_causal_conv1d
    with monkeypatch.context() as mp:
        for name, module in modules.items():
            mp.setitem(sys.modules, name, module)
        mp.setattr(fused_delta_rule, "on_cuda", lambda device: True)
        fused_delta_rule.fla_kernels.cache_clear()
        assert fused_delta_rule.fla_kernels() is not None
        yield mp
    fused_delta_rule.fla_kernels.cache_clear()
    fused_delta_rule.choose("auto")


def tiny_config(key_heads: int = 2) -> ModelConfig:
    return ModelConfig(arch="qwen3_5", n_embd=64, n_layer=2, n_head=4, n_kv_head=2, vocab_size=300, seq_len=256,
                       linear_key_heads=key_heads, linear_value_heads=4, linear_key_width=8, linear_value_width=12,
                       linear_conv_kernel=4, full_attention_interval=2)


def tiny_layer(key_heads: int = 2) -> qwen35.GatedDeltaNet:
    torch.manual_seed(0)
    layer = qwen35.GatedDeltaNet(tiny_config(key_heads))
    with torch.no_grad():  # off their initial values (A_log 0, dt_bias 1, the gain 1)
        for p in (layer.A_log, layer.dt_bias, layer.norm.weight):
            p.add_(torch.randn_like(p) * 0.3)
    return layer


def record_starts(rows: int = 2) -> torch.Tensor:
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(RECORDS)]).expand(rows, SEQ).contiguous()
    return qwen35.record_starts(segments)


def layer_run(layer: qwen35.GatedDeltaNet, starts: torch.Tensor | None, kernel: str) -> list[torch.Tensor]:
    """The layer's output on fixed inputs (in the layer's dtype), then the gradients of a fixed projection of it: the
    input's, every parameter's."""
    fused_delta_rule.choose(kernel)
    dtype = layer.out_proj.weight.dtype
    x = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(5)).to(dtype).requires_grad_()
    y = layer(x, None, 0, starts)
    weights = torch.randn(y.shape, generator=torch.Generator().manual_seed(6)).to(dtype)
    layer.zero_grad()
    (y * weights).sum().backward()
    return [y.detach(), x.grad] + [p.grad.clone() for p in layer.parameters()]


def gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b, strict=True))


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_the_layer_through_fla_gives_the_torch_paths_outputs_and_gradients(fla, packed):
    """In fp64 within 1e-6 (measured 1.4e-14 unpacked, 4.5e-14 packed; the rule alone, below, 0). In fp32 the two
    paths round apart: unpacked 7.5e-8 at the layer's output (of 0.84 at most), 1.1e-5 at the gradients (of 56 at
    most: a parameter's, summed over 300 tokens); packed, where a record starting inside a chunk is chunked on another
    grid than alone (docs/models.md), 1.2e-6 and 6.5e-5."""
    layer, starts = tiny_layer().double(), record_starts() if packed else None
    assert gap(layer_run(layer, starts, "auto"), layer_run(layer, starts, "torch")) < EXACT


def rule_inputs(key_heads: int = 2):
    """q, k, v, g, beta as the layer gives them (fp64), and an initial state, each requiring its gradient."""
    gen = torch.Generator().manual_seed(7)
    q, k = (torch.randn(2, SEQ, key_heads, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, SEQ, 4, 12, generator=gen, dtype=torch.float64)
    g = -F.softplus(torch.randn(2, SEQ, 4, generator=gen, dtype=torch.float64))
    beta = torch.rand(2, SEQ, 4, generator=gen, dtype=torch.float64)
    state = torch.randn(2, 4, 8, 12, generator=gen, dtype=torch.float64)
    return [t.requires_grad_() for t in (q, k, v, g, beta, state)]


def rule_run(rule, starts: torch.Tensor | None, with_state: bool, key_heads: int = 2) -> list[torch.Tensor]:
    """`rule`'s outputs and final state on fixed inputs, and the gradients of a fixed projection of its outputs."""
    *inputs, state = rule_inputs(key_heads)
    out, final = rule(*inputs, starts, state if with_state else None)
    weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    (out * weights).sum().backward()
    return [out.detach(), final.detach()] + [t.grad for t in inputs] + ([state.grad] if with_state else [])


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
@pytest.mark.parametrize("with_state", [False, True], ids=["from zeros", "from an initial state"])
def test_the_rule_through_fla_gives_the_torch_paths_outputs_states_and_gradients(fla, packed, with_state):
    """Packed, row 0 starts a record at its first token (its initial state is not read), row 1 continues one."""
    starts = None
    if packed:
        starts = record_starts()
        starts[1, 0] = False
    fused = rule_run(fused_delta_rule.chunk_gated_delta_rule, starts, with_state)
    assert gap(fused, rule_run(delta_rule.chunk_gated_delta_rule, starts, with_state)) < EXACT
    if with_state and packed:  # the state was read where the row continues a record, and only there
        assert fused[-1][1].abs().max() > 0 and fused[-1][0].abs().max() == 0


@pytest.mark.parametrize("packed", [False, True], ids=["unpacked", "packed"])
def test_context_parallel_chunks_through_fla_compose_to_the_whole_rows(fla, packed):
    """--cp's linear layers (delta_rule_cp.py) run the rule on each chunk from an identity state and compose the
    chunks' final states, through their gradients too: through fla, at C = 1 (the rank's two chunks the rows'
    halves), the whole rows' outputs and gradients as the torch path gives them."""
    starts = record_starts() if packed else None
    rows = SplitRows(gather=lambda x: x, chunks=(0, 1), starts=starts)
    calls = []
    fla.setattr(sys.modules["fla.ops.gated_delta_rule"], "chunk_gated_delta_rule",
                lambda *a, **kw: calls.append(kw["initial_state"].shape) or fake_chunk_gated_delta_rule(*a, **kw))
    fused_delta_rule.fla_kernels.cache_clear()
    fused = rule_run(lambda *a: (split_gated_delta_rule(*a[:5], rows), torch.zeros(())), None, False)
    whole = rule_run(delta_rule.chunk_gated_delta_rule, starts, False)
    assert len(calls) == 1 and gap(fused[:1] + fused[2:], whole[:1] + whole[2:]) < EXACT


def test_context_parallel_convolution_through_fla_gives_the_whole_rows(fla):
    """delta_rule_cp.py's convolution of each chunk after the inputs before it, through fla at C = 1: the whole
    packed rows' convolution as the torch path gives it, and its gradients."""
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(RECORDS)]).expand(2, SEQ)
    starts, before = part_record_starts(segments, 1, 0, 3)
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 80, SEQ, generator=gen, dtype=torch.float64)
    weight = torch.randn(80, 1, 4, generator=gen, dtype=torch.float64)
    calls = []
    fla.setattr(sys.modules["fla.modules.convolution"], "causal_conv1d",
                lambda *a, **kw: calls.append(kw["cu_seqlens"]) or fake_causal_conv1d(*a, **kw))
    fused_delta_rule.fla_kernels.cache_clear()
    runs = []
    for conv in (lambda x, w: split_causal_conv(x, w, SplitRows(lambda t: t, (0, 1), starts, before)),
                 lambda x, w: delta_rule.causal_conv(x, w, starts)):
        xg, wg = x.clone().requires_grad_(), weight.clone().requires_grad_()
        y = conv(xg, wg)
        (y * torch.randn(y.shape, generator=torch.Generator().manual_seed(10), dtype=y.dtype)).sum().backward()
        runs.append([y.detach(), xg.grad, wg.grad])
    # one call, its segments each chunk's records (the inputs before a chunk counted in as the torch path counts them)
    assert len(calls) == 1 and calls[0] is not None and gap(*runs) < EXACT


def rows_only(starts: torch.Tensor) -> torch.Tensor:
    """Planted: cu_seqlens without the record starts, each row one segment (states leak across records)."""
    first = torch.zeros_like(starts)
    first[:, 0] = True
    return first


def test_segments_without_the_record_starts_are_caught(fla):
    layer, starts = tiny_layer().double(), record_starts()
    torch_path = layer_run(layer, starts, "torch")
    fla.setattr(fused_delta_rule, "segment_starts", rows_only)
    assert gap(layer_run(layer, starts, "auto"), torch_path) > CAUGHT


def test_the_head_first_layout_is_caught(fla):
    """Planted: q, k, v, g and beta handed over heads before time (B, H, T, D), as fla took them once, and the
    output read back so: with as many key heads as value heads fla would run silently along the heads."""
    torch_path = rule_run(delta_rule.chunk_gated_delta_rule, None, False, key_heads=4)
    fla.setattr(fused_delta_rule, "to_fla", lambda x, packed: x.transpose(1, 2))
    fla.setattr(fused_delta_rule, "from_fla", lambda y, rows, packed: y.transpose(1, 2))
    planted = rule_run(fused_delta_rule.chunk_gated_delta_rule, None, False, key_heads=4)
    # the outputs and the gradients (the final state comes back one per time step: of another shape)
    assert gap(planted[:1] + planted[2:], torch_path[:1] + torch_path[2:]) > CAUGHT


def cached_logits(model, ids: torch.Tensor, prompt: int = 70) -> torch.Tensor:
    """Logits through the cache: the prompt in one forward (two chunks), then one token per forward."""
    cache = KVCache(model.cfg, ids.shape[0])
    with torch.no_grad():
        steps = [model(ids[:, :prompt], cache)] + [model(ids[:, t:t + 1], cache) for t in range(prompt, ids.shape[1])]
    return torch.cat(steps, dim=1)


def test_decoding_through_the_cache_with_fla_gives_the_torch_paths_logits(fla):
    """The prompt's convolution and rule through fla; each next token's convolution on torch (it continues the
    cached inputs), its rule through fla from the cached state."""
    model = build_model(tiny_config(), 0)
    ids = torch.randint(0, 300, (2, 80), generator=torch.Generator().manual_seed(3))
    fused_delta_rule.choose("torch")
    torch_path = cached_logits(model, ids)
    calls = []
    fla.setattr(sys.modules["fla.ops.gated_delta_rule"], "chunk_gated_delta_rule",
                lambda *a, **kw: calls.append(a[0].shape[1]) or fake_chunk_gated_delta_rule(*a, **kw))
    fused_delta_rule.fla_kernels.cache_clear()
    fused_delta_rule.choose("auto")
    assert (cached_logits(model, ids) - torch_path).abs().max() < EXACT
    assert calls[0] == 70 and calls[1:] == [1] * 10  # the linear layer's prompt, then each token


@contextlib.contextmanager
def dispatch_reads(fla):
    """Counts the host reads made from fused_delta_rule.py in the block (tests/test_host_reads.py's counting:
    torch.Tensor's reading methods patched) into the list it gives; the stand-in fla's own checks are not counted:
    they are not zerotrain's."""
    counter, reads = host_reads_jobs.Counter(), []
    counter.where = {}
    for module, kernel in (("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
                           ("fla.modules.convolution", "causal_conv1d")):
        fla.setattr(sys.modules[module], kernel, host_reads_jobs._paused(counter, getattr(sys.modules[module], kernel)))
    fused_delta_rule.fla_kernels.cache_clear()
    with contextlib.ExitStack() as stack:
        for patch in host_reads_jobs.reading_patches(counter):
            stack.enter_context(patch)
        counter.on = True
        yield reads
        counter.on = False
    reads.append(sum(n for where, n in counter.where.items() if "model/fused_delta_rule.py" in where))


def packed_model_run(fla) -> tuple[int, torch.Tensor]:
    """The host reads from fused_delta_rule.py (dispatch_reads) in the forward and backward of a packed micro-batch
    through a Qwen3.5 of two linear layers, the micro-batch taken as the step takes it (objectives'
    token_micro_batches: on_device, with what bounds_for asks it to compute on the host), and the logits."""
    model = build_model(dataclasses.replace(tiny_config(), n_layer=4), 0).double()
    assert sum(block.linear for block in model.model.layers) == 2
    gen = torch.Generator().manual_seed(11)
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(RECORDS)]).expand(2, SEQ).contiguous()
    micro = MicroBatch(torch.randint(0, 300, (2, SEQ), generator=gen), torch.randint(0, 300, (2, SEQ), generator=gen),
                       segments)
    engine = types.SimpleNamespace(model=model, device=torch.device("cpu"), mesh=types.SimpleNamespace(dp_rank=0))
    micro = next(objectives.token_micro_batches(engine, StepBatch([micro], global_tokens=0))).data
    with dispatch_reads(fla) as reads:
        logits = model(micro.inputs, segments=micro.segments)
        F.cross_entropy(logits.flatten(0, 1), micro.labels.flatten()).backward()
    return reads[0], logits.detach()


def test_a_packed_forward_and_backward_reads_nothing_in_the_linear_layers(fla):
    """The segments' boundaries come with the micro-batch, computed on the host: none of the two calls of each linear
    layer reads the device (before: one .nonzero() a call, 96 a micro-batch in a 48-layer model). Planted: the
    boundaries found again from the starts at every call, as before, are caught (at least one read a call). The
    logits are the torch path's."""
    fused_delta_rule.choose("torch")
    torch_path = packed_model_run(fla)[1]
    fused_delta_rule.choose("auto")
    reads, logits = packed_model_run(fla)
    assert reads == 0 and (logits - torch_path).abs().max() < EXACT

    def per_call(starts):  # planted: the old per-call cu_seqlens of the starts on the device
        starts = fused_delta_rule.plain(starts)
        bounds = fused_delta_rule.cu_seqlens(starts)
        return fused_delta_rule.Packed(starts, fused_delta_rule.SegmentBounds(bounds, bounds.cpu()))

    fla.setattr(fused_delta_rule, "with_bounds", per_call)
    assert packed_model_run(fla)[0] >= 2 * 2


def test_a_host_copy_of_the_boundaries_unlike_the_device_s_is_caught(fla):
    """The stand-in holds fla's contract for cu_seqlens_cpu (what fla reads instead of cu_seqlens): the same values.
    Planted: a host copy missing the last boundary."""
    def short_host_copy(starts):
        bounds = fused_delta_rule.cu_seqlens(fused_delta_rule.plain(starts))
        short = fused_delta_rule.SegmentBounds(bounds, bounds[:-1])
        return fused_delta_rule.Packed(fused_delta_rule.plain(starts), short)

    fla.setattr(fused_delta_rule, "with_bounds", short_host_copy)
    with pytest.raises(AssertionError):
        layer_run(tiny_layer().double(), record_starts(), "auto")


def split_rows_run(fla) -> tuple[int, list[torch.Tensor]]:
    """--cp's linear layers (delta_rule_cp.py) at C = 1 on a packed micro-batch taken as the step takes it (this
    rank's part, ContextParallel.part with the convolution's reach; on_device with bounds_for's computation; the
    layers' SplitRows from ContextParallel.split_rows): the reads from fused_delta_rule.py (dispatch_reads) in the
    convolution's and the rule's forward and backward, and their outputs and gradients."""
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(RECORDS)]).expand(2, SEQ).contiguous()
    cp, device = ContextParallel(None, 1, 0), torch.device("cpu")
    part = cp.part(MicroBatch(torch.zeros(2, SEQ, dtype=torch.long), torch.zeros(2, SEQ, dtype=torch.long),
                              segments), reach=3)
    micro = next(on_device([part], device, fused_delta_rule.bounds_for(tiny_config(), device)))
    rows = cp.split_rows(micro.segments[None], 3, getattr(micro.segments, "segment_bounds", None))
    rows = dataclasses.replace(rows, gather=lambda x: x)  # one rank: every chunk its own
    gen = torch.Generator().manual_seed(9)
    x = torch.randn(2, 80, SEQ, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(80, 1, 4, generator=gen, dtype=torch.float64, requires_grad=True)
    *inputs, _ = rule_inputs()
    with dispatch_reads(fla) as reads:
        y, out = split_causal_conv(x, weight, rows), split_gated_delta_rule(*inputs, rows)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
        (y.sum() + (out * weights).sum()).backward()
    return reads[0], [y.detach(), out.detach(), x.grad, weight.grad] + [t.grad for t in inputs]


def test_context_parallel_split_rows_read_nothing_through_fla(fla):
    """Under --cp the record starts of a rank's chunks need the whole rows: ContextParallel.part computes them on the
    host, on_device their boundaries, and the split convolution and rule read nothing from the device (before: one
    read a call); they give the torch path's outputs and gradients. Planted: the per-call boundaries, caught."""
    fused_delta_rule.choose("torch")
    torch_path = split_rows_run(fla)[1]
    fused_delta_rule.choose("auto")
    reads, fused = split_rows_run(fla)
    assert reads == 0 and gap(fused, torch_path) < EXACT

    def per_call(starts):  # planted: the old per-call cu_seqlens of the starts on the device
        starts = fused_delta_rule.plain(starts)
        bounds = fused_delta_rule.cu_seqlens(starts)
        return fused_delta_rule.Packed(starts, fused_delta_rule.SegmentBounds(bounds, bounds.cpu()))

    fla.setattr(fused_delta_rule, "with_bounds", per_call)
    assert split_rows_run(fla)[0] >= 2


def test_the_torch_setting_keeps_cuda_tensors_on_torch(fla):
    fla.setattr(sys.modules["fla.ops.gated_delta_rule"], "chunk_gated_delta_rule", None)  # planted: any call fails
    fused_delta_rule.fla_kernels.cache_clear()
    layer_run(tiny_layer(), record_starts(), "torch")
    with pytest.raises(TypeError):
        layer_run(tiny_layer(), record_starts(), "auto")


QWEN35 = ["--arch", "qwen3_5", "--n-layer", "2", "--n-embd", "64", "--n-head", "4", "--linear-key-heads", "2",
          "--linear-value-heads", "4"]


@pytest.mark.parametrize("args, message", [
    (["--linear-attention-kernel", "triton"], "--linear-attention-kernel must be auto, torch or fla, got 'triton'"),
    (["--linear-attention-kernel", "fla"], "--linear-attention-kernel fla runs flash-linear-attention's CUDA "
                                           "kernels: with --device cpu give auto or torch"),
])
def test_a_linear_attention_kernel_refused_is_one_line(capsys, args, message):
    assert main(["train", "--data", "synthetic", *QWEN35, *args]) == 2
    assert capsys.readouterr().err == f"zerotrain: error: {message}\n"


def test_fla_without_its_package_is_one_line(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "fla" else real(name, *a))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert main(["train", "--data", "synthetic", *QWEN35, "--device", "cuda", "--linear-attention-kernel", "fla"]) == 2
    assert capsys.readouterr().err == ("zerotrain: error: --linear-attention-kernel fla needs the "
                                       "flash-linear-attention package: pip install flash-linear-attention, or give "
                                       "auto\n")


def test_the_setting_given_to_another_family_is_one_line(capsys):
    assert main(["train", "--data", "synthetic", "--linear-attention-kernel", "torch"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "--linear-attention-kernel applies to --arch qwen3_5" in err


def qwen35_run(tmp_path, comm) -> dict:
    """Two steps of a tiny Qwen3.5 in this process (one rank): the memory plan's report."""
    cfg = tiny_config_of_run(tmp_path, steps=2, micro=2, arch="qwen3_5", n_layer=2, n_head=4, n_kv_head=2, n_embd=32,
                             intermediate_size=64, seq_len=16, vocab_size=64, full_attention_interval=2,
                             linear_key_heads=2, linear_value_heads=4, linear_key_width=8, linear_value_width=8)
    return train(cfg, comm, announce=False).plan


def test_the_plan_is_not_measured_against_fla_s_saved_tensors(fla, tmp_path, one_rank):
    """The plan counts the torch path's saved tensors (model/activation_memory.py); what fla's kernels keep is
    another set, and is not held against it (as a compiled graph's is not). Planted: measured anyway, the stand-in's
    saved tensors (transformers' torch path's) are held against the plan, and differ from it (measured 1,032,320
    bytes against 1,015,392 planned)."""
    fused_delta_rule.choose("torch")
    measured = qwen35_run(tmp_path / "torch", one_rank)
    assert measured["activations_measured"] == measured["rows"]["activations"]
    fused_delta_rule.choose("auto")
    assert qwen35_run(tmp_path / "fla", one_rank)["activations_measured"] is None
    fla.setattr(loop, "fused_linear_layers", lambda cfg: False)
    planted = qwen35_run(tmp_path / "planted", one_rank)
    assert planted["activations_measured"] != planted["rows"]["activations"]
