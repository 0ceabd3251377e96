"""The Llama-family decoder: rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention; Qwen2, Qwen3, Mistral,
Phi-3, Gemma 2 and Gemma 3.

Its members are options of this one decoder, as the config's `arch` implies them (config.LLAMA_FAMILY):

    llama    no biases; Llama 3.1's rope scaling (--rope-scaling llama3) rescales the rotary frequencies
    qwen2    biases on q, k and v (not on o_proj): Qwen2 and Qwen2.5
    qwen3    an RMSNorm of every q and k head (one gain of head_dim) before rotary; heads may be narrower or
             wider than n_embd / n_head (--head-width)
    mistral  each token attends to the last `sliding_window` tokens only (0: to all), in training and in the cache
    phi3     Mistral's window; its files stack q, k, v (and gate, up) in one matrix, which hub/mapping.py splits
    gemma2   Gemma's block (model/gemma.py): (1 + w) RMSNorms in fp32, before and after the attention and the MLP
             (input_layernorm, post_attention_layernorm, pre_feedforward_layernorm, post_feedforward_layernorm),
             GeGLU, the embedding scaled by sqrt(width); scores scaled by 1 / sqrt(query_pre_attn_scalar); sliding
             and global layers alternating (every sliding_window_pattern-th layer global); the attention scores
             and the final logits soft-capped (vocab.LMHead, inside the chunked loss too)
    gemma3   Gemma 2's block without the soft-caps, with (1 + w) q/k norms as Qwen3's, and its sliding layers'
             own rotary base (rope_local_theta, unscaled; the global layers take rope_theta and the rope scaling)
    qwen3_moe, qwen2_moe, mixtral, olmoe
             mixtures of experts (model/moe.py: a router and --n-experts experts in place of the MLP, on every
             --moe-every-th layer but --mlp-only-layers) with Qwen3's, Qwen2's, Mistral's attention; OLMoE's
             q/k norms normalise the whole q and k projections (a gain per unit, all heads at once)

Every member takes YaRN's rope scaling (--rope-scaling yarn: gpt-oss's, long-context Qwen's). gpt-oss's attention
has biases on q, k, v and o, and a learned sink logit per head in each softmax's denominator (attention.attend).

Parameter names are Hugging Face's `LlamaForCausalLM` / `Qwen2ForCausalLM` / `Qwen3ForCausalLM` /
`MistralForCausalLM` / `Gemma2ForCausalLM` / `Gemma3ForCausalLM` names (the same scheme) and every matrix is stored
as it is there (nn.Linear's (out, in)), so the mapping to and from Hugging Face (hub/mapping.py) is the identity.
Rotary embeddings follow Hugging Face's rotate-half convention: imported q and k weights need no permutation. The
head is tied to the token embedding unless `tie_embeddings` is off.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerotrain.config import ModelConfig

from . import attention, moe, mtp
from .attention import attend, document_attention, window_attention
from .decoder import Decoder
from .gemma import GemmaRMSNorm, embedding_scale, geglu
from .kv_cache import KVCache
from .moe import MoE
from .norms import RMSNorm
from .positions import new_positions
from .recompute import run_block
from .rotary import LinearScaling, Llama3Scaling, YarnScaling, apply_rotary, rotary_tables
from .tensor_parallel import (ColumnParallelLinear, ReduceFromTP, RowParallelLinear, TPSlice, blocks, copy_to_tp,
                              kv_head_blocks)
from .vocab import VocabParallelEmbedding, VocabParallelHead, splits_vocab, vocab_slice


def member_norm(cfg: ModelConfig, dim: int) -> nn.Module:
    """The member's RMSNorm: Gemma's (1 + w) or Llama's."""
    return GemmaRMSNorm(dim, cfg.norm_eps) if cfg.gemma else RMSNorm(dim, cfg.norm_eps)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int = 0):
        super().__init__()
        C, D = cfg.n_embd, cfg.head_dim
        self.head_dim, self.window = D, cfg.sliding_window if cfg.sliding(layer) else 0
        self.scale = cfg.attn_scale if cfg.query_pre_attn_scalar else None  # None: SDPA's 1 / sqrt(head_dim)
        self.softcap = cfg.attn_softcap
        self.tp_comm = None  # under TP: q, k and v share one all-reduce of their input's gradient (parallelize)
        self.q_proj = nn.Linear(C, cfg.n_head * D, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(C, cfg.kv_heads * D, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(C, cfg.kv_heads * D, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.n_head * D, C, bias=cfg.o_bias)
        if cfg.attn_sinks:  # one logit per query head (under TP: this rank's heads')
            self.sinks = nn.Parameter(torch.zeros(cfg.n_head))
        self.whole_qk_norm = cfg.qk_norm_whole
        if cfg.qk_norm:
            self.q_norm = member_norm(cfg, D)
            self.k_norm = member_norm(cfg, D)
        elif cfg.qk_norm_whole:  # OLMoE's: one gain per unit of the whole projection
            self.q_norm = member_norm(cfg, cfg.n_head * D)
            self.k_norm = member_norm(cfg, cfg.kv_heads * D)
        self.tp_rank, self.qk_rows = 0, None  # under TP, OLMoE's: this rank, its q_proj and k_proj slices (parallelize)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None,
                layer: int, documents=None) -> torch.Tensor:
        B, T, _ = x.shape
        x = copy_to_tp(x, self.tp_comm)
        q, k, v = (p(x) for p in (self.q_proj, self.k_proj, self.v_proj))
        if self.whole_qk_norm and self.qk_rows is None:
            q, k = self.q_norm(q), self.k_norm(k)
        elif self.whole_qk_norm:
            q_rows, k_rows = self.qk_rows
            q = normalize_whole(self.q_norm, q, self.tp_comm, q_rows, self.tp_rank)
            k = normalize_whole(self.k_norm, k, self.tp_comm, k_rows, self.tp_rank)
        # Heads from the projections' widths: under TP each rank holds its share of q heads and of KV heads.
        q, k, v = (t.view(B, T, -1, self.head_dim).transpose(1, 2) for t in (q, k, v))
        if hasattr(self, "q_norm") and not self.whole_qk_norm:
            q, k = normalize_heads(self.q_norm, q, self.tp_comm), normalize_heads(self.k_norm, k, self.tp_comm)
        q, k = apply_rotary(q, *rotary), apply_rotary(k, *rotary)
        sinks = getattr(self, "sinks", None)
        y = attend(q, k, v, cache, layer, documents, self.window, self.scale, self.softcap, sinks)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))


def normalize_heads(norm: nn.Module, x: torch.Tensor, comm) -> torch.Tensor:
    """Qwen3's (Gemma 3's) RMSNorm of each head of x (B, heads, T, D), one gain of D shared by the heads.

    Under TP a rank normalizes its own heads only, so the gain's gradient is a partial sum over the TP group
    (`comm`): copy_to_tp all-reduces it, and the replicated gain stays equal on every rank.
    """
    return norm(x, copy_to_tp(norm.weight, comm))


def normalize_whole(norm: RMSNorm, x: torch.Tensor, comm, rows: TPSlice, rank: int) -> torch.Tensor:
    """OLMoE's RMSNorm of a whole q or k projection (B, T, units) under TP, where this rank holds the projection's
    `rows` (its heads' units) of it: the mean of squares is over the full width, so each rank's sum of squares is
    all-reduced forward and its gradient backward (every rank's output depends on every rank's units), a KV head held
    by several ranks counted once. The gain stays replicated whole (checkpoints and exports keep it as it is): each
    rank takes its units' part, whose gradient copy_to_tp sums over the group as normalize_heads' is. Equal to
    norm(x) on the gathered projection within float noise (its mean is a sum over the ranks, divided once)."""
    xf = x.float()
    squares = ReduceFromTP.apply(xf.pow(2).sum(-1, keepdim=True), comm, "all_reduce_tp_norm_squares")
    squares = copy_to_tp(squares, comm, "all_reduce_tp_norm_grads")
    mean = squares / (rows.full_shape[0] * rows.holders(rank))
    (lo, hi), = rows.parts[rank]  # one block of units per rank: its q heads', or its KV heads'
    gain = copy_to_tp(norm.weight, comm).narrow(0, lo, hi - lo)  # a view: autograd keeps no copy of it
    return gain * (xf * torch.rsqrt(mean + norm.eps)).to(x.dtype)


class LlamaMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.tp_comm = None  # as LlamaAttention's: gate and up share one all-reduce
        self.gated = geglu if cfg.gemma else swiglu
        self.gate_proj = nn.Linear(cfg.n_embd, cfg.ffn_width, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, cfg.ffn_width, bias=False)
        self.down_proj = nn.Linear(cfg.ffn_width, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp_comm)
        return self.down_proj(self.gated(self.gate_proj(x), self.up_proj(x)))


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return F.silu(gate) * up


class LlamaBlock(nn.Module):
    """Pre-norm attention and MLP; Gemma's also normalizes each one's output before the residual adds it
    (its post_attention_layernorm is that, where Llama's is the MLP's input norm)."""

    def __init__(self, cfg: ModelConfig, layer: int = 0, experts: type[MoE] = MoE):
        super().__init__()
        self.input_layernorm = member_norm(cfg, cfg.n_embd)
        self.self_attn = LlamaAttention(cfg, layer)
        self.post_attention_layernorm = member_norm(cfg, cfg.n_embd)
        self.mlp = experts(cfg) if cfg.has_experts(layer) else LlamaMLP(cfg)
        if cfg.gemma:
            self.pre_feedforward_layernorm = member_norm(cfg, cfg.n_embd)
            self.post_feedforward_layernorm = member_norm(cfg, cfg.n_embd)

    def forward(self, x, rotary, cache: KVCache | None = None, layer: int = 0, documents=None) -> torch.Tensor:
        if hasattr(self, "pre_feedforward_layernorm"):  # Gemma
            x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rotary, cache, layer,
                                                                 documents))
            return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        x = x + self.self_attn(self.input_layernorm(x), rotary, cache, layer, documents)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(Decoder):
    """Token embedding, pre-RMSNorm blocks with rotary attention, final RMSNorm, LM head (tied or its own)."""

    block = LlamaBlock  # a member whose experts are another family's names its own block (glm.py)

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, self.block, member_norm(cfg, cfg.n_embd), softcap=cfg.final_softcap,
                         mtp_layers=mtp.build_layers(cfg, self.block))  # GLM-4.5's, with --mtp train

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None,
               segments: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output, the head's input: (batch, time, width)."""
        cfg = self.cfg
        x = self.model.embed_tokens(idx)
        if cfg.gemma:
            x = x * embedding_scale(cfg.n_embd, x.dtype)
        ring = None
        if self.context_parallel is not None and cache is None:  # this rank's part of each row
            positions, ring = self.context_parallel.prepare(idx, segments)
        else:
            positions = new_positions(idx, cache, cfg.positions, segments)
        rotary = rotary_tables(positions, cfg.rotary_dim, cfg.rope_theta, rope_scaling(cfg))
        local = rope_local(cfg)  # the sliding layers': their own tables only where they differ (Gemma 3's)
        sliding_rotary = rotary if local == (cfg.rope_theta, rope_scaling(cfg)) else \
            rotary_tables(positions, cfg.rotary_dim, *local)
        windows = [cfg.sliding_window if cfg.sliding(layer) else 0 for layer in range(cfg.n_layer)]
        masks = {window: layer_mask(cfg, idx, x.dtype, cache, segments, window) if ring is None else ring
                 for window in set(windows)}
        if self.trains_mtp and cache is None:  # GLM-4.5's MTP layers: the embeddings, a global layer's arguments
            self.mtp_inputs = (x, rotary, masks[0])
        for layer, block in enumerate(self.model.layers):
            x = run_block(block, self.recompute_blocks if cache is None else False, x,
                          sliding_rotary if windows[layer] else rotary, cache, layer, masks[windows[layer]])
        if cache is not None:
            cache.length += idx.shape[1]
        return self.model.norm(x)


def layer_mask(cfg: ModelConfig, idx: torch.Tensor, dtype: torch.dtype, cache: KVCache | None,
               segments: torch.Tensor | None, window: int):
    """What attend takes for the layers of `window` (0: global), built once per forward and shared by them: the
    records' mask (with the window), the window's, or None for SDPA's own causal mask. With a cache, None: attend
    applies the window to the cached positions itself. Soft-capped scores (Gemma 2) and attention sinks (gpt-oss) are
    computed explicitly or by FlexAttention, neither of which has a causal mask of its own: theirs is built here
    too."""
    if segments is not None:
        return document_attention(segments, dtype, cfg.head_dim, window)
    if cache is not None:
        return None
    T = idx.shape[1]
    mask = window_attention(T, window, dtype, idx.device, cfg.head_dim)
    if mask is None and (cfg.attn_softcap or cfg.attn_sinks):  # causal: a window of the whole row, or one record
        if attention.document_kernel(idx.device.type, cfg.head_dim) == "flex":
            return attention.window_block_mask(T, T, idx.device)
        return attention.document_mask(torch.zeros(1, T, dtype=torch.long, device=idx.device), dtype)
    return mask


def rope_scaling(cfg: ModelConfig) -> Llama3Scaling | LinearScaling | YarnScaling | None:
    """The rotary frequencies' scaling the config names (--rope-scaling), or None."""
    if cfg.rope_scaling == "none":
        return None
    if cfg.rope_scaling == "linear":
        return LinearScaling(cfg.rope_factor)
    if cfg.rope_scaling == "yarn":
        return YarnScaling(cfg.rope_factor, cfg.rope_original_context, cfg.rope_theta, cfg.rope_beta_fast,
                           cfg.rope_beta_slow, cfg.rope_truncate, cfg.rope_attention_factor)
    return Llama3Scaling(cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor,
                         cfg.rope_original_context)


def rope_local(cfg: ModelConfig) -> tuple[float, Llama3Scaling | LinearScaling | YarnScaling | None]:
    """The sliding layers' rotary base and scaling: Gemma 3's local base (--rope-theta without one), unscaled; every
    other member's sliding layers rotate as its global ones."""
    if cfg.arch == "gemma3":
        return cfg.rope_local_theta or cfg.rope_theta, None
    return cfg.rope_theta, rope_scaling(cfg)


def init_rule(cfg: ModelConfig, name: str):
    """How parameter `name` starts (model/init.py draws it): ("normal", std), ("uniform", bound) or "ones".

    Hugging Face's initialisation: N(0, 0.02) matrices and embeddings, unit norm gains (Gemma's: a zero weight, its
    gain is 1 + weight). Qwen2's q, k and v biases keep nn.Linear's own init, U(-1/sqrt(fan_in), 1/sqrt(fan_in)), as
    zerotrain's Llama always gave them.
    """
    if name.endswith("norm.weight"):  # input_layernorm, post_attention_layernorm, norm, q_norm, k_norm, Gemma's too
        return "zeros" if cfg.gemma else "ones"
    if name.endswith(".bias"):
        return ("uniform", 1 / math.sqrt(cfg.n_embd))
    return ("normal", 0.02)


# Tensor parallelism: q_proj column-parallel by q heads (rank r: heads r*H/T ..), k_proj and v_proj by KV heads
# (r*KV/T ..: the KV heads its q heads attend with; with T a multiple of KV, head r // (T/KV), replicated on T/KV
# ranks), o_proj row-parallel over the matching input columns; gate_proj and up_proj column-parallel, down_proj
# row-parallel. The token embedding and the head (tied or not) are split by vocabulary rows when T divides the
# vocabulary (model/vocab.py), else replicated; norms (Gemma's four per block and its q/k norms too) are replicated,
# OLMoE's q/k norms of the whole projections too, each rank normalising its slice (normalize_whole).


def plan(cfg: ModelConfig, tp: int) -> dict[str, TPSlice]:
    """The TP slice of every split parameter, by its name in the full model (a replicated KV head's slices are the
    same rows on each of its ranks)."""
    C, D = cfg.n_embd, cfg.head_dim
    q, kv = cfg.n_head * D, cfg.kv_heads * D
    kv_rows = kv_head_blocks(cfg.kv_heads, D, tp)
    slices = {}
    for i in range(cfg.n_layer):
        h = f"model.layers.{i}."
        slices[h + "self_attn.q_proj.weight"] = TPSlice(0, (q, C), blocks(q // tp, tp))
        slices[h + "self_attn.k_proj.weight"] = TPSlice(0, (kv, C), kv_rows)
        slices[h + "self_attn.v_proj.weight"] = TPSlice(0, (kv, C), kv_rows)
        slices[h + "self_attn.o_proj.weight"] = TPSlice(1, (C, q), blocks(q // tp, tp))
        if cfg.qkv_bias:  # Qwen2's (gpt-oss's) q, k and v biases: split as their weights' rows
            slices[h + "self_attn.q_proj.bias"] = TPSlice(0, (q,), blocks(q // tp, tp))
            for name in ("k_proj", "v_proj"):
                slices[f"{h}self_attn.{name}.bias"] = TPSlice(0, (kv,), kv_rows)
        if cfg.attn_sinks:  # gpt-oss's: one per q head, split as the heads (o_proj's bias is replicated)
            slices[h + "self_attn.sinks"] = TPSlice(0, (cfg.n_head,), blocks(cfg.n_head // tp, tp))
        # each expert split as the MLP is, the router replicated (model/moe.py)
        slices.update(moe.plan(cfg, tp, h + "mlp.") if cfg.has_experts(i) else mlp_plan(cfg, tp, h + "mlp."))
    if splits_vocab(cfg.vocab_size, tp):
        slices["model.embed_tokens.weight"] = vocab_slice(cfg.vocab_size, C, tp)
        if not cfg.tie_embeddings:
            slices["lm_head.weight"] = vocab_slice(cfg.vocab_size, C, tp)
    return slices


def mlp_plan(cfg: ModelConfig, tp: int, prefix: str) -> dict[str, TPSlice]:
    """The TP slices of the SwiGLU (GeGLU) MLP at `prefix` (model.layers.{i}.mlp.): gate_proj and up_proj by rows of
    the hidden width, down_proj by the matching input columns (Qwen3.5's MLP too)."""
    C, F_ = cfg.n_embd, cfg.ffn_width
    rows = blocks(F_ // tp, tp)
    return {prefix + "gate_proj.weight": TPSlice(0, (F_, C), rows),
            prefix + "up_proj.weight": TPSlice(0, (F_, C), rows),
            prefix + "down_proj.weight": TPSlice(1, (C, F_), rows)}


def parallelize_mlp(mlp: LlamaMLP, slices: dict[str, TPSlice], prefix: str, rank: int, comm) -> None:
    """This rank's slices of the MLP at `prefix`, in place (mlp_plan's)."""
    for name in ("gate_proj", "up_proj"):
        setattr(mlp, name, ColumnParallelLinear(getattr(mlp, name), slices[f"{prefix}{name}.weight"], None, rank,
                                                None))
    mlp.tp_comm = comm
    mlp.down_proj = RowParallelLinear(mlp.down_proj, slices[prefix + "down_proj.weight"], rank, comm)


def parallelize_vocab(model: nn.Module, slices: dict[str, TPSlice], rank: int, comm) -> None:
    """This rank's rows of the embedding and the head, where the plan splits the vocabulary (a tied head stays tied)."""
    if "model.embed_tokens.weight" in slices:
        vocab = slices["model.embed_tokens.weight"]
        model.model.embed_tokens = VocabParallelEmbedding(model.model.embed_tokens, vocab, rank, comm)
        model.lm_head = VocabParallelHead(model.lm_head, vocab, rank, comm)
        model.tie_weights()


def parallelize(model: Llama, tp_size: int, tp_rank: int, comm, kv_comm=None) -> dict[str, TPSlice]:
    """Replace the full model's split layers by this rank's parallel ones, in place; return the plan.

    `kv_comm`: the TP ranks holding this rank's KV heads, when there are more TP ranks than KV heads (the mesh's
    kv group); their k_proj and v_proj gradients are summed over it.
    """
    slices = plan(model.cfg, tp_size)
    for i, block in enumerate(model.model.layers):
        h = f"model.layers.{i}."
        attn, mlp = block.self_attn, block.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            replicas = kv_comm if name != "q_proj" else None
            setattr(attn, name, ColumnParallelLinear(getattr(attn, name), slices[f"{h}self_attn.{name}.weight"],
                                                     slices.get(f"{h}self_attn.{name}.bias"), tp_rank, None, replicas))
        attn.tp_comm = comm
        if attn.whole_qk_norm:
            attn.tp_rank = tp_rank
            attn.qk_rows = (slices[h + "self_attn.q_proj.weight"], slices[h + "self_attn.k_proj.weight"])
        attn.o_proj = RowParallelLinear(attn.o_proj, slices[h + "self_attn.o_proj.weight"], tp_rank, comm)
        if hasattr(attn, "sinks"):
            attn.sinks = nn.Parameter(slices[h + "self_attn.sinks"].take(attn.sinks.detach(), tp_rank))
        if isinstance(mlp, MoE):
            moe.parallelize(mlp, slices, h + "mlp.", tp_rank, comm)
        else:
            parallelize_mlp(mlp, slices, h + "mlp.", tp_rank, comm)
    parallelize_vocab(model, slices, tp_rank, comm)
    model.tp_slices = slices
    return slices
