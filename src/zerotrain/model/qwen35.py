"""Qwen3.5's text decoder, dense (qwen3_5) and mixture of experts (qwen3_5_moe), as transformers' Qwen3_5ForCausalLM
and Qwen3_5MoeForCausalLM compute it: a hybrid of Gated DeltaNet linear-attention layers and gated attention layers,
every --full-attention-interval-th layer (layers N-1, 2N-1, ...) attention, the others linear (config.layer_types).

    linear_attn   Gated DeltaNet: x -> in_proj_qkv -> a causal depthwise convolution (conv1d) and SiLU -> q, k, v
                  split by heads (each key head serving a group of value heads); beta = sigmoid(in_proj_b x), the
                  decay g = -exp(A_log) softplus(in_proj_a x + dt_bias); the gated delta rule (delta_rule.py); each
                  value head's output RMS-normalised (a plain gain, `norm`) times SiLU(in_proj_z x), the output gate;
                  out_proj
    self_attn     Qwen3's attention with an output gate: q_proj gives each head's query and gate side by side (2 x
                  head_dim per head), q and k RMS-normalised per head ((1 + w) gains), rotary on the first
                  --partial-rotary share of each head only, the attention's output times sigmoid(gate), o_proj
    mlp           SwiGLU, or (qwen3_5_moe) model/moe.py's router (top-k always renormalised) and experts beside a
                  shared expert behind a sigmoid gate, on every layer
    norms         (1 + w) RMSNorms in fp32 (Gemma's, model/gemma.py) before each mixer and MLP and at the end

Packed records (`segments`): the attention layers take the records' mask, the linear layers restart their
convolution and state at each record's first token (delta_rule.py). Through a KV cache (generation) the attention
layers append to it; the linear layers keep their convolution's last inputs and their state beside it.

Context parallelism (--cp): each rank's part of the rows, the attention layers around the ring (rotary at the whole
row's or record's positions), the linear layers on its two chunks apart, each from the state and the convolution
inputs the row's earlier chunks leave it (delta_rule_cp.py).

Under tensor parallelism (`plan`, `parallelize`) each rank holds whole heads: the linear layers' key heads and the
value heads they serve, the attention's heads as Qwen3's (the comment above `linear_plan` gives every split).

Parameter names are transformers' (model.layers.{i}.linear_attn.in_proj_qkv.weight, ...self_attn.q_norm.weight,
...mlp.experts.{e}.gate_proj.weight as its files store them): hub/mapping.py's table is the identity.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerotrain.config import ModelConfig

from . import moe, mtp
from .attention import attend
from .decoder import Decoder
from .delta_rule import record_starts
from .delta_rule_cp import SplitRows, split_causal_conv, split_gated_delta_rule
from .fused_delta_rule import Packed, causal_conv, chunk_gated_delta_rule
from .gemma import GemmaRMSNorm
from .kv_cache import KVCache
from .llama import LlamaMLP, layer_mask, mlp_plan, normalize_heads, parallelize_mlp, parallelize_vocab
from .moe import MoE
from .positions import new_positions
from .recompute import run_block
from .rotary import apply_rotary, rotary_tables
from .tensor_parallel import (ColumnParallelLinear, RowParallelLinear, TPSlice, blocks, copy_to_tp,
                              kv_head_blocks)
from .vocab import splits_vocab, vocab_slice


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight x / sqrt(mean(x^2) + eps) times SiLU(gate), as transformers' Qwen3_5RMSNormGated: normalised in fp32,
    the gain applied in x's dtype, the gate in fp32."""
    xf = x.float()
    normed = weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)
    return (normed * F.silu(gate.float())).to(x.dtype)


def decay_and_beta(a: torch.Tensor, b: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) of each token and value head: the state's decay in log space, -exp(A_log) softplus(a + dt_bias)
    in fp32 (exp(A_log) overflows fp16), and the write strength sigmoid(b)."""
    return -A_log.float().exp() * F.softplus(a.float() + dt_bias), b.sigmoid()


def output_gate(y: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
    """The attention layer's output gate: y times sigmoid(gate), per unit."""
    return y * torch.sigmoid(gate)


class GatedDeltaNet(nn.Module):
    """Qwen3.5's linear-attention layer (the module docstring's linear_attn)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.key_width, self.value_width = cfg.linear_key_width, cfg.linear_value_width
        # this rank's q (and k) and v widths: all heads', or under TP its heads' (parallelize)
        self.key_dim = cfg.linear_key_heads * cfg.linear_key_width
        self.value_dim = cfg.linear_value_heads * cfg.linear_value_width
        self.tp_comm = None  # under TP: the four input projections share one all-reduce of their input's gradient
        self.eps = cfg.norm_eps
        conv_dim = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(conv_dim, conv_dim, cfg.linear_conv_kernel, groups=conv_dim, bias=False,
                                padding=cfg.linear_conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(cfg.linear_value_heads))
        self.A_log = nn.Parameter(torch.zeros(cfg.linear_value_heads))
        self.norm = GatedNormGain(cfg.linear_value_width)
        self.out_proj = nn.Linear(self.value_dim, cfg.n_embd, bias=False)
        self.in_proj_qkv = nn.Linear(cfg.n_embd, conv_dim, bias=False)
        self.in_proj_z = nn.Linear(cfg.n_embd, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(cfg.n_embd, cfg.linear_value_heads, bias=False)
        self.in_proj_a = nn.Linear(cfg.n_embd, cfg.linear_value_heads, bias=False)

    def forward(self, x: torch.Tensor, cache: KVCache | None, layer: int,
                starts: torch.Tensor | Packed | SplitRows | None) -> torch.Tensor:
        """`starts`: each record's first token (B, T) bool (through fla, Packed: with their segments' boundaries),
        None for one document a row, or under --cp the rows' split (delta_rule_cp.py)."""
        B, T, _ = x.shape
        split = starts if isinstance(starts, SplitRows) else None
        x = copy_to_tp(x, self.tp_comm)
        mixed = self.in_proj_qkv(x).transpose(1, 2)
        z = self.in_proj_z(x).reshape(B, T, -1, self.value_width)
        past_inputs, past_state = recurrent_state(cache, layer)
        kernel = self.conv1d.weight.shape[-1]
        if split is not None:
            conv = split_causal_conv(mixed.to(self.conv1d.weight.dtype), self.conv1d.weight, split)
        else:
            conv = causal_conv(mixed.to(self.conv1d.weight.dtype), self.conv1d.weight, starts, past_inputs)
        if cache is not None:  # the convolution's last inputs, for the next tokens
            before = torch.zeros_like(mixed[..., :kernel - 1]) if past_inputs is None else past_inputs
            past_inputs = torch.cat([before, mixed], dim=-1)[..., -(kernel - 1):]
        mixed = F.silu(conv).to(x.dtype).transpose(1, 2)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k = q.reshape(B, T, -1, self.key_width), k.reshape(B, T, -1, self.key_width)
        v = v.reshape(B, T, -1, self.value_width)
        g, beta = decay_and_beta(self.in_proj_a(x), self.in_proj_b(x), self.A_log, self.dt_bias)
        if split is not None:
            y = split_gated_delta_rule(q, k, v, g, beta, split)
        else:
            y, state = chunk_gated_delta_rule(q, k, v, g, beta, starts, past_state)
        if cache is not None:
            keep_recurrent_state(cache, layer, past_inputs, state)
        # under TP each rank normalises its own heads: the replicated gain's gradient is summed over the group
        y = gated_rms_norm(y, z, copy_to_tp(self.norm.weight, self.tp_comm), self.eps)
        return self.out_proj(y.reshape(B, T, -1))


class GatedNormGain(nn.Module):
    """The gain of the linear layer's gated RMSNorm (a plain gain, starting at 1): its own module, so that its name
    is transformers' linear_attn.norm.weight."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


def recurrent_state(cache: KVCache | None, layer: int) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """A linear layer's (convolution inputs, state) kept beside the KV cache; (None, None) without a cache or when
    the cache is empty (a new sequence, or one refilled: generate.py resets it)."""
    if cache is None or cache.length == 0:
        return None, None
    return getattr(cache, "linear_states", {}).get(layer, (None, None))


def keep_recurrent_state(cache: KVCache, layer: int, inputs: torch.Tensor, state: torch.Tensor) -> None:
    if not hasattr(cache, "linear_states"):
        cache.linear_states = {}
    cache.linear_states[layer] = (inputs, state)


class GatedAttention(nn.Module):
    """Qwen3.5's attention layer (the module docstring's self_attn)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        C, D = cfg.n_embd, cfg.head_dim
        self.head_dim = D
        self.tp_comm = None  # under TP: q, k and v share one all-reduce of their input's gradient (parallelize)
        self.q_proj = nn.Linear(C, cfg.n_head * D * 2, bias=False)
        self.k_proj = nn.Linear(C, cfg.kv_heads * D, bias=False)
        self.v_proj = nn.Linear(C, cfg.kv_heads * D, bias=False)
        self.o_proj = nn.Linear(cfg.n_head * D, C, bias=False)
        self.q_norm = GemmaRMSNorm(D, cfg.norm_eps)
        self.k_norm = GemmaRMSNorm(D, cfg.norm_eps)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None,
                layer: int, documents=None) -> torch.Tensor:
        B, T, _ = x.shape
        x = copy_to_tp(x, self.tp_comm)
        q, gate = self.q_proj(x).view(B, T, -1, 2 * self.head_dim).chunk(2, dim=-1)
        q = normalize_heads(self.q_norm, q, self.tp_comm).transpose(1, 2)
        k = normalize_heads(self.k_norm, self.k_proj(x).view(B, T, -1, self.head_dim), self.tp_comm).transpose(1, 2)
        v = self.v_proj(x).view(B, T, -1, self.head_dim).transpose(1, 2)
        q, k = partial_rotary(q, *rotary), partial_rotary(k, *rotary)
        y = attend(q, k, v, cache, layer, documents)
        return self.o_proj(output_gate(y.transpose(1, 2).reshape(B, T, -1), gate.reshape(B, T, -1)))


def partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary on the first cos.shape[-1] units of each head of x (B, H, T, D), the rest passed through."""
    rotated = cos.shape[-1]
    if rotated == x.shape[-1]:
        return apply_rotary(x, cos, sin)
    return torch.cat([apply_rotary(x[..., :rotated], cos, sin), x[..., rotated:]], dim=-1)


class Qwen35Block(nn.Module):
    """(1 + w) pre-norm token mixer (linear or attention, by the layer) and MLP or mixture of experts."""

    def __init__(self, cfg: ModelConfig, layer: int, attention: bool = False):
        super().__init__()
        self.linear = cfg.linear_attention(layer) and not attention  # `attention`: a multi-token-prediction block's
        self.input_layernorm = GemmaRMSNorm(cfg.n_embd, cfg.norm_eps)
        if self.linear:
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = GemmaRMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MoE(cfg) if cfg.has_experts(layer) else LlamaMLP(cfg)

    def forward(self, x, rotary, cache: KVCache | None, layer: int, documents=None, starts=None) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.linear:
            x = x + self.linear_attn(h, cache, layer, starts)
        else:
            x = x + self.self_attn(h, rotary, cache, layer, documents)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35(Decoder):
    """Token embedding, Qwen3.5's hybrid blocks, final (1 + w) RMSNorm, LM head (tied or its own)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, Qwen35Block, GemmaRMSNorm(cfg.n_embd, cfg.norm_eps))
        trained = mtp.build_qwen(cfg, Qwen35Block, GemmaRMSNorm)  # --mtp train: mtp.*, as the folder names them
        if trained is not None:
            self.mtp = trained

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None,
               segments: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        x = self.model.embed_tokens(idx)
        if self.context_parallel is not None and cache is None:  # this rank's part of each row: the attention layers
            # around the ring, the linear ones from the states and inputs of the chunks before this rank's
            positions, mask = self.context_parallel.prepare(idx, segments)
            starts = self.context_parallel.split_rows(mask.documents, cfg.linear_conv_kernel - 1,
                                                      getattr(segments, "segment_bounds", None))
        else:
            positions = new_positions(idx, cache, cfg.positions, segments)
            mask = layer_mask(cfg, idx, x.dtype, cache, segments, 0)
            starts = None if segments is None else record_starts(segments)
            bounds = getattr(segments, "segment_bounds", None)  # fla's, computed with the micro-batch (on_device)
            if bounds is not None:
                starts = Packed(starts, bounds[0])
        rotary = rotary_tables(positions, cfg.rotary_dim, cfg.rope_theta)
        if self.trains_mtp and cache is None:  # the MTP blocks (attention) read the embeddings and these too
            self.mtp_inputs = (x, rotary, mask)
        for layer, block in enumerate(self.model.layers):
            x = run_block(block, self.recompute_blocks if cache is None else False, x, rotary, cache, layer, mask,
                          starts)
        if cache is not None:
            cache.length += idx.shape[1]
        return self.model.norm(x)


def init_rule(cfg: ModelConfig, name: str):
    """How parameter `name` starts (model/init.py draws it), as transformers' _init_weights: N(0, 0.02) matrices,
    embeddings and convolution, the (1 + w) norms' weights at 0, the gated norm's gain at 1, dt_bias at 1. A_log
    starts at 0 (A = 1, every head's decay softplus(a + 1)): transformers draws A from U(0.01, 16), which
    zerotrain's draws (normal, uniform around 0) do not give."""
    if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
        return "ones"
    if name.endswith("norm.weight") or name.endswith("A_log"):
        return "zeros"
    if name.endswith(".bias"):
        return ("uniform", 1 / math.sqrt(cfg.n_embd))
    return ("normal", 0.02)


# Tensor parallelism (T ranks), by heads. A linear-attention layer: rank r holds key heads r Hk/T .. and the value
# heads they serve (r Hv/T ..: repeat_interleave's groups of Hv/Hk consecutive value heads per key head), so the delta
# rule runs on each rank's heads alone. in_proj_qkv stacks q, k and v: the rank takes its heads' rows of each of the
# three (one TPSlice of three ranges), and the depthwise convolution's channels the same (each channel is one row of
# in_proj_qkv's output); in_proj_z, in_proj_a, in_proj_b, A_log and dt_bias by value heads; the gated norm's gain
# (one value head's width, shared by the heads) replicated; out_proj row-parallel over its input columns. An attention
# layer as Qwen3's: q_proj by heads (each head's query and gate are 2 D consecutive rows: a block of heads keeps them
# together), k_proj and v_proj by KV heads (replicated past them, as Llama's), o_proj row-parallel, the q/k norms'
# gains replicated. The MLP (mixture of experts: model/moe.py's), embedding and head as Llama's.


def linear_plan(cfg: ModelConfig, tp: int, prefix: str) -> dict[str, TPSlice]:
    """The TP slices of the linear-attention layer at `prefix` (model.layers.{i}.linear_attn.)."""
    C, Hv, K = cfg.n_embd, cfg.linear_value_heads, cfg.linear_conv_kernel
    key, value = cfg.linear_key_heads * cfg.linear_key_width, Hv * cfg.linear_value_width
    k, v = key // tp, value // tp  # a rank's rows of q (and of k), of v
    qkv = tuple(((r * k, (r + 1) * k), (key + r * k, key + (r + 1) * k), (2 * key + r * v, 2 * key + (r + 1) * v))
                for r in range(tp))
    width = 2 * key + value
    heads = blocks(Hv // tp, tp)
    return {prefix + "in_proj_qkv.weight": TPSlice(0, (width, C), qkv),
            prefix + "conv1d.weight": TPSlice(0, (width, 1, K), qkv),
            prefix + "in_proj_z.weight": TPSlice(0, (value, C), blocks(v, tp)),
            prefix + "in_proj_a.weight": TPSlice(0, (Hv, C), heads),
            prefix + "in_proj_b.weight": TPSlice(0, (Hv, C), heads),
            prefix + "A_log": TPSlice(0, (Hv,), heads),
            prefix + "dt_bias": TPSlice(0, (Hv,), heads),
            prefix + "out_proj.weight": TPSlice(1, (C, value), blocks(v, tp))}


def attention_plan(cfg: ModelConfig, tp: int, prefix: str) -> dict[str, TPSlice]:
    """The TP slices of the gated attention layer at `prefix` (model.layers.{i}.self_attn.)."""
    C, D = cfg.n_embd, cfg.head_dim
    q, kv = cfg.n_head * D, cfg.kv_heads * D
    kv_rows = kv_head_blocks(cfg.kv_heads, D, tp)
    return {prefix + "q_proj.weight": TPSlice(0, (2 * q, C), blocks(2 * q // tp, tp)),
            prefix + "k_proj.weight": TPSlice(0, (kv, C), kv_rows),
            prefix + "v_proj.weight": TPSlice(0, (kv, C), kv_rows),
            prefix + "o_proj.weight": TPSlice(1, (C, q), blocks(q // tp, tp))}


def plan(cfg: ModelConfig, tp: int) -> dict[str, TPSlice]:
    """The TP slice of every split parameter, by its name in the full model."""
    slices = {}
    for i in range(cfg.n_layer):
        h = f"model.layers.{i}."
        if cfg.linear_attention(i):
            slices.update(linear_plan(cfg, tp, h + "linear_attn."))
        else:
            slices.update(attention_plan(cfg, tp, h + "self_attn."))
        slices.update(moe.plan(cfg, tp, h + "mlp.") if cfg.has_experts(i) else mlp_plan(cfg, tp, h + "mlp."))
    if splits_vocab(cfg.vocab_size, tp):
        slices["model.embed_tokens.weight"] = vocab_slice(cfg.vocab_size, cfg.n_embd, tp)
        if not cfg.tie_embeddings:
            slices["lm_head.weight"] = vocab_slice(cfg.vocab_size, cfg.n_embd, tp)
    return slices


def parallelize(model: Qwen35, tp_size: int, tp_rank: int, comm, kv_comm=None) -> dict[str, TPSlice]:
    """Replace the full model's split layers by this rank's parallel ones, in place; return the plan. `kv_comm`: the
    TP ranks holding this rank's KV heads (more TP ranks than KV heads), as llama.parallelize's."""
    slices = plan(model.cfg, tp_size)
    for i, block in enumerate(model.model.layers):
        h = f"model.layers.{i}."
        if block.linear:
            parallelize_linear_attention(block.linear_attn, slices, h + "linear_attn.", tp_size, tp_rank, comm)
        else:
            attn, a = block.self_attn, h + "self_attn."
            for name in ("q_proj", "k_proj", "v_proj"):
                setattr(attn, name, ColumnParallelLinear(getattr(attn, name), slices[f"{a}{name}.weight"], None,
                                                         tp_rank, None, kv_comm if name != "q_proj" else None))
            attn.o_proj = RowParallelLinear(attn.o_proj, slices[a + "o_proj.weight"], tp_rank, comm)
            attn.tp_comm = comm
        if isinstance(block.mlp, MoE):
            moe.parallelize(block.mlp, slices, h + "mlp.", tp_rank, comm)
        else:
            parallelize_mlp(block.mlp, slices, h + "mlp.", tp_rank, comm)
    parallelize_vocab(model, slices, tp_rank, comm)
    model.tp_slices = slices
    return slices


def parallelize_linear_attention(layer: GatedDeltaNet, slices: dict[str, TPSlice], prefix: str, tp_size: int,
                                 rank: int, comm) -> None:
    """This rank's heads of the linear-attention layer at `prefix`, in place (linear_plan's slices)."""
    for name in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"):
        setattr(layer, name, ColumnParallelLinear(getattr(layer, name), slices[f"{prefix}{name}.weight"], None,
                                                  rank, None))
    layer.conv1d.weight = nn.Parameter(slices[prefix + "conv1d.weight"].take(layer.conv1d.weight.detach(), rank))
    for name in ("A_log", "dt_bias"):
        setattr(layer, name, nn.Parameter(slices[prefix + name].take(getattr(layer, name).detach(), rank)))
    layer.out_proj = RowParallelLinear(layer.out_proj, slices[prefix + "out_proj.weight"], rank, comm)
    layer.key_dim, layer.value_dim = layer.key_dim // tp_size, layer.value_dim // tp_size
    layer.tp_comm = comm
