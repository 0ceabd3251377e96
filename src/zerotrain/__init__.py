"""zerotrain: data-parallel GPT training on torch.distributed with a ZeRO stage-1 optimizer.

The public API, for using a trained model from Python:

    model = zerotrain.load_model("runs/x/checkpoints")   # a checkpoint (folder, root, run folder) or an export
    tok = zerotrain.load_tokenizer("runs/x/checkpoints")
    logits = model(torch.tensor([tok.encode("def ")]))   # (1, T, vocab)
"""

__version__ = "0.1.0"
__all__ = ["__version__", "load_model", "load_tokenizer"]


def load_model(path: str):
    """The model of a checkpoint folder, checkpoint root (what `latest` names), run folder or exported folder.

    Verified before it is read, returned in eval mode on the CPU: `model(idx)` maps a (B, T) integer
    tensor to (B, T, vocab) logits.
    """
    from zerotrain.hub.pretrained import load_model as load  # torch is imported on first use, not by `import zerotrain`

    return load(path)


def load_tokenizer(path: str):
    """The tokenizer of the same paths: `encode(text)`, `decode(ids)`, `vocab_size`, `eot_id`, `kind`."""
    from zerotrain.hub.pretrained import load_tokenizer as load

    return load(path)
