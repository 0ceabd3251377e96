"""The CUDA settings a rank starts with: the allocator's segments, TF32 for fp32 matmuls, --deterministic's kernels.

What torchtitan and FSDP2 runs set on CUDA, each where the user has not set it:
- PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: ZeRO-3 gathers and frees every unit each step, in blocks of
  changing sizes, which the caching allocator's fixed segments fragment; expandable segments grow in place. Read
  when the allocator starts, so set before the rank's first CUDA call.
- fp32 matmuls in TF32 (`torch.set_float32_matmul_precision("high")`) where the run asked for --precision fp32;
  bf16 parameters with an fp32 master shard are CUDA's default precision (config.cuda_defaults).
- --deterministic: the kernels that make a run repeatable bit for bit, so that a resume on CUDA is bitwise: cuBLAS's
  fixed workspace (CUBLAS_WORKSPACE_CONFIG, before its first use), cuDNN without its autotuner, PyTorch's
  deterministic algorithms (warn_only: an op without a deterministic kernel warns rather than stopping the run),
  and SDPA without flash attention, whose backward sums with atomics (the memory-efficient kernel takes its
  deterministic backward under deterministic algorithms; math where it cannot run). Without it the fastest
  kernels run and a CUDA resume equals the uninterrupted run within float noise, not bit for bit.
None of this was measured on a GPU in zerotrain's tests (no GPU there): the choices follow PyTorch's documentation.
"""

from __future__ import annotations

import os

import torch

ALLOCATOR = {"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}
CUBLAS_DETERMINISTIC = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}


def allocator_environment(environ=os.environ) -> dict[str, str]:
    """What a CUDA rank sets in its environment before its first CUDA call: nothing where the user set it."""
    return {} if "PYTORCH_CUDA_ALLOC_CONF" in environ else dict(ALLOCATOR)


def deterministic_kernels(environ=os.environ) -> None:
    """--deterministic: the kernels that give bitwise resume (the module docstring)."""
    for key, value in CUBLAS_DETERMINISTIC.items():
        environ.setdefault(key, value)
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.deterministic = True
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cuda.enable_flash_sdp(False)


def apply(precision: str, deterministic: bool, environ=os.environ) -> list[str]:
    """Set this rank's CUDA settings before its first CUDA call; the lines rank 0 says about them at start."""
    environ.update(allocator_environment(environ))
    said = []
    if deterministic:
        deterministic_kernels(environ)
        said.append("--deterministic: deterministic CUDA kernels (cuBLAS workspace " +
                    environ.get("CUBLAS_WORKSPACE_CONFIG", "") + ", no flash attention): a resume is bitwise")
    if precision == "fp32":
        torch.set_float32_matmul_precision("high")
        said.append("--precision fp32 on CUDA: matmuls in TF32 (bf16 with an fp32 master is CUDA's default)")
    return said
