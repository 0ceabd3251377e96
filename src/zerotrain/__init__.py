"""zerotrain: data-parallel GPT training on torch.distributed with a ZeRO stage-1 optimizer."""

__version__ = "0.1.0"
