"""Multi-token prediction (--mtp train): the D modules after a DeepSeek-V3, GLM-4.5 or Qwen3.5 decoder that predict, at
each position, the token k + 1 places past the next one (depth k = 1 .. D), and the loss they add to the main one.

Depth k at position i (DeepSeek-V3's technical report, section 2.2, eqs. 21-25):

    h'_i^k  = eh_proj([enorm(Emb(t_{i+k})) ; hnorm(h_i^{k-1})])     the embedding first, then the hidden state
    h_i^k   = Block_k(h'_i^k)                                        a decoder block of the family's, causal
    p_i^k   = softmax(LMHead(shared_head.norm(h_i^k)))               predicting t_{i+k+1}
    loss    = main + lambda / D * sum_k (sum over depth k's targets of -log p(t_{i+k+1})) / the main loss's tokens

What was chosen where the paper is silent, from the implementations that train or serve these layers:
  - the concatenation's order, embedding then hidden state: vLLM's deepseek_mtp.py (torch.cat([inputs_embeds,
    previous_hidden_states])) and Megatron-LM's multi_token_prediction.py (torch.cat((decoder_input, hidden_states)))
  - h^0 is the main model's final-norm output, the head's input (Megatron-LM's decoder output, its final layernorm
    applied, and vLLM's target hidden states); h^k for k >= 1 is depth k's block output before shared_head.norm (the
    paper's h_i^k; vLLM's DeepSeekMultiTokenPredictorLayer returns it so and normalises it for the logits only)
  - the embedding and the LM head are the main model's (the paper's shared embedding and output head): the folder's
    per-layer copies (model.layers.{n+k}.embed_tokens, .shared_head.head) are read as them, and an hf export writes the
    trained ones back under those names (vLLM loads one copy for every depth)
  - each depth's summed loss over the main loss's global token count (the paper's 1/T), not its own smaller count
    (Megatron-LM's default): one normaliser for the whole step, known before it, so the split does not change the math
  - the block sees the main model's positions (rotary is relative: Megatron-LM's rolled positions give the same
    scores) and its records' mask; a target in another record than its position's is masked (packed records train
    as each record alone), as is every target past the row (`depth_targets`)
  - the block's experts do not count in the balancing figures or the routing bias's loads (its router's
    e_score_correction_bias stays as the folder has it)

Qwen3.5's head (QwenMTP, as vLLM's qwen3_next_mtp.py runs it) is the same computation with its own names: mtp.fc for
eh_proj, mtp.pre_fc_norm_embedding and mtp.pre_fc_norm_hidden for enorm and hnorm, mtp.norm for shared_head.norm,
all four shared by the depths and (1 + w) norms, and a full-attention block per depth (mtp.layers.{k-1}); each depth
passes on its normalised output (vLLM's step returns it so). With one depth, as every release has, both read alike.

Parameter names: DeepSeek-V3's and GLM-4.5's model.mtp_layers.{n+k}.* (n = num_hidden_layers), each layer's enorm,
hnorm, eh_proj, shared_head.norm and the block's own names (self_attn, mlp, input_layernorm, post_attention_layernorm)
beside them: the folder's model.layers.{n+k}.* with mtp_ in the prefix (hub/mtp_layers.py renames them both ways);
Qwen3.5's mtp.*, the folder's. In ZeRO-3 each depth is a unit of its own (`depth_units`: parallel/units.py),
gathered for its forward and again for its backward as a block is, so that no rank holds an MTP layer whole outside
them (DeepSeek-V3's is a whole MoE block, 11.5B parameters); Qwen3.5's depths share fc and the norms, so its mtp.* is
one unit, gathered for each depth (every release has one); under TP
the block stays whole on every rank (its input, the embedding's output and the final norm's, is), its experts split
over --ep as the decoder's are.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from zerotrain.config import ModelConfig

from .norms import RMSNorm
from .vocab import IGNORE


def joined(embedded: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """eh_proj's input: the normalised embedding of t_{i+k}, then the normalised h_i^{k-1} (vLLM's and Megatron-LM's
    order)."""
    return torch.cat([embedded, hidden], dim=-1)


def shifted(x: torch.Tensor, k: int, fill) -> torch.Tensor:
    """x moved k places to the left along time (dim 1): position i holds x's i + k; the last k positions `fill`."""
    if k == 0:
        return x
    tail = torch.full_like(x[:, :k], fill)
    return torch.cat([x[:, k:], tail], dim=1)


def depth_targets(targets: torch.Tensor, segments: torch.Tensor | None, k: int) -> torch.Tensor:
    """Depth k's target at position i: the main target at i + k (t_{i+k+1}, its loss mask with it), IGNORE past the
    row's end and, with packed records (`segments`), where position i + k is another record's."""
    out = shifted(targets, k, IGNORE)
    if segments is not None:
        out = torch.where(shifted(segments, k, -1) == segments, out, IGNORE)
    return out


class MTPLayer(nn.Module):
    """One depth of DeepSeek-V3's (GLM-4.5's): enorm, hnorm, eh_proj, the family's decoder block (its modules under
    its own names) and shared_head.norm."""

    def __init__(self, cfg: ModelConfig, block: nn.Module):
        super().__init__()
        C = cfg.n_embd
        self.enorm = RMSNorm(C, cfg.norm_eps)
        self.hnorm = RMSNorm(C, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * C, C, bias=False)
        # the block's modules are this layer's own, named as the folder names them, and its forward runs on them
        self.block_forward = type(block).forward
        for name, module in block.named_children():
            self.add_module(name, module)
        self.shared_head = nn.ModuleDict(dict(norm=RMSNorm(C, cfg.norm_eps)))
        unbalanced(self)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, *block_args) -> tuple[torch.Tensor, torch.Tensor]:
        """(h^k, shared_head.norm(h^k)) from the embeddings of t_{i+k} and h^{k-1}; `block_args` as the block's. The
        norm runs inside the layer's call: at ZeRO-3 the layer is a unit, whole from its call to its return."""
        x = self.eh_proj(joined(self.enorm(embedded), self.hnorm(hidden)))
        h = self.block_forward(self, x, *block_args)
        return h, self.shared_head.norm(h)


class MTPLayers(nn.ModuleDict):
    """DeepSeek-V3's (GLM-4.5's) layers, keyed by their index in the folder (n + k), each a whole depth."""

    def depth(self, k: int, embedded: torch.Tensor, hidden: torch.Tensor, block_args) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
        """(h^k, passed to depth k + 1; the head's input, shared_head.norm(h^k))."""
        index = list(self)[k - 1]
        layer = self[index]
        rotary, cache, *rest = block_args
        return layer(embedded, hidden, rotary, cache, int(index), *rest)

    def depth_units(self) -> list[nn.Module]:
        """The modules ZeRO-3 gathers as units, in forward order: each depth's layer."""
        return list(self.values())


class QwenMTP(nn.Module):
    """Qwen3.5's mtp.*: fc, pre_fc_norm_embedding and pre_fc_norm_hidden shared by the depths, a full-attention block
    per depth (layers.{k - 1}) and the final norm, shared too, as vLLM's qwen3_next_mtp.py runs them (one block per
    step); its norms the family's (1 + w) RMSNorms. Each depth passes on its normalised output, as vLLM's step does."""

    def __init__(self, cfg: ModelConfig, block_class, norm_class):
        super().__init__()
        C = cfg.n_embd
        self.fc = nn.Linear(2 * C, C, bias=False)
        self.pre_fc_norm_embedding = norm_class(C, cfg.norm_eps)
        self.pre_fc_norm_hidden = norm_class(C, cfg.norm_eps)
        self.first_layer = cfg.n_layer  # the blocks' indices after the decoder's
        self.layers = nn.ModuleList(block_class(cfg, cfg.n_layer + k, attention=True) for k in range(cfg.mtp_layers))
        self.norm = norm_class(C, cfg.norm_eps)
        unbalanced(self)

    def depth(self, k: int, embedded: torch.Tensor, hidden: torch.Tensor, block_args) -> tuple[torch.Tensor,
                                                                                                torch.Tensor]:
        return self(embedded, hidden, k, block_args)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, k: int, block_args) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
        """Depth k, inside the module's call (at ZeRO-3 it is a unit, whole from its call to its return)."""
        x = self.fc(joined(self.pre_fc_norm_embedding(embedded), self.pre_fc_norm_hidden(hidden)))
        rotary, cache, *rest = block_args
        h = self.norm(self.layers[k - 1](x, rotary, cache, self.first_layer + k - 1, *rest))
        return h, h

    def depth_units(self) -> list[nn.Module]:
        """The modules ZeRO-3 gathers as units: the whole head, once per depth (its depths share fc and the norms)."""
        return [self]


def unbalanced(module: nn.Module) -> None:
    """The MTP block's experts' routing is no part of the balancing figures (module docstring)."""
    for m in module.modules():
        if hasattr(m, "balanced"):
            m.balanced = False


def build_layers(cfg: ModelConfig, block_class) -> MTPLayers | None:
    """DeepSeek-V3's (GLM-4.5's) trained MTP layers, or None when --mtp frozen."""
    if cfg.mtp != "train" or not cfg.mtp_layers:
        return None
    layers = range(cfg.n_layer, cfg.n_layer + cfg.mtp_layers)
    return MTPLayers({str(i): MTPLayer(cfg, block_class(cfg, i)) for i in layers})


def build_qwen(cfg: ModelConfig, block_class, norm_class) -> QwenMTP | None:
    """Qwen3.5's trained mtp.*, or None when --mtp frozen."""
    if cfg.mtp != "train" or not cfg.mtp_layers:
        return None
    return QwenMTP(cfg, block_class, norm_class)


def mtp_loss(depths, head, hidden: torch.Tensor, embedded: torch.Tensor, targets: torch.Tensor,
             segments: torch.Tensor | None, block_args, count: int) -> torch.Tensor:
    """sum over the `count` depths of each one's summed token loss (unweighted): `depths` the MTP module (its
    depth(k, ...)), `hidden` the main model's final-norm output, `embedded` its token embeddings of the row, `head` the
    head's summed token loss of (h, targets), `block_args` what a block takes after its input (rotary tables, cache,
    then the mask and the rest) but the layer index."""
    outputs, depth_rows = [], []
    for k in range(1, count + 1):
        hidden, out = depths.depth(k, shifted(embedded, k, 0.0), hidden, block_args)
        outputs.append(out)
        depth_rows.append(depth_targets(targets, segments, k))
    return head(torch.cat(outputs), torch.cat(depth_rows))
