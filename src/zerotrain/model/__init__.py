"""The models zerotrain trains: GPT-2 (gpt2.py), the layers every architecture shares (layers.py), sampling (generate.py)."""

from .gpt2 import GPT, KVCache, build_model, is_decayed, parallelize, summed_token_loss
from .layers import TPSlice

__all__ = ["GPT", "KVCache", "TPSlice", "build_model", "is_decayed", "parallelize", "summed_token_loss"]
