"""GRPO's reward functions: the built-ins (exact_answer, format), a user's function loaded from a file, and the
weighted sum of their scores, with TRL's signature and TRL's handling of None.

A reward function is TRL's: `f(prompts, completions, completion_ids, **columns) -> list[float | None]`, one score per
completion, where `columns` are the records' other fields (`answer`, ...) repeated for each completion, as lists. None
means the function does not apply to that completion: it is left out of the weighted sum (NaN summed as 0); a
completion that no function scored has no reward (NaN) and advantage 0 (grpo_loss.group_advantages).
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
from collections.abc import Callable, Sequence

import torch

from zerotrain.errors import ConfigError

RewardFunction = Callable[..., list]
NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?|-?\.\d+")


def boxed(text: str) -> str | None:
    """The contents of the last \\boxed{...} in `text`, braces inside it balanced; None without one."""
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None


def final_answer(text: str) -> str | None:
    """What a completion answers: its last \\boxed{...}, else its last number; None when it has neither."""
    found = boxed(text)
    if found is not None:
        return found.strip()
    numbers = NUMBER.findall(text)
    return numbers[-1] if numbers else None


def same_answer(given: str | None, expected) -> bool:
    """Whether two answers agree: as numbers where both are numbers (1,000 = 1000.0), else as stripped text."""
    if given is None or expected is None:
        return False
    given, expected = given.strip(), str(expected).strip()
    try:
        return math.isclose(float(given.replace(",", "")), float(expected.replace(",", "")), rel_tol=0, abs_tol=1e-9)
    except ValueError:
        return given == expected


def exact_answer(prompts, completions, completion_ids=None, answer=None, **columns) -> list[float | None]:
    """1.0 where the completion's final answer (its last \\boxed{...}, else its last number) is the record's
    `answer`, else 0.0; None for a record with no answer."""
    answers = answer if answer is not None else [None] * len(completions)
    return [None if a is None else float(same_answer(final_answer(text_of(c)), a))
            for c, a in zip(completions, answers)]


def format_reward(pattern: str) -> RewardFunction:
    """The built-in `format`: 1.0 where the whole completion matches `pattern` (re.fullmatch, `.` spans lines),
    else 0.0."""
    try:
        regex = re.compile(pattern, re.DOTALL)
    except re.error as e:
        raise ConfigError(f"--reward-format {pattern!r} is not a regular expression: {e}") from None

    def format(prompts, completions, completion_ids=None, **columns) -> list[float]:  # noqa: A001 (TRL's name)
        return [float(regex.fullmatch(text_of(c)) is not None) for c in completions]

    return format


def text_of(completion) -> str:
    """A completion's text: itself, or the content of its messages (a conversational completion, TRL's)."""
    if isinstance(completion, str):
        return completion
    return "".join(m.get("content") or "" for m in completion)


def load_reward_function(spec: str) -> RewardFunction:
    """The function `FUNC` of the Python file `FILE.py` named by `spec` = "FILE.py:FUNC"."""
    path, sep, name = spec.rpartition(":")
    if not sep or not path or not name:
        raise ConfigError(f"--reward {spec!r} must be exact_answer, format or FILE.py:FUNC")
    if not os.path.isfile(path):
        raise ConfigError(f"--reward {spec}: no file {path}")
    module_spec = importlib.util.spec_from_file_location(f"zerotrain_reward_{abs(hash(path))}", path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as e:  # the user's file: say what it raised, in one line
        raise ConfigError(f"--reward {spec}: loading {path} raised {type(e).__name__}: {e}") from None
    if not hasattr(module, name):
        raise ConfigError(f"--reward {spec}: {path} has no function {name}")
    func = getattr(module, name)
    if not callable(func):
        raise ConfigError(f"--reward {spec}: {name} in {path} is a {type(func).__name__}, not a function")
    return func


def resolve_rewards(specs: Sequence[str], format_pattern: str | None = None) -> list[RewardFunction]:
    """The reward functions `--reward` names, in order: exact_answer, format (with `format_pattern`) or
    FILE.py:FUNC."""
    functions = []
    for spec in specs:
        if spec == "exact_answer":
            functions.append(exact_answer)
        elif spec == "format":
            if format_pattern is None:
                raise ConfigError("--reward format needs --reward-format REGEX")
            functions.append(format_reward(format_pattern))
        else:
            functions.append(load_reward_function(spec))
    return functions


def reward_weights(weights: Sequence[float] | None, count: int) -> torch.Tensor:
    """`--reward-weights`, one per reward function; all 1 when not given."""
    if weights is None:
        return torch.ones(count)
    if len(weights) != count:
        raise ConfigError(f"--reward-weights has {len(weights)} weights for {count} reward functions")
    return torch.tensor([float(w) for w in weights])


def reward_name(func: RewardFunction) -> str:
    return getattr(func, "__name__", type(func).__name__)


def score(functions: Sequence[RewardFunction], prompts: list, completions: list, completion_ids: list,
          columns: dict[str, list] | None = None) -> torch.Tensor:
    """Each function's scores of the N completions, (N, functions), NaN where it returned None. A function that
    raises or returns anything but N numbers or None is refused in one line naming it and what it returned."""
    n = len(completions)
    out = torch.full((n, len(functions)), float("nan"))
    for i, func in enumerate(functions):
        name = reward_name(func)
        try:
            got = func(prompts=prompts, completions=completions, completion_ids=completion_ids, **(columns or {}))
        except Exception as e:  # the user's function: say which and what it raised, in one line
            raise ConfigError(f"reward function {name} raised {type(e).__name__}: {e}") from None
        if not isinstance(got, (list, tuple)) or len(got) != n:
            what = f"{len(got)} values" if isinstance(got, (list, tuple)) else f"a {type(got).__name__}"
            raise ConfigError(f"reward function {name} returned {what} for {n} completions: one number or None each")
        for row, value in enumerate(got):
            if value is None:
                continue
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ConfigError(f"reward function {name} returned {value!r} for completion {row}: a number or None")
            out[row, i] = float(value)
    return out


def weighted_reward(per_function: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Each completion's reward: the weighted sum of its functions' scores, a None (NaN) counted as 0 (TRL's nansum),
    NaN where no function scored it."""
    total = (per_function * weights.to(per_function.device).unsqueeze(0)).nansum(dim=1)
    return total.masked_fill(torch.isnan(per_function).all(dim=1), float("nan"))
