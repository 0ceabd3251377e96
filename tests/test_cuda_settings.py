"""CUDA's defaults, as far as a CPU can check them: bf16 with an fp32 master unless the user gives --precision,
expandable segments for the allocator unless the user set PYTORCH_CUDA_ALLOC_CONF, TF32 said in one line for fp32,
and --deterministic's kernels (runtime/cuda_settings.py). What they do on a GPU was not measured here."""

from __future__ import annotations

import pytest
import torch

from zerotrain.cli import flags
from zerotrain.cli.main import build_parser
from zerotrain.runtime import cuda_settings


def precision_of(*argv: str, toml: str | None = None, tmp_path=None) -> str:
    extra = []
    if toml is not None:
        path = tmp_path / "run.toml"
        path.write_text(toml)
        extra = ["--config", str(path)]
    args = build_parser().parse_args(["train", "--data", "synthetic", *extra, *argv])
    return flags.config_from_args(args, environment=False).parallel.precision


def test_cuda_defaults_to_bf16_unless_the_user_gives_a_precision_and_a_skipped_default_is_caught(tmp_path,
                                                                                                  monkeypatch):
    assert precision_of("--device", "cuda") == "bf16"
    assert precision_of("--device", "cuda", "--precision", "fp32") == "fp32"
    assert precision_of("--device", "cuda", toml="[parallel]\nprecision = \"fp32\"\n", tmp_path=tmp_path) == "fp32"
    assert precision_of() == "fp32"  # the CPU's default is unchanged
    monkeypatch.setattr(flags, "cuda_defaults", lambda cfg, stated: None)  # planted: no CUDA default
    assert precision_of("--device", "cuda") == "fp32"


@pytest.fixture
def torch_flags():
    """torch's global flags as they were, put back after the test."""
    saved = (torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), torch.backends.cudnn.deterministic,
             torch.backends.cudnn.benchmark, torch.backends.cuda.flash_sdp_enabled())
    yield
    torch.set_float32_matmul_precision(saved[0])
    torch.use_deterministic_algorithms(saved[1], warn_only=saved[2])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[3], saved[4]
    torch.backends.cuda.enable_flash_sdp(saved[5])


def test_a_cuda_rank_sets_expandable_segments_unless_set_and_says_tf32_for_fp32(torch_flags):
    environ = {}
    assert cuda_settings.apply("bf16", deterministic=False, environ=environ) == []
    assert environ == {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
    assert torch.get_float32_matmul_precision() == "highest"  # bf16 runs leave fp32 matmuls alone
    mine = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}
    said = cuda_settings.apply("fp32", deterministic=False, environ=mine)
    assert mine == {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:512"}  # the user's own stays
    assert len(said) == 1 and "TF32" in said[0] and torch.get_float32_matmul_precision() == "high"
    assert not torch.are_deterministic_algorithms_enabled()  # without --deterministic: the fastest kernels


def test_deterministic_picks_deterministic_kernels_and_says_so(torch_flags):
    environ = {}
    [said] = cuda_settings.apply("bf16", deterministic=True, environ=environ)
    assert environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8" and "bitwise" in said
    assert torch.are_deterministic_algorithms_enabled() and torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark
    assert not torch.backends.cuda.flash_sdp_enabled()  # flash attention's backward sums with atomics
    theirs = {"CUBLAS_WORKSPACE_CONFIG": ":16:8"}
    cuda_settings.apply("bf16", deterministic=True, environ=theirs)
    assert theirs["CUBLAS_WORKSPACE_CONFIG"] == ":16:8"  # also deterministic; the user's choice
