"""Multi-token prediction (--mtp train): the D modules after a DeepSeek-V3 decoder that predict, at each position, the
token k + 1 places past the next one (depth k = 1 .. D), and the loss they add to the main one.

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

Parameter names: model.mtp_layers.{n+k}.* (n = num_hidden_layers), each layer's enorm, hnorm, eh_proj,
shared_head.norm and the block's own names (self_attn, mlp, input_layernorm, post_attention_layernorm) beside them:
the folder's model.layers.{n+k}.* with mtp_ in the prefix (hub/mtp_layers.py renames them both ways). In ZeRO-3 they
are in the root unit (whole for the step: parallel/units.py); under TP the block stays whole on every rank (its input,
the embedding's output and the final norm's, is), its experts split over --ep as the decoder's are.
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
    """One depth: enorm, hnorm, eh_proj, the family's decoder block (its modules under its own names) and
    shared_head.norm."""

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
        if hasattr(self, "mlp") and hasattr(self.mlp, "balanced"):
            self.mlp.balanced = False  # its routing is no part of the balancing figures (module docstring)

    def forward(self, embedded: torch.Tensor, hidden: torch.Tensor, *block_args) -> torch.Tensor:
        """h^k (before shared_head.norm) from the embeddings of t_{i+k} and h^{k-1}; `block_args` as the block's."""
        x = self.eh_proj(joined(self.enorm(embedded), self.hnorm(hidden)))
        return self.block_forward(self, x, *block_args)


def build_layers(cfg: ModelConfig, block_class) -> nn.ModuleDict | None:
    """The trained MTP layers, keyed by their layer index (n + k), or None when --mtp frozen."""
    if cfg.mtp != "train" or not cfg.mtp_layers:
        return None
    layers = range(cfg.n_layer, cfg.n_layer + cfg.mtp_layers)
    return nn.ModuleDict({str(i): MTPLayer(cfg, block_class(cfg, i)) for i in layers})


def mtp_loss(layers: nn.ModuleDict, head, hidden: torch.Tensor, embedded: torch.Tensor, targets: torch.Tensor,
             segments: torch.Tensor | None, block_args) -> torch.Tensor:
    """sum over the depths of each one's summed token loss (unweighted): `hidden` the main model's final-norm output,
    `embedded` its token embeddings of the row, `head` the head's summed token loss of (h, targets), `block_args`
    what the block takes after its input (rotary tables, cache, layer, mask, ...) but the layer index."""
    outputs, depth_rows = [], []
    rotary, cache, *rest = block_args
    for k, (index, layer) in enumerate(layers.items(), start=1):
        hidden = layer(shifted(embedded, k, 0.0), hidden, rotary, cache, int(index), *rest)
        outputs.append(layer.shared_head.norm(hidden))
        depth_rows.append(depth_targets(targets, segments, k))
    return head(torch.cat(outputs), torch.cat(depth_rows))
