"""Every parameter's initial values from the seed and its name alone, whoever holds which part of it.

Each value is a function of (seed, the parameter's name in the full model, its position in the full tensor) and of
nothing else: a counter-based generator. The position is hashed with the parameter's key (sha256 of seed and name)
by splitmix64's finaliser, twice; the 64 bits become a uniform or, by Box-Muller, a normal value, scaled by the
architecture's rule (gpt2.init_rule, llama.init_rule). So any part of a tensor is drawn exactly, alone: a rank that
trains a TP slice draws its slice, a ZeRO-3 rank its owned flat ranges, and every world size, TP degree and stage
starts from bitwise the same model, each rank drawing only its share (Llama-3-8B at DP 64: 125 M values a rank, not
the 8 G a whole-tensor draw per owned part cost).

The arithmetic is integer operations, and float64 additions, multiplications, divisions and square roots with the
logarithm and the sine written as polynomials: each is correctly rounded on any CPU, vectorised or not, so a value
does not depend on where it falls in a draw (torch's log and cos differ by an ulp between their vectorised and
scalar paths). Values are drawn on the CPU, a million at a time. The token embedding's padding row (the Llama
family's pad_token_id) is zeros, as transformers' initialisation leaves nn.Embedding's padding_idx row.

The engine fills its flat buffers from a source of initial values: `SeedValues` here, or --init-from's files
(hub/init_from.FileValues); both answer `values(name, shape)` with this rank's (TP slice of the) tensor, and
`flat_values(name, shape, lo, hi)` with its flat range [lo, hi) alone.
"""

from __future__ import annotations

import hashlib
import math
from typing import Protocol

import torch
import torch.nn as nn

from zerotrain.config import DEEPSEEK, GEMMA4, GLM, LLAMA_FAMILY, QWEN35, ModelConfig

from . import deepseek, gemma4, glm, gpt2, llama, qwen35
from .tensor_parallel import TPSlice

RULES = {"gpt2": gpt2.init_rule, **{arch: llama.init_rule for arch in LLAMA_FAMILY},
         **{arch: qwen35.init_rule for arch in QWEN35}, **{arch: deepseek.init_rule for arch in DEEPSEEK},
         **{arch: glm.init_rule for arch in GLM}, **{arch: gemma4.init_rule for arch in GEMMA4}}
DRAW_CHUNK = 1 << 16  # values per pass: the temporaries (512 KiB each) stay in the CPU's cache
_MOD = 1 << 64


class InitialValues(Protocol):
    def values(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        """This rank's tensor of parameter `name` (its TP slice, of `shape`, when the parameter is split)."""

    def flat_values(self, name: str, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
        """Values [lo, hi) of this rank's tensor of `name` flattened (fp32), reading or drawing no more than that."""


def _signed(x: int) -> int:
    """x mod 2**64 as the int64 with the same bits (torch's integer scalars are signed)."""
    x %= _MOD
    return x - _MOD if x >= 1 << 63 else x


GOLDEN = _signed(0x9E3779B97F4A7C15)
M1, M2 = _signed(0xBF58476D1CE4E5B9), _signed(0x94D049BB133111EB)


def parameter_key(seed: int, name: str) -> int:
    """The key of one parameter: 64 bits of sha256(seed/name) (Python's hash() changes per process)."""
    return _signed(int.from_bytes(hashlib.sha256(f"{seed}/{name}".encode()).digest()[:8], "little"))


def _shift(z: torch.Tensor, s: int) -> torch.Tensor:
    """z >> s, logical (torch shifts int64 arithmetically)."""
    return torch.bitwise_right_shift(z, s).bitwise_and_((1 << (64 - s)) - 1)


def _mix(z: torch.Tensor) -> torch.Tensor:
    """splitmix64's finaliser (wrap-around int64 arithmetic, as digest.py relies on), in place."""
    z.bitwise_xor_(_shift(z, 30)).mul_(M1)
    z.bitwise_xor_(_shift(z, 27)).mul_(M2)
    return z.bitwise_xor_(_shift(z, 31))


def random_bits(key: int, positions: torch.Tensor) -> torch.Tensor:
    """64 random bits (int64) for each position of the tensor keyed `key`: splitmix64 from the key."""
    return _mix(positions.to(torch.int64).mul(GOLDEN).add_(key))


# Series coefficients, in Horner's order: log m = 2 s (1 + s^2/3 + s^4/5 + ...), s = (m-1)/(m+1), |s| < 0.172: seven
# terms leave < 1e-13; sin x = x (1 - x^2/3! + x^4/5! - ...), |x| <= pi/2: to x^15 leaves < 1e-9, below fp32's ulp.
LOG_TERMS = [2 / k for k in range(13, 0, -2)]
SIN_TERMS = [(-1) ** (k // 2) / math.factorial(k) for k in range(15, 0, -2)]


def _horner(x2: torch.Tensor, terms: list[float]) -> torch.Tensor:
    out = torch.full_like(x2, terms[0])
    for c in terms[1:]:
        out.mul_(x2).add_(c)
    return out


def _log(u: torch.Tensor) -> torch.Tensor:
    """log(u) for u > 0 (float64): u = m 2**e with m in [sqrt(1/2), sqrt(2)), log m = 2 atanh((m-1)/(m+1)) by its
    series."""
    m, e = torch.frexp(u)  # m in [0.5, 1)
    small = m < math.sqrt(0.5)
    m.mul_(small.to(m.dtype).add_(1))  # m in [sqrt(1/2), sqrt(2))
    e = e.to(torch.float64).sub_(small.to(torch.float64))
    s = (m - 1).div_(m.add_(1))
    return _horner(s * s, LOG_TERMS).mul_(s).add_(e.mul_(math.log(2)))


def _cos_turns(t: torch.Tensor) -> torch.Tensor:
    """cos(2 pi t) for t in [0, 1] (float64), as sin(2 pi w) with w = |t - 1/2| - 1/4 in [-1/4, 1/4], by its
    series."""
    x = t.sub(0.5).abs_().sub_(0.25).mul_(2 * math.pi)
    return _horner(x * x, SIN_TERMS).mul_(x)


def _unit(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each 32-bit half as a uniform in (0, 1), float64: (high, low)."""
    high = _shift(bits, 32).to(torch.float64).add_(0.5).mul_(2.0**-32)
    low = torch.bitwise_and(bits, 0xFFFFFFFF).to(torch.float64).add_(0.5).mul_(2.0**-32)
    return high, low


def standard_normal(bits: torch.Tensor) -> torch.Tensor:
    """N(0, 1) values (float64) from 64 random bits each, by Box-Muller."""
    u1, u2 = _unit(bits)
    return _log(u1).mul_(-2).sqrt_().mul_(_cos_turns(u2))


def uniform(bits: torch.Tensor) -> torch.Tensor:
    """U(-1, 1) values (float64) from the top 53 of 64 random bits each."""
    return _shift(bits, 11).to(torch.float64).add_(0.5).mul_(2.0**-52).sub_(1)


def full_positions(full_shape: tuple[int, ...], tp_slice: TPSlice | None, tp_rank: int, lo: int,
                   hi: int) -> torch.Tensor:
    """The positions in the full tensor (flat, row-major) of values [lo, hi) of this rank's tensor flattened: itself
    without a TP slice; with one, its parts along the split dimension put back where they lie."""
    idx = torch.arange(lo, hi, dtype=torch.int64)
    if tp_slice is None:
        return idx
    dim = tp_slice.dim
    inner = math.prod(full_shape[dim + 1 :])
    along = torch.cat([torch.arange(a, b, dtype=torch.int64) for a, b in tp_slice.parts[tp_rank]])
    block = along.numel() * inner  # values of one outer index in the local tensor
    outer, rest = idx // block, idx % block
    return (outer * full_shape[dim] + along[rest // inner]) * inner + rest % inner


def parameter_rule(cfg: ModelConfig, name: str):
    return RULES[cfg.arch](cfg, name)


def padding_row(cfg: ModelConfig, name: str) -> tuple[int, int] | None:
    """The positions [a, b) in the full tensor of the token embedding's padding row, which starts at zero (as
    transformers' _init_weights zeroes nn.Embedding's padding_idx row), where `name` is that embedding and the model
    has a padding token (Gemma 4's per-layer input embedding has the row too); else None."""
    widths = {"model.embed_tokens.weight": cfg.n_embd,
              "model.embed_tokens_per_layer.weight": cfg.n_layer * cfg.per_layer_width}
    if cfg.padding_idx is None or name not in widths:
        return None
    return cfg.padding_idx * widths[name], (cfg.padding_idx + 1) * widths[name]


def draw(rule, key: int, positions, zeroed: tuple[int, int] | None = None) -> torch.Tensor:
    """fp32 values of a parameter with init `rule` at `positions` (a function of (lo, hi) giving the positions of
    values [lo, hi) of the result, and its length), a chunk at a time; those at positions in `zeroed` [a, b) are
    zeros (the padding row)."""
    position_of, n = positions
    out = torch.empty(n)
    if rule in ("zeros", "ones"):
        return out.fill_(0.0 if rule == "zeros" else 1.0)
    kind, a = rule
    for at in range(0, n, DRAW_CHUNK):
        end = min(n, at + DRAW_CHUNK)
        where = position_of(at, end)
        values = standard_normal(random_bits(key, where)) if kind == "normal" else uniform(random_bits(key, where))
        out[at:end] = values.mul_(a)  # "uniform": U(-a, a)
        if zeroed is not None:
            out[at:end].masked_fill_((where >= zeroed[0]) & (where < zeroed[1]), 0.0)
    return out


def initial_value(cfg: ModelConfig, seed: int, name: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The full fp32 tensor parameter `name` (of full shape `shape`) starts from."""
    n = math.prod(shape)
    return draw(parameter_rule(cfg, name), parameter_key(seed, name),
                (lambda lo, hi: torch.arange(lo, hi, dtype=torch.int64), n), padding_row(cfg, name)).view(shape)


class SeedValues:
    """Initial values from the seed: each rank draws exactly its (TP slice's) values, or a flat range of them."""

    def __init__(self, cfg: ModelConfig, seed: int, tp_slices: dict[str, TPSlice] | None = None, tp_rank: int = 0):
        self.cfg, self.seed, self.tp_slices, self.tp_rank = cfg, seed, tp_slices or {}, tp_rank
        self.values_drawn = 0  # values drawn so far by this source

    def values(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return self.flat_values(name, shape, 0, math.prod(shape)).view(shape)

    def flat_values(self, name: str, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
        split = self.tp_slices.get(name)
        full = split.full_shape if split is not None else tuple(shape)
        self.values_drawn += hi - lo
        return draw(parameter_rule(self.cfg, name), parameter_key(self.seed, name),
                    (lambda a, z: full_positions(full, split, self.tp_rank, lo + a, lo + z), hi - lo),
                    padding_row(self.cfg, name))


class RestoredValues:
    """The initial values of a run that restores a checkpoint over them before its first step (a resume of full
    fine-tuning): zeros, neither read from --init-from's files nor drawn from the seed, which a resume did at 1x the
    start-up's cost for values it then overwrote."""

    def values(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        return torch.zeros(shape)

    def flat_values(self, name: str, shape: tuple[int, ...], lo: int, hi: int) -> torch.Tensor:
        return torch.zeros(hi - lo)


@torch.no_grad()
def materialise(model: nn.Module, source: InitialValues, device: torch.device | str = "cpu",
                dtype: torch.dtype = torch.float32) -> nn.Module:
    """Move a model built on the meta device to `device` in `dtype` (a LoRA run's frozen base: its run's precision
    from the first byte, never a whole fp32 copy first), every parameter filled from `source` (one fp32 tensor at a
    time beyond the model itself); a tied head is tied again. Non-parameter state: the models have none (rotary
    tables are computed in forward), so to_empty leaves nothing uninitialised."""
    model.to(dtype).to_empty(device=device)
    model.tie_weights()
    for name, p in model.named_parameters():  # a tied parameter once, under the embedding's name
        p.copy_(source.values(name, tuple(p.shape)))
    return model
