"""The shell every Llama-family decoder shares: token embedding, the family's blocks, a final norm and the LM head
(tied to the embedding or its own), with Hugging Face's names (model.embed_tokens, model.layers.{i}, model.norm,
lm_head). A family gives its block, its final norm and its `hidden` (what runs between the embedding and the head:
Llama's in llama.py, Qwen3.5's in qwen35.py, DeepSeek-V3's in deepseek.py, Llama 4's in llama4.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from zerotrain.config import ModelConfig

from . import mtp
from .kv_cache import KVCache
from .vocab import LMHead, tied_head_hook, token_embedding


class Decoder(nn.Module):
    """Token embedding, `block(cfg, layer)` for every layer, `norm`, LM head (tied or its own)."""

    def __init__(self, cfg: ModelConfig, block, norm: nn.Module, softcap: float = 0.0,
                 mtp_layers: nn.ModuleDict | None = None):
        super().__init__()
        self.cfg = cfg
        self.recompute_blocks = False  # activation checkpointing per block (--activation-checkpointing blocks)
        # --cp C: parallel/context.py's ContextParallel (each row split over C ranks, attention around their ring);
        # None: the whole row is here (and for the families whose attention the ring does not serve: config refuses)
        self.context_parallel = None
        self.model = nn.ModuleDict(dict(
            embed_tokens=token_embedding(cfg.vocab_size, cfg.n_embd, cfg.padding_idx),
            layers=nn.ModuleList(block(cfg, layer) for layer in range(cfg.n_layer)),
            norm=norm,
        ))
        if mtp_layers is not None:  # --mtp train: the multi-token-prediction layers (model/mtp.py)
            self.model["mtp_layers"] = mtp_layers
        # what the MTP layers take from the decoder's forward (its `hidden` leaves it, forward takes it):
        # (the token embeddings, the block's arguments after its input but the cache and layer)
        self.mtp_inputs = None
        # the last training forward's MTP depths' summed token loss, detached, on the device: the step's mtp_loss
        # figure (training/mtp_loss.py), apart from the loss it joins
        self.mtp_summed = None
        self.lm_head = LMHead(cfg.n_embd, cfg.vocab_size, softcap=softcap)
        self.tie_weights()
        if cfg.tie_embeddings:
            self.register_load_state_dict_pre_hook(tied_head_hook("lm_head.weight", "model.embed_tokens.weight"))
        # initial values: the family module's init_rule (model/init.py draws them)

    @property
    def embedding(self) -> nn.Embedding:
        return self.model.embed_tokens

    @property
    def final_norm(self) -> nn.Module:
        """The norm between the last block and the head."""
        return self.model.norm

    def tie_weights(self) -> None:
        """The head is the token embedding's tensor, when tied (again after moving off the meta device)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, idx: torch.Tensor, cache: KVCache | None = None,
                segments: torch.Tensor | None = None, head=None, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits of shape (batch, time, vocab); with a cache, segments (packed records), a head or targets (the
        summed token loss), as GPT's."""
        h = self.hidden(idx, cache, segments)
        mtp_inputs, self.mtp_inputs = self.mtp_inputs, None
        if head is not None:
            return head(h)
        if mtp_inputs is None or targets is None:
            return self.lm_head(h, targets=targets)
        # the MTP depths' summed loss first, through the head's forward rather than its call: at ZeRO-3 the hooks
        # around the head's call mark its unit's one use, the main loss's below
        embedded, rotary, *rest = mtp_inputs
        depths = mtp.mtp_loss(self.mtp_module, lambda x, t: self.lm_head.forward(x, targets=t), h, embedded,
                              targets, segments, (rotary, None, *rest), self.cfg.mtp_layers)
        self.mtp_summed = depths.detach()
        return self.lm_head(h, targets=targets) + self.cfg.mtp_loss_weight / self.cfg.mtp_layers * depths

    @property
    def mtp_module(self) -> nn.Module | None:
        """The trained MTP layers (model/mtp.py): DeepSeek-V3's and GLM-4.5's model.mtp_layers, Qwen3.5's mtp."""
        return self.model["mtp_layers"] if "mtp_layers" in self.model else getattr(self, "mtp", None)

    @property
    def trains_mtp(self) -> bool:
        """Whether this forward computes the MTP layers' loss too: --mtp train, while training (the validation loss,
        computed without gradients, is the main model's)."""
        return self.mtp_module is not None and torch.is_grad_enabled()

    def hidden(self, idx: torch.Tensor, cache: KVCache | None = None,
               segments: torch.Tensor | None = None) -> torch.Tensor:
        """The final norm's output, the head's input: (batch, time, width)."""
        raise NotImplementedError
