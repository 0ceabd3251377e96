"""What a step achieves on its device: tokens/s, model FLOP/s and MFU per rank against the device's peak, and memory.

The model FLOPs of one token, forward and backward (PaLM, appendix B; Chinchilla's count without embeddings):

    flops_per_token = 6 * N + 12 * L * T * a

N is the weights of the matmuls a token goes through: per block attention's q, k, v and output projections
(d x (a + 2 * kv_width + a), a = heads x head_dim: d itself unless the heads have a width of their own, as Qwen3's)
and the MLP's matrices (2 x d x ffn for GPT-2, 3 for the Llama family's SwiGLU; a mixture of experts' active ones:
the router, the top-k experts a token is routed to and a shared expert, not every expert), plus the head (V x d; a
tied head too: it is a matmul). A multiply-add is 2 FLOPs: 2N forward, 4N backward (the input's and the weight's
gradients).
12 L T a is attention's scores Q K^T and their product with V: 2 matmuls of 2 T a FLOPs per token and layer
forward, twice that backward, over the whole T x T (the causal half SDPA may skip is counted, as is conventional).
A sliding window shorter than T (Mistral's) is counted as the causal half is: over the whole T x T, which SDPA
with a mask computes (a kernel that skips masked blocks, FlexAttention, does about window / T of it).
Qwen3.5's layers (model/qwen35.py) differ by kind: its gated attention's q_proj is twice as wide (the output gate),
and a Gated DeltaNet layer has its own projections, a depthwise convolution, and in place of 12 T a the chunked delta
rule's matmuls (delta_rule_flops), which grow with the chunk (64 positions), not with T, and its padding to
whole chunks is counted (the kernels compute it). Its depthwise convolution counts as W K weights.
Embedding lookups, biases, norms (Qwen3's q/k norms too), activations, softmax and the loss are left out. The
recompute of --activation-checkpointing is not counted: MFU counts the model's work, not the hardware's. Every
position of the batch counts as a token (padding too: the matmuls run on it). tests/test_throughput.py checks the
formula against torch's FlopCounterMode on the model's forward and backward. A LoRA run (--lora-rank) counts
what it computes: 4 N for the frozen base (no weight gradients), 6 per adapter weight a token goes through (a
routed expert's, --lora-targets experts, for each of its top-k experts: lora_flops_per_token).

Per rank: the global batch's model FLOPs over the ranks. TP ranks split a replica's matmuls, DP ranks the batch;
the head each TP rank computes again is the model's work once. MFU = model FLOP/s per rank / the peak of one device.

The peak: `--peak-flops`; on CUDA the device's dense figure from CUDA_PEAKS at the precision its matmuls run in
(bf16; tf32 when PyTorch's fp32 matmul precision allows it; else fp32); on CPU a matmul of the model's MLP shape
timed once and cached by CPU model, threads per rank, torch version, dtype and shape in
`$ZEROTRAIN_CACHE` or `~/.cache/zerotrain` (the user's cache, not the run folder: every run on this machine then
measures against the same figure, so MFUs compare across runs).

A peak timed on a busy machine is too low, and every MFU against it too high (5.86 was seen), so a measurement is
the best of several timings, and it is not cached when it was taken on a busy machine (busy_reason: a load average
above the cores, other runnable threads that leave this rank's threads fewer cores than they need, or timings that
spread as contended ones do). A step whose MFU comes out above 1 proves the peak too low: a CPU peak is dropped
from the cache and timed again once; if the step still beats it, or the peak was a table's or --peak-flops', no
MFU above 1 is reported: the run says once that the peak is unreliable, and reports no MFU from there on.
"""

from __future__ import annotations

import functools
import glob
import json
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from zerotrain.config import GROUP_ROUTED, LORA_EXPERTS, QWEN35, Config, LoraConfig, ModelConfig
from zerotrain.data.corpus import cache_root
from zerotrain.durable import write_json
from zerotrain.model.delta_rule import CHUNK

PEAK_CACHE = "peak_flops.json"

# Dense (no structured sparsity) peaks in FLOP/s of one device: (bf16, tf32, fp32), from NVIDIA's datasheets and
# architecture whitepapers. The first name contained in torch.cuda.get_device_name() is the device: a longer name
# comes before a name it contains ("A100" before "A10", "L40S" before "L4").
CUDA_PEAKS: tuple[tuple[str, float, float, float], ...] = (
    ("H100 PCIe", 756e12, 378e12, 51.2e12),
    ("H100 NVL", 835e12, 417.5e12, 60e12),
    ("H100", 989.4e12, 494.7e12, 66.9e12),  # SXM5 (HBM3)
    ("H200 NVL", 835e12, 417.5e12, 60e12),
    ("H200", 989.4e12, 494.7e12, 66.9e12),  # GH200's GPU too: the name contains it
    ("A100", 312e12, 156e12, 19.5e12),  # SXM4 and PCIe alike
    ("A10G", 125e12, 62.5e12, 31.2e12),  # AWS's A10, without a datasheet of its own: the A10's figures
    ("A10", 125e12, 62.5e12, 31.2e12),
    ("L40S", 362.05e12, 183.2e12, 91.6e12),
    ("L40", 181e12, 90.5e12, 90.5e12),
    ("L4", 121e12, 60e12, 30.3e12),
    ("RTX 4090", 165.2e12, 82.6e12, 82.6e12),  # GeForce: bf16 with fp32 accumulation, half the fp16 rate
    ("RTX 3090", 71e12, 35.6e12, 35.6e12),
)


@dataclass(frozen=True)
class Peak:
    """The FLOP/s one device does at the run's precision (None: not known), and where the figure comes from;
    `remeasure` times a measured figure again, dropping it from the cache first (None: a table's or a flag's)."""

    flops: float | None
    source: str
    remeasure: Callable[[], "Peak"] | None = field(default=None, compare=False, repr=False)


# A machine is busy when a timing may have lost the cores: what cpu_peak will not cache.
SPREAD_LIMIT = 1.5  # the fastest timing over the slowest, above a quiet machine's repeat (docs/benchmarks.md)


def matmul_params(m: ModelConfig) -> int:
    """The weights of the matmuls one token goes through: every block's projections (mixer_params) and MLP (a mixture
    of experts' active ones: mlp_active_params), and the head."""
    return sum(mixer_params(m, layer) + mlp_active_params(m, layer) for layer in range(m.n_layer)) + \
        m.vocab_size * m.n_embd


def mixer_params(m: ModelConfig, layer: int) -> int:
    """The token mixer's matmul weights of `layer`: attention's q, k, v and output projections (Qwen3.5's q_proj
    twice as wide: each head's output gate beside its query); a Qwen3.5 Gated DeltaNet layer's in_proj_qkv (d x W,
    W = 2 Hk dk + Hv dv), in_proj_z (d x Hv dv), in_proj_a and in_proj_b (d x Hv each), out_proj (Hv dv x d) and its
    depthwise convolution's K taps per channel (W K: a multiply-add per tap, as a weight's)."""
    d = m.n_embd
    if m.linear_attention(layer):
        W = 2 * m.linear_key_heads * m.linear_key_width + m.linear_value_heads * m.linear_value_width
        values = m.linear_value_heads * m.linear_value_width
        return d * (W + values + 2 * m.linear_value_heads) + values * d + W * m.linear_conv_kernel
    q_width, kv_width = m.n_head * m.head_dim, m.kv_heads * m.head_dim
    gate = q_width if m.arch in QWEN35 else 0
    return d * (q_width + gate + 2 * kv_width) + q_width * d


def mixing_flops_per_token(m: ModelConfig) -> float:
    """The token mixers' FLOPs beyond their weights, forward and backward: attention's 12 T a a layer (a = its heads'
    width), and a Gated DeltaNet layer's chunked delta rule (delta_rule_flops), per token of the sequence."""
    attention = 12 * m.seq_len * m.n_head * m.head_dim
    layers = [m.linear_attention(layer) for layer in range(m.n_layer)]
    return attention * layers.count(False) + delta_rule_flops(m) * layers.count(True) / m.seq_len


def delta_rule_flops(m: ModelConfig) -> int:
    """One sequence's matmul FLOPs, forward and backward, in one Gated DeltaNet layer's chunked delta rule
    (delta_rule.py), over its n chunks of c = 64 positions (the padding of the last one computed too), for each of its
    Hv value heads of widths dk (keys) and dv (values):

        within a chunk   q k^T and beta k k^T (2 c^2 dk each), the decayed scores times the corrected values
                         (2 c^2 dv): forward, and the two gradients of each backward; the triangular solves'
                         gradients of their system (2 c^2 (dk + dv)); the solves themselves are not matmuls
        across chunks    the state read by the queries and by the corrections (2 c dk dv each): forward, the
                         gradient of their other factor, and past the first chunk (the first state is zeros, no
                         gradient) the state's; the state updated (2 c dk dv): forward in every chunk, backward in
                         all but the last (the state it leaves is a cache's, without a graph)

    What torch's FlopCounterMode counts of it (tests/test_throughput.py)."""
    c, dk, dv = CHUNK, m.linear_key_width, m.linear_value_width
    n = -(-m.seq_len // c)
    within = 3 * (4 * c * c * dk + 2 * c * c * dv) + 2 * c * c * (dk + dv)
    state = 2 * c * dk * dv
    across = 2 * state * (2 + 3 * (n - 1)) + state * (n + 2 * (n - 1))
    return m.linear_value_heads * (n * within + across)


def mlp_active_params(m: ModelConfig, layer: int) -> int:
    """The MLP weights one token of `layer` goes through. A dense MLP: 3 matrices d x ffn (SwiGLU's gate, up and
    down), 2 for GPT-2. A mixture of experts (model/moe.py): the router (d x E), its top-k experts' 3 matrices
    d x expert width each, and Qwen2-MoE's shared expert (3 matrices d x its width) and its gate (d x 1), or
    DeepSeek-V3's (GLM-4.5's) ungated shared experts (3 matrices d x shared_experts x expert width); the experts a
    token is not routed to do no work for it (dropless routing runs each expert on its own tokens only)."""
    d = m.n_embd
    if not m.has_experts(layer):
        return (3 if m.llama_family else 2) * d * m.ffn_width
    shared = 3 * d * m.shared_expert_width + d if m.shared_expert_width else 0
    if m.arch in GROUP_ROUTED:
        shared = 3 * d * m.shared_experts * m.expert_ffn
    return d * m.n_experts + m.experts_per_token * 3 * d * m.expert_ffn + shared


def model_flops_per_token(m: ModelConfig, lora: LoraConfig | None = None) -> float:
    """6 N + 12 L T a: the model's forward and backward FLOPs per token (the module docstring says what counts); with
    LoRA adapters (`lora` of a rank), what a run with a frozen base computes (lora_flops_per_token)."""
    if lora is not None and lora.rank:
        return lora_flops_per_token(m, lora)
    return 6 * matmul_params(m) + mixing_flops_per_token(m)


def adapted_shapes(m: ModelConfig, lora: LoraConfig, layer: int) -> list[tuple[str, int, int]]:
    """(module name, in, out) of each linear of block `layer` that carries adapters, in the block's order, as a
    token goes through them: a mixture of experts' routed experts' projections (--lora-targets experts) once for
    each of the top-k experts it is routed to, a shared expert's as a dense MLP's (`all` adapts it, not the routed
    experts)."""
    d, q, kv = m.n_embd, m.n_head * m.head_dim, m.kv_heads * m.head_dim
    targets = lora.modules(m.arch)
    if not m.llama_family:  # GPT-2's c_proj names the attention's output and the MLP's down projection alike
        f = m.ffn_width
        linears = [("c_attn", d, 3 * d), ("c_proj", d, d), ("c_fc", d, f), ("c_proj", f, d)]
        return [linear for linear in linears if linear[0] in targets]
    linears = [("q_proj", d, q), ("k_proj", d, kv), ("v_proj", d, kv), ("o_proj", q, d)]
    f = m.ffn_width if not m.has_experts(layer) else m.shared_expert_width  # a MoE layer's shared expert, if any
    if f:
        linears += [("gate_proj", d, f), ("up_proj", d, f), ("down_proj", f, d)]
    shapes = [linear for linear in linears if linear[0] in targets]
    if m.has_experts(layer) and LORA_EXPERTS in targets:
        w = m.expert_ffn
        shapes += m.experts_per_token * [("experts.gate_proj", d, w), ("experts.up_proj", d, w),
                                         ("experts.down_proj", w, d)]
    return shapes


def lora_flops_per_token(m: ModelConfig, lora: LoraConfig) -> int:
    """A LoRA run's FLOPs per token, forward and backward, attention's included: each frozen weight 2 forward and 2
    for its input's gradient (no weight gradient), each adapter weight (R x (in + out) per adapted linear a token
    goes through) 6 as a trained weight's, attention 12 L T a; less what autograd skips in the first block
    (first_block_skips)."""
    adapters = lora.rank * sum(i + o for layer in range(m.n_layer) for _, i, o in adapted_shapes(m, lora, layer))
    attention = 12 * m.n_layer * m.seq_len * m.n_head * m.head_dim
    return 4 * matmul_params(m) + 6 * adapters + attention - first_block_skips(m, lora)


def first_block_skips(m: ModelConfig, lora: LoraConfig) -> int:
    """The FLOPs per token autograd does not compute before a LoRA run's first adapters: the blocks before the first
    that has adapters (a mixture of experts' dense layers, where only `experts` are adapted) compute no backward at
    all, and in that first block, whose input (the frozen embedding's, or those blocks' output) needs no gradient, a
    linear's input gradient (its base's 2 x in x out, its A's 2 R in) wherever its input needs none, and attention's
    backward matmuls (2 T a each: dQ, dK, dP for either, dV) for the q, k, v that need none. A mixture of experts'
    router (and shared expert's gate), its top-k experts and its shared expert read the MLP's input as a dense MLP
    does. Every later block's input needs a gradient: the adapters' output joins the residual stream."""
    d, a, kv, R = m.n_embd, m.n_head * m.head_dim, m.kv_heads * m.head_dim, lora.rank
    first = next((layer for layer in range(m.n_layer) if adapted_shapes(m, lora, layer)), 0)
    attention_params = d * (a + 2 * kv) + a * d
    skipped = sum(2 * (attention_params + mlp_active_params(m, layer)) + 8 * m.seq_len * a for layer in range(first))
    targets = set(lora.modules(m.arch))
    if m.llama_family:
        q, k, v, o = (name in targets for name in ("q_proj", "k_proj", "v_proj", "o_proj"))
        linears = [("q_proj", d, a, False), ("k_proj", d, kv, False), ("v_proj", d, kv, False)]
    else:
        q = k = v = "c_attn" in targets
        o = "c_proj" in targets  # c_proj: the attention's output and the MLP's alike
        linears = [("c_attn", d, 3 * d, False)]
    attended = q or k or v  # the attention's output needs a gradient
    mlp_input = attended or o
    linears += [(("o_proj" if m.llama_family else "c_proj"), a, d, attended)]
    for ups, down in block_mlps(m, first):
        linears += [(name, i, out, mlp_input) for name, i, out in ups]
        if down is not None:
            linears += [(*down, mlp_input or any(name in targets for name, _, _ in ups))]
    skipped += sum(2 * i * out + (2 * R * i if name in targets else 0) for name, i, out, needed in linears if not needed)
    attention_backward = 2 * m.seq_len * a * (q + k + (q or k) + v)
    return skipped + 8 * m.seq_len * a - attention_backward


def block_mlps(m: ModelConfig, layer: int) -> list[tuple[list[tuple[str, int, int]], tuple[str, int, int] | None]]:
    """Block `layer`'s MLP as the linears a token goes through, by their --lora-targets names: (those reading the
    MLP's input, the down projection reading their output), once for a dense MLP; a mixture of experts' router (and
    shared expert's gate: never adapted, no down projection), each of the top-k experts (`experts`) and its shared
    expert."""
    d, f = m.n_embd, m.ffn_width
    if not m.llama_family:
        return [([("c_fc", d, f)], ("c_proj", f, d))]
    if not m.has_experts(layer):
        return [([("gate_proj", d, f), ("up_proj", d, f)], ("down_proj", f, d))]
    w, s = m.expert_ffn, m.shared_expert_width
    gates = [("router", d, m.n_experts + (1 if s else 0))]  # the router, and the shared expert's gate (d x 1)
    mlps = [(gates, None)]
    mlps += m.experts_per_token * [([(LORA_EXPERTS, d, w), (LORA_EXPERTS, d, w)], (LORA_EXPERTS, w, d))]
    if s:
        mlps.append(([("gate_proj", d, s), ("up_proj", d, s)], ("down_proj", s, d)))
    return mlps


def peak_flops(cfg: Config, device: torch.device) -> Peak:
    """The peak of one of this run's devices: --peak-flops, else the table (CUDA) or a measured matmul (CPU)."""
    if cfg.logging.peak_flops:
        return Peak(cfg.logging.peak_flops, "--peak-flops")
    bf16 = cfg.parallel.precision == "bf16"
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        tf32 = torch.get_float32_matmul_precision() != "highest"
        precision = "bf16" if bf16 else "tf32" if tf32 else "fp32"
        for known, *figures in CUDA_PEAKS:
            if known.lower() in name.lower():
                return Peak(figures[("bf16", "tf32", "fp32").index(precision)], f"{name} dense {precision}, table")
        return Peak(None, f"{name} is not in zerotrain's table of devices: --peak-flops F (FLOP/s) gives MFU")
    m = cfg.model
    shape = (min(cfg.loop.micro_batch * m.seq_len, 1024), m.n_embd, max(1, m.ffn_width // cfg.parallel.tp))
    return cpu_peak(shape, torch.bfloat16 if bf16 else torch.float32)


def cpu_peak(shape: tuple[int, int, int], dtype: torch.dtype, cache: str | None = None, forget: bool = False) -> Peak:
    """A (M x K) @ (K x N) matmul's FLOP/s on this CPU with this rank's threads: cached, or timed now (the best of
    several timings) and cached unless the machine was busy. `forget`: drop the cached figure and time it again."""
    threads = torch.get_num_threads()
    key = f"{cpu_model()}; {threads} threads; torch {torch.__version__}; {dtype}; {'x'.join(map(str, shape))}"
    path = os.path.join(cache or cache_root(), PEAK_CACHE)
    known = _read_cache(path)
    what = f"CPU {str(dtype).removeprefix('torch.')} matmul {'x'.join(map(str, shape))}, {threads} thread" + \
        "s" * (threads != 1)
    again = functools.partial(cpu_peak, shape, dtype, cache, forget=True)
    if forget and key in known:
        known.pop(key)
        _write_cache(path, known)
    elif key in known:
        return Peak(known[key], f"{what}: measured before, cached in {path}", again)
    rates, others = time_matmul(shape, dtype)
    flops = max(rates)
    busy = busy_reason(rates, others, os.getloadavg()[0], os.cpu_count() or 1, threads)
    if busy:
        return Peak(flops, f"{what}: measured now, not cached ({busy})", again)
    problem = _write_cache(path, {**_read_cache(path), key: flops})
    if problem:
        return Peak(flops, f"{what}: measured now, not cached ({problem})", again)
    return Peak(flops, f"{what}: measured now, cached in {path}", again)


def busy_reason(rates: list[float], others_running: list[int], load: float, cores: int, threads: int) -> str | None:
    """Why FLOP/s timed as `rates` may not be the CPU's peak (the machine was busy), or None.

    `others_running`: the runnable threads of other processes seen around each timing (/proc/loadavg's running
    count less this process's own); `load`: the 1-minute load average. Busy: a load average above the cores; other
    runnable threads that leave fewer cores than this rank's threads; or the fastest timing more than SPREAD_LIMIT
    times the slowest (a quiet machine repeats a matmul closely; a contended one does not).
    """
    if load > cores:
        return f"load average {load:.1f} on {cores} cores"
    busiest = max(others_running, default=0)
    if busiest + threads > cores:
        return f"{busiest} runnable thread(s) of other processes beside this rank's {threads} on {cores} cores"
    if len(rates) > 1 and max(rates) > SPREAD_LIMIT * min(rates):
        return f"its timings spread {max(rates) / min(rates):.1f}x: other work took the cores"
    return None


def others_running() -> int:
    """The runnable threads of other processes now: /proc/loadavg's running count less this process's runnable
    threads (its matmul threads may still spin); 0 where /proc is not there to say."""
    try:
        with open("/proc/loadavg") as f:
            running = int(f.read().split()[3].split("/")[0])
    except (OSError, ValueError, IndexError):
        return 0
    own = 0
    for task in glob.glob("/proc/self/task/*/stat"):
        try:
            with open(task) as f:
                own += f.read().rsplit(")", 1)[1].split()[0] == "R"
        except (OSError, IndexError):
            continue
    return max(0, running - own)


def time_matmul(shape: tuple[int, int, int], dtype: torch.dtype, budget_s: float = 0.25,
                timings: int = 5) -> tuple[list[float], list[int]]:
    """The FLOP/s of each of `timings` batches of matmuls of `shape`, each batch long enough for the clock, or of what
    `budget_s` allows (after one untimed warm-up); and the other processes' runnable threads seen after each batch
    (others_running)."""
    M, K, N = shape
    a, b = torch.randn(M, K, dtype=dtype), torch.randn(K, N, dtype=dtype)
    out = torch.mm(a, b)
    rates, others, reps, start = [], [others_running()], 1, time.perf_counter()
    while len(rates) < timings:
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b, out=out)
        took = time.perf_counter() - t0
        over = time.perf_counter() - start > budget_s
        if took < 0.01 and not over:  # too short for the clock: twice the calls next time
            reps *= 2
            continue
        rates.append(2 * M * K * N * reps / took)
        others.append(others_running())
        if over:
            break
    return rates, others


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what the platform says."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _write_cache(path: str, known: dict[str, float]) -> str | None:
    """Write the cache; what went wrong (for the start line), or None."""
    try:
        os.makedirs(os.path.dirname(path), exist_ok=True)
        write_json(path, known, durable=False)
    except OSError as e:
        return f"{e.strerror}: {path}"
    return None


def _read_cache(path: str) -> dict[str, float]:
    try:
        with open(path) as f:
            known = json.load(f)
    except (OSError, ValueError):
        return {}
    return known if isinstance(known, dict) else {}


class Throughput:
    """A step's figures per rank from its time: tokens/s, model FLOP/s, MFU; and this rank's peak memory."""

    def __init__(self, cfg: Config, world_size: int, peak: Peak, say: Callable[[str], None] | None = None):
        self.flops_per_token = model_flops_per_token(cfg.model, cfg.lora)
        self.formula = "4N + 6N_lora + 12LTd" if cfg.lora.rank else "6N + 12LTd"  # a LoRA run's frozen base: 4N
        self.world_size, self.peak = world_size, peak
        self.say = say or (lambda line: print(f"zerotrain: warning: {line}", file=sys.stderr, flush=True))
        self.unreliable = False  # a step beat the peak: no MFU is reported from then on

    def of_step(self, step_s: float, tokens: int, positions: int) -> dict:
        """`tokens` trained (unmasked targets) and `positions` computed (the batch's capacity) by all ranks."""
        flops = positions * self.flops_per_token / self.world_size / step_s
        figures = dict(tokens_per_s_per_rank=tokens / self.world_size / step_s, flops_per_s_per_rank=flops)
        mfu = self.mfu(flops)
        if mfu is not None:
            figures["mfu"] = mfu
        return figures

    def mfu(self, flops: float) -> float | None:
        """flops / the peak, never above 1: a step above the peak has a measured peak timed again once (dropped
        from the cache), else the peak is said to be unreliable and no MFU is reported from then on."""
        if not self.peak.flops or self.unreliable:
            return None
        if flops <= self.peak.flops:
            return flops / self.peak.flops
        low = self.peak
        if low.remeasure is not None:
            self.peak = low.remeasure()
            if self.peak.flops and flops <= self.peak.flops:
                self.say(f"a step did {flop_rate(flops)} per rank, above the peak of {flop_rate(low.flops)} timed on "
                         f"a busy machine: dropped from the cache and timed again: {flop_rate(self.peak.flops)} "
                         f"({self.peak.source})")
                return flops / self.peak.flops
        self.unreliable = True
        peak = flop_rate(self.peak.flops) if self.peak.flops else "no figure"
        self.peak = replace(self.peak, source=f"{self.peak.source}; unreliable: a step did {flop_rate(flops)} per "
                                              "rank, above it")
        self.say(f"a step did {flop_rate(flops)} per rank, above the peak of {peak} MFU is measured against "
                 f"({low.source}): the peak is unreliable, so no MFU is reported; --peak-flops F (FLOP/s) sets it"
                 + (" (a CPU peak timed on a quiet machine is cached for later runs)" if low.remeasure else ""))
        return None

    def describe(self) -> str:
        """For the start line: the FLOPs per token and the peak MFU is measured against."""
        peak = f"{flop_rate(self.peak.flops)} per rank" if self.peak.flops else "an unknown peak"
        return (f"{self.flops_per_token / 1e6:,.2f} MFLOP per token ({self.formula}); MFU against {peak} "
                f"({self.peak.source})")

    def state(self) -> dict:
        """What the summary states beside the step figures."""
        return {"flops_per_token": self.flops_per_token, "peak_flops": self.peak.flops,
                "peak_source": self.peak.source}


def flop_rate(flops_per_s: float) -> str:
    """FLOP/s as a person reads them: 24.4 GFLOP/s, 989.4 TFLOP/s."""
    if flops_per_s >= 1e12:
        return f"{flops_per_s / 1e12:,.1f} TFLOP/s"
    return f"{flops_per_s / 1e9:,.2f} GFLOP/s" if flops_per_s < 10e9 else f"{flops_per_s / 1e9:,.1f} GFLOP/s"


def current_rss() -> int:
    """This process's resident memory now (Linux's /proc; 0 elsewhere): what a phase's peak is measured from."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def peak_memory(device: torch.device) -> dict:
    """This rank's peak memory so far: resident on the host, and allocated on its CUDA device."""
    figures = {"peak_host_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}  # Linux gives KiB
    if device.type == "cuda":
        figures["peak_device_bytes"] = torch.cuda.max_memory_allocated(device)
    return figures
