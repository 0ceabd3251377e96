"""Gemma 4's text decoder (gemma4), as transformers' Gemma4ForCausalLM computes it (its eager attention).

    layers     sliding and global, alternating (every --sliding-window-pattern-th global, the last always); the two
               kinds differ in shape: the sliding layers' heads of --head-width and --n-kv-head KV heads, rotated
               by the local base (--rope-local-theta) over the whole head; the global layers' heads of
               --global-head-width, their KV heads (--global-kv-heads with --k-eq-v), rotated by --rope-theta's
               proportional rotary: the first --partial-rotary of the frequencies, as the whole head's, turn, the
               rest stand still (transformers' rope_type "proportional")
    attention  q, k (and v) normalised per head before rotary: q and k by RMSNorms with a gain, v by one without;
               scores unscaled (1, not 1 / sqrt(head width)), no soft-cap; with --k-eq-v the global layers have no
               v_proj and take their keys' projection (before its norm) as values
    shared KV  the last --kv-shared-layers layers have no k_proj, v_proj or their norms: each attends with the keys
               and values of the last earlier layer of its kind (ModelConfig.kv_source), through the cache too
    block      RMSNorms (a plain w gain, fp32) before and after the attention and the MLP (GeGLU; twice as wide on
               the shared-KV layers with --double-wide-mlp); with --n-experts (enable_moe_block) a mixture of
               experts beside the MLP on every layer: the router reads the block's residual x (normed without a
               gain, times its scale and 1 / sqrt(width); softmax, top-k renormalised, times per_expert_scale),
               the experts (GeGLU, --expert-width) read pre_feedforward_layernorm_2(x), and the MLP's and the
               experts' outputs, each normed (post_feedforward_layernorm_1, _2), are summed before
               post_feedforward_layernorm; then, with --per-layer-width P, the layer's input
               embedding: gelu(per_layer_input_gate(x)) times it, projected back to the width, normalised and added;
               the block's output multiplied by its layer_scalar
    per-layer  each token's row of embed_tokens_per_layer (n_layer x P, scaled by sqrt(P)) plus its scaled
    inputs     embedding projected (per_layer_model_projection, times 1 / sqrt(width)) and normalised per layer
               (per_layer_projection_norm), the sum times 1 / sqrt(2): layer i reads its P-wide slice
    embedding  scaled by sqrt(width) in the weights' dtype; the head tied to it, its logits soft-capped
               (--final-softcap)

layer_scalar is a buffer in transformers, which its optimizer never moves; here it is a parameter the forward reads
detached: its gradient is zero, AdamW (undecayed, as a vector) leaves it as it was, and the files' values (the
released checkpoints' are not 1) are read and exported. Packed records: positions restart at each record, and each
record's tokens see their own record only (the sliding window inside it), on both kinds and through the shared KV.
Context parallelism (--cp): each rank's part of the rows around the ring (parallel/ring_attention.py), both kinds'
rotary at the tokens' positions in the whole row (or record), the sliding layers' window in the ring; a shared-KV
layer's ring carries its source layer's keys and values of this rank's part (their gradients come home to that
layer); the per-layer inputs and the logits' soft-cap are each token's own.

Parameter names are transformers' (model.embed_tokens_per_layer, model.per_layer_model_projection,
model.layers.{i}.per_layer_input_gate, ...) but the MoE block's: its router and experts are model/moe.py's under
layers.{i}.moe (moe.gate.weight, moe.scale, moe.per_expert_scale, moe.experts.{e}.gate_proj.weight, ...), which
hub/mapping.py maps to transformers' router.proj, router.scale, router.per_expert_scale and the stacked
experts.gate_up_proj (E, 2F, C: gate rows, then up) and experts.down_proj (E, C, F), and back.
No balancing loss unless a run asks for one (--moe-aux-coef): transformers' Gemma4ForCausalLM adds none.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerotrain.config import ModelConfig

from .attention import RingAttention, attend
from . import moe
from .decoder import Decoder
from .gemma import embedding_scale, geglu
from .kv_cache import KVCache
from .llama import layer_mask, parallelize_mlp, parallelize_vocab
from .moe import MoE
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPSlice, blocks, copy_to_tp, kv_head_blocks
from .positions import new_positions
from .recompute import run_block
from .rotary import apply_rotary, rotary_tables
from .vocab import splits_vocab, token_embedding, vocab_slice


class Gemma4RMSNorm(nn.Module):
    """x * (mean(x^2) + eps)^-0.5 times a gain w (none for `scaled` False: the values' norm), in fp32, returned in
    x's dtype (transformers' Gemma4RMSNorm: w, not Gemma 2/3's 1 + w)."""

    def __init__(self, dim: int, eps: float, scaled: bool = True):
        super().__init__()
        self.eps = eps
        if scaled:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, weight: torch.Tensor | None = None) -> torch.Tensor:
        """`weight`: the gain as the caller passes it (under TP the per-head norms' gain, its gradient summed)."""
        xf = x.float()
        normed = xf * torch.pow(xf.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if hasattr(self, "weight"):
            normed = normed * (self.weight if weight is None else weight).float()
        return normed.to(x.dtype)


@dataclass(frozen=True)
class ProportionalRotary:
    """The global layers' rotary (transformers' rope_type "proportional"): the frequencies of the whole head's
    rotary, of which the first `turning` turn and the others are 0 (cos 1, sin 0: those units pass unrotated)."""

    turning: int

    def rescale(self, inv_freq: torch.Tensor) -> torch.Tensor:
        return torch.cat((inv_freq[: self.turning], torch.zeros_like(inv_freq[self.turning:])))


def global_rotary(cfg: ModelConfig) -> ProportionalRotary:
    return ProportionalRotary(int(cfg.partial_rotary * cfg.global_head_width // 2))


def cached_mask(past: int, T: int, window: int, device: torch.device) -> torch.Tensor:
    """Query past + i sees keys 0 .. past + i, within the last `window` of them (0: all): boolean (T, past + T), for
    a forward continuing a cache (the shared-KV layers attend with another layer's keys, so no layer lets attend
    append to the cache itself)."""
    query = torch.arange(past, past + T, device=device)[:, None]
    key = torch.arange(past + T, device=device)[None, :]
    allowed = key <= query
    return allowed & (key > query - window) if window else allowed


class Gemma4Attention(nn.Module):
    """The module docstring's attention, of the layer's kind; the shared-KV layers' without keys or values."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        C, eps = cfg.n_embd, cfg.norm_eps
        kv_heads, D = cfg.attention_shape(layer)
        self.head_dim, self.kind = D, cfg.global_layer(layer)
        self.window = 0 if self.kind else cfg.sliding_window
        self.source = cfg.kv_source(layer)  # the layer whose keys and values this one attends with
        self.q_proj = nn.Linear(C, cfg.n_head * D, bias=False)
        self.q_norm = Gemma4RMSNorm(D, eps)
        if self.source == layer:
            self.k_proj = nn.Linear(C, kv_heads * D, bias=False)
            if not (cfg.k_eq_v and self.kind):
                self.v_proj = nn.Linear(C, kv_heads * D, bias=False)
            self.k_norm = Gemma4RMSNorm(D, eps)
            self.v_norm = Gemma4RMSNorm(D, eps, scaled=False)
        self.o_proj = nn.Linear(cfg.n_head * D, C, bias=False)
        self.tp_comm = None  # under TP: q, k and v share one all-reduce of their input's gradient (parallelize)

    def forward(self, x: torch.Tensor, rotary: tuple[torch.Tensor, torch.Tensor], cache: KVCache | None, layer: int,
                mask, shared: dict) -> torch.Tensor:
        B, T, _ = x.shape
        x = copy_to_tp(x, self.tp_comm)
        q = self.head_norm(self.q_norm, self.q_proj(x).view(B, T, -1, self.head_dim)).transpose(1, 2)
        q = apply_rotary(q, *rotary)
        if self.source != layer:
            k, v = shared[self.source]
        else:
            k = self.k_proj(x).view(B, T, -1, self.head_dim)
            v = self.v_proj(x).view(B, T, -1, self.head_dim) if hasattr(self, "v_proj") else k
            k = apply_rotary(self.head_norm(self.k_norm, k).transpose(1, 2), *rotary)
            v = self.v_norm(v).transpose(1, 2)
            if cache is not None:  # the keys and values of every position so far
                k, v = cache.append(layer, k, v)
            if isinstance(mask, RingAttention):  # what travels, made contiguous once: a shared-KV layer's ring
                k, v = k.contiguous(), v.contiguous()  # reads these, not copies of its own
            shared[layer] = k, v
        # the window: a ring's (under --cp each hop masks its block by it); otherwise `mask` holds it already
        y = attend(q, k, v, None, layer, mask, window=self.window, scale=1.0)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))

    def head_norm(self, norm: Gemma4RMSNorm, x: torch.Tensor) -> torch.Tensor:
        """`norm` of each head of x; under TP this rank's heads only, so the replicated gain's gradient is summed over
        the group (llama.normalize_heads')."""
        return norm(x, copy_to_tp(norm.weight, self.tp_comm))


class Gemma4MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        width = cfg.ffn_width_of(layer)
        self.gate_proj = nn.Linear(cfg.n_embd, width, bias=False)
        self.up_proj = nn.Linear(cfg.n_embd, width, bias=False)
        self.down_proj = nn.Linear(width, cfg.n_embd, bias=False)
        self.tp_comm = None  # under TP: gate and up share one all-reduce of their input's gradient

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = copy_to_tp(x, self.tp_comm)
        return self.down_proj(geglu(self.gate_proj(x), self.up_proj(x)))


class Gemma4MoE(MoE):
    """The module docstring's mixture of experts: model/moe.py's experts (GeGLU), dispatch and expert parallelism (its
    `exchange`), with Gemma 4's router (transformers' Gemma4TextRouter): the residual normed without a gain, times
    `scale` and 1 / sqrt(width), projected (`gate`: router.proj), softmax in fp32, the top-k renormalised, each
    weight times its expert's `per_expert_scale`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        for expert in self.experts:
            expert.activation = geglu
        self.norm = Gemma4RMSNorm(cfg.n_embd, cfg.norm_eps, scaled=False)
        self.scale = nn.Parameter(torch.ones(cfg.n_embd))
        self.per_expert_scale = nn.Parameter(torch.ones(cfg.n_experts))
        self.root_width = cfg.n_embd ** -0.5

    def route(self, flat: torch.Tensor, B: int, T: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the top-k weights (N, k), fp32; the experts chosen (N, k)) from the residual `flat`; records the layer's
        Routing."""
        logits = self.gate(self.norm(flat) * self.scale * self.root_width)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True) * self.per_expert_scale[chosen]
        self.record_routing(probs, chosen, B, T)
        return weights, chosen


class Gemma4Block(nn.Module):
    """Normed attention and MLP, each output normed before its residual add (with the MoE block, the MLP's and the
    experts' outputs each normed, summed, then normed); the layer's input embedding's gated residual; the whole
    scaled by layer_scalar."""

    def __init__(self, cfg: ModelConfig, layer: int):
        super().__init__()
        C, eps = cfg.n_embd, cfg.norm_eps
        self.input_layernorm = Gemma4RMSNorm(C, eps)
        self.self_attn = Gemma4Attention(cfg, layer)
        self.post_attention_layernorm = Gemma4RMSNorm(C, eps)
        self.pre_feedforward_layernorm = Gemma4RMSNorm(C, eps)
        self.mlp = Gemma4MLP(cfg, layer)
        self.post_feedforward_layernorm = Gemma4RMSNorm(C, eps)
        if cfg.has_experts(layer):  # beside the MLP, each with its own norms (transformers' names)
            self.moe = Gemma4MoE(cfg)
            self.post_feedforward_layernorm_1 = Gemma4RMSNorm(C, eps)
            self.pre_feedforward_layernorm_2 = Gemma4RMSNorm(C, eps)
            self.post_feedforward_layernorm_2 = Gemma4RMSNorm(C, eps)
        if cfg.per_layer_width:
            self.per_layer_input_gate = nn.Linear(C, cfg.per_layer_width, bias=False)
            self.per_layer_projection = nn.Linear(cfg.per_layer_width, C, bias=False)
            self.post_per_layer_input_norm = Gemma4RMSNorm(C, eps)
        self.layer_scalar = nn.Parameter(torch.ones(1))

    def forward(self, x, per_layer_input, rotary, cache: KVCache | None, layer: int, mask, shared: dict):
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rotary, cache, layer, mask,
                                                             shared))
        ffn = self.mlp(self.pre_feedforward_layernorm(x))
        if hasattr(self, "moe"):  # the experts read their own norm of x, the router x itself
            routed = self.moe(self.pre_feedforward_layernorm_2(x), router_input=x)
            ffn = self.post_feedforward_layernorm_1(ffn) + self.post_feedforward_layernorm_2(routed)
        x = x + self.post_feedforward_layernorm(ffn)
        if per_layer_input is not None:
            gated = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * per_layer_input
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        return x * self.layer_scalar.detach()  # a buffer in transformers: never trained (module docstring)


def beside_the_embedding(model: nn.ModuleDict, modules: dict[str, nn.Module]) -> nn.ModuleDict:
    """`model`'s modules with `modules` registered right after the token embedding, before the blocks.

    Every block reads the per-layer inputs, computed once before the first block, so their parameters' gradients are
    complete only as the backward ends, with the embedding's. The flat layout fills its buckets in reverse
    registration order and ZeRO-3 reduces a root parameter registered after the blocks with the last block
    (parallel/units.bucket_units: the final norm's place); registered here, they lie in the embedding's buckets,
    reduced last. Registered after the blocks, buckets small enough to hold them alone were reduced before their
    gradients arrived (the run stopped)."""
    ordered = {"embed_tokens": model.embed_tokens, **modules}
    ordered.update((name, module) for name, module in model.items() if name != "embed_tokens")
    return nn.ModuleDict(ordered)


class Gemma4(Decoder):
    """Token embedding, the per-layer input embeddings, Gemma 4's blocks, final RMSNorm, tied (or own) head."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, Gemma4Block, Gemma4RMSNorm(cfg.n_embd, cfg.norm_eps), softcap=cfg.final_softcap)
        if cfg.per_layer_width:
            width = cfg.n_layer * cfg.per_layer_width
            self.model = beside_the_embedding(self.model, dict(
                embed_tokens_per_layer=token_embedding(cfg.vocab_size, width, cfg.padding_idx),
                per_layer_model_projection=nn.Linear(cfg.n_embd, width, bias=False),
                per_layer_projection_norm=Gemma4RMSNorm(cfg.per_layer_width, cfg.norm_eps)))

    def per_layer_inputs(self, idx: torch.Tensor, x: torch.Tensor) -> torch.Tensor | None:
        """Each layer's input embedding (B, T, n_layer, P) from the ids and their scaled embedding `x`; None without
        --per-layer-width."""
        cfg = self.cfg
        if not cfg.per_layer_width:
            return None
        shape = (*idx.shape, cfg.n_layer, cfg.per_layer_width)
        looked_up = self.model.embed_tokens_per_layer(idx) * embedding_scale(cfg.per_layer_width, x.dtype)
        projected = self.model.per_layer_model_projection(x) * cfg.n_embd ** -0.5
        projected = self.model.per_layer_projection_norm(projected.view(shape))
        return (projected + looked_up.view(shape)) * 2 ** -0.5

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None,
               segments: torch.Tensor | None = None) -> torch.Tensor:
        cfg = self.cfg
        x = self.model.embed_tokens(idx)
        x = x * embedding_scale(cfg.n_embd, x.dtype)
        per_layer = self.per_layer_inputs(idx, x)  # each token's own: this rank's tokens' under --cp
        ring = None
        if self.context_parallel is not None and cache is None:  # this rank's part of each row, around the ring
            positions, ring = self.context_parallel.prepare(idx, segments)
        else:
            positions = new_positions(idx, cache, cfg.positions, segments)
        tables = {False: rotary_tables(positions, cfg.head_dim, cfg.rope_local_theta or cfg.rope_theta),
                  True: rotary_tables(positions, cfg.global_head_width, cfg.rope_theta, global_rotary(cfg))}
        past = 0 if cache is None else cache.length
        masks = {kind: ring if ring is not None else layer_mask(cfg, idx, x.dtype, None, segments, window)
                 if past == 0 else cached_mask(past, idx.shape[1], window, idx.device)
                 for kind, window in ((False, cfg.sliding_window), (True, 0))}
        shared = {}  # layer -> its keys and values, for the shared-KV layers that read them
        for layer, block in enumerate(self.model.layers):
            kind = cfg.global_layer(layer)
            layer_input = None if per_layer is None else per_layer[:, :, layer]
            x = run_block(block, self.recompute_blocks and cache is None, x, layer_input, tables[kind], cache,
                          layer, masks[kind], shared)
        if cache is not None:
            cache.length += idx.shape[1]
        return self.model.norm(x)


def init_rule(cfg: ModelConfig, name: str):
    """How parameter `name` starts (model/init.py): transformers' Gemma 4 initialisation, N(0, 0.02) matrices,
    experts and embeddings, unit norm gains, layer scalars and router scales."""
    if name.endswith(("norm.weight", "layer_scalar", "moe.scale", "per_expert_scale")):
        return "ones"
    return ("normal", 0.02)


def plan(cfg: ModelConfig, tp: int) -> dict[str, TPSlice]:
    """The TP slice of every split parameter, by its name in the full model: each layer's attention by heads of its
    own kind's shape (q, k, v by rows, o_proj by the matching columns; tp divides both kinds' KV heads, config checks,
    so no KV head is replicated), its MLP by its own width (the shared-KV layers' doubled), the experts as
    model/moe.py splits them (the router replicated), the vocabulary as Llama's. The per-layer input table, its
    projection and norm and each block's per-layer gate and projection are replicated: each token's row of the table
    and the projection's are normed per layer's P-wide slice, and the gate's product is P wide (256 in the released
    models), where a split would add an all-gather per layer for little memory that ZeRO shards anyway."""
    C, slices = cfg.n_embd, {}
    for i in range(cfg.n_layer):
        h = f"model.layers.{i}."
        kv_heads, D = cfg.attention_shape(i)
        q, kv = cfg.n_head * D, kv_heads * D
        slices[h + "self_attn.q_proj.weight"] = TPSlice(0, (q, C), blocks(q // tp, tp))
        names = () if cfg.kv_source(i) != i else ("k_proj",) if cfg.k_eq_v and cfg.global_layer(i) else \
            ("k_proj", "v_proj")
        for name in names:
            slices[f"{h}self_attn.{name}.weight"] = TPSlice(0, (kv, C), kv_head_blocks(kv_heads, D, tp))
        slices[h + "self_attn.o_proj.weight"] = TPSlice(1, (C, q), blocks(q // tp, tp))
        W = cfg.ffn_width_of(i)
        rows = blocks(W // tp, tp)
        slices.update({h + "mlp.gate_proj.weight": TPSlice(0, (W, C), rows),
                       h + "mlp.up_proj.weight": TPSlice(0, (W, C), rows),
                       h + "mlp.down_proj.weight": TPSlice(1, (C, W), rows)})
        if cfg.has_experts(i):
            slices.update(moe.plan(cfg, tp, h + "moe."))
    if splits_vocab(cfg.vocab_size, tp):
        slices["model.embed_tokens.weight"] = vocab_slice(cfg.vocab_size, C, tp)
        if not cfg.tie_embeddings:
            slices["lm_head.weight"] = vocab_slice(cfg.vocab_size, C, tp)
    return slices


def parallelize(model: Gemma4, tp_size: int, tp_rank: int, comm, kv_comm=None) -> dict[str, TPSlice]:
    """Replace the full model's split layers by this rank's parallel ones, in place (`plan`'s slices); return the
    plan. No KV head is replicated (config), so `kv_comm` is None."""
    slices = plan(model.cfg, tp_size)
    for i, block in enumerate(model.model.layers):
        h = f"model.layers.{i}."
        attn, mlp = block.self_attn, block.mlp
        for name in ("q_proj", "k_proj", "v_proj"):
            if hasattr(attn, name):
                setattr(attn, name, ColumnParallelLinear(getattr(attn, name), slices[f"{h}self_attn.{name}.weight"],
                                                         None, tp_rank, None))
        attn.tp_comm = comm
        attn.o_proj = RowParallelLinear(attn.o_proj, slices[h + "self_attn.o_proj.weight"], tp_rank, comm)
        parallelize_mlp(mlp, slices, h + "mlp.", tp_rank, comm)
        if hasattr(block, "moe"):
            moe.parallelize(block.moe, slices, h + "moe.", tp_rank, comm)
    parallelize_vocab(model, slices, tp_rank, comm)
    model.tp_slices = slices
    return slices
