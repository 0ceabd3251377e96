"""GRPO's reward functions: the built-ins' scores, a user's FILE.py:FUNC loaded (and each way it can be wrong refused
in one line naming it), a function that raises or returns the wrong thing named in one line, and the weighted sum
with None left out as TRL's nansum (a planted plain sum is caught)."""

from __future__ import annotations

import math

import pytest
import torch

from zerotrain.errors import ConfigError
from zerotrain.training import rewards
from zerotrain.training.rewards import (exact_answer, format_reward, load_reward_function, resolve_rewards,
                                        reward_weights, score, weighted_reward)


def test_exact_answer_reads_the_last_boxed_answer_else_the_last_number():
    completions = ["so the answer is \\boxed{42}.", "first \\boxed{1} then \\boxed{\\frac{1}{2}}", "2 + 2 = 4",
                   "it is 1,000 apples", "4 is wrong, \\boxed{5}", "no number here", "-3.50", "7"]
    answers = ["42", "\\frac{1}{2}", 4, "1000", "4", "1", -3.5, None]
    assert exact_answer(["p"] * 8, completions, None, answer=answers) == [1.0, 1.0, 1.0, 1.0, 0.0, 0.0, 1.0, None]
    conversational = [[{"role": "assistant", "content": "\\boxed{9}"}]]
    assert exact_answer(["p"], conversational, None, answer=["9"]) == [1.0]
    assert exact_answer(["p"], ["9"], None) == [None]  # a record with no answer is not scored


def test_format_matches_the_whole_completion_across_lines():
    fmt = format_reward(r"<think>.*</think>\s*<answer>.*</answer>")
    assert fmt.__name__ == "format"
    got = fmt(["p"] * 3, ["<think>a\nb</think>\n<answer>3</answer>", "<answer>3</answer>",
                          "<think>a</think><answer>3</answer> and more"], None)
    assert got == [1.0, 0.0, 0.0]
    with pytest.raises(ConfigError, match=r"--reward-format '\(' is not a regular expression"):
        format_reward("(")


def test_a_reward_file_is_loaded_and_each_wrong_spec_is_refused_in_one_line(tmp_path):
    file = tmp_path / "my_rewards.py"
    file.write_text("LENGTH = 3\n\ndef short(prompts, completions, completion_ids, **kw):\n"
                    "    return [float(len(c) < LENGTH) for c in completions]\n")
    short = load_reward_function(f"{file}:short")
    assert short.__name__ == "short" and short(["p", "p"], ["ab", "abcd"], None) == [1.0, 0.0]
    (tmp_path / "broken.py").write_text("import no_such_module_zt\n")
    refusals = {f"{tmp_path}/absent.py:f": f"no file {tmp_path}/absent.py",
                f"{file}:long": f"{file} has no function long",
                f"{file}:LENGTH": "LENGTH in .* is a int, not a function",
                f"{tmp_path}/broken.py:f": "raised ModuleNotFoundError",
                "exact": "must be exact_answer, format or FILE.py:FUNC"}
    for spec, said in refusals.items():
        with pytest.raises(ConfigError, match=said) as caught:
            resolve_rewards([spec])
        assert "\n" not in str(caught.value) and (spec in str(caught.value) or spec == "exact")
    with pytest.raises(ConfigError, match="--reward format needs --reward-format"):
        resolve_rewards(["format"])
    assert [f.__name__ for f in resolve_rewards(["exact_answer", "format", f"{file}:short"], ".*")] == \
        ["exact_answer", "format", "short"]


def test_a_reward_function_that_raises_or_returns_the_wrong_thing_is_named_in_one_line():
    def crashes(prompts, completions, completion_ids, **kw):
        raise KeyError("answer")

    def too_few(prompts, completions, completion_ids, **kw):
        return [1.0]

    def a_number(prompts, completions, completion_ids, **kw):
        return 1.0

    def text(prompts, completions, completion_ids, **kw):
        return ["1.0", 0.0]

    said = {crashes: "reward function crashes raised KeyError: 'answer'",
            too_few: "reward function too_few returned 1 values for 2 completions",
            a_number: "reward function a_number returned a float for 2 completions",
            text: "reward function text returned '1.0' for completion 0"}
    for func, message in said.items():
        with pytest.raises(ConfigError) as caught:
            score([func], ["p", "q"], ["a", "b"], [[1], [2]])
        assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_columns_reach_the_functions_and_nones_are_left_out_of_the_weighted_sum_as_trls_nansum(monkeypatch):
    def half(prompts, completions, completion_ids, answer, **kw):
        return [None if a is None else 0.5 for a in answer]

    def length(prompts, completions, completion_ids, **kw):
        return [None if len(ids) == 0 else len(ids) for ids in completion_ids]

    per_function = score([half, length], ["p"] * 3, ["a", "b", ""], [[5, 6], [7], []],
                         columns={"answer": ["1", None, None]})
    assert torch.equal(torch.isnan(per_function), torch.tensor([[False, False], [True, False], [True, True]]))
    weights = reward_weights([2.0, 0.25], 2)
    got = weighted_reward(per_function, weights)
    assert got[:2].tolist() == [1.0 + 0.5, 0.25] and math.isnan(got[2])  # unscored: NaN, advantage 0 later
    with pytest.raises(ConfigError, match="--reward-weights has 1 weights for 2 reward functions"):
        reward_weights([1.0], 2)
    assert torch.equal(reward_weights(None, 2), torch.ones(2))
    # planted: a plain sum, where one None makes the completion's whole reward NaN
    monkeypatch.setattr(torch.Tensor, "nansum", torch.Tensor.sum)
    assert math.isnan(rewards.weighted_reward(per_function, weights)[1])
