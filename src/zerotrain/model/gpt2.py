"""The GPT: a GPT-2-architecture decoder whose parameter names map one-to-one onto Hugging Face's GPT-2.

Training calls `model(idx)`, or `model(idx, segments=segments)` for packed records, each attending only to
itself with its positions restarting at 0. Generation passes a `KVCache` as well: each attention layer then
stores the keys and values of the positions it has seen and computes only the new ones.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from zerotrain.config import ModelConfig

from .attention import attend, document_attention
from .kv_cache import KVCache
from .positions import new_positions
from .recompute import run_block
from .tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPSlice, blocks
from .vocab import LMHead, VocabParallelEmbedding, VocabParallelHead, splits_vocab, tied_head_hook, vocab_slice


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_head = cfg.n_head  # heads computed here: n_head / T under tensor parallelism (parallelize, below)
        self.head_dim = cfg.n_embd // cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0, documents=None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.c_attn(x).chunk(3, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))
        y = attend(q, k, v, cache, layer, documents)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, self.n_head * self.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.ffn_width)
        self.c_proj = nn.Linear(cfg.ffn_width, cfg.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # GPT-2 uses the tanh approximation of GELU ("gelu_new" in Hugging Face).
        return self.c_proj(F.gelu(self.c_fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cache: KVCache | None = None, layer: int = 0, documents=None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, documents)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + learned position embeddings, pre-LayerNorm blocks, final LayerNorm, tied LM head.

    Linear weights are stored (out, in) as in nn.Linear; exporting to Hugging Face's Conv1D layout
    is a rename plus a transpose of the four per-block matrices.
    """

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.recompute_blocks = False  # per block: True (--activation-checkpointing blocks) or "selective"
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(cfg.vocab_size, cfg.n_embd),
                wpe=nn.Embedding(cfg.positions, cfg.n_embd),  # rows past --seq-len: kept, not trained
                h=nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer)),
                ln_f=nn.LayerNorm(cfg.n_embd, eps=cfg.norm_eps),
            )
        )
        self.lm_head = LMHead(cfg.n_embd, cfg.vocab_size)
        self.tie_weights()  # initial values: init_rule, below (model/init.py draws them)
        self.register_load_state_dict_pre_hook(tied_head_hook("lm_head.weight", "transformer.wte.weight"))

    @property
    def embedding(self) -> nn.Embedding:
        return self.transformer.wte

    @property
    def final_norm(self) -> nn.Module:
        """The norm between the last block and the head."""
        return self.transformer.ln_f

    def tie_weights(self) -> None:
        """The head is the token embedding's tensor, as in GPT-2 (again after moving off the meta device)."""
        self.lm_head.weight = self.transformer.wte.weight

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None,
                segments: torch.Tensor | None = None, head=None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of shape (batch, time, vocab) for token ids of shape (batch, time).

        With a cache, `idx` continues the positions already in it, and the cache grows by time. With
        `segments` (batch, time; the record of each token, non-decreasing along time), a token attends only to
        the earlier tokens of its record, and its position is its place in the record. `head`: what takes the
        final norm's output in the LM head's place (head_loss's recomputed head and loss, inside the model's call).
        `targets` (batch, time): the summed token loss instead of the logits, computed by the head (vocab.LMHead:
        chunked over tokens, vocab-parallel under TP, never the full logits).
        """
        h = self.hidden(idx, cache, segments)
        return head(h) if head is not None else self.lm_head(h, targets=targets)

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None,
               segments: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output, the head's input: (batch, time, width)."""
        x = self.transformer.wte(idx) + self.transformer.wpe(new_positions(idx, cache, self.cfg.positions, segments))
        documents = None if segments is None else document_attention(segments, x.dtype, self.cfg.head_dim)
        for layer, block in enumerate(self.transformer.h):
            x = run_block(block, self.recompute_blocks if cache is None else False, x, cache, layer, documents)
        if cache is not None:
            cache.length += idx.shape[1]
        return self.transformer.ln_f(x)


def init_rule(cfg: ModelConfig, name: str):
    """How parameter `name` starts (model/init.py draws it): ("normal", std), "zeros" or "ones".

    GPT-2's: N(0, 0.02) matrices and embeddings, zero biases, LayerNorm gains 1. The projections that write into
    the residual stream (c_proj) start at 0.02 / sqrt(2 * n_layer), so the residual's variance does not grow with
    depth.
    """
    if ".ln_" in name:  # ln_1, ln_2, ln_f
        return "ones" if name.endswith(".weight") else "zeros"
    if name.endswith(".bias"):
        return "zeros"
    if name.endswith("c_proj.weight"):
        return ("normal", 0.02 / math.sqrt(2 * cfg.n_layer))
    return ("normal", 0.02)


# Tensor parallelism (Megatron-style), applied to the full model after it is built from the seed:
#     attention: c_attn column-parallel (rank r keeps heads r*H/T .. (r+1)*H/T of q, k and v),
#                attention over its own heads, c_proj row-parallel (the matching input columns)
#     MLP:       c_fc column-parallel (rows r*4C/T ..), GELU, c_proj row-parallel
#     vocabulary: the token embedding and the tied head split by rows (model/vocab.py), when T divides it
# Everything else (position embeddings, layer norms, the row-parallel biases, added once after the all-reduce; the
# embedding and head of a vocabulary T does not divide) is replicated: every TP rank computes it identically, so
# the activations, the loss and the replicated gradients are bitwise equal across the TP group.
# Each value is drawn from (seed, name, its position in the full tensor) (model/init.py), so TP = 1 and TP = T start
# from the same parameters; the model is built on the meta device and sliced there, before any value exists.


def plan(cfg: ModelConfig, tp: int) -> dict[str, TPSlice]:
    """The TP slice of every split parameter, by its name in the full model."""
    C, F_ = cfg.n_embd, cfg.ffn_width
    c, f = C // tp, F_ // tp

    def rows(width: int, copies: int = 1) -> tuple:
        return blocks(width, tp, copies)

    slices = {}
    for i in range(cfg.n_layer):
        h = f"transformer.h.{i}."
        slices[h + "attn.c_attn.weight"] = TPSlice(0, (3 * C, C), rows(c, 3))  # q, k and v of rank r's heads
        slices[h + "attn.c_attn.bias"] = TPSlice(0, (3 * C,), rows(c, 3))
        slices[h + "attn.c_proj.weight"] = TPSlice(1, (C, C), rows(c))  # the matching input columns
        slices[h + "mlp.c_fc.weight"] = TPSlice(0, (F_, C), rows(f))
        slices[h + "mlp.c_fc.bias"] = TPSlice(0, (F_,), rows(f))
        slices[h + "mlp.c_proj.weight"] = TPSlice(1, (C, F_), rows(f))
    if splits_vocab(cfg.vocab_size, tp):  # the head is this tensor too (tied)
        slices["transformer.wte.weight"] = vocab_slice(cfg.vocab_size, C, tp)
    return slices


def parallelize(model: nn.Module, tp_size: int, tp_rank: int, comm, kv_comm=None) -> dict[str, TPSlice]:
    """Replace the full model's split layers by this rank's parallel ones, in place; return the plan.

    `comm` is the TP group's communicator. The full weights are dropped as each layer is replaced. `kv_comm` is
    unused: GPT-2 has a KV head per head, which --tp always divides, so no head is replicated.
    """
    slices = plan(model.cfg, tp_size)
    for i, block in enumerate(model.transformer.h):
        h = f"transformer.h.{i}."
        attn, mlp = block.attn, block.mlp
        attn.c_attn = ColumnParallelLinear(attn.c_attn, slices[h + "attn.c_attn.weight"],
                                           slices[h + "attn.c_attn.bias"], tp_rank, comm)
        attn.c_proj = RowParallelLinear(attn.c_proj, slices[h + "attn.c_proj.weight"], tp_rank, comm)
        attn.n_head = model.cfg.n_head // tp_size
        mlp.c_fc = ColumnParallelLinear(mlp.c_fc, slices[h + "mlp.c_fc.weight"], slices[h + "mlp.c_fc.bias"],
                                        tp_rank, comm)
        mlp.c_proj = RowParallelLinear(mlp.c_proj, slices[h + "mlp.c_proj.weight"], tp_rank, comm)
    if "transformer.wte.weight" in slices:
        vocab = slices["transformer.wte.weight"]
        model.transformer.wte = VocabParallelEmbedding(model.transformer.wte, vocab, tp_rank, comm)
        model.lm_head = VocabParallelHead(model.lm_head, vocab, tp_rank, comm)
        model.tie_weights()
    model.tp_slices = slices
    return slices
