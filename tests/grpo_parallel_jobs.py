"""Job functions of tests/test_grpo_parallel.py, run by spawned ranks: GRPO runs in turn on the same ranks, some with a
bug planted in the product's own functions there."""

from __future__ import annotations

from unittest import mock

import torch

from zerotrain.config import Config
from zerotrain.errors import InvariantError
from zerotrain.parallel import Comm
from zerotrain.training import grpo
from zerotrain.training.loop import train


def train_job(cfg: Config, comm: Comm) -> str:
    """Train; the InvariantError's message if the run raised one (on every rank alike), else "no error"."""
    try:
        train(cfg, comm)
    except InvariantError as e:
        return str(e)
    return "no error"


def tp_duplicates_kept_job(cfg: Config, comm: Comm) -> str:
    """Planted: every world rank's rollouts count, a TP group's copies of its DP rank's among them."""
    with mock.patch.object(grpo, "per_dp_rank", lambda mesh, gathered: gathered):
        return train_job(cfg, comm)


def tp_rank_seeded_job(cfg: Config, comm: Comm) -> str:
    """Planted: TP rank 1 samples from another stream than TP rank 0 (its seed moved by one)."""
    real = grpo.sampling_generator

    def seeded(seed: int, generation: int, prompt: int, device: torch.device) -> torch.Generator:
        return real(seed + comm.rank % 2, generation, prompt, device)

    with mock.patch.object(grpo, "sampling_generator", seeded):
        return train_job(cfg, comm)


def rank_seeded_job(cfg: Config, comm: Comm) -> str:
    """Planted: each rank's prompts draw from the streams of the rank's first prompts (seeded by their place on the
    rank, not in the step), so the completions depend on the split."""
    real = grpo.sampling_generator
    first = {}

    def seeded(seed: int, generation: int, prompt: int, device: torch.device) -> torch.Generator:
        first.setdefault(generation, prompt)
        return real(seed, generation, prompt - first[generation], device)

    with mock.patch.object(grpo, "sampling_generator", seeded):
        return train_job(cfg, comm)
