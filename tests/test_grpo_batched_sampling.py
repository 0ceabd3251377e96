"""GRPO's prompts sampled in one batch, each prompt's G rows from its own generator (sample_completions given one
generator per prompt): every prompt draws the completions it draws alone with that generator, in any batch (prompts of
several lengths, in any order); a batch drawn from the first prompt's generator alone is caught."""

from __future__ import annotations

import pytest
import torch
from model_folders import family_folder

import zerotrain
from zerotrain.model import generate as gen

pytestmark = pytest.mark.timeout(300)
EOS = 2
PROMPTS = [[1, 40, 41], [1, 7, 8, 9, 10], [1, 60, 3, 5, 9], [1, 11, 12, 13, 14, 15, 16, 17], [1, 20, 21]]
G, L = 4, 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The tiny Llama of model_folders (vocab 96, 32 positions), its EOS logit raised: completions of varied lengths."""
    folder = tmp_path_factory.mktemp("grpo-batched") / "llama"
    hf = family_folder(folder, "llama")
    with torch.no_grad():
        hf.lm_head.weight[EOS] = hf.model.norm.weight * 0.5
    hf.save_pretrained(str(folder))
    return zerotrain.load_model(str(folder))


def generators(seeds):
    return [torch.Generator().manual_seed(s) for s in seeds]


def test_each_prompt_draws_alone_what_it_draws_in_a_batch_and_one_generator_for_the_batch_is_caught(model,
                                                                                                   monkeypatch):
    seeds = [11, 12, 13, 14, 15]

    def batched(order):
        drawn = gen.sample_completions(model, [PROMPTS[i] for i in order], G, L, temperature=1.0,
                                       generator=generators([seeds[i] for i in order]), stop_ids=[EOS])
        return {i: drawn[k * G:(k + 1) * G] for k, i in enumerate(order)}

    alone = {i: gen.sample_completions(model, [p], G, L, temperature=1.0, generator=generators([seeds[i]]),
                                       stop_ids=[EOS]) for i, p in enumerate(PROMPTS)}
    assert len({len(c) for rows in alone.values() for c in rows}) > 1  # varied lengths: rows end apart
    assert batched(range(5)) == alone and batched([4, 2, 0, 3, 1]) == alone
    # prompts 0 and 4 share a length, so one batch: planted, it draws from the first prompt's generator only
    next_token = gen.next_token

    def one_stream(logits, t, k, g, *a, **kw):
        return next_token(logits, t, k, g if isinstance(g, torch.Generator) or g is None else g[0], *a, **kw)

    monkeypatch.setattr(gen, "next_token", one_stream)
    assert batched(range(5)) != alone
