"""The multi-token-prediction layers of a DeepSeek-V3, GLM-4.5 or Qwen3.5 folder: their names in the folder and in
zerotrain's model (--mtp train, DeepSeek-V3's: model/mtp.py), and with --mtp frozen kept as the folder holds them, from
--init-from's folder into an hf export.

Trained (--mtp train), DeepSeek-V3's model.layers.{n+k}.* are zerotrain's model.mtp_layers.{n+k}.* (`trained_name`;
mapping.HFMapping.stored_name renames them back), but for each layer's copies of the embedding and the head
(embed_tokens, shared_head.head), which are the main model's (shared, as DeepSeek-V3's report has them): read as
those, and written from them (`shared_copies`).

Frozen:

DeepSeek-V3's files hold num_nextn_predict_layers of them after the decoder's blocks, model.layers.{num_hidden_layers}
... (its embedding, enorm, hnorm, eh_proj, a block and shared_head); Qwen3.5's hold mtp_num_hidden_layers blocks under
mtp.layers.{k}. beside the head's own mtp.* tensors (fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm), which
transformers does not build either. hub/mapping.py sets them aside at import; an export copies each tensor as it is
(cast to the export's dtype) beside the trained ones, and writes their count back, so a model that comes with them
leaves with them. A folder whose config counts them but whose files lack them is refused in one line, never exported
without them.
"""

from __future__ import annotations

import torch
from safetensors import safe_open

from zerotrain.checkpoint import CheckpointError
from zerotrain.checkpoint.stream import read_header
from zerotrain.config import GROUP_ROUTED, QWEN35, ModelConfig

# Where each family's files keep them: Qwen3.5's under mtp., the others' as blocks past the decoder's
QWEN35_PREFIX = "mtp."


def is_mtp_tensor(cfg: ModelConfig, name: str) -> bool:
    """Whether tensor `name` of `cfg`'s folder belongs to its multi-token-prediction layers."""
    if cfg.arch in QWEN35:
        return name.startswith(QWEN35_PREFIX)
    layer = name.removeprefix("model.layers.").partition(".")[0] if name.startswith("model.layers.") else ""
    return layer.isdigit() and int(layer) >= cfg.n_layer


TRAINED_PREFIX = "model.mtp_layers."  # model/mtp.py's layers, by their index in the folder (n + k)
# each MTP layer's copies of the main model's tensors (DeepSeek-V3's files), by their name after the layer's prefix
SHARED = {"embed_tokens.weight": "model.embed_tokens.weight", "shared_head.head.weight": "lm_head.weight"}


def trained_name(name: str) -> str | None:
    """zerotrain's name of a DeepSeek-V3 folder's MTP tensor `name` (model.layers.{n+k}.X: model.mtp_layers.{n+k}.X),
    None for a layer's copy of the embedding or the head (the main model's are read)."""
    layer, _, rest = name.removeprefix("model.layers.").partition(".")
    return None if rest in SHARED else f"{TRAINED_PREFIX}{layer}.{rest}"


def shared_copies(cfg: ModelConfig) -> dict[str, str]:
    """{each MTP layer's copy of the embedding and the head, as the folder names it: the main model's tensor} that an
    hf export of a --mtp train model writes (the head's only where it is not tied)."""
    out = {}
    for k in range(cfg.mtp_layers if cfg.mtp == "train" and cfg.arch not in QWEN35 else 0):  # Qwen3.5's: none
        for rest, ours in SHARED.items():
            out[layer_prefix(cfg, k) + rest] = "model.embed_tokens.weight" if cfg.tie_embeddings else ours
    return out


def layer_prefix(cfg: ModelConfig, k: int) -> str:
    """The names of MTP layer k's tensors start so."""
    return f"{QWEN35_PREFIX}layers.{k}." if cfg.arch in QWEN35 else f"model.layers.{cfg.n_layer + k}."


def count_key(cfg: ModelConfig) -> str:
    """The config.json key that counts them."""
    return "mtp_num_hidden_layers" if cfg.arch in QWEN35 else "num_nextn_predict_layers"


class MTPLayers:
    """The MTP layers' tensors of `folder`'s files (name -> file), their shapes, and a reader of one tensor."""

    def __init__(self, cfg: ModelConfig, files: dict[str, str], folder: str):
        self.files = {n: f for n, f in files.items() if is_mtp_tensor(cfg, n)}
        for k in range(cfg.mtp_layers):
            prefix = layer_prefix(cfg, k)
            if not any(n.startswith(prefix) for n in self.files):
                raise CheckpointError(f"{folder}: its config counts {cfg.mtp_layers} multi-token-prediction layers "
                                      f"({count_key(cfg)}) but its files hold no {prefix}*, which an hf export "
                                      "copies: put them back in the folder")
        self.shapes = {}
        for path in set(self.files.values()):
            for name, (_, shape) in read_header(path).items():
                if name in self.files:
                    self.shapes[name] = tuple(shape)

    def read(self, name: str) -> torch.Tensor:
        with safe_open(self.files[name], framework="pt") as f:
            return f.get_tensor(name).float()


def mtp_layers_of(cfg: ModelConfig, folder: str | None, files_of) -> MTPLayers | None:
    """The MTP layers an hf export of `cfg` keeps, from `folder` (the --init-from folder; `files_of(folder)`: its
    tensors' files); None for a model without them."""
    if cfg.arch not in (*GROUP_ROUTED, *QWEN35) or not cfg.mtp_layers or cfg.mtp == "train":
        return None
    if folder is None:
        raise CheckpointError(f"the model has {cfg.mtp_layers} multi-token-prediction layers, which an hf export "
                              "copies from the folder they came from; none is known here")
    return MTPLayers(cfg, files_of(folder), folder)
