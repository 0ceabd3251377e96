"""Generating tokens from a model (GPT-2 or the Llama family): greedy or temperature / top-k / top-p sampling, with or
without a KV cache, up to the model's end-of-text or end-of-turn token; a GRPO step's G completions of each prompt
(sample_completions).

A sliding window (Mistral's) is the attention mask's, not the cache's: the cache keeps every position of the
model's context and each new token attends to the last `sliding_window` of them, as transformers' logits do.

Past the context. The learned position embedding has seq_len positions, so the model sees a window
of at most seq_len tokens of the sequence. When the next token would not fit, the window jumps
forward and keeps only the last `keep` tokens (default 3/4 of seq_len): the cache is refilled from
them in one forward, and decoding continues one token per step. Both paths follow this one rule,
so greedy output is the same with and without the cache.

Why not slide by one token (always the last seq_len tokens, as nanoGPT's sampler does)? Positions
are absolute: after a slide by one every cached key and value is stale, so the cache would be
recomputed at every step and stop paying once the context is full. `keep=seq_len` gives that rule.
With keep = 3/4 seq_len the model always sees at least 3/4 of a context, and a refill is one forward
of the kept tokens each time the window overflows (every seq_len - keep + 1 tokens: 96 per 33 on
the bench preset). `zerotrain sample RUN --max-new-tokens 256 --ignore-eos`, with and without
`--no-kv-cache`, prints the tokens per second of each on a machine.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

# One random stream for every row, or one per block of rows (GRPO: a prompt's G rows draw from the prompt's own)
Generators = torch.Generator | Sequence[torch.Generator] | None

from .kv_cache import KVCache
from .tensor_parallel import kv_heads_per_rank


def default_keep(seq_len: int) -> int:
    return max(1, seq_len - seq_len // 4)


def window_start(start: int, n: int, seq_len: int, keep: int) -> int:
    """The first token of the model's window over a sequence of n tokens, given the current window's start."""
    return start if n - start <= seq_len else n - keep


@torch.inference_mode()
def generate(model: torch.nn.Module, prompt: torch.Tensor, max_new_tokens: int, *, temperature: float = 1.0,
             top_k: int | None = None, generator: Generators = None, kv_cache: bool = True,
             keep: int | None = None, vocab_limit: int | None = None,
             stop_ids: Collection[int] | None = None, top_p: float | None = None) -> torch.Tensor:
    """The (B, L) tokens that follow `prompt` (B, T0), T0 >= 1: L = max_new_tokens, or fewer with `stop_ids`.

    temperature 0 is greedy (argmax); otherwise tokens are drawn from softmax(logits / temperature),
    restricted to the top_k most likely when top_k is given and to the nucleus of mass top_p when top_p is given
    (in transformers' order: temperature, top-k, top-p), with `generator`'s random stream (a sequence of k
    generators: the rows are k equal blocks in order, each drawn from its own, as it would be alone).
    `vocab_limit` excludes ids at or above it (a vocabulary padded beyond the tokenizer's).
    `stop_ids` (end of text, end of turn): a row ends at the first it draws, which it keeps, and repeats that
    token from there, as transformers' generate pads a finished row; generation stops once every row has ended
    (until_stop cuts a row there). The draws of the rows still going are those they would be without it.
    """
    seq_len = model.cfg.positions  # the model's context, not the window it was trained on
    keep = default_keep(seq_len) if keep is None else keep
    if not 1 <= keep <= seq_len:
        raise ValueError(f"keep must be in [1, seq_len={seq_len}], got {keep}")
    B, n = prompt.shape
    if n < 1:
        raise ValueError("generation needs a prompt of at least one token")
    if max_new_tokens <= 0:
        return prompt.new_empty(B, 0)
    weight = model.embedding.weight
    tokens = torch.empty(B, n + max_new_tokens, dtype=torch.long, device=weight.device)
    tokens[:, :n] = prompt
    stops = torch.tensor(sorted(stop_ids or ()), dtype=torch.long, device=weight.device)
    ended = torch.zeros(B, dtype=torch.bool, device=weight.device)
    first = n
    # The window never holds more than the prompt and the new tokens: the cache is that long, not the whole context
    cache = KVCache(model.cfg, B, weight.device, weight.dtype, cache_positions(n, max_new_tokens, seq_len),
                    cached_kv_heads(model)) if kv_cache else None
    start = window_start(0, n, seq_len, keep)
    logits = last_logits(model, tokens[:, start:n], cache)
    for i in range(max_new_tokens):
        drawn = next_token(logits, temperature, top_k, generator, vocab_limit, top_p)
        tokens[:, n] = torch.where(ended, tokens[:, n - 1], drawn)
        ended |= torch.isin(tokens[:, n], stops)
        n += 1
        if i == max_new_tokens - 1 or bool(ended.all()):
            break
        new_start = window_start(start, n, seq_len, keep)
        if cache is None:  # recompute the whole window
            logits = last_logits(model, tokens[:, new_start:n])
        elif new_start != start:  # the window jumped: refill the cache from the tokens it keeps
            cache.reset()
            logits = last_logits(model, tokens[:, new_start:n], cache)
        else:  # only the newest token is new to the cache
            logits = last_logits(model, tokens[:, n - 1 : n], cache)
        start = new_start
    return tokens[:, first:n]


def cache_positions(prompt: int, max_new_tokens: int, seq_len: int) -> int:
    """The positions the KV cache needs: the prompt and the new tokens, at most the model's context (the window)."""
    return min(seq_len, prompt + max_new_tokens)


def cached_kv_heads(model: torch.nn.Module) -> int:
    """The KV heads the model's attention computes on this rank: all of them, or under TP its share."""
    slices = getattr(model, "tp_slices", {})
    tp = len(next(iter(slices.values())).parts) if slices else 1
    return kv_heads_per_rank(model.cfg.kv_heads, tp)


def last_logits(model: torch.nn.Module, idx: torch.Tensor, cache: KVCache | None = None) -> torch.Tensor:
    """The logits (B, vocab) of the last position of `idx`: the head runs on that position alone (under TP its
    vocabulary shards gathered for it alone), not on every position of a prompt."""
    return model(idx, cache, head=lambda h: model.lm_head(h[:, -1]))


def until_stop(ids: list[int], stop_ids: Collection[int] | None) -> tuple[list[int], bool]:
    """`ids` up to and including the first of `stop_ids`, and whether it holds one."""
    end = next((i for i, t in enumerate(ids) if t in (stop_ids or ())), None)
    return (ids, False) if end is None else (ids[: end + 1], True)


def next_token(logits: torch.Tensor, temperature: float, top_k: int | None, generator: Generators,
               vocab_limit: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """One token id per row of the (B, vocab) logits: argmax at temperature 0, else a draw (with a sequence of k
    generators, each of the k equal blocks of rows from its own)."""
    if vocab_limit is not None:
        logits = logits[:, :vocab_limit]
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits.float() / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p is not None and top_p < 1.0:
        logits = top_p_filter(logits, top_p)
    probs = torch.softmax(logits, dim=-1)
    if generator is None or isinstance(generator, torch.Generator):
        return torch.multinomial(probs, 1, generator=generator).squeeze(1)
    blocks = probs.view(len(generator), -1, probs.shape[-1])
    return torch.cat([torch.multinomial(block, 1, generator=g) for block, g in zip(blocks, generator)]).squeeze(1)


def top_p_filter(logits: torch.Tensor, top_p: float) -> torch.Tensor:
    """The (B, vocab) logits with every token outside the nucleus set to -inf: the fewest most likely tokens whose
    probabilities sum past top_p, the most likely always kept (transformers' TopPLogitsWarper, ties and all)."""
    ascending, order = torch.sort(logits, descending=False)
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    outside = cumulative <= 1 - top_p
    outside[..., -1:] = False
    return logits.masked_fill(outside.scatter(1, order, outside), float("-inf"))


@torch.inference_mode()
def sample_completions(model: torch.nn.Module, prompts: Sequence[Sequence[int]], num_generations: int,
                       max_completion_length: int, *, temperature: float = 1.0, top_p: float | None = None,
                       top_k: int | None = None, generator: Generators = None,
                       stop_ids: Collection[int] | None = None, vocab_limit: int | None = None) -> list[list[int]]:
    """`num_generations` completions of each prompt (token ids, of any lengths), prompt-major: prompt i's are
    completions i G .. i G + G - 1. Each is at most `max_completion_length` tokens, cut after its first stop token,
    which it keeps. Sampled as `generate` samples (temperature 0: greedy), with the KV cache, by `generator`: one for
    every row, or a sequence of one per prompt, from which the prompt's G rows draw.

    The rows run as batches of the prompts of one length, without padding: a prompt's G rows always share a batch,
    and prompts of equal length share one too. (The attention has no key-padding mask with a cache, so a padded
    batch would attend to its pads.) Each row's tokens are those `generate` gives it alone; with one generator, the
    same prompts, seed and batch draw the same completions; with one per prompt, a prompt draws the same completions
    in any batch (up to the float rounding of a batch's matmuls)."""
    seq_len = model.cfg.positions
    longest = max(len(p) for p in prompts)
    if longest + max_completion_length > seq_len:  # the loss's forward must see a whole completion with its prompt
        raise ValueError(f"a prompt of {longest} tokens and {max_completion_length} completion tokens exceed the "
                         f"model's {seq_len} positions")
    rows = [list(p) for p in prompts for _ in range(num_generations)]
    completions: list[list[int]] = [[] for _ in rows]
    device = model.embedding.weight.device
    per_prompt = not (generator is None or isinstance(generator, torch.Generator))
    for indices in rows_by_prompt_length(rows):
        batch = torch.tensor([rows[i] for i in indices], dtype=torch.long, device=device)
        drawing = [generator[i // num_generations] for i in indices[::num_generations]] if per_prompt else generator
        drawn = generate(model, batch, max_completion_length, temperature=temperature, top_k=top_k, top_p=top_p,
                         generator=drawing, stop_ids=stop_ids, vocab_limit=vocab_limit).tolist()
        for i, ids in zip(indices, drawn):
            completions[i] = until_stop(ids, stop_ids)[0]
    return completions


def rows_by_prompt_length(rows: Sequence[Sequence[int]]) -> list[list[int]]:
    """The row indices grouped by their prompt's length, shortest first, each group in row order."""
    groups: dict[int, list[int]] = {}
    for i, row in enumerate(rows):
        groups.setdefault(len(row), []).append(i)
    return [groups[n] for n in sorted(groups)]
