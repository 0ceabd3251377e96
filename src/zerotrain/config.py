"""Typed run configuration: dataclasses, validation that names the bad field, TOML + CLI merge."""

from __future__ import annotations

import dataclasses
import importlib.util
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from zerotrain.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


PRESETS: dict[str, dict[str, int]] = {
    # The lesson's tiny GPT: fast enough for 4 ranks on 2 cores.
    "tiny": dict(n_layer=2, n_head=4, n_embd=32, seq_len=16, vocab_size=64),
    # GPT-2-shaped model used by the benchmarks (P = 842,496 with vocab 256).
    "bench": dict(n_layer=4, n_head=4, n_embd=128, seq_len=128, vocab_size=256),
    # Wider, communication-heavy benchmark model.
    "wide": dict(n_layer=2, n_head=8, n_embd=512, seq_len=64, vocab_size=256),
    # GPT-2 small (124M).
    "gpt2": dict(n_layer=12, n_head=12, n_embd=768, seq_len=1024, vocab_size=50257),
}


@dataclass
class ModelConfig:
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    seq_len: int = 16
    vocab_size: int = 64


@dataclass
class DataConfig:
    # "python-stdlib" (this interpreter's standard-library sources, as bytes), "synthetic",
    # "synthetic-varlen", a UTF-8 text file or folder (as bytes), or token files: a folder with
    # *train*.bin / *val*.bin (zerotrain prepare, nanoGPT, llm.c) or one .bin file. See data/resolve.py.
    source: str = "python-stdlib"
    # Pack the token stream into full sequences (True) or one document per sequence, padded and
    # label-masked (False; documents end with the end-of-text token).
    pack: bool = True
    glob: str = "**/*.txt"  # a text folder's files
    val_fraction: float = 0.05  # text inputs: the documents set aside for validation (by a hash of their name)
    cache_dir: str = ""  # prepared text inputs; "" -> $ZEROTRAIN_CACHE or ~/.cache/zerotrain


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = -1  # -1: resolved to max(1, steps // 10)
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0  # 0 disables clipping


@dataclass
class RunConfig:
    nproc: int = 1
    tp: int = 1  # tensor-parallel degree: ranks that split each layer; the rest of nproc is data parallelism
    steps: int = 20
    micro_batch: int = 8
    accum: int = 1
    seed: int = 0
    device: str = "cpu"
    precision: str = "fp32"  # fp32 | bf16
    threads: int = 0  # torch threads per rank; 0: cores // nproc, at least 1
    bucket_mb: float = 4.0  # gradient bucket size in MiB of fp32 values
    # on: reduce-scatter during backward, all-gather during the next forward; off: neither;
    # auto: on with CUDA, off on CPU (see reduce_in_backward)
    overlap: str = "auto"
    compile: bool = False  # run the model's forward and backward through torch.compile
    check_every: int = 10  # cross-rank drift check period in steps (0: only at the end)
    timeout_s: float = 120.0  # collective timeout: a stuck peer fails the job instead of hanging it
    max_restarts: int = 0  # elastic restarts of the whole group after a worker dies; each resumes from a checkpoint
    out: str = ""  # run folder; "" -> runs/<timestamp>
    metrics: str = ""  # JSONL path; "" -> <out>/metrics.jsonl
    progress: bool = True
    eval_every: int = 0  # validation loss every K steps and at the end (0: never)
    eval_batches: int = 8  # fixed validation batches, each DP replicas x micro-batch sequences
    tensorboard: bool = False  # also log to <out>/tensorboard (needs the tensorboard package)

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the world size over the TP degree."""
        return max(1, self.nproc // self.tp)

    @property
    def reduce_in_backward(self) -> bool:
        # On CPU gloo's transfers are copies by CPU threads, competing with compute for the cores:
        # measured no faster overlapped (2 ranks on 2 cores, --preset wide, micro-batch 1, settings
        # alternated within one run: 68 ms per step with neither, 67-71 with the all-gather behind
        # the forward, 72-75 with the reduce-scatter in backward).
        return self.overlap == "on" or (self.overlap == "auto" and self.device == "cuda")

    @property
    def gather_in_forward(self) -> bool:
        # The same switch, but a compiled forward cannot stop midway to wait for a bucket.
        return self.reduce_in_backward and not self.compile


@dataclass
class CheckpointConfig:
    dir: str = ""  # "" -> <out>/checkpoints
    every: int = 0  # 0: no periodic checkpoints
    keep: int = 0  # how many committed checkpoints to keep; 0 keeps all
    resume: str = ""  # "", "auto" or a checkpoint folder
    every_minutes: float = 0.0  # also save by wall clock, rank 0's, whichever of the two comes due first; 0: off
    async_save: bool = False  # write in a background thread from CPU staging buffers while training goes on
    overwrite: bool = False  # a fresh run may replace the checkpoints and metrics already in its folders


@dataclass
class GuardConfig:
    on_anomaly: str = "rollback"  # rollback | abort: what a non-finite loss or gradient norm or a loss spike does
    spike_factor: float = 3.0  # a loss above spike_factor x the median of the last spike_window steps is a spike
    spike_window: int = 20
    max_rollbacks: int = 3  # past this many rollbacks the run stops with an error


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    run: RunConfig = field(default_factory=RunConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: DP replicas x micro-batch x accumulation steps (TP ranks share theirs)."""
        return self.run.dp * self.run.micro_batch * self.run.accum

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        cfg = cls()
        merge(cfg, d, origin="config")
        return cfg


SECTIONS = ("model", "data", "optim", "run", "checkpoint", "guard")


def merge(cfg: Config, overrides: dict[str, Any], origin: str) -> None:
    """Apply {section: {field: value}} onto cfg, rejecting unknown sections and fields by name."""
    for section, values in overrides.items():
        if section not in SECTIONS:
            raise ConfigError(f"{origin}: unknown section [{section}] (known: {', '.join(SECTIONS)})")
        target = getattr(cfg, section)
        known = {f.name: f for f in fields(target)}
        for name, value in values.items():
            if name not in known:
                raise ConfigError(f"{origin}: unknown field {section}.{name}")
            default = getattr(target, name)
            if isinstance(default, bool) and not isinstance(value, bool):
                raise ConfigError(f"{origin}: {section}.{name} must be true or false, got {value!r}")
            if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if type(default) is not type(value):
                raise ConfigError(
                    f"{origin}: {section}.{name} must be {type(default).__name__}, got {value!r}"
                )
            setattr(target, name, value)


def load_toml(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"--config {path}: file not found") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {path}: invalid TOML ({e})") from None


def apply_preset(cfg: Config, name: str) -> None:
    if name not in PRESETS:
        raise ConfigError(f"--preset {name!r} is unknown (known: {', '.join(PRESETS)})")
    for k, v in PRESETS[name].items():
        setattr(cfg.model, k, v)


def _positive(value: int | float, flag: str) -> None:
    if value <= 0:
        raise ConfigError(f"{flag} must be positive, got {value}")


def validate(cfg: Config) -> Config:
    """Check everything that can be checked before a worker starts; resolve derived defaults."""
    m, o, r, c, g = cfg.model, cfg.optim, cfg.run, cfg.checkpoint, cfg.guard
    for name in ("n_layer", "n_head", "n_embd", "seq_len", "vocab_size"):
        _positive(getattr(m, name), "--" + name.replace("_", "-"))
    if m.n_embd % m.n_head:
        raise ConfigError(f"--n-embd {m.n_embd} is not divisible by --n-head {m.n_head}")
    for name in ("nproc", "steps", "micro_batch", "accum"):
        _positive(getattr(r, name), "--" + name.replace("_", "-"))
    _positive(r.tp, "--tp")
    if r.nproc % r.tp:
        raise ConfigError(f"--tp {r.tp} does not divide the world size {r.nproc} (--nproc): ranks form TP x DP")
    if m.n_head % r.tp:
        raise ConfigError(f"--tp {r.tp} does not divide --n-head {m.n_head}: each TP rank keeps whole attention heads")
    # The MLP width 4 x n_embd is then divisible too: n_head divides n_embd.
    if r.threads < 0:
        raise ConfigError(f"--threads must be >= 0, got {r.threads}")
    _positive(r.bucket_mb, "--bucket-mb")
    _positive(r.timeout_s, "--timeout")
    if r.check_every < 0:
        raise ConfigError(f"--check-every must be >= 0, got {r.check_every}")
    if r.precision not in ("fp32", "bf16"):
        raise ConfigError(f"--precision must be fp32 or bf16, got {r.precision!r}")
    if r.overlap not in ("auto", "on", "off"):
        raise ConfigError(f"--overlap must be auto, on or off, got {r.overlap!r}")
    if r.device not in ("cpu", "cuda"):
        raise ConfigError(f"--device must be cpu or cuda, got {r.device!r}")
    if r.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no CUDA device is available on this machine")
        # Under torchrun nproc is the world; this machine runs LOCAL_WORLD_SIZE of its ranks.
        local = int(os.environ.get("LOCAL_WORLD_SIZE", r.nproc))
        if local > torch.cuda.device_count():
            raise ConfigError(
                f"--nproc {local} exceeds the {torch.cuda.device_count()} CUDA devices here"
            )
    _positive(o.lr, "--lr")
    if not (0.0 <= o.min_lr_ratio <= 1.0):
        raise ConfigError(f"--min-lr-ratio must be in [0, 1], got {o.min_lr_ratio}")
    if o.weight_decay < 0:
        raise ConfigError(f"--weight-decay must be >= 0, got {o.weight_decay}")
    if o.grad_clip < 0:
        raise ConfigError(f"--grad-clip must be >= 0, got {o.grad_clip}")
    for name in ("beta1", "beta2"):
        if not (0.0 <= getattr(o, name) < 1.0):
            raise ConfigError(f"--{name} must be in [0, 1), got {getattr(o, name)}")
    _positive(o.eps, "--eps")
    if o.warmup_steps < 0:
        o.warmup_steps = max(1, r.steps // 10)
    if c.every < 0:
        raise ConfigError(f"--ckpt-every must be >= 0, got {c.every}")
    if c.keep < 0:
        raise ConfigError(f"--keep must be >= 0, got {c.keep}")
    if not (c.every_minutes >= 0 and math.isfinite(c.every_minutes)):
        raise ConfigError(f"--ckpt-every-minutes must be >= 0, got {c.every_minutes}")
    if r.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("--tensorboard needs the tensorboard package: pip install 'zerotrain[tb]'")
    if r.eval_every < 0:
        raise ConfigError(f"--eval-every must be >= 0, got {r.eval_every}")
    _positive(r.eval_batches, "--eval-batches")
    if r.max_restarts < 0:
        raise ConfigError(f"--max-restarts must be >= 0, got {r.max_restarts}")
    if g.on_anomaly not in ("rollback", "abort"):
        raise ConfigError(f"--on-anomaly must be rollback or abort, got {g.on_anomaly!r}")
    if not (g.spike_factor > 1.0 and math.isfinite(g.spike_factor)):
        raise ConfigError(f"--spike-factor must be a number above 1, got {g.spike_factor}")
    _positive(g.spike_window, "--spike-window")
    if g.max_rollbacks < 0:
        raise ConfigError(f"--max-rollbacks must be >= 0, got {g.max_rollbacks}")
    for value in (o.lr, o.eps, o.weight_decay, o.grad_clip, r.bucket_mb, r.timeout_s):
        if not math.isfinite(value):
            raise ConfigError(f"configuration value {value} is not finite")
    return cfg

