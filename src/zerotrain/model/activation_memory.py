"""Predicted activation memory: the bytes autograd saves for the backward of one micro-batch's forward and loss.

The prediction is what `training.activations.saved_for_backward` measures (each saved storage once, the
parameters left out) for `head_loss(model, x, y, summed_token_loss, ...)` on one rank, in eager mode. Per rank, with
B sequences of T tokens, width C, ffn width F, vocabulary V, head_dim D, H query and KV key/value heads
(H/tp, KV/tp and F/tp under tensor parallelism: column-parallel outputs are split, row-parallel outputs
and everything between the blocks are whole), `a` bytes per activation (4 fp32, 2 bf16):

    GPT-2 block  2 LayerNorms  2 x (2 BTC a + 2 BT a)               input, output (the next linear's), mean, rstd
                 attention     BT (H + 2 KV) D a + BTHD a + BHT 4   q k v, output, logsumexp
                 GELU MLP      2 BTF a                              c_fc's output (GELU's input), GELU's output
    Llama block  2 RMSNorms    2 x (BTC 4 + BT 4 + 2 BTC a)         fp32 input, rsqrt, normalized, output
                 attention     as GPT-2's (q and k rotated); in bf16 also the rotary tables cast per use, 4 TD a
                 SwiGLU MLP    4 BTF a                              gate, silu(gate), up, their product
                 q/k norms     (H + KV) x (BTD 4 + BT 4 + BTD a)    Qwen3: fp32 input, rsqrt, normalized, per head
                               (H + KV) BTD (4 + a) + 2 BT 4        OLMoE's, of the whole projections
                 experts       in place of the SwiGLU MLP on the    a mixture of experts (N = BT tokens, top-k,
                               MoE layers: N E 4 + N k (8 + a)      E experts of width W): the router's fp32
                               (+ N k 4 + N 4 renormalised)         probabilities, top-k indices and weights;
                               + 2 N k 8 + 2 N k C a + 4 N k W a    the dispatch's indices, rows in and out, the
                               (+ 4 N Ws a + N a + N C a shared)    experts' SwiGLUs; Qwen2-MoE's shared expert
                               gpt-oss: 7 N k W a for 4 N k W a     its clamped SwiGLU (its top-k softmax in the
                                                                    activations' dtype: the weights themselves)
                               (+ 2 N k 8 under --ep)               the exchange's two indices of the rows its
                                                                    experts receive, N k at the mean rank; every
                                                                    MoE family's, Gemma 4's too (expert_exchange)
                 (Qwen2's q/k/v biases save nothing: the linear's output is what it was)
    Gemma block  4 (1 + w)      4 x (2 BTC 4 + BT 4 + C 4)          fp32 input and normalized, rsqrt, gain 1 + w
                 RMSNorms       + 2 BTC a                           the two outputs a linear reads
                 attention      as Llama's with SDPA or FlexAttention; Gemma 2's soft-capped scores on the mask
                                path: 4 BTHD a + BHTT (a + 4)       q, k and v at H heads, output; capped scores,
                                (+ BHTT a in bf16)                  fp32 probabilities (and their bf16 copy)
                 GeGLU MLP      4 BTF a                             as SwiGLU's
    DeepSeek-V3  latent        the query and KV latents' RMSNorms, the core on CPU SDPA's math kernel (values narrower
    (Mistral 4)  attention     than q and k: fp32 q, k, v and probabilities, BHT (2 D + Dv) 4 + BHTT 4) and o_proj's
                               copied input (latent_attention); its router's scores, choice and sums
                               (group_limited_router), ungated shared experts 4 N Ws a; Mistral 4's query scale
                               (B or 1) T 4 in fp32, cast per block in bf16
    Llama 4      attention     rotary layers: the L2 norms' fp32 inputs and rsqrts (H + KV) BT (D + 1) 4, SDPA's
                               output copied for o_proj BTHD a, within chunks shorter than T SDPA's T T a copy of the
                               boolean chunk mask; the others: the temperature (B or 1) T 4 (llama4_attention); the
                               fp32 rotary tables in bf16 too; the chunked mask beside the records' (llama4_masks)
                 experts       the existing rows, with the sigmoid scores N k 4 and a third index N k 8, the shared
                               expert ungated 4 N Ws a
    Gemma 4      block         layer by layer (gemma4_block): five w RMSNorms in fp32 (gemma4_norm: fp32 input and
                               normalized, two per-token fp32 terms, in bf16 the gain's copy), q/k norms per head and
                               v's without a gain, the global layers' own head width and KV heads, the shared-KV
                               layers' q alone, GeGLU at the layer's width, the per-layer input's gate, GELU and
                               product; outside (gemma4_embedding) the per-layer inputs (B, T, L, P), their norm,
                               two rotary tables in fp32. Its decoders (and DeepSeek-V3's, Llama 4's) recompute
                               blocks whole under "selective"
                 MoE block     beside the MLP (gemma4_moe): the experts' rows, the router's norm without a gain, its
                               normed and scaled input, each chosen expert's scale and its product, three more w
                               RMSNorms (the experts' input, the MLP's and the experts' outputs)
    gpt-oss      attention     explicit scores with the sinks' column off FlexAttention: 4 BTHD a + BHTT 4 (+ BHTT a
                               in bf16) + BHT 4 (no cap, so no capped scores); on FlexAttention, SDPA's list and
                               the renormalization factor BHT 4 (+ BHT a in bf16) and its output BTHD a
                 q/k norms      (H + KV) x (2 BTD 4 + BT 4) + 2 D 4 Gemma 3's, (1 + w)
    outside      token ids BT 8 (GPT-2: positions T 8; Llama in fp32 without recompute: the fp32 rotary
                 tables 2 TD 4, twice for Gemma 3's two bases; with the vocabulary split across TP, the ids outside
                 the rank's rows, BT 1), the
                 final norm as a block's but for its output, which the head does not keep, and the head with the
                 loss (model/vocab.py): the gradients of the head's input, BTC a, and of its weight, V' C a (V' =
                 V/tp where TP splits the vocabulary, else V), computed with the loss; no logits, no targets.
    not kept     the loss's working set, one chunk of N tokens at a time (vocab.chunk_tokens: N V' times these bytes
                 a logit within vocab.LOSS_CHUNK_BYTES, at least 256 tokens): its fp32 logits
                 N V' 4 (+ N V' a for their copy in bf16, + N V' 4 with a soft-cap), and over several chunks in bf16
                 the fp32 sum of the weight's gradient, V' C 4: `working`, beside the total (Gemma 2's soft-capped
                 logits are capped in the working set too: nothing of the cap is kept).
    DPO          the head computes each token's log-prob of its target (vocab.token_logps) and keeps its input (the
                 final norm's output, BTC a), each token's log-sum-exp BT 4 and the targets BT 8, no gradient; its
                 working set is the backward's: one chunk's logits made again, and the gradients of the head's
                 input and weight, BTC a + V' C a.
    packed       records in a batch (segments): positions and rotary tables per row (B times the above:
                 GPT-2's positions BT 8, Llama's tables 2 BTD 4 and in bf16 its casts 4 BTD a per block) and
                 the document mask, built once per forward and saved by every layer's SDPA as one storage:
                 B T T a on the mask kernel (CPU; CUDA without FlexAttention); on CUDA FlexAttention's block
                 mask instead, 8 int32 tables of B x ceil(T/128) or its square (not measured here: FlexAttention
                 has no backward on CPU).
    window       Mistral's sliding window shorter than T, without records: the window's mask, one row shared by the
                 batch, as the records' (T T a, or FlexAttention's tables at B = 1); with records, the records'
                 mask holds the window too, at no extra bytes. Gemma's sliding and global layers each have their
                 own mask (two storages); soft-capped scores on the mask path only add theirs, which keeps nothing
                 (recomputed blocks' checkpoints keep it as an argument).
    GQA repeat   where attend copies the KV heads to the query heads (attention.repeats_kv_heads: CUDA fp32, or an
                 explicit mask on CUDA), SDPA saves k and v at H heads: 2 BT (H - KV) D a more per block.

That is 16 BTC a plus the small terms per GPT-2 block (F = 4C). With recompute "selective" each block keeps its
input and the outputs of its matmuls and attention kernel (selective_block: a Llama block's q, k, v, attention
output and logsumexp, output projection, gate, up and down, BT ((H + 2 KV) D + H D + 2 C + 2 F) a + BHT 4; GPT-2's
one MLP matmul fewer), the rest recomputed; what lies outside the blocks as with "blocks". With recompute "blocks" each block keeps
only its input, BTC a (torch.utils.checkpoint, non-reentrant, saves its tensor arguments; Llama's rotary
tables travel in a tuple, which it holds by reference: alive, 2 T D 4 bytes, but not a saved tensor, so
counted neither here nor by the measurement), and for a large vocabulary the loss's BTV 4 is then most of
what remains (GPT-2 124M, B 1, T 1024, fp32: the head's weight gradient, 154 MB). With recompute "full" the summed
token loss keeps the final norm's output and the targets (BT 8) and computes its gradients in the backward (its
matmuls: one in the forward, three in the backward); DPO's head and loss run under a checkpoint whose input is the
final norm's output: it keeps nothing more.

Attention is counted as SDPA's fused kernels save it: q, k, v, output and per-row logsumexp, never the
T x T matrix. That is measured on the CPU path (flash attention for CPU); CUDA's flash, memory-efficient
and cuDNN kernels save the same list (plus a few bytes of RNG state; memory-efficient pads the logsumexp
to a multiple of 32 rows), not measured here. The CPU flash kernel takes the document mask (it saves the mask,
counted above, and nothing T x T besides). SDPA's math fallback (a shape or dtype no fused kernel takes; on
CUDA, GQA that attend does not repeat) saves the T x T attention probabilities as well and is not what this
predicts.
--mtp train (model/mtp.py) adds per depth its two input norms (their outputs one 2C-wide concatenation, which the
projection saves), its block as the decoder's of its kind, counted whole (every TP rank runs it all), its output norm
(read by the head alone), and the head's loss over the depths' rows at once (D BTC a + V C a), as mtp_depths counts.
LayerNorm's mean and rstd are counted in the activation dtype, as on CPU; CUDA keeps them in fp32 (4 BT
bytes more per LayerNorm in bf16). A torch.compile'd forward saves what its fused kernels need instead.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from zerotrain.config import DEEPSEEK, GEMMA4, GROUP_ROUTED, LLAMA4, QWEN35, ModelConfig

from . import attention as kernels  # `attention` here is the attention's bytes
from . import moe, tensor_parallel
from .delta_rule import CHUNK
from .llama import rope_local, rope_scaling
from .vocab import chunk_tokens, logps_logit_bytes, loss_logit_bytes, splits_vocab, vocab_rows

FP32 = 4  # bytes: SDPA's logsumexp, RMSNorm's internals, the loss's log-probabilities
INDEX = 8  # bytes: int64 token ids, positions and targets
ACTIVATION_BYTES = {"fp32": 4, "bf16": 2}  # the parameters' dtype, which the activations take
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
INT32 = 4  # bytes: FlexAttention's block-mask tables
FLEX_BLOCK = 128  # FlexAttention's default block size, query and key


@dataclass(frozen=True)
class RankShape:
    """One rank's sizes for one micro-batch: heads, kv_heads and ffn are this rank's share under TP."""

    B: int
    T: int
    C: int
    heads: int
    kv_heads: int
    head_dim: int
    ffn: int
    vocab: int  # the rows of the head this rank holds: V, or V / tp where TP splits the vocabulary
    act: int  # bytes of an activation element
    position_rows: int = 1  # rows of positions and rotary tables: 1 shared by the batch, B for packed records
    kv_repeated: bool = False  # k and v copied to the query heads before SDPA (attention.repeats_kv_heads)
    documents: str = ""  # the kernel of the records' or the window's mask (attention.document_kernel), "" without one
    mask_rows: int = 0  # rows of the document or window mask: B for packed records, 1 for a window alone
    rotary_dim: int = 0  # the rotated share of head_dim (Qwen3.5's and GLM-4.5's partial rotary); 0: all of it

    @property
    def BT(self) -> int:
        return self.B * self.T


# Each term below names the tensors autograd saves and returns their bytes.

def layer_norm(s: RankShape) -> int:
    """LayerNorm: its input, mean and rstd per token (activation dtype on CPU), and its output (saved by the
    linear that reads it)."""
    return 2 * s.BT * s.C * s.act + 2 * s.BT * s.act


def rms_norm(s: RankShape) -> int:
    """RMSNorm (computed in fp32): the fp32 input (x itself in fp32, a copy in bf16), rsqrt per token, the
    normalized input cast back (saved for the gain's gradient) and the output (saved by the next linear)."""
    return s.BT * s.C * FP32 + s.BT * FP32 + 2 * s.BT * s.C * s.act


def attention_inputs(s: RankShape) -> int:
    """q, k and v as SDPA saves them: (B, heads or kv_heads, T, D); GPT-2's are views of c_attn's output. Copied
    to the query heads (kv_repeated), k and v are saved at heads; the copy itself saves nothing."""
    kv = s.heads if s.kv_repeated else s.kv_heads
    return s.BT * (s.heads + 2 * kv) * s.head_dim * s.act


def attention_output(s: RankShape) -> int:
    """SDPA's output, stored (B, T, heads, D): also the output projection's input, one storage."""
    return s.BT * s.heads * s.head_dim * s.act


def attention_logsumexp(s: RankShape) -> int:
    """SDPA's per-row logsumexp (B, heads, T), fp32 in every precision: all the backward needs of the softmax."""
    return s.B * s.heads * s.T * FP32


def attention(s: RankShape) -> int:
    return attention_inputs(s) + attention_output(s) + attention_logsumexp(s)


def gelu_mlp(s: RankShape) -> int:
    """c_fc's output (GELU's input) and GELU's output (c_proj's input); c_fc's input is the norm's output."""
    return 2 * s.BT * s.ffn * s.act


def swiglu_mlp(s: RankShape) -> int:
    """gate_proj's output (silu's input), silu's output and up_proj's output (the product's factors), and
    their product (down_proj's input)."""
    return 4 * s.BT * s.ffn * s.act


def rotary_casts(s: RankShape, width: int | None = None) -> int:
    """In bf16 apply_rotary casts cos and sin to bf16 for q and again for k: four (T, D) copies per block,
    saved by the multiplications (`width`: the rotated share of D, Qwen3.5's partial rotary). In fp32 the cast is a
    no-op: the shared fp32 tables are saved, once (rotary_tables)."""
    if s.act == FP32:
        return 0
    return 4 * s.position_rows * s.T * (width or s.head_dim) * s.act


def rotary_tables(s: RankShape, width: int | None = None) -> int:
    """cos and sin (T, D) in fp32, computed once per forward and shared by every block; for packed records one
    pair per row (B, 1, T, D); `width`: the rotated share of D, Qwen3.5's partial rotary."""
    return 2 * s.position_rows * s.T * (width or s.head_dim) * FP32


def positions(s: RankShape) -> int:
    """GPT-2's positions, saved by the position embedding: (T,), or (B, T) for packed records."""
    return s.position_rows * s.T * INDEX


def document_mask(s: RankShape) -> int:
    """What packed records attend through, built once per forward and saved as one storage by every layer:
    the additive (B, 1, T, T) mask in the activation dtype (the "mask" kernel), or FlexAttention's block mask
    ("flex"): kv and q block counts (B, 1, n) and indices (B, 1, n, n), each partial and full, n = ceil(T/128)."""
    if s.documents == "mask":
        return s.mask_rows * s.T * s.T * s.act
    if s.documents == "flex":
        n = -(-s.T // FLEX_BLOCK)
        return 4 * s.mask_rows * (n + n * n) * INT32
    return 0


def block_input(s: RankShape) -> int:
    """What a recomputed block keeps: its input x (B, T, C)."""
    return s.BT * s.C * s.act


def selective_block(s: RankShape, llama: bool) -> int:
    """What a selectively recomputed block keeps beside its input (model/recompute.py's policy): the outputs of its
    matmuls, q, k and v (GPT-2's c_attn, one), the output projection, the MLP's (Llama's gate, up and down; GPT-2's
    c_fc and c_proj), and of its attention kernel (output and logsumexp). The norms, rotary, the gated unit and the
    residual adds are recomputed from them."""
    qkv = s.BT * (s.heads + 2 * s.kv_heads) * s.head_dim * s.act
    mlp = (2 if llama else 1) * s.BT * s.ffn * s.act + s.BT * s.C * s.act
    return qkv + attention_output(s) + attention_logsumexp(s) + s.BT * s.C * s.act + mlp


def loss(s: RankShape) -> int:
    """The head and the loss (vocab.token_loss): the gradients of the head's input (B, T, C) and of its weight (its
    rows, C), computed with the loss and kept for the backward; neither the logits nor the targets are kept."""
    return s.BT * s.C * s.act + s.vocab * s.C * s.act


def loss_working_set(s: RankShape, softcap: bool = False) -> int:
    """What the loss holds while it runs and keeps nothing of: one chunk's fp32 logits (their bf16 product first, and
    the tanh beside them under a soft-cap), and over several chunks in bf16 the weight gradient's fp32 sum."""
    per_value = loss_logit_bytes(s.act, softcap)
    chunk = chunk_tokens(s.BT, s.vocab, per_value)
    summed = s.vocab * s.C * FP32 if chunk < s.BT and s.act != FP32 else 0
    return chunk * s.vocab * per_value + summed


def token_logps(s: RankShape) -> int:
    """DPO's per-token log-probs of the targets (vocab.token_logps), beyond the head's input (the final norm's output,
    kept and counted with the norm): each token's log-sum-exp (fp32) and the targets (int64); the logits and their
    gradients are computed again in the backward."""
    return s.BT * FP32 + s.BT * INDEX


def token_logps_working_set(s: RankShape, softcap: bool = False) -> int:
    """What DPO's per-token log-probs hold while they run and keep nothing of, at its largest in the backward: one
    chunk's fp32 logits made again (their bf16 product first and the gradient's bf16 copy after; under a soft-cap the
    tanh and its derivative beside them), the gradients of the head's input and of its weight (and over several chunks
    in bf16 the fp32 sum of the weight's); the forward holds one chunk's logits only, less."""
    per_value = logps_logit_bytes(s.act, softcap)
    chunk = chunk_tokens(s.BT, s.vocab, per_value)
    summed = s.vocab * s.C * FP32 if chunk < s.BT and s.act != FP32 else 0
    return chunk * s.vocab * per_value + s.BT * s.C * s.act + s.vocab * s.C * s.act + summed


def gpt2_block(s: RankShape) -> int:
    return 2 * layer_norm(s) + attention(s) + gelu_mlp(s)


def qk_norms(s: RankShape) -> int:
    """Qwen3's RMSNorm of each q and k head (computed in fp32): the fp32 input (the projection's output itself in
    fp32, a copy in bf16), rsqrt per head and token, and the normalized input cast back (saved for the gain's
    gradient); the output is rotated, which saves only the tables."""
    rows = s.BT * (s.heads + s.kv_heads)
    return rows * s.head_dim * FP32 + rows * FP32 + rows * s.head_dim * s.act


def whole_qk_norms(s: RankShape) -> int:
    """OLMoE's RMSNorm of the whole q and k projections (computed in fp32): as qk_norms, with one rsqrt per token
    for each of the two."""
    width = (s.heads + s.kv_heads) * s.head_dim
    return s.BT * width * FP32 + 2 * s.BT * FP32 + s.BT * width * s.act


def llama_block(s: RankShape, qk_norm: bool = False, whole_qk_norm: bool = False) -> int:
    return (2 * rms_norm(s) + attention(s) + rotary_casts(s, s.rotary_dim) + swiglu_mlp(s)
            + (qk_norms(s) if qk_norm else 0) + (whole_qk_norms(s) if whole_qk_norm else 0))


def glu_tensors(cfg: ModelConfig) -> int:
    """The (rows, W) tensors an expert's gated unit saves: SwiGLU's gate, silu(gate), up and their product (4);
    gpt-oss's clamped SwiGLU the gate and up before their clamps, the clamped gate, its sigmoid, up + 1, the gated
    gate and the product (7). Biases save nothing."""
    return 7 if cfg.gpt_oss_experts else 4


def experts(s: RankShape, cfg: ModelConfig, tp: int = 1) -> int:
    """A mixture of experts in place of the MLP (model/moe.py), dropless, so its bytes do not depend on the routing:
    over its N = BT tokens' N k (token, expert) pairs, the router's fp32 probabilities (N, E), the top-k's indices
    (int64) and, renormalised, its values and their sum (fp32), the weights the outputs are multiplied by (activation
    dtype); the gather of the tokens by expert (its int64 indices and the N k C gathered rows, the experts' input),
    each expert's SwiGLU on its rows (4 N k W in all), the gather back (indices, N k C outputs). A shared expert
    (Qwen2-MoE) adds a SwiGLU on every token, its sigmoid gate's output (N) and its output (N C). Under TP each rank
    holds 1/tp of every expert's (and the shared expert's) hidden width; the router is replicated; gpt-oss's down
    biases, added after the all-reduce, keep each token's weights over the E experts (N E) and the biases stacked
    (E C). DeepSeek-V3's router (GLM-4.5's; model/group_routing.py) keeps its sigmoid scores (N, E) as the
    probabilities, and the scores' sum per token (N, fp32) the balancing loss's probabilities divide by, and in bf16
    its fp32 copies of the tokens (N C) and of its weight (E C); its shared experts are a SwiGLU of n_shared_experts x
    W on every token, whose output is added (saved nothing more). On the grouped path, add grouped_offsets."""
    N, k, W = s.BT, cfg.experts_per_token, cfg.expert_ffn // tp
    router = N * cfg.n_experts * FP32 + N * k * INDEX + N * k * s.act
    if cfg.renormalizes:
        router += N * k * FP32 + N * FP32
    if cfg.arch in GROUP_ROUTED:  # DeepSeek-V3's group-limited router (GLM-4.5's too) and ungated shared experts
        router = group_limited_router(s, cfg) + N * k * s.act
    if cfg.arch in LLAMA4:  # the sigmoid of the top-k logits (fp32), the index its scores are gathered by
        router += N * k * FP32 + N * k * INDEX
    dispatch = 2 * N * k * INDEX + 2 * N * k * s.C * s.act + glu_tensors(cfg) * N * k * W * s.act
    shared = 0
    if cfg.arch in GROUP_ROUTED:
        shared = 4 * N * (cfg.expert_ffn * cfg.shared_experts // tp) * s.act
    elif cfg.arch in LLAMA4:  # ungated
        shared = 4 * N * (cfg.shared_expert_width // tp) * s.act
    elif cfg.shared_expert_width:
        shared = 4 * N * (cfg.shared_expert_width // tp) * s.act + N * s.act + N * s.C * s.act
    if tp > 1 and cfg.gpt_oss_experts:  # the weights over the E experts (N E) and the biases stacked (E C)
        dispatch += N * cfg.n_experts * s.act + cfg.n_experts * s.C * s.act
    return router + dispatch + shared


def group_limited_router(s: RankShape, cfg: ModelConfig) -> int:
    """DeepSeek-V3's router (group_routing.py) over N = BT tokens, before the weights the outputs are multiplied by:
    the scores (N, E) (sigmoid's in fp32, from fp32 copies of the tokens and, in bf16, of its weight; Mistral 4's
    softmax in the activations' dtype), the experts chosen (N, k int64), with norm_topk_prob the chosen scores and
    their sum (the scores' dtype), and the balancing loss's probabilities: the scores' sum per token (fp32; Mistral
    4's in bf16 from an fp32 copy of its scores)."""
    N, E, k = s.BT, cfg.n_experts, cfg.experts_per_token
    scores = s.act if cfg.softmax_router else FP32
    router = N * E * scores + N * k * INDEX + N * FP32
    if not cfg.softmax_router and s.act != FP32:
        router += N * s.C * FP32 + E * s.C * FP32
    if cfg.softmax_router and s.act != FP32:
        router += N * E * FP32
    if cfg.norm_topk_prob:
        router += N * k * scores + N * scores
    return router


def latent_attention(s: RankShape, cfg: ModelConfig, device: str, tp: int = 1) -> int:
    """DeepSeek-V3's multi-head latent attention (mla.py) after its input norm, whose output q_a_proj (or q_proj) and
    kv_a_proj_with_mqa read. With query rank r_q, KV latent r, rotary units R, q/k heads of D = nope + R units and
    values of Dv:

        query latent  RMSNorm over r_q units (rms_norm's four terms at that width), its output q_b_proj's input
        KV latent     RMSNorm over r units: its fp32 input (in fp32 a view of kv_a_proj_with_mqa's whole output, BT (r
                      + R) 4), rsqrt, the normalized latent cast back and the output kv_b_proj reads
        rotary        in bf16 cos and sin cast for q and again for the shared key: 4 T R a (the fp32 tables are the
                      embedding's); Mistral 4's query scale in bf16 cast per layer, T a
        core          values narrower than q and k: SDPA's math kernel on CPU, which computes in fp32 and keeps the
                      scaled q and k and v (2 BHTD + BHT Dv) and the probabilities (BHTT) in fp32, and whose output
                      o_proj reads as a copy (BT H Dv a); values as wide: the fused kernels' list (attention)
        TP            the replicated latents joined into one tensor for the heads (mla.to_heads): that storage, BT (r_q
                      or C, + r + R) a, in place of the two norms' outputs
    """
    BT, a, H, Dv, R, r = s.BT, s.act, s.heads, cfg.v_head_dim, cfg.qk_rope_dim, cfg.kv_lora_rank
    latents = 0
    if cfg.q_lora_rank:
        latents += rms_norm(dataclasses.replace(s, C=cfg.q_lora_rank))
    kv_input = BT * (r + R) * FP32 if a == FP32 else BT * r * FP32
    latents += kv_input + BT * FP32 + 2 * BT * r * a
    if tp > 1:
        latents += BT * ((cfg.q_lora_rank or s.C) + r + R) * a - BT * r * a - BT * cfg.q_lora_rank * a
    rotary = rotary_casts(s, R)
    if cfg.arch == "mistral4" and cfg.llama4_scaling_beta and a != FP32:
        rotary += s.position_rows * s.T * a
    if math_attention(cfg, device):
        core = s.B * H * s.T * (2 * s.head_dim + Dv) * FP32 + s.B * H * s.T * s.T * FP32 + BT * H * Dv * a
    else:
        core = BT * H * (2 * s.head_dim + Dv) * a + BT * H * Dv * a + attention_logsumexp(s)
    return latents + rotary + core


def math_attention(cfg: ModelConfig, device: str) -> bool:
    """Whether SDPA takes its math kernel: latent attention's values narrower than q and k, on CPU, whose fused
    kernel needs one width for all three (CUDA's memory-efficient kernel takes them)."""
    return cfg.arch in DEEPSEEK and cfg.v_head_dim != cfg.head_dim and device == "cpu"


def deepseek_blocks(s: RankShape, cfg: ModelConfig, device: str, tp: int = 1) -> list[int]:
    """Each DeepSeek-V3 (Mistral 4) block's bytes: its two RMSNorms, the latent attention and the SwiGLU MLP of the
    first dense layers (the others' experts are added by the caller in its place, as every MoE's)."""
    return [2 * rms_norm(s) + latent_attention(s, cfg, device, tp) + swiglu_mlp(s) for _ in range(cfg.n_layer)]


def llama4_attention(s: RankShape, cfg: ModelConfig, layer: int) -> int:
    """Llama 4's attention (llama4.Llama4Attention) after its input norm. A rotary layer rotates in fp32 (saving only
    the fp32 tables, the embedding's) and L2-normalises q and k in fp32: each one's fp32 input and rsqrt, (H + KV) BT
    (D + 1) 4; SDPA's output, laid out by heads, is copied for o_proj (BTHD a); within chunks shorter than T, one
    sequence per row, SDPA converts the boolean chunk mask to its own T T a copy. A layer without rotary keeps its
    temperature (rows, T) fp32; its scaled q is SDPA's and o_proj reads SDPA's output as it is."""
    if not cfg.rotary(layer):
        return attention(s) + (s.position_rows * s.T * FP32 if cfg.temperature_tuning else 0)
    norms = s.BT * (s.heads + s.kv_heads) * (s.head_dim + 1) * FP32 if cfg.qk_l2_norm else 0
    converted = s.T * s.T * s.act if not s.documents and 0 < cfg.attention_chunk < s.T else 0
    return norms + attention(s) + attention_output(s) + converted


def llama4_blocks(s: RankShape, cfg: ModelConfig) -> list[int]:
    """Each Llama 4 block's bytes: two RMSNorms, its attention (by the layer's kind), a SwiGLU MLP (on the MoE layers
    the experts, added by the caller in its place)."""
    return [2 * rms_norm(s) + llama4_attention(s, cfg, layer) + swiglu_mlp(s) for layer in range(cfg.n_layer)]


def llama4_masks(s: RankShape, cfg: ModelConfig, recompute: str) -> int:
    """The masks Llama 4's layers attend through, built once per forward: for packed records the rotary layers'
    chunked mask (B, 1, T, T) a and the other layers' records' mask (document_mask), one storage where there are no
    chunks; one sequence per row with chunks shorter than T, the rotary layers' boolean (T, T), which recomputed
    blocks keep as their argument (without recompute SDPA's converted copies are the layers')."""
    rotary = [cfg.rotary(layer) for layer in range(cfg.n_layer)]
    if not s.documents:
        return s.T * s.T if recompute != "none" and any(rotary) and 0 < cfg.attention_chunk < s.T else 0
    if not cfg.attention_chunk:
        return document_mask(s)
    return (s.mask_rows * s.T * s.T * s.act if any(rotary) else 0) + (document_mask(s) if not all(rotary) else 0)


def gemma4_norm(s: RankShape, rows: int, width: int, gain: bool = True) -> int:
    """Gemma 4's RMSNorm (gemma4.Gemma4RMSNorm: a plain w gain, all in fp32) over `rows` of `width`: its fp32 input
    (x itself in fp32, a copy in bf16), the mean square plus eps and its power (rows, fp32, both saved by pow), and
    with a gain the normalized input (fp32) and, in bf16, the gain's fp32 copy; its output is counted where it is
    read."""
    normed = rows * width * FP32 + (width * FP32 if s.act != FP32 else 0) if gain else 0
    return rows * width * FP32 + 2 * rows * FP32 + normed


def gemma4_block(s: RankShape, cfg: ModelConfig, layer: int) -> int:
    """One Gemma 4 block (gemma4.Gemma4Block), its attention of the layer's kind (the global layers' own head width
    and KV heads, cfg.attention_shape):

        norms         four of the width C around the attention and the MLP, and the per-layer input's, each with its
                      fp32 input (the block's input, a projection's output or a residual sum); the outputs of the two a
                      linear reads (2 BTC a)
        q, k, v       q's and k's norms per head (gemma4_norm) and v's without a gain (its input shared with k's in
                      fp32 where the keys are the values); in bf16 the rotary tables cast for q and k (2 T D a each);
                      SDPA's q, k and v, output and logsumexp (attention)
        shared KV     the last layers rotate and attend q alone: k and v are their source layer's storages
        MLP           GeGLU at the layer's width (doubled on the shared-KV layers with --double-wide-mlp)
        per-layer     the block's output the gate reads (BTC a), GELU's input and output and their product with the
      input           layer's input (3 BT P a); the input itself is the embedding's (B, T, L, P), one storage
    """
    kv, D = cfg.attention_shape(layer)
    own = cfg.kv_source(layer) == layer
    kv //= cfg.n_head // s.heads  # this rank's under TP, which divides both kinds' KV heads (config)
    s = dataclasses.replace(s, kv_heads=kv, head_dim=D)
    BT, a, C, P = s.BT, s.act, s.C, cfg.per_layer_width
    norms = (5 if P else 4) * gemma4_norm(s, BT, C) + 2 * BT * C * a
    q = gemma4_norm(s, BT * s.heads, D)
    casts = rotary_casts(s) // (1 if own else 2)  # q's and k's casts, or q's alone
    core = attention(s)
    if own:
        keys_as_values = cfg.k_eq_v and cfg.global_layer(layer) and a == FP32
        q += gemma4_norm(s, BT * kv, D) + gemma4_norm(s, BT * kv, D, gain=False) - (BT * kv * D * FP32
                                                                                   if keys_as_values else 0)
    elif not s.kv_repeated:  # the source layer's k and v
        core -= 2 * BT * kv * D * a
    per_layer = BT * C * a + 3 * BT * P * a if P else 0
    mlp = swiglu_mlp(dataclasses.replace(s, ffn=s.ffn * cfg.ffn_width_of(layer) // cfg.ffn_width))  # GeGLU's four
    return norms + q + casts + core + mlp + per_layer


def gemma4_moe(s: RankShape, cfg: ModelConfig, tp: int = 1) -> int:
    """Gemma 4's MoE block (gemma4.Gemma4MoE, and the block's three norms it brings), beside the MLP, over N = BT
    tokens:

        norms     the experts' input norm (pre_feedforward_layernorm_2) and the MLP's and the experts' output norms
                  (post_feedforward_layernorm_1, _2), gemma4_norm's each, but that in fp32 the first one's input is x
                  itself, the MLP norm's; the router's norm without a gain (its fp32 input: x in fp32, a copy in bf16)
        router    its normed x cast back (saved by the product with `scale`) and the gate's input (2 N C a); the
                  experts' list (experts: fp32 softmax, top-k indices, renormalised values and their sum, the weights
                  the outputs are multiplied by), with each chosen expert's per_expert_scale (N k a) and the
                  renormalised weights it multiplies (N k 4)
        experts   experts()'s dispatch, GeGLU at 4 tensors a row as SwiGLU, each expert 1/tp of its width under TP
    """
    N, k, a = s.BT, cfg.experts_per_token, s.act
    x = N * s.C * FP32 if a == FP32 else 0  # x itself: the MLP norm's input, saved there
    norms = 3 * gemma4_norm(s, N, s.C) - x + gemma4_norm(s, N, s.C, gain=False) - x
    router = 2 * N * s.C * a + N * k * a + N * k * FP32
    return norms + router + experts(s, cfg, tp)


def gemma4_embedding(s: RankShape, cfg: ModelConfig, recompute: str) -> int:
    """What Gemma 4's per-layer inputs keep (gemma4.Gemma4.per_layer_inputs), beyond the token ids: the scaled
    embedding per_layer_model_projection reads (BTC a; in fp32, or recomputed, the first block's input as it is,
    counted there), the per-layer norm over P of BT L rows, and the inputs themselves (B, T, L, P) a, one storage the
    blocks read; without recompute the fp32 rotary tables of both kinds of layer (2 T D 4 and 2 T Dg 4)."""
    P, L = cfg.per_layer_width, cfg.n_layer
    kept = 0
    if P:
        kept += gemma4_norm(s, s.BT * L, P) + s.BT * L * P * s.act
        if s.act != FP32 and recompute == "none":
            kept += s.BT * s.C * s.act
    if recompute == "none" and s.act == FP32:
        kinds = {cfg.global_layer(layer) for layer in range(L)}
        kept += sum(rotary_tables(s, cfg.global_head_width if kind else cfg.head_dim) for kind in kinds)
    return kept


def grouped_offsets(cfg: ModelConfig, device: str, precision: str, tp: int = 1, ep: int = 1) -> int:
    """What an MoE layer's grouped path (moe.GroupedLinear) keeps beyond the loop's `experts`: its local experts' row
    offsets (int32), one storage shared by the three projections; the experts' weights are parameters, no stacked
    copy. 0 where the layer takes the loop: MoE.expert_path's choice, CUDA where _grouped_mm runs (asked of the
    device where there is one, assumed where the plan is made without one) with rows of a whole multiple of 16 bytes
    (moe.aligned)."""
    if device != "cuda" or not cfg.moe:
        return 0
    per_row = 16 // ACTIVATION_BYTES[precision]
    if cfg.n_embd % per_row or (cfg.expert_ffn // tp) % per_row:
        return 0
    if torch.cuda.is_available() and not moe.grouped_mm_works("cuda", DTYPES[precision]):
        return 0
    return cfg.n_experts // ep * INT32


def expert_exchange(s: RankShape, cfg: ModelConfig) -> int:
    """What an MoE layer's exchange under --ep keeps beyond `experts` (parallel/experts.ExpertExchange): the rows its
    experts receive put in expert order (expert_major_order) and back (its inverse), two int64 indices of those rows,
    saved by the two gathers; N k rows at the mean rank (the rows a rank's experts get depend on the routing, their sum
    over the EP group does not), as `experts` counts the experts' rows. Its all-to-alls keep nothing (their backward
    needs the split sizes alone), and the rows in expert order are the experts' input `experts` counts."""
    return 2 * s.BT * cfg.experts_per_token * INDEX


def gemma_norm(s: RankShape) -> int:
    """Gemma's (1 + w) RMSNorm, all in fp32: the fp32 input (x itself in fp32, a copy in bf16), rsqrt per token, the
    normalized input in fp32 and the gain 1 + w (C, fp32), both saved by their product; its output is counted where
    it is read (by a linear: saved; by the residual add: not)."""
    return 2 * s.BT * s.C * FP32 + s.BT * FP32 + s.C * FP32


def gemma_qk_norms(s: RankShape) -> int:
    """Gemma 3's (1 + w) RMSNorm of each q and k head: as gemma_norm per head and token, with one gain of D each."""
    rows = s.BT * (s.heads + s.kv_heads)
    return 2 * rows * s.head_dim * FP32 + rows * FP32 + 2 * s.head_dim * FP32


def softcapped_attention(s: RankShape, capped: bool = True, sinks: bool = False) -> int:
    """Attention with explicit scores (attention.softcapped_attention): q, and k and v copied to the query heads
    (B, heads, T, D); Gemma 2's capped scores (tanh's output, where `capped`) and the fp32 probabilities (B, heads,
    T, T; gpt-oss's `sinks` add a column to them, which the value matmul's view of them leaves out), in bf16 also
    their bf16 copy (the value matmul's input); the output reshaped for the output projection."""
    squares = s.B * s.heads * s.T * s.T
    probabilities = squares * FP32 + (squares * s.act if s.act != FP32 else 0)
    if sinks:
        probabilities += s.B * s.heads * s.T * FP32
    return 4 * s.BT * s.heads * s.head_dim * s.act + (squares * s.act if capped else 0) + probabilities


def flex_sinks(s: RankShape) -> int:
    """gpt-oss's sinks on FlexAttention (attention.with_sinks): the renormalization factor per row (sigmoid's output,
    fp32; in bf16 also its cast) and the renormalized output, a second (B, T, heads, D) beside FlexAttention's (not
    measured here: FlexAttention has no backward on CPU)."""
    rows = s.B * s.heads * s.T
    return rows * FP32 + (rows * s.act if s.act != FP32 else 0) + attention_output(s)


def sink_attention(s: RankShape, eager: bool) -> int:
    """gpt-oss's attention: explicit scores with the sinks' column where FlexAttention does not run, else
    FlexAttention's (as SDPA's) and the renormalization."""
    return softcapped_attention(s, capped=False, sinks=True) if eager else attention(s) + flex_sinks(s)


def gemma_block(s: RankShape, qk_norm: bool, eager: bool) -> int:
    """Four norms, the outputs of the two that a linear reads (input and pre-feedforward), the attention (explicit
    soft-capped scores where `eager`), GeGLU (as SwiGLU: gate, gelu(gate), up, product)."""
    return (4 * gemma_norm(s) + 2 * s.BT * s.C * s.act + (softcapped_attention(s) if eager else attention(s))
            + rotary_casts(s) + swiglu_mlp(s) + (gemma_qk_norms(s) if qk_norm else 0))


def gated_delta_net(s: RankShape, cfg: ModelConfig, documents: bool = False, tp: int = 1, cp: int = 1) -> int:
    """Qwen3.5's linear-attention layer (qwen35.GatedDeltaNet, delta_rule.py), one rank, one micro-batch; its input
    (the norm's output, which its four projections read) is the block's. With Hk key and Hv value heads (this rank's:
    1/tp of them under TP) of widths
    dk and dv, the convolution's W = 2 Hk dk + Hv dv channels and K taps, n = ceil(T / c) chunks of c = 64 tokens
    (T' = n c, the sequence padded to them):

        convolution   its input (B, W, T) and SiLU's input, the convolution's output before its K - 1 extra
                      columns are cut: B T W a + B W (T + K - 1) a
        decay, beta   exp(A_log) and its negation (Hv, fp32), softplus's input and output (BT Hv, fp32), beta
                      (sigmoid's output, BT Hv a)
        delta rule    `delta_rule`
        gated norm    each value head's output RMS-normalised in fp32 (its fp32 input, BT Hv dv 4), rsqrt, the
                      normalised output cast
                      back and times the gain (2 BT Hv dv a); SiLU's fp32 input and output (the output gate z, 2 BT
                      Hv dv 4); the product cast back, out_proj's input (BT Hv dv a)

    At --cp `cp` > 1, the layer on this rank's T tokens, two chunks of T / 2 of a split row (delta_rule_cp.py), as the
    group's first rank keeps it (it composes the most states): the convolution's input each chunk's, the K - 1 inputs
    before it in front (2 B W (T / 2 + K - 1) a; packed, each tap's product and mask of those columns), SiLU's input
    the chunks' outputs put back in row order (B W T a); the delta rule on 2 B rows of T / 2 tokens with values dk
    wider, from the identity's columns, its last state with a graph (`delta_rule`'s split); every chunk's (M, B)
    gathered (2 cp B Hv dk (dk + dv) 4) and the states composed from them (2 cp - 3 of B Hv dk dv 4 past the
    gathered ones); the readout of the two states (their stack, 2 B Hv dk dv 4) by the identity's outputs (copied
    per head, 2 B Hv (T / 2) dk 4).
    """
    B, T, a = s.B, s.T, s.act
    Hk, Hv, dk, dv, K = (cfg.linear_key_heads // tp, cfg.linear_value_heads // tp, cfg.linear_key_width,
                         cfg.linear_value_width, cfg.linear_conv_kernel)
    W = 2 * Hk * dk + Hv * dv
    convolution = B * T * W * a + B * W * (T + K - 1) * a
    if documents:  # packed records: each tap of the convolution its own product, kept, beside its document mask
        # (B T a); no conv1d input; SiLU's input the taps' sum, T columns
        convolution = K * (B * W * T * a + B * T * a) + B * W * T * a
    decay = 2 * Hv * FP32 + 2 * B * T * Hv * FP32 + B * T * Hv * a
    normalised = 2 * (B * Hv * T * dk * FP32 + B * Hv * T * FP32)
    values = B * T * Hv * dv
    norm = values * FP32 + B * T * Hv * FP32 + 2 * values * a + 2 * values * FP32 + values * a
    if cp == 1:
        return convolution + decay + normalised + delta_rule(B, T, Hv, dk, dv, documents) + norm
    L = T // 2
    convolution = 2 * B * W * (L + K - 1) * a + B * W * T * a
    if documents:
        convolution = K * (2 * B * W * (L + K - 1) * a + 2 * B * (L + K - 1) * a) + B * W * T * a
    composed = 2 * cp * B * Hv * dk * (dk + dv) * FP32 + (2 * cp - 3) * B * Hv * dk * dv * FP32
    readout = 2 * B * Hv * dk * dv * FP32 + 2 * B * Hv * L * dk * FP32
    rule = delta_rule(2 * B, L, Hv, dk, dk + dv, documents, split=True)
    return convolution + decay + normalised + rule + composed + readout + norm


def delta_rule(B: int, T: int, Hv: int, dk: int, dv: int, documents: bool, split: bool = False) -> int:
    """delta_rule.chunk_gated_delta_rule's tensors for B rows of T tokens, Hv heads, key width dk, value width dv, all
    in fp32: q and k at Hv heads L2-normalised are gated_delta_net's; padded to T': beta, v, k, beta k and q (B Hv T'
    (1 + dv + 3 dk)); the decays' mask (c c bools), five (B, Hv, n, c, c) squares (the pair decays, k-beta k^T and it
    decayed, q k^T and it decayed), two exp's of the summed decays (B Hv T'), the two triangular solves' results (B Hv
    T' (dv + dk)); per chunk its state (B Hv dk dv) and corrected values (B Hv c dv); past the first chunk the decayed
    queries (B Hv T' dk), and for every chunk whose state update has a graph (all but the last, whose state is a
    cache's) its decay (B Hv), its keys' decays to its end (B Hv c) and its decayed keys (B Hv c dk). `split`: a chunk
    of a split row (delta_rule_cp.py): the first state the identity's columns (dk dv 4, expanded), every chunk's
    update with a graph.

    Packed records (`documents`): the decays summed per record (the matrix of same-record pairs, expanded to the
    heads, B Hv n c c 4), the pairs' mask per row (B n c c bools), the tokens whose chunk no record started in yet (B
    n c 4), the last record's tokens of every chunk with a graph (B c bools each), and the decays of those past the
    first zeroed where a record started (B Hv 4 each)."""
    c = CHUNK
    n = -(-T // c)
    padded = n * c
    graphs = n if split else n - 1
    first_state = dk * dv * FP32 if split else B * Hv * dk * dv * FP32
    rule = (B * Hv * padded * (1 + dv + 3 * dk) * FP32 + c * c + 5 * B * Hv * n * c * c * FP32
            + 2 * B * Hv * padded * FP32 + B * Hv * padded * (dv + dk) * FP32
            + first_state + (n - 1) * B * Hv * dk * dv * FP32 + B * Hv * padded * dv * FP32
            + graphs * B * Hv * (1 + c + c * dk) * FP32)
    if n > 1:
        rule += B * Hv * padded * dk * FP32
    if documents:
        rule += (B * Hv * n * c * c * FP32 + (B * n * c * c - c * c) + B * n * c * FP32 + graphs * B * c
                 + max(graphs - 1, 0) * B * Hv * FP32)
    return rule


def gated_attention(s: RankShape) -> int:
    """Qwen3.5's attention layer (qwen35.GatedAttention): its (1 + w) q/k norms (in fp32 the q norm's input is a view
    of q_proj's output, whose other half is the gate: BT H D 4 more), SDPA's tensors, the partial rotary's bf16 casts,
    and the output gate: the attention's output (B, T, H D) copied to rows, sigmoid's output and their product,
    o_proj's input (3 BT H D a)."""
    gate_half = s.BT * s.heads * s.head_dim * FP32 if s.act == FP32 else 0
    return (gemma_qk_norms(s) + gate_half + attention(s) + rotary_casts(s, s.rotary_dim)
            + 3 * s.BT * s.heads * s.head_dim * s.act)


def qwen35_blocks(s: RankShape, cfg: ModelConfig, documents: bool = False, tp: int = 1) -> list[int]:
    """Each Qwen3.5 block's bytes: two (1 + w) norms and the outputs the mixer's and the MLP's linears read, the mixer
    (linear attention or gated attention, by the layer), the SwiGLU MLP (a mixture of experts: `experts`, added by
    the caller)."""
    common = 2 * gemma_norm(s) + 2 * s.BT * s.C * s.act + swiglu_mlp(s)
    return [common + (gated_delta_net(s, cfg, documents, tp) if cfg.linear_attention(layer) else gated_attention(s))
            for layer in range(cfg.n_layer)]


def activation_bytes(cfg: ModelConfig, micro_batch: int, seq_len: int, *, tp: int = 1, precision: str = "fp32",
                     recompute: str = "none", device: str = "cpu", documents: bool = False,
                     objective: str = "sft", ep: int = 1) -> dict[str, int]:
    """Bytes autograd saves on one rank for the backward of one micro-batch's forward and summed token loss.

    Returns {"per_block", "blocks", "embedding", "head", "loss", "mtp", "total", "working"}, where total = blocks +
    embedding + head + loss + mtp: the blocks' (all n_layer of them), what the embedding saves (token ids; GPT-2's
    positions; Llama's fp32 rotary tables; the document mask of packed records), the final norm, and the head with
    the loss, and --mtp train's depths (mtp_depths; 0 without); `working` is the loss's working set beside them (one
    chunk's logits, soft-capped where the model caps them), not kept for the backward. The formula is in the module docstring; `precision` is the parameters' dtype (--precision),
    `recompute` --activation-checkpointing, `device` the device type the kernels are chosen for, `documents`
    whether the micro-batches carry segments (packed records), `objective` "sft" (the summed token loss) or "dpo"
    (each token's log-prob of its target, vocab.token_logps: the head keeps its input, the log-sum-exp and the targets,
    and its working set is the backward's), `ep` the expert-parallel degree (a rank's experts on the grouped path).
    """
    if objective not in ("sft", "dpo", "grpo"):
        raise ValueError(f"objective must be sft, dpo or grpo, got {objective!r}")
    if objective == "grpo":  # its loss takes the logits (tempered log-probs): counted as the token loss's head
        objective = "sft"
    if precision not in ACTIVATION_BYTES:
        raise ValueError(f"precision must be fp32 or bf16, got {precision!r}")
    if tp < 1:
        raise ValueError(f"tp must be at least 1, got {tp}")
    if recompute not in ("none", "selective", "blocks", "full"):
        raise ValueError(f"recompute must be none, selective, blocks or full, got {recompute!r}")
    if recompute == "selective" and cfg.arch in DEEPSEEK + LLAMA4 + GEMMA4:
        # their decoders hand run_block `recompute_blocks and cache is None`, which is True for "selective": each block
        # is recomputed whole, and keeps its input alone (measured: tests/test_activation_bytes.py)
        recompute = "blocks"
    for what, n in (("n_head", cfg.n_head), ("ffn width", cfg.ffn_width)):
        if n % tp:
            raise ValueError(f"tp {tp} does not divide the {what} ({n}); pick a tp that divides it")
    llama = cfg.llama_family
    # Each window the layers attend within (0: global; Gemma's alternate), with the mask it is given, built once per
    # forward and shared by its layers (llama.layer_mask): for packed records, a window shorter than T, or soft-capped
    # scores (which have no causal mask of their own).
    windows = [cfg.sliding_window if cfg.sliding(layer) else 0 for layer in range(cfg.n_layer)]
    shapes, masks = {}, 0
    for window in set(windows):
        explicit = bool(cfg.attn_softcap) or cfg.attn_sinks  # what SDPA cannot compute: no causal mask of its own
        masked = documents or 0 < window < seq_len or explicit
        kernel = kernels.document_kernel(device, cfg.head_dim) if masked else ""
        eager = explicit_scores(cfg, device)  # softcapped_attention: it copies the KV heads itself
        # FlexAttention takes GQA itself; in training SDPA gets a mask only for packed records or a window.
        repeated = (cfg.kv_heads != cfg.n_head and kernel != "flex" and not eager
                    and kernels.repeats_kv_heads(device, DTYPES[precision], masked=kernel == "mask"))
        s = RankShape(B=micro_batch, T=seq_len, C=cfg.n_embd, heads=cfg.n_head // tp,
                      # 1 KV head per rank where TP replicates each KV head
                      kv_heads=tensor_parallel.kv_heads_per_rank(cfg.kv_heads, tp),
                      head_dim=cfg.head_dim, ffn=cfg.ffn_width // tp, vocab=vocab_rows(cfg.vocab_size, tp),
                      act=ACTIVATION_BYTES[precision], position_rows=micro_batch if documents else 1,
                      kv_repeated=repeated, documents=kernel, mask_rows=micro_batch if documents else 1,
                      rotary_dim=cfg.rotary_dim)
        if recompute == "selective":
            shapes[window] = block_input(s) + selective_block(s, llama)
        elif recompute != "none":
            shapes[window] = block_input(s)
        elif cfg.arch in QWEN35:  # its layers differ: counted layer by layer below
            shapes[window] = max(qwen35_blocks(s, cfg, documents, tp))
        elif cfg.arch in DEEPSEEK:
            shapes[window] = max(deepseek_blocks(s, cfg, device, tp))
        elif cfg.arch in LLAMA4:
            shapes[window] = max(llama4_blocks(s, cfg))
        elif cfg.arch in GEMMA4:  # its two kinds of layer differ: counted layer by layer below
            shapes[window] = max(gemma4_block(s, cfg, layer) for layer in range(cfg.n_layer))
        elif cfg.gemma:
            shapes[window] = gemma_block(s, cfg.qk_norm, eager)
        elif cfg.attn_sinks:
            shapes[window] = llama_block(s, cfg.qk_norm) - attention(s) + sink_attention(s, eager)
        else:
            shapes[window] = llama_block(s, cfg.qk_norm, cfg.qk_norm_whole) if llama else gpt2_block(s)
        # The mask, saved by every SDPA or FlexAttention (and, recomputed, by every block's checkpoint, which saves
        # its tensor arguments), one storage; explicit scores only add it, which keeps nothing.
        attends = cfg.arch not in QWEN35 or not all(cfg.linear_attention(i) for i in range(cfg.n_layer))
        # (Qwen3.5's linear layers restart at records instead; SDPA's math kernel adds the mask, keeping nothing)
        if cfg.arch in LLAMA4:  # its chunked mask beside the records'
            masks += llama4_masks(s, cfg, recompute)
        elif recompute != "none" or not eager and attends and not math_attention(cfg, device):
            masks += document_mask(s)
        if recompute != "none" and documents and cfg.arch in QWEN35:  # each record's first token, an argument
            masks += s.BT
    per_block = max(shapes.values())
    # Token ids, saved by the embedding lookup (Gemma's scale is a number: its product keeps nothing); the masks.
    embedding = s.BT * INDEX + masks
    if splits_vocab(cfg.vocab_size, tp):  # the rank's ids, and which fall outside its rows (BT bools)
        embedding += s.BT
        if cfg.arch in GEMMA4 and cfg.per_layer_width:  # its replicated per-layer table reads the ids themselves
            embedding += s.BT * INDEX
    if cfg.arch in GEMMA4:  # its per-layer inputs; its rotary tables of two widths
        embedding += gemma4_embedding(s, cfg, recompute)
    elif llama and recompute == "none" and precision == "fp32":
        # Saved as they are by the rotations (in bf16 each block saves its own casts; recomputed blocks, none): one
        # pair per rotary base the layers use (Gemma 3's sliding layers have their own).
        # (Qwen3.5's of its rotated share of each head, where one of its layers attends)
        embedding += rotary_tables(s, cfg.rotary_dim) * rotary_bases(cfg, windows) * attends
    if cfg.arch in LLAMA4 and recompute == "none" and precision != "fp32" and any(map(cfg.rotary, range(cfg.n_layer))):
        embedding += rotary_tables(s)  # rotated in fp32 in every precision: its fp32 tables saved as they are
    if cfg.arch in LLAMA4 and recompute != "none":  # the positions, each recomputed block's argument
        embedding += positions(s)
    if not llama:
        embedding += positions(s)
    if cfg.arch == "mistral4" and cfg.llama4_scaling_beta and (recompute != "none" or precision == "fp32"):
        # its query scale (B or 1, T) in fp32: saved as it is (in bf16 each block saves its cast), or a recomputed
        # block's argument
        embedding += s.position_rows * s.T * FP32
    if cfg.gemma or cfg.arch in QWEN35:  # the final (1 + w) norm, and its output, which the head reads
        head = gemma_norm(s) + s.BT * s.C * s.act
    elif cfg.arch in GEMMA4:  # its final norm (w), and its output
        head = gemma4_norm(s, s.BT, s.C) + s.BT * s.C * s.act
    else:
        head = rms_norm(s) if llama else layer_norm(s)  # the final norm
    blocks = sum(shapes[window] for window in windows)
    if cfg.arch in QWEN35 and recompute == "none":
        blocks = sum(qwen35_blocks(s, cfg, documents, tp))
    if cfg.arch in DEEPSEEK and recompute == "none":
        blocks = sum(deepseek_blocks(s, cfg, device, tp))
    if cfg.arch in LLAMA4 and recompute == "none":
        blocks = sum(llama4_blocks(s, cfg))
    if cfg.arch in GEMMA4 and recompute == "none":
        blocks = sum(gemma4_block(s, cfg, layer) for layer in range(cfg.n_layer))
    if cfg.moe and recompute == "none":  # its layers' experts in place of their MLP (Gemma 4's beside it)
        # beyond the experts' rows: the grouped path's offsets, and under --ep the exchange's indices
        beside = grouped_offsets(cfg, device, precision, tp, ep) + (expert_exchange(s, cfg) if ep > 1 else 0)
        layer_moe = gemma4_moe(s, cfg, tp) if cfg.arch in GEMMA4 else experts(s, cfg, tp) - swiglu_mlp(s)
        blocks += sum(layer_moe + beside for layer in range(cfg.n_layer) if cfg.has_experts(layer))
    if recompute == "full" and objective == "dpo":
        # the head and the loss run under a checkpoint whose one input is the final norm's output (in `head`)
        total_loss = 0
    elif recompute == "full":
        # the loss keeps the final norm's output (in `head`) and the targets; its gradients are computed in the
        # backward (vocab.token_loss's recompute), not kept
        total_loss = s.BT * INDEX
    elif objective == "dpo":  # the head keeps its input (in `head`), each token's log-sum-exp and the targets
        total_loss = token_logps(s)
    else:  # the head keeps its input's gradient (in `loss`), not the input
        head -= s.BT * s.C * s.act
        total_loss = loss(s)
    working = (token_logps_working_set if objective == "dpo" else loss_working_set)(s, bool(cfg.final_softcap))
    depths = mtp_depths(s, cfg, device, precision, recompute, ep) if cfg.mtp == "train" and cfg.mtp_layers else 0
    if depths:  # the depths' loss runs before the main one, over their rows at once: its own chunks
        working = max(working, loss_working_set(dataclasses.replace(s, B=s.B * cfg.mtp_layers)))
    return {"per_block": per_block, "blocks": blocks, "embedding": embedding, "head": head, "loss": total_loss,
            "mtp": depths, "total": blocks + embedding + head + total_loss + depths, "working": working}


def mtp_block_shape(s: RankShape, cfg: ModelConfig) -> RankShape:
    """An MTP block's shape on a TP rank: the full model's heads and widths (the block is whole on every rank)."""
    return dataclasses.replace(s, heads=cfg.n_head, kv_heads=cfg.kv_heads, ffn=cfg.ffn_width)


def mtp_depths(s: RankShape, cfg: ModelConfig, device: str, precision: str, recompute: str, ep: int) -> int:
    """--mtp train's D depths (model/mtp.py), each: its two input norms (their outputs one concatenation, which the
    projection saves: 2C wide), its block (whole on every TP rank: the full model's heads and widths; its experts
    split over --ep as the decoder's), its output norm, whose output only the head reads; and the head's loss over
    the D depths' rows at once (the gradients of its input, D BTC, and of its weight, kept as the main loss's). A
    block's mask and rotary tables are the decoder's storages: nothing more."""
    whole = mtp_block_shape(s, cfg)
    layer = cfg.n_layer  # the first MTP layer's index: its kind (experts or not) the depths'
    if cfg.arch in QWEN35:  # (1 + w) norms; a gated-attention block
        norms = 3 * gemma_norm(s) + 2 * s.BT * s.C * s.act
        block = 2 * gemma_norm(whole) + 2 * s.BT * s.C * s.act + swiglu_mlp(whole) + gated_attention(whole)
    else:  # DeepSeek-V3's latent attention, or GLM-4.5's Llama attention
        norms = 3 * rms_norm(s) - s.BT * s.C * s.act
        attention_part = latent_attention(whole, cfg, device) if cfg.arch in DEEPSEEK else \
            llama_block(whole, cfg.qk_norm, cfg.qk_norm_whole) - 2 * rms_norm(whole) - swiglu_mlp(whole)
        block = 2 * rms_norm(whole) + attention_part + swiglu_mlp(whole)
    if cfg.has_experts(layer):
        block += experts(whole, cfg) - swiglu_mlp(whole) + grouped_offsets(cfg, device, precision, 1, ep) + \
            (expert_exchange(s, cfg) if ep > 1 else 0)
    rows = dataclasses.replace(s, B=s.B * cfg.mtp_layers)
    # fp32 rotary tables are saved as they are by the rotations: the embedding counts them unless every decoder block
    # is recomputed, which the MTP blocks are not
    tables = rotary_tables(s, cfg.rotary_dim) if precision == "fp32" and recompute != "none" else 0
    return cfg.mtp_layers * (norms + block) + loss(rows) + tables


def explicit_scores(cfg: ModelConfig, device: str) -> bool:
    """Whether the attention computes its scores itself (attention.softcapped_attention: Gemma 2's soft-cap, gpt-oss's
    sinks, where FlexAttention does not run), whose backward keeps the probabilities and not its output as SDPA's
    does."""
    return (bool(cfg.attn_softcap) or cfg.attn_sinks) and kernels.document_kernel(device, cfg.head_dim) != "flex"


def rotary_bases(cfg: ModelConfig, windows: list[int]) -> int:
    """The rotary tables the layers rotate with: one pair, or two where the sliding layers have their own base
    (llama.rope_local) and both kinds of layer are there."""
    own = rope_local(cfg) != (cfg.rope_theta, rope_scaling(cfg))
    return 2 if own and any(windows) and not all(windows) else 1
