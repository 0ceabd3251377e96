"""GRPO's sampling of G completions per prompt (model/generate.py's sample_completions): greedy completions of prompts
of several lengths, batched, are the tokens transformers' generate gives each prompt alone, cut after the first EOS
(a completion that keeps what follows its EOS is caught); a seed draws the same completions again (a sampler off the
seeded generator is caught); top-p keeps transformers' TopPLogitsWarper's nucleus, and only its tokens are drawn (an
unfiltered draw is caught)."""

from __future__ import annotations

import pytest
import torch
import transformers
from model_folders import family_folder

import zerotrain
from zerotrain.model import generate as gen

pytestmark = pytest.mark.timeout(300)
EOS = 2
PROMPTS = [[1, 40, 41], [1, 7, 8, 9, 10], [1, 60, 3, 5, 9], [1, 11, 12, 13, 14, 15, 16, 17], [1, 20, 21]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The tiny Llama of model_folders (vocab 96, 32 positions) with its EOS logit raised so that greedy completions
    end at varied lengths: transformers' model and zerotrain's, loaded from its folder."""
    folder = tmp_path_factory.mktemp("grpo-sampling") / "llama"
    hf = family_folder(folder, "llama")
    with torch.no_grad():
        hf.lm_head.weight[EOS] = hf.model.norm.weight * 0.5
    hf.save_pretrained(str(folder))
    return hf, zerotrain.load_model(str(folder))


def transformers_greedy(hf, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS,
                      pad_token_id=EOS, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


def test_batched_greedy_completions_are_transformers_own_cut_after_the_eos_and_a_completion_past_it_is_caught(
        models, monkeypatch):
    hf, model = models
    L, G = 12, 2
    got = gen.sample_completions(model, PROMPTS, G, L, temperature=0, stop_ids=[EOS])
    want = [transformers_greedy(hf, p, L) for p in PROMPTS for _ in range(G)]
    assert got == want
    lengths = [len(c) for c in got]
    assert min(lengths) < L and max(lengths) == L and sum(c[-1] == EOS for c in got) >= 2, lengths  # both kinds
    single = [gen.until_stop(gen.generate(model, torch.tensor([p]), L, temperature=0, stop_ids=[EOS])[0].tolist(),
                             [EOS])[0] for p in PROMPTS for _ in range(G)]
    assert got == single  # the batch changes nothing for any row
    monkeypatch.setattr(gen, "until_stop", lambda ids, stop_ids: (ids, False))  # planted: nothing cut
    assert gen.sample_completions(model, PROMPTS, G, L, temperature=0, stop_ids=[EOS]) != want


def test_a_seed_draws_the_same_completions_again_and_a_sampler_off_the_generator_is_caught(models, monkeypatch):
    _, model = models
    def draw(seed):
        return gen.sample_completions(model, PROMPTS, 4, 10, temperature=1.0, top_p=0.9,
                                      generator=torch.Generator().manual_seed(seed), stop_ids=[EOS])
    first = draw(5)
    assert draw(5) == first and draw(6) != first
    assert len({tuple(c) for c in first[:4]}) > 1  # a prompt's G completions differ from each other
    next_token = gen.next_token
    monkeypatch.setattr(gen, "next_token", lambda logits, t, k, g, *a: next_token(logits, t, k, None, *a))  # planted
    assert draw(5) != draw(5)


def test_completions_that_would_not_fit_the_context_are_refused(models):
    _, model = models
    with pytest.raises(ValueError, match="a prompt of 8 tokens and 25 completion tokens exceed the model's 32"):
        gen.sample_completions(model, PROMPTS, 2, 25, temperature=0)


def test_top_p_keeps_transformers_nucleus_and_draws_only_from_it_and_an_unfiltered_draw_is_caught(monkeypatch):
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(64, 50, generator=g) * 2
    logits[0, :3] = 5.0  # ties at the edge of the nucleus
    for top_p in (0.3, 0.8, 0.95):
        want = transformers.TopPLogitsWarper(top_p)(None, logits.clone())
        got = gen.top_p_filter(logits, top_p)
        assert torch.equal(torch.isinf(got), torch.isinf(want)) and torch.isinf(got).any()
    nucleus = ~torch.isinf(transformers.TopPLogitsWarper(0.5)(None, logits.clone()))

    def drawn(seed):
        return torch.stack([gen.next_token(logits, 1.0, None, torch.Generator().manual_seed(seed + i), top_p=0.5)
                            for i in range(40)], dim=1)
    assert nucleus.gather(1, drawn(0)).all()
    monkeypatch.setattr(gen, "top_p_filter", lambda logits, top_p: logits)  # planted: the nucleus ignored
    assert not nucleus.gather(1, drawn(0)).all()
