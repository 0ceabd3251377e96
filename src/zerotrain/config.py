"""The run configuration: every setting declared once (key, default, help, rule), pure validation, derived values.

A setting is a dataclass field declared with `setting(...)`. Its key is its TOML name in its
section's table and, with dashes, its flag: `ckpt_every` under `[checkpoint]` is `--ckpt-every`.
The flag table, the TOML loader, `--help` and docs/reference.md's table are all built from
these declarations, so they cannot disagree. A declaration also says which runs the setting does
something in: its methods (`methods`) and the models or options it needs (`applies`, a Scope);
`check_applicable` refuses a setting the user gave that does nothing in the run. `validate` is pure
(it reads, never changes); `resolve` fills in the derived values (warmup from steps) in one place after it.
"""

from __future__ import annotations

import difflib
import functools
import math
from dataclasses import dataclass, field, fields
from typing import Any, Callable, Iterator

from zerotrain.errors import ConfigError

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib


@dataclass(frozen=True)
class Rule:
    """What a setting's value must satisfy, and how the error says it."""

    says: str
    holds: Callable[[Any], bool]


POSITIVE = Rule("must be positive", lambda v: v > 0)
NON_NEGATIVE = Rule("must be >= 0", lambda v: v >= 0)
FRACTION = Rule("must be in [0, 1]", lambda v: 0 <= v <= 1)
BELOW_ONE = Rule("must be in [0, 1)", lambda v: 0 <= v < 1)
ABOVE_ONE = Rule("must be a number above 1", lambda v: v > 1)


def step_range(text: str) -> tuple[int, int] | None:
    """Steps A to B from "A:B" (1 <= A <= B), or None for anything else."""
    first, colon, last = text.partition(":")
    if not (colon and first.isdigit() and last.isdigit()) or not 1 <= int(first) <= int(last):
        return None
    return int(first), int(last)


STEP_RANGE = Rule("must be A:B, the first and last step to trace (1 <= A <= B)",
                  lambda v: v == "" or step_range(v) is not None)


def one_of(*choices: str) -> Rule:
    return Rule("must be " + ", ".join(choices[:-1]) + f" or {choices[-1]}", lambda v: v in choices)


@dataclass(frozen=True)
class Scope:
    """The runs a setting does something in, beyond its methods: a test of the run's config (its model known), what
    the runs are (`runs`) and what a run it does nothing in is instead (`otherwise(cfg, model)`, `model` naming the
    run's model as the user gave it: a preset, an --init-from folder or an --arch)."""

    runs: str
    holds: Callable[[Any], bool]
    otherwise: Callable[[Any, str], str]


def archs_scope(*archs: str) -> Scope:
    """The settings of some architectures only."""
    return Scope(f"--arch {' or '.join(archs)}", lambda cfg: cfg.model.arch in archs,
                 lambda cfg, model: f"{model} is --arch {cfg.model.arch}")


def option_scope(flag: str, attribute: Callable[[Any], str], *values: str) -> Scope:
    """The settings that refine one choice of another setting (--rope-scaling yarn's, --dpo-loss sigmoid's)."""
    return Scope(f"{flag} {' or '.join(values)}", lambda cfg: attribute(cfg) in values,
                 lambda cfg, model: f"this run's is {flag} {attribute(cfg)}")


METHODS = ("sft", "dpo", "grpo")


def setting(default, help: str, *, rule: Rule | None = None, key: str | None = None, shown: str | None = None,
            many: bool = False, methods: tuple[str, ...] | None = None, applies: Scope | None = None):
    """Declare a setting: its default, its help, the rule its value obeys, and its key when not the field's name.

    `shown` is how `--help` and the README state a default that is derived (`runs/<timestamp>`). `many`: a string
    setting the flag may give several times (a TOML list), its values kept one per line. `methods`: the --method
    values it does something in (None: every method; a new method is added where it reads the setting);
    `applies`: the models or options it needs, else every run's.
    """
    assert methods is None or set(methods) <= set(METHODS), methods
    return field(default=default, metadata={"help": help, "rule": rule, "key": key, "shown": shown, "many": many,
                                            "methods": methods, "applies": applies})


def data_sources(text: str) -> list[tuple[str, float | None]]:
    """The (name, weight or None) of each source --data names, one per line (the flag given several times, or a TOML
    list). `PATH:WEIGHT` splits on the last colon only when what follows it reads as a number, so a path with colons
    in it stays whole; a path that itself ends in `:NUMBER` is given with a weight after it."""
    out = []
    for entry in text.split("\n"):
        path, colon, tail = entry.rpartition(":")
        try:
            weight = float(tail) if colon and path else None
        except ValueError:
            weight = None
        out.append((entry, None) if weight is None else (path, weight))
    return out


def is_mixture(text: str) -> bool:
    """Whether --data names a mixture (weighted sources) rather than today's one source."""
    return any(weight is not None for _, weight in data_sources(text))


def _check_mixture(text: str) -> None:
    """A mixture's weights are positive numbers, one on every source, and its sources are named once each."""
    entries = text.split("\n")
    sources = data_sources(text)
    for entry, (_, weight) in zip(entries, sources):
        if weight is not None and not (math.isfinite(weight) and weight > 0):
            raise ConfigError(f"--data {entry}: the weight {entry.rpartition(':')[2]!r} is not a positive number")
    if len(sources) > 1 and any(weight is None for _, weight in sources):
        entry = next(e for e, (_, w) in zip(entries, sources) if w is None)
        raise ConfigError(f"--data {entry}: a mixture of several --data needs a weight on each (--data PATH:WEIGHT)")
    names = [name for name, _ in sources]
    twice = next((n for n in names if names.count(n) > 1), None)
    if twice is not None:
        raise ConfigError(f"--data {twice} is named twice in the mixture: give each source once, with its weight")


# Every preset states the whole architecture, so a preset never inherits another's (--arch llama --preset gpt2).
_GPT2 = dict(arch="gpt2", n_kv_head=0, intermediate_size=0, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True)
PRESETS: dict[str, dict] = {
    # The lesson's tiny GPT: fast enough for 4 ranks on 2 cores.
    "tiny": dict(_GPT2, n_layer=2, n_head=4, n_embd=32, seq_len=16, vocab_size=64),
    # GPT-2-shaped model used by the benchmarks (P = 842,496 with vocab 256).
    "bench": dict(_GPT2, n_layer=4, n_head=4, n_embd=128, seq_len=128, vocab_size=256),
    # Wider, communication-heavy benchmark model.
    "wide": dict(_GPT2, n_layer=2, n_head=8, n_embd=512, seq_len=64, vocab_size=256),
    # GPT-2 small (124M).
    "gpt2": dict(_GPT2, n_layer=12, n_head=12, n_embd=768, seq_len=1024, vocab_size=50257),
    # A tiny Llama for tests and the demo: grouped-query attention (2 KV heads for 4 query heads), untied head.
    "llama-tiny": dict(arch="llama", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64, seq_len=16,
                       vocab_size=64, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False),
    # SmolLM-135M's shape (Hugging Face's HuggingFaceTB/SmolLM-135M).
    "smollm-135m": dict(arch="llama", n_layer=30, n_head=9, n_kv_head=3, n_embd=576, intermediate_size=1536,
                        seq_len=2048, vocab_size=49152, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=True),
    # The shapes of meta-llama/Llama-3.2-1B, Qwen/Qwen2.5-0.5B, Qwen/Qwen3-0.6B and mistralai/Mistral-7B-v0.3 (their
    # config.json), at a 2048-token window (their contexts are 32k-128k: --context gives one, and sample's KV cache
    # holds all of it).
    "llama-3.2-1b": dict(arch="llama", n_layer=16, n_head=32, n_kv_head=8, n_embd=2048, intermediate_size=8192,
                         seq_len=2048, vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5,
                         tie_embeddings=True, rope_scaling="llama3", rope_factor=32.0, rope_low_freq_factor=1.0,
                         rope_high_freq_factor=4.0, rope_original_context=8192),
    "qwen2.5-0.5b": dict(arch="qwen2", n_layer=24, n_head=14, n_kv_head=2, n_embd=896, intermediate_size=4864,
                         seq_len=2048, vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6,
                         tie_embeddings=True),
    "qwen3-0.6b": dict(arch="qwen3", n_layer=28, n_head=16, n_kv_head=8, n_embd=1024, head_width=128,
                       intermediate_size=3072, seq_len=2048, vocab_size=151936, rope_theta=1000000.0,
                       norm_eps=1e-6, tie_embeddings=True),
    "mistral-7b": dict(arch="mistral", n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                       seq_len=2048, vocab_size=32768, rope_theta=1000000.0, norm_eps=1e-5,
                       tie_embeddings=False),
    # microsoft/Phi-3-mini-4k-instruct: 32 heads without GQA, a window of 2047 tokens.
    "phi-3-mini-4k": dict(arch="phi3", n_layer=32, n_head=32, n_kv_head=32, n_embd=3072, intermediate_size=8192,
                          seq_len=2048, vocab_size=32064, rope_theta=10000.0, norm_eps=1e-5, tie_embeddings=False,
                          sliding_window=2047),
    # google/gemma-2-2b and google/gemma-3-1b-pt (their config.json; Gemma 3 1B's global rope is unscaled), at a
    # 2048-token window.
    "gemma-2-2b": dict(arch="gemma2", n_layer=26, n_head=8, n_kv_head=4, n_embd=2304, head_width=256,
                       intermediate_size=9216, seq_len=2048, vocab_size=256000, rope_theta=10000.0, norm_eps=1e-6,
                       tie_embeddings=True, sliding_window=4096, sliding_window_pattern=2, query_pre_attn_scalar=256,
                       attn_softcap=50.0, final_softcap=30.0),
    "gemma-3-1b": dict(arch="gemma3", n_layer=26, n_head=4, n_kv_head=1, n_embd=1152, head_width=256,
                       intermediate_size=6912, seq_len=2048, vocab_size=262144, rope_theta=1000000.0, norm_eps=1e-6,
                       tie_embeddings=True, sliding_window=512, sliding_window_pattern=6, rope_local_theta=10000.0,
                       query_pre_attn_scalar=256),
    # A tiny Qwen3-MoE for tests and the demo: 4 experts of width 32, each token routed to 2.
    "qwen3-moe-tiny": dict(arch="qwen3_moe", n_layer=2, n_head=4, n_kv_head=2, n_embd=32, intermediate_size=64,
                           seq_len=16, vocab_size=64, rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=False,
                           n_experts=4, experts_per_token=2, expert_width=32, norm_topk_prob=True),
    # The shapes people plan (`zerotrain plan --preset ... --seq-len 8192`): meta-llama/Llama-3.1-8B and -70B (llama3
    # rope scaling), Qwen/Qwen3-32B and Qwen/Qwen3-235B-A22B, their config.json's values and contexts, at a 2048-token
    # window.
    "llama-3.1-8b": dict(arch="llama", n_layer=32, n_head=32, n_kv_head=8, n_embd=4096, intermediate_size=14336,
                         seq_len=2048, vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False,
                         rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                         rope_original_context=8192, context=131072),
    "llama-3.1-70b": dict(arch="llama", n_layer=80, n_head=64, n_kv_head=8, n_embd=8192, intermediate_size=28672,
                          seq_len=2048, vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=False,
                          rope_scaling="llama3", rope_factor=8.0, rope_low_freq_factor=1.0, rope_high_freq_factor=4.0,
                          rope_original_context=8192, context=131072),
    "qwen3-32b": dict(arch="qwen3", n_layer=64, n_head=64, n_kv_head=8, n_embd=5120, head_width=128,
                      intermediate_size=25600, seq_len=2048, vocab_size=151936, rope_theta=1000000.0, norm_eps=1e-6,
                      tie_embeddings=False, context=40960),
    # 128 experts of width 1536, top-8, in every layer (its intermediate_size, 12288, is for dense layers: it has none).
    "qwen3-235b-a22b": dict(arch="qwen3_moe", n_layer=94, n_head=64, n_kv_head=4, n_embd=4096, head_width=128,
                            intermediate_size=12288, seq_len=2048, vocab_size=151936, rope_theta=1000000.0,
                            norm_eps=1e-6, tie_embeddings=False, n_experts=128, experts_per_token=8,
                            expert_width=1536, norm_topk_prob=True, context=40960),
    # Qwen/Qwen3-30B-A3B's shape (its config.json): 128 experts of width 768, top-8, at a 2048-token window.
    "qwen3-30b-a3b": dict(arch="qwen3_moe", n_layer=48, n_head=32, n_kv_head=4, n_embd=2048, head_width=128,
                          intermediate_size=6144, seq_len=2048, vocab_size=151936, rope_theta=1000000.0,
                          norm_eps=1e-6, tie_embeddings=False, n_experts=128, experts_per_token=8, expert_width=768,
                          norm_topk_prob=True),
    # Qwen/Qwen3.5-27B's text model (its config.json's text_config; Qwen3.6-27B shares it): 64 layers, every 4th gated
    # attention (24 heads of 256, 4 KV heads, rotary on a quarter of each head, base 1e7), the others Gated DeltaNet
    # (16 key heads and 48 value heads of 128); its MTP layer is frozen unless --mtp train. 26.9B parameters.
    "qwen3.5-27b": dict(arch="qwen3_5", n_layer=64, n_head=24, n_kv_head=4, n_embd=5120, head_width=256,
                        intermediate_size=17408, seq_len=4096, context=262144, vocab_size=248320,
                        rope_theta=10000000.0, norm_eps=1e-6, tie_embeddings=False, linear_key_heads=16,
                        linear_value_heads=48),
    # Qwen/Qwen3.5-35B-A3B's text model (its config.json's text_config): 40 layers of the same pattern (16 heads of
    # 256, 2 KV heads; 16 key and 32 value heads of 128), 256 experts of width 512 (top-8) beside a shared expert of
    # 512 on every layer (no dense MLP: intermediate_size 0, as import reads it). 34.7B parameters, 3.5B a token with
    # the embedding and head.
    "qwen3.5-35b-a3b": dict(arch="qwen3_5_moe", n_layer=40, n_head=16, n_kv_head=2, n_embd=2048, head_width=256,
                            intermediate_size=0, seq_len=4096, context=262144, vocab_size=248320,
                            rope_theta=10000000.0, norm_eps=1e-6, tie_embeddings=False, n_experts=256,
                            experts_per_token=8, expert_width=512, shared_expert_width=512, norm_topk_prob=True),
    # deepseek-ai/DeepSeek-V3's shape (its config.json; V3.1 and R1 share it): 61 layers of latent attention, the first
    # 3 dense, 256 routed experts of 2048 in 8 groups (top-4 groups, top-8 experts) and one shared, YaRN x40 with its
    # mscale pair; its MTP layer is kept frozen through an hf export unless --mtp train. 671B parameters, 37B a token.
    "deepseek-v3-671b": dict(arch="deepseek_v3", n_layer=61, n_head=128, n_kv_head=128, n_embd=7168,
                             intermediate_size=18432, seq_len=4096, context=163840, vocab_size=129280,
                             rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=False, n_experts=256,
                             experts_per_token=8, expert_width=2048, norm_topk_prob=True, router_aux_coef=0.0,
                             q_lora_rank=1536, kv_lora_rank=512, qk_rope_dim=64, qk_nope_dim=128, v_head_dim=128,
                             first_dense_layers=3, shared_experts=1, expert_groups=8, expert_groups_per_token=4,
                             routed_scaling=2.5, rope_scaling="yarn", rope_factor=40.0, rope_original_context=4096,
                             rope_mscale=1.0, rope_mscale_all_dim=1.0, mtp_layers=1),
    # moonshotai/Kimi-K2-Instruct's shape (its config.json, model_type deepseek_v3): 64 heads, 384 routed experts in
    # one group, the first layer dense, routed_scaling_factor 2.827, rope base 50000 with YaRN x32.
    "kimi-k2": dict(arch="deepseek_v3", n_layer=61, n_head=64, n_kv_head=64, n_embd=7168, intermediate_size=18432,
                    seq_len=4096, context=131072, vocab_size=163840, rope_theta=50000.0, norm_eps=1e-6,
                    tie_embeddings=False, n_experts=384, experts_per_token=8, expert_width=2048, norm_topk_prob=True,
                    router_aux_coef=0.0, q_lora_rank=1536, kv_lora_rank=512, qk_rope_dim=64, qk_nope_dim=128,
                    v_head_dim=128, first_dense_layers=1, shared_experts=1, expert_groups=1,
                    expert_groups_per_token=1, routed_scaling=2.827, rope_scaling="yarn", rope_factor=32.0,
                    rope_original_context=4096, rope_beta_fast=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0),
    # zai-org/GLM-4.5-Air's and zai-org/GLM-4.5's shapes (their config.json, model_type glm4_moe): grouped-query
    # attention of 96 heads of 128 (8 KV heads) with q/k/v biases and rotary on half of each head, the first 1 (3)
    # layers dense, then 128 (160) routed experts in one group, top-8, and one shared; GLM-4.5 normalises q and k per
    # head and scales its routed weights by 2.5. Their MTP layer is kept frozen through an hf export unless --mtp train.
    "glm-4.5-air": dict(arch="glm4_moe", n_layer=46, n_head=96, n_kv_head=8, n_embd=4096, head_width=128,
                        intermediate_size=10944, seq_len=4096, context=131072, vocab_size=151552,
                        rope_theta=1000000.0, partial_rotary=0.5, norm_eps=1e-5, tie_embeddings=False,
                        attention_bias=True, use_qk_norm=False, n_experts=128, experts_per_token=8,
                        expert_width=1408, norm_topk_prob=True, router_aux_coef=0.0, first_dense_layers=1,
                        shared_experts=1, expert_groups=1, expert_groups_per_token=1, routed_scaling=1.0,
                        mtp_layers=1),
    "glm-4.5": dict(arch="glm4_moe", n_layer=92, n_head=96, n_kv_head=8, n_embd=5120, head_width=128,
                    intermediate_size=12288, seq_len=4096, context=131072, vocab_size=151552, rope_theta=1000000.0,
                    partial_rotary=0.5, norm_eps=1e-5, tie_embeddings=False, attention_bias=True, use_qk_norm=True,
                    n_experts=160, experts_per_token=8, expert_width=1536, norm_topk_prob=True, router_aux_coef=0.0,
                    first_dense_layers=3, shared_experts=1, expert_groups=1, expert_groups_per_token=1,
                    routed_scaling=2.5, mtp_layers=1),
    # mistralai/Mistral-Small-4-119B-2603's language model (transformers' Mistral4Config defaults, which name that
    # checkpoint): 36 MoE layers of latent attention, 128 routed experts of 2048 (top-4, softmax, one group) and one
    # shared, YaRN x128 over 8192 positions with the query scaling; 118,972,826,624 parameters (its vision tower's are
    # not in this model).
    "mistral-small-4-119b": dict(arch="mistral4", n_layer=36, n_head=32, n_kv_head=32, n_embd=4096,
                                 intermediate_size=12288, seq_len=4096, context=1048576, vocab_size=131072,
                                 rope_theta=10000.0, norm_eps=1e-6, tie_embeddings=False, n_experts=128,
                                 experts_per_token=4, expert_width=2048, norm_topk_prob=True, router_aux_coef=0.0,
                                 q_lora_rank=1024, kv_lora_rank=256, qk_rope_dim=64, qk_nope_dim=64, v_head_dim=128,
                                 first_dense_layers=0, shared_experts=1, expert_groups=1, expert_groups_per_token=1,
                                 routed_scaling=1.0, rope_scaling="yarn", rope_factor=128.0,
                                 rope_original_context=8192, rope_mscale=1.0, rope_mscale_all_dim=1.0,
                                 llama4_scaling_beta=0.1),
    # google/gemma-4-12B's text model (its text_config): 48 layers, every 6th global (heads of 512, one KV head, keys
    # as values, a quarter of the rotary turning at base 1e6), the others sliding over 1024 tokens (heads of 256, 8 KV
    # heads, base 1e4), logits capped at 30, no per-layer inputs or shared KV (the E2B and E4B edge models have them).
    "gemma4-12b": dict(arch="gemma4", n_layer=48, n_head=16, n_kv_head=8, n_embd=3840, head_width=256,
                       intermediate_size=15360, seq_len=4096, context=131072, vocab_size=262144, rope_theta=1000000.0,
                       rope_local_theta=10000.0, partial_rotary=0.25, norm_eps=1e-6, tie_embeddings=True,
                       pad_token_id=0, sliding_window=1024, sliding_window_pattern=6, final_softcap=30.0,
                       global_head_width=512, k_eq_v=True, global_kv_heads=1),
    # google/gemma-4-26B-A4B's text model: 30 layers, every 6th global (heads of 512, 2 KV heads, keys as values),
    # the others sliding over 1024 (heads of 256, 8 KV heads); beside each layer's MLP of 2112, 128 experts of 704,
    # top-8 (its config.json's text_config as ollama's GGUF metadata and Megatron-Bridge's Gemma 4 provider give it)
    "gemma4-26b-a4b": dict(arch="gemma4", n_layer=30, n_head=16, n_kv_head=8, n_embd=2816, head_width=256,
                           intermediate_size=2112, seq_len=4096, context=262144, vocab_size=262144,
                           rope_theta=1000000.0, rope_local_theta=10000.0, partial_rotary=0.25, norm_eps=1e-6,
                           tie_embeddings=True, pad_token_id=0, sliding_window=1024, sliding_window_pattern=6,
                           final_softcap=30.0, global_head_width=512, k_eq_v=True, global_kv_heads=2, n_experts=128,
                           experts_per_token=8, expert_width=704, norm_topk_prob=True, router_aux_coef=0.0),
    # Llama 4 Scout's and Maverick's text models (meta-llama/Llama-4-Scout-17B-16E, -Maverick-17B-128E; transformers'
    # Llama4TextConfig defaults are Scout's): 48 layers of 40 heads (8 KV), every 4th without rotary, chunks of 8192;
    # one routed expert of 8192 of 16 (128) beside a shared one, on every layer (every 2nd, the others a dense MLP of
    # 16384). 107,769,861,120 and 400,711,848,960 parameters (their vision towers' are not in this model).
    "llama-4-scout": dict(arch="llama4", n_layer=48, n_head=40, n_kv_head=8, n_embd=5120, intermediate_size=16384,
                          seq_len=4096, context=131072, vocab_size=202048, rope_theta=500000.0, tie_embeddings=False,
                          n_experts=16, experts_per_token=1, expert_width=8192, shared_expert_width=8192,
                          router_aux_coef=0.0),
    "llama-4-maverick": dict(arch="llama4", n_layer=48, n_head=40, n_kv_head=8, n_embd=5120, intermediate_size=16384,
                             seq_len=4096, context=131072, vocab_size=202048, rope_theta=500000.0,
                             tie_embeddings=False, n_experts=128, experts_per_token=1, expert_width=8192,
                             shared_expert_width=8192, moe_every=2, router_aux_coef=0.0),
}
# What a preset leaves unsaid is the plain Llama's: no head width of its own, no rope scaling, no window.
_PLAIN = dict(head_width=0, rope_scaling="none", rope_factor=8.0, rope_low_freq_factor=1.0,
              rope_high_freq_factor=4.0, rope_original_context=8192, rope_beta_fast=32.0, rope_beta_slow=1.0,
              rope_truncate=True, rope_attention_factor=0.0, sliding_window=0, sliding_window_pattern=0,
              rope_local_theta=0.0, query_pre_attn_scalar=0, attn_softcap=0.0, final_softcap=0.0,
              n_experts=0, experts_per_token=2, expert_width=0, norm_topk_prob=False, shared_expert_width=0,
              moe_every=1, mlp_only_layers="", router_aux_coef=0.001, full_attention_interval=4,
              partial_rotary=0.25, linear_conv_kernel=4, linear_key_heads=16, linear_value_heads=32,
              linear_key_width=128, linear_value_width=128, q_lora_rank=0, kv_lora_rank=512, qk_rope_dim=64,
              qk_nope_dim=128, v_head_dim=128, rope_interleave=True, rope_mscale=0.0, rope_mscale_all_dim=0.0,
              first_dense_layers=0, shared_experts=1, expert_groups=1, expert_groups_per_token=1,
              routed_scaling=1.0, routing_bias_speed=0.001, mtp_layers=0, llama4_scaling_beta=0.1,
              attention_bias=False, use_qk_norm=False)
PRESETS = {name: {**_PLAIN, **values} for name, values in PRESETS.items()}


# The Llama family: one decoder (model/llama.py) whose members differ in options each implies. qwen2: biases on q, k
# and v; qwen3: RMSNorm of q and k per head; mistral and phi3: a sliding window (--sliding-window; Phi-3's fused
# projections are a matter of its files, hub/mapping.py). Every member takes
# --head-width and --rope-scaling, as their Hugging Face configs do.
# gemma2 and gemma3: Gemma's block (four (1 + w) RMSNorms, GeGLU, a scaled embedding), sliding and global layers
# alternating (--sliding-window-pattern), --query-pre-attn-scalar; Gemma 2's soft-caps, Gemma 3's q/k norms and
# local rotary base (--rope-local-theta).
# The mixtures of experts (model/moe.py: a router and experts in place of the MLP, --n-experts): qwen3_moe (Qwen3's
# attention), qwen2_moe (Qwen2's, and a shared expert behind a sigmoid gate), mixtral (Mistral's, top-2 always
# renormalised), olmoe (q/k norms over the whole projection, not per head).
# gpt_oss: gpt-oss's attention (sinks, q/k/v/o biases, YaRN, sliding and full layers alternating) and its experts'
# options (a router with a bias and a softmax over the top-k logits, experts with biases and a clamped SwiGLU).
# qwen3_5 and qwen3_5_moe: Qwen3.5's hybrid (model/qwen35.py), Gated DeltaNet linear-attention layers with every
# --full-attention-interval-th layer a gated attention layer; the MoE's experts always renormalised, a shared expert.
QWEN35 = ("qwen3_5", "qwen3_5_moe")
# deepseek_v3: DeepSeek-V3's decoder (model/deepseek.py; DeepSeek-V3/V3.1/R1, Kimi K2): multi-head latent attention
# (model/mla.py), the first --first-dense-layers layers dense, the others experts with shared experts, routed by
# sigmoid scores with group-limited top-k and a load-balancing bias (model/group_routing.py).
# mistral4: Mistral 4's decoder, DeepSeek-V3's with a softmax router (group-limited top-k on the probabilities, no
# bias), always YaRN, and each query scaled by its position (--llama4-scaling-beta).
DEEPSEEK = ("deepseek_v3", "mistral4")
# glm4_moe: GLM-4.5's decoder (model/glm.py; GLM-4.5, GLM-4.5-Air, GLM-4.6/4.7): the Llama family's grouped-query
# attention with partial rotary, q/k/v biases (--attention-bias) and per-head q/k norms (--use-qk-norm), and
# DeepSeek-V3's MLPs (dense first layers, then group-routed experts with shared experts).
GLM = ("glm4_moe",)
# The members whose experts are DeepSeek-V3's (model/group_routing.py): --first-dense-layers, shared experts,
# group-limited routing (sigmoid scores and a load-balancing bias; Mistral 4's softmax without one) and, but Mistral
# 4's, multi-token-prediction layers kept through an export.
GROUP_ROUTED = (*DEEPSEEK, *GLM)
# llama4: Llama 4's text decoder (model/llama4.py): experts on every --moe-every-th layer (a shared expert beside them,
# the router's sigmoid scores on the experts' input), chunked local attention on its rotary layers, global attention
# without rotary on every --nope-every-th layer (with attention temperature tuning), weightless q/k L2 norms.
LLAMA4 = ("llama4",)
# gemma4: Gemma 4's text decoder (model/gemma4.py): sliding and global layers of different widths (--global-head-width,
# --global-kv-heads, keys as values on the global layers with --k-eq-v) and rotaries (the global layers' partial,
# --partial-rotary), the last --kv-shared-layers layers reading the keys and values of the last earlier layer of their
# kind, a per-layer input embedding (--per-layer-width) added after every block; plain w RMSNorms, GeGLU.
GEMMA4 = ("gemma4",)
MOE = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "gpt_oss", "qwen3_5_moe", *DEEPSEEK, *LLAMA4, *GLM)
LLAMA_FAMILY = ("llama", "qwen2", "qwen3", "mistral", "phi3", "gemma2", "gemma3", *MOE, "qwen3_5", *GEMMA4)
GEMMA = ("gemma2", "gemma3")
WINDOWED = ("mistral", "phi3", *GEMMA, "mixtral", "gpt_oss", *GEMMA4)  # the members with a sliding window
# the members whose sliding and global layers alternate (--sliding-window-pattern)
ALTERNATING = (*GEMMA, "gpt_oss", *GEMMA4)
ARCHS = ("gpt2", *LLAMA_FAMILY)
ROPE_SCALINGS = ("none", "llama3", "linear", "yarn")

# The kinds of model a setting may need (the model is known once the preset or --init-from's config.json is read).
EXPERTS = Scope("mixture-of-experts models", lambda cfg: cfg.model.n_experts > 0,
                lambda cfg, model: f"{model} has no experts")
# gpt-oss's top-k weights are a softmax over the top-k logits (transformers' GptOssTopKRouter): they sum to 1 already,
# and its config has no norm_topk_prob
RENORMALIZABLE = Scope("mixture-of-experts models but gpt_oss",
                       lambda cfg: cfg.model.n_experts > 0 and cfg.model.arch != "gpt_oss",
                       lambda cfg, model: f"{model} has no experts" if not cfg.model.n_experts else
                       f"{model} is --arch gpt_oss, whose top-k weights are a softmax over them: they sum to 1")
LLAMA_MODELS = Scope("the Llama family's models (rotary positions)", lambda cfg: cfg.model.llama_family,
                     lambda cfg, model: f"{model} is --arch {cfg.model.arch}")


def _rope_scaling(*kinds: str) -> Scope:
    return option_scope("--rope-scaling", lambda cfg: cfg.model.rope_scaling, *kinds)


@dataclass
class ModelConfig:
    arch: str = setting("gpt2", "architecture: gpt2 (learned positions, LayerNorm, GELU MLP, biases), llama "
                        "(rotary positions, RMSNorm, SwiGLU MLP, grouped-query attention, no biases), or a member of "
                        "the Llama family: qwen2 (biases on q, k and v), qwen3 (RMSNorm of q and k per head), "
                        "mistral (sliding-window attention), phi3 (Phi-3: a sliding window, fused projections in its "
                        "files), gemma2 (Gemma 2: (1 + w) RMSNorms around attention and MLP, GeGLU, a scaled "
                        "embedding, sliding and global layers alternating, soft-capped logits), gemma3 (Gemma 3: "
                        "Gemma 2's block with q/k norms and a local rotary base instead of the soft-caps), or a "
                        "mixture of experts (--n-experts): qwen3_moe, qwen2_moe (a shared expert), mixtral, olmoe, "
                        "gpt_oss (attention sinks, biases, alternating windows; biased experts, clamped SwiGLU); "
                        "qwen3_5 and qwen3_5_moe (Qwen3.5: Gated DeltaNet linear-attention layers and gated attention "
                        "layers); deepseek_v3 (DeepSeek-V3, Kimi K2: multi-head latent attention, sigmoid "
                        "group-limited routing, shared experts); mistral4 (Mistral 4: DeepSeek-V3's decoder with "
                        "softmax routing and position-scaled queries); glm4_moe (GLM-4.5: grouped-query attention "
                        "with partial rotary, DeepSeek-V3's routing and shared experts); llama4 (Llama 4: chunked "
                        "attention, layers without rotary, sigmoid-routed experts and a shared expert); gemma4 (Gemma "
                        "4: sliding and wider global layers, keys and values shared across the last layers, per-layer "
                        "input embeddings)",
                        rule=one_of(*ARCHS))
    n_layer: int = setting(2, "transformer blocks", rule=POSITIVE)
    n_head: int = setting(4, "attention heads", rule=POSITIVE)
    n_kv_head: int = setting(0, "key/value heads of grouped-query attention (Llama family; divides --n-head)",
                             rule=NON_NEGATIVE, shown="--n-head", applies=LLAMA_MODELS)
    n_embd: int = setting(32, "embedding width", rule=POSITIVE)
    head_width: int = setting(0, "width of each attention head, Hugging Face's head_dim (Llama family; Qwen3's "
                              "differs from --n-embd / --n-head)", rule=NON_NEGATIVE, shown="--n-embd / --n-head",
                              applies=LLAMA_MODELS)
    intermediate_size: int = setting(0, "the MLP's hidden width", rule=NON_NEGATIVE, shown="4 x --n-embd")
    seq_len: int = setting(16, "tokens per sequence: the training window", rule=POSITIVE)
    context: int = setting(0, "positions the model holds, exported as its context (GPT-2's position table); an "
                              "--init-from model's comes with it: a shorter window trains it whole",
                           rule=NON_NEGATIVE, shown="--seq-len")
    vocab_size: int = setting(64, "vocabulary size; when not given, the data's", rule=POSITIVE,
                              shown="the data's; synthetic data: 64")
    rope_theta: float = setting(10000.0, "rotary embeddings' base (llama)", rule=POSITIVE, applies=LLAMA_MODELS)
    rope_scaling: str = setting("none", "rotary frequencies rescaled for a longer context: none, llama3 (Llama "
                                "3.1's, with the four --rope-* settings below), linear (gemma3's global layers: "
                                "every frequency slowed by --rope-factor) or yarn (YaRN, as transformers' rope_type "
                                "yarn: --rope-factor, --rope-original-context and the --rope-beta-*, --rope-truncate "
                                "and --rope-attention-factor settings)", rule=one_of(*ROPE_SCALINGS),
                                applies=LLAMA_MODELS)
    rope_factor: float = setting(8.0, "llama3, linear and yarn rope scaling: how much the (low) frequencies are "
                                 "slowed", rule=POSITIVE, applies=_rope_scaling("llama3", "linear", "yarn"))
    rope_low_freq_factor: float = setting(1.0, "llama3 rope scaling: wavelengths above original context / this are "
                                          "slowed by --rope-factor", rule=POSITIVE, applies=_rope_scaling("llama3"))
    rope_high_freq_factor: float = setting(4.0, "llama3 rope scaling: wavelengths below original context / this "
                                           "are kept (in between: interpolated)", rule=POSITIVE,
                                           applies=_rope_scaling("llama3"))
    rope_original_context: int = setting(8192, "llama3 and yarn rope scaling: the context the model was pretrained "
                                         "at", rule=POSITIVE, applies=_rope_scaling("llama3", "yarn"))
    rope_beta_fast: float = setting(32.0, "yarn rope scaling: frequencies turning more than this many times over the "
                                    "original context are kept (transformers' beta_fast)", rule=POSITIVE,
                                    applies=_rope_scaling("yarn"))
    rope_beta_slow: float = setting(1.0, "yarn rope scaling: frequencies turning fewer than this many times over the "
                                    "original context are slowed by --rope-factor (in between: a linear ramp; "
                                    "transformers' beta_slow)", rule=POSITIVE, applies=_rope_scaling("yarn"))
    rope_truncate: bool = setting(True, "yarn rope scaling: the ramp's ends rounded to whole dimensions "
                                  "(transformers' truncate; gpt-oss: --no-rope-truncate)",
                                  applies=_rope_scaling("yarn"))
    rope_attention_factor: float = setting(0.0, "yarn rope scaling: cos and sin are multiplied by this (0: YaRN's "
                                           "0.1 ln(--rope-factor) + 1; transformers' attention_factor)",
                                           rule=NON_NEGATIVE, shown="YaRN's own", applies=_rope_scaling("yarn"))
    sliding_window: int = setting(0, "each token attends to at most this many tokens, itself included (mistral, "
                                  "phi3, gemma2, gemma3; 0: all earlier tokens)", rule=NON_NEGATIVE, shown="0: none",
                                  applies=archs_scope(*WINDOWED))
    sliding_window_pattern: int = setting(0, "with --sliding-window, every N-th layer (layers N-1, 2N-1, ...) is "
                                          "global, the others sliding (Gemma 2: 2, Gemma 3: 6; 0: every layer "
                                          "slides)", rule=NON_NEGATIVE, shown="0: every layer",
                                          applies=archs_scope(*ALTERNATING))
    rope_local_theta: float = setting(0.0, "rotary base of the sliding layers (gemma3's rope_local_base_freq, "
                                      "gemma4's sliding rope_theta; 0: --rope-theta, unscaled)", rule=NON_NEGATIVE, shown="--rope-theta",
                                      applies=archs_scope("gemma3", *GEMMA4))
    query_pre_attn_scalar: int = setting(0, "attention scores are scaled by 1 / sqrt(this) (gemma2, gemma3; 0: "
                                           "the head width)", rule=NON_NEGATIVE, shown="the head width",
                                           applies=archs_scope(*GEMMA))
    attn_softcap: float = setting(0.0, "attention scores soft-capped to (-S, S) by S tanh(score / S) (gemma2; 0: "
                                  "none)", rule=NON_NEGATIVE, shown="0: none", applies=archs_scope("gemma2"))
    final_softcap: float = setting(0.0, "the head's logits soft-capped to (-S, S) by S tanh(logit / S) (gemma2, "
                                   "gemma3, gemma4; 0: none)", rule=NON_NEGATIVE, shown="0: none",
                                   applies=archs_scope(*GEMMA, *GEMMA4))
    n_experts: int = setting(0, "experts of each MoE layer (qwen3_moe, qwen2_moe, mixtral, olmoe; Hugging Face's "
                             "num_experts; gemma4: beside the MLP, enable_moe_block); 0: a dense MLP", rule=NON_NEGATIVE,
                             shown="0: none", applies=archs_scope(*MOE, *GEMMA4))
    experts_per_token: int = setting(2, "experts each token is routed to (top-k, num_experts_per_tok)", rule=POSITIVE,
                                     applies=EXPERTS)
    expert_width: int = setting(0, "each expert's hidden width (moe_intermediate_size)", rule=NON_NEGATIVE,
                                shown="--intermediate-size", applies=EXPERTS)
    norm_topk_prob: bool = setting(False, "the top-k routing weights renormalised to sum to 1 (norm_topk_prob; "
                                   "mixtral always; gpt_oss's sum to 1 as they are)", applies=RENORMALIZABLE)
    shared_expert_width: int = setting(0, "qwen2_moe, qwen3_5_moe, llama4: the width of the expert every token goes "
                                       "through beside its routed ones, gated by a sigmoid (llama4's: not gated; 0: "
                                       "none)", rule=NON_NEGATIVE, shown="0: none",
                                       applies=archs_scope("qwen2_moe", "qwen3_5_moe", *LLAMA4))
    moe_every: int = setting(1, "every N-th layer (layers N-1, 2N-1, ...) has experts, the others a dense MLP of "
                             "--intermediate-size (decoder_sparse_step)", rule=POSITIVE, applies=EXPERTS)
    mlp_only_layers: str = setting("", "layers with a dense MLP instead of experts, comma-separated (mlp_only_layers)",
                                   shown="none", applies=EXPERTS)
    router_aux_coef: float = setting(0.001, "the model's weight of the load-balancing loss (router_aux_loss_coef; "
                                     "--moe-aux-coef overrides it for a run)", rule=NON_NEGATIVE, applies=EXPERTS)
    full_attention_interval: int = setting(4, "qwen3_5: every N-th layer (layers N-1, 2N-1, ...) is a gated "
                                           "attention layer, the others Gated DeltaNet linear-attention layers",
                                           rule=POSITIVE, applies=archs_scope(*QWEN35))
    partial_rotary: float = setting(0.25, "qwen3_5, glm4_moe: the share of each attention head's width that rotary "
                                    "rotates, its first units (partial_rotary_factor; GLM-4.5's 0.5); gemma4: its "
                                    "global layers' (their proportional rotary's frequencies as the whole head's, the "
                                    "rest unrotated)",
                                    rule=Rule("must be in (0, 1]", lambda v: 0 < v <= 1),
                                    applies=archs_scope(*QWEN35, *GLM, *GEMMA4))
    linear_conv_kernel: int = setting(4, "qwen3_5: the causal convolution's width over the linear-attention layers' "
                                      "q, k and v (linear_conv_kernel_dim)", rule=POSITIVE,
                                      applies=archs_scope(*QWEN35))
    linear_key_heads: int = setting(16, "qwen3_5: query and key heads of the linear-attention layers "
                                    "(linear_num_key_heads)", rule=POSITIVE, applies=archs_scope(*QWEN35))
    linear_value_heads: int = setting(32, "qwen3_5: value heads of the linear-attention layers, a multiple of the key "
                                      "heads (linear_num_value_heads)", rule=POSITIVE, applies=archs_scope(*QWEN35))
    linear_key_width: int = setting(128, "qwen3_5: each linear-attention query and key head's width "
                                    "(linear_key_head_dim)", rule=POSITIVE, applies=archs_scope(*QWEN35))
    linear_value_width: int = setting(128, "qwen3_5: each linear-attention value head's width "
                                      "(linear_value_head_dim)", rule=POSITIVE, applies=archs_scope(*QWEN35))
    q_lora_rank: int = setting(0, "deepseek_v3: the rank of the queries' low-rank projection (q_a_proj, its RMSNorm, "
                               "q_b_proj; 0: one q_proj)", rule=NON_NEGATIVE, shown="0: q_proj",
                               applies=archs_scope(*DEEPSEEK))
    kv_lora_rank: int = setting(512, "deepseek_v3: the width of the keys' and values' shared latent (kv_lora_rank)",
                                rule=POSITIVE, applies=archs_scope(*DEEPSEEK))
    qk_rope_dim: int = setting(64, "deepseek_v3: each query head's rotary units, and the one rotary key every head "
                               "shares (qk_rope_head_dim)", rule=POSITIVE, applies=archs_scope(*DEEPSEEK))
    qk_nope_dim: int = setting(128, "deepseek_v3: each query and key head's units without rotary "
                               "(qk_nope_head_dim)", rule=POSITIVE, applies=archs_scope(*DEEPSEEK))
    v_head_dim: int = setting(128, "deepseek_v3: each value head's width (v_head_dim)", rule=POSITIVE,
                              applies=archs_scope(*DEEPSEEK))
    rope_interleave: bool = setting(True, "deepseek_v3: the rotary units' pairs are adjacent (x0, x1), (x2, x3), ... "
                                    "as DeepSeek's files store them (rope_interleave; --no-rope-interleave: "
                                    "rotate-half pairs)", applies=archs_scope(*DEEPSEEK))
    rope_mscale: float = setting(0.0, "deepseek_v3 with yarn rope scaling: YaRN's mscale (0: none)",
                                 rule=NON_NEGATIVE, applies=archs_scope(*DEEPSEEK))
    rope_mscale_all_dim: float = setting(0.0, "deepseek_v3 with yarn rope scaling: mscale_all_dim, which also scales "
                                         "the attention's softmax by (0.1 mscale_all_dim ln(factor) + 1)^2 (0: none)",
                                         rule=NON_NEGATIVE, applies=archs_scope(*DEEPSEEK))
    first_dense_layers: int = setting(0, "deepseek_v3, glm4_moe: the first N layers have a dense MLP of "
                                      "--intermediate-size, the others experts (first_k_dense_replace)",
                                      rule=NON_NEGATIVE, applies=archs_scope(*GROUP_ROUTED))
    shared_experts: int = setting(1, "deepseek_v3, glm4_moe: shared experts every token goes through, as one MLP of "
                                  "this many times --expert-width (n_shared_experts)", rule=POSITIVE,
                                  applies=archs_scope(*GROUP_ROUTED))
    expert_groups: int = setting(1, "deepseek_v3, glm4_moe: the experts split into this many groups; a token's "
                                 "experts come from its --expert-groups-per-token best groups (n_group)",
                                 rule=POSITIVE, applies=archs_scope(*GROUP_ROUTED))
    expert_groups_per_token: int = setting(1, "deepseek_v3, glm4_moe: the groups a token's experts may come from, "
                                           "each group scored by its two best experts (topk_group)", rule=POSITIVE,
                                           applies=archs_scope(*GROUP_ROUTED))
    routed_scaling: float = setting(1.0, "deepseek_v3, glm4_moe: the routed experts' weights are multiplied by this "
                                    "(routed_scaling_factor)", rule=POSITIVE, applies=archs_scope(*GROUP_ROUTED))
    routing_bias_speed: float = setting(0.001, "deepseek_v3, glm4_moe: after each optimizer step every MoE layer's "
                                        "e_score_correction_bias moves by this times sign(mean load - expert load), "
                                        "the step's loads summed over every rank (DeepSeek-V3's auxiliary-loss-free "
                                        "balancing; 0: frozen)", rule=NON_NEGATIVE,
                                        applies=archs_scope("deepseek_v3", *GLM))
    mtp_layers: int = setting(0, "deepseek_v3, glm4_moe, qwen3_5, qwen3_5_moe: multi-token-prediction layers the "
                              "--init-from folder holds (num_nextn_predict_layers after the decoder's; Qwen3.5's "
                              "mtp_num_hidden_layers, under mtp.): trained or kept frozen as --mtp says",
                              rule=NON_NEGATIVE, applies=archs_scope("deepseek_v3", *GLM, *QWEN35))
    mtp: str = setting("frozen", "the multi-token-prediction layers (--mtp-layers): frozen (set aside at import, "
                       "copied as they are into an hf export) or train (depth k predicts the token k+1 places past "
                       "the next, its loss joins the main one weighted by --mtp-loss-weight: model/mtp.py)",
                       rule=one_of("frozen", "train"), applies=archs_scope("deepseek_v3", *GLM, *QWEN35))
    mtp_loss_weight: float = setting(0.1, "--mtp train: lambda, the weight of the MTP loss, the mean of the D "
                                     "depths' losses (DeepSeek-V3's lambda; Megatron-LM's --mtp-loss-scaling-factor)",
                                     rule=NON_NEGATIVE, applies=archs_scope("deepseek_v3", *GLM, *QWEN35))
    attention_bias: bool = setting(False, "glm4_moe: biases on q, k and v (attention_bias; GLM-4.5's releases have "
                                   "them)", applies=archs_scope(*GLM))
    use_qk_norm: bool = setting(False, "glm4_moe: an RMSNorm of each q and k head before rotary, one gain of the "
                                "head width (use_qk_norm; GLM-4.5's, not GLM-4.5-Air's)", applies=archs_scope(*GLM))
    llama4_scaling_beta: float = setting(0.1, "mistral4: each query is scaled by 1 + beta ln(1 + floor(position / "
                                         "--rope-original-context)) (rope_parameters' llama_4_scaling_beta; 0: "
                                         "none)", rule=NON_NEGATIVE, applies=archs_scope("mistral4"))
    nope_every: int = setting(4, "llama4: every N-th layer (layers N-1, 2N-1, ...) has no rotary and attends to "
                              "every earlier token (no_rope_layer_interval); the others rotary and chunked",
                              rule=POSITIVE, applies=archs_scope(*LLAMA4))
    attention_chunk: int = setting(8192, "llama4: the rotary layers attend within chunks of this many positions "
                                   "(attention_chunk_size; 0: every earlier token)", rule=NON_NEGATIVE,
                                   applies=archs_scope(*LLAMA4))
    qk_l2_norm: bool = setting(True, "llama4: the rotary layers' q and k heads L2-normalised, no gain (use_qk_norm)",
                               applies=archs_scope(*LLAMA4))
    temperature_tuning: bool = setting(True, "llama4: the layers without rotary scale each query by 1 + "
                                       "--temperature-scale ln(1 + floor((position + 1) / --temperature-floor)) "
                                       "(attn_temperature_tuning)", applies=archs_scope(*LLAMA4))
    temperature_floor: int = setting(8192, "llama4: the positions per step of the temperature tuning (floor_scale)",
                                     rule=POSITIVE, applies=archs_scope(*LLAMA4))
    temperature_scale: float = setting(0.1, "llama4: the strength of the temperature tuning (attn_scale)",
                                       rule=NON_NEGATIVE, applies=archs_scope(*LLAMA4))
    global_head_width: int = setting(512, "gemma4: the width of each attention head of the global layers "
                                     "(global_head_dim; --head-width is the sliding layers')", rule=POSITIVE,
                                     applies=archs_scope(*GEMMA4))
    k_eq_v: bool = setting(False, "gemma4: the global layers have no v_proj, their values are their keys' projection "
                           "(attention_k_eq_v), and --global-kv-heads KV heads", applies=archs_scope(*GEMMA4))
    global_kv_heads: int = setting(0, "gemma4 with --k-eq-v: the global layers' KV heads (num_global_key_value_heads; "
                                   "0: --n-kv-head)", rule=NON_NEGATIVE, shown="--n-kv-head",
                                   applies=archs_scope(*GEMMA4))
    kv_shared_layers: int = setting(0, "gemma4: the last N layers compute no keys and values of their own: each reads "
                                    "those of the last earlier layer of its kind, sliding or global "
                                    "(num_kv_shared_layers)", rule=NON_NEGATIVE, applies=archs_scope(*GEMMA4))
    per_layer_width: int = setting(0, "gemma4: each layer's input embedding width (hidden_size_per_layer_input): a "
                                   "token's row of a table of n_layer x this, plus a projection of its embedding, "
                                   "gates a residual added after every block (0: none)", rule=NON_NEGATIVE,
                                   applies=archs_scope(*GEMMA4))
    double_wide_mlp: bool = setting(False, "gemma4: the layers of --kv-shared-layers have an MLP of twice "
                                    "--intermediate-size (use_double_wide_mlp)", applies=archs_scope(*GEMMA4))
    norm_eps: float = setting(1e-5, "epsilon of the LayerNorms (gpt2) or RMSNorms (llama)", rule=POSITIVE)
    tie_embeddings: bool = setting(True, "the output head is the token embedding (--no-tie-embeddings: a matrix of "
                                   "its own; llama)")
    pad_token_id: int = setting(-1, "the padding token: its embedding row starts at zero and its lookups train "
                                "nothing (Hugging Face's pad_token_id, nn.Embedding's padding_idx; Llama family)",
                                rule=Rule("must be a token id or -1 (none)", lambda v: v >= -1),
                                shown="-1: none; with --init-from the model's")

    @property
    def padding_idx(self) -> int | None:
        """The token embedding's padding row (nn.Embedding's padding_idx), or None."""
        return None if self.pad_token_id == -1 else self.pad_token_id

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def positions(self) -> int:
        """The positions the model holds: its context, or the training window where none is set."""
        return self.context or self.seq_len

    def global_layer(self, layer: int) -> bool:
        """Whether `layer` is one of Gemma 4's global layers (of their own width, KV heads and rotary)."""
        return self.arch in GEMMA4 and not self.sliding(layer)

    def attention_shape(self, layer: int) -> tuple[int, int]:
        """(KV heads, head width) of `layer`'s keys and values: Gemma 4's global layers' own, else every layer's."""
        if self.global_layer(layer):
            return (self.global_kv_heads or self.kv_heads) if self.k_eq_v else self.kv_heads, self.global_head_width
        return self.kv_heads, self.head_dim

    def kv_source(self, layer: int) -> int:
        """The layer whose keys and values `layer` attends with: itself, or for Gemma 4's last --kv-shared-layers
        the last layer of its kind before them (transformers' kv_sharing_modes)."""
        first = self.n_layer - self.kv_shared_layers
        if self.arch not in GEMMA4 or layer < first:
            return layer
        return max(i for i in range(first) if self.sliding(i) == self.sliding(layer))

    def ffn_width_of(self, layer: int) -> int:
        """`layer`'s MLP width: Gemma 4's shared-KV layers' doubled with --double-wide-mlp."""
        doubled = self.double_wide_mlp and self.kv_source(layer) != layer
        return self.ffn_width * (2 if doubled else 1)

    @property
    def head_dim(self) -> int:
        """Each attention head's width: --head-width, or the embedding width over the heads (DeepSeek-V3's: a query
        and key head's, its units without rotary and its rotary units)."""
        if self.arch in DEEPSEEK:
            return self.qk_nope_dim + self.qk_rope_dim
        return self.head_width or self.n_embd // self.n_head

    @property
    def llama_family(self) -> bool:
        return self.arch in LLAMA_FAMILY

    @property
    def qkv_bias(self) -> bool:
        """Biases on q, k and v: Qwen2's and Qwen2-MoE's (not on the output projection), gpt-oss's (there too:
        o_bias), GLM-4.5's with --attention-bias."""
        return self.arch in ("qwen2", "qwen2_moe", "gpt_oss") or (self.arch in GLM and self.attention_bias)

    @property
    def gpt_oss_experts(self) -> bool:
        """gpt-oss's experts: a router with a bias whose top-k logits are softmaxed (not the top-k of the softmax),
        experts with biases and a clamped SwiGLU (model/moe.py)."""
        return self.arch == "gpt_oss"

    @property
    def o_bias(self) -> bool:
        """A bias on the attention's output projection: gpt-oss's."""
        return self.arch == "gpt_oss"

    @property
    def attn_sinks(self) -> bool:
        """A learned logit per head in each softmax's denominator, a key no value comes with (gpt-oss's sinks)."""
        return self.arch == "gpt_oss"

    @property
    def qk_norm(self) -> bool:
        """An RMSNorm of each q and k head (one gain of head_dim shared by the heads) before rotary: Qwen3's,
        Qwen3-MoE's and Gemma 3's; GLM-4.5's with --use-qk-norm."""
        return self.arch in ("qwen3", "gemma3", "qwen3_moe") or (self.arch in GLM and self.use_qk_norm)

    @property
    def qk_norm_whole(self) -> bool:
        """An RMSNorm of the whole q and k projections (all heads at once, a gain per unit): OLMoE's."""
        return self.arch == "olmoe"

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def dense_layers(self) -> tuple[int, ...]:
        """--mlp-only-layers as numbers (validate checks them)."""
        return tuple(int(t) for t in self.mlp_only_layers.split(",") if t.strip())

    def has_experts(self, layer: int) -> bool:
        """Whether `layer`'s MLP is a mixture of experts (every --moe-every-th layer, but --mlp-only-layers)."""
        if self.arch in GROUP_ROUTED:
            return self.moe and layer >= self.first_dense_layers
        return self.moe and (layer + 1) % self.moe_every == 0 and layer not in self.dense_layers

    @property
    def softmax_router(self) -> bool:
        """Whether DeepSeek's group-limited router scores with a softmax and has no load-balancing bias: Mistral 4's
        (DeepSeek-V3's: sigmoid scores and e_score_correction_bias)."""
        return self.arch == "mistral4"

    @property
    def renormalizes(self) -> bool:
        """Whether the top-k routing weights are divided by their sum: --norm-topk-prob (not gpt-oss's, a softmax over
        the top-k: a preset's value carried to --arch gpt_oss divided them again, in bf16 rounding them and saving
        the quotient's tensors in bf16), and Mixtral's always."""
        return self.norm_topk_prob and not self.gpt_oss_experts or self.arch in ("mixtral", "qwen3_5_moe")

    def rotary(self, layer: int) -> bool:
        """Whether `layer` rotates q and k: every layer but Llama 4's every --nope-every-th."""
        return self.arch not in LLAMA4 or (layer + 1) % self.nope_every != 0

    def linear_attention(self, layer: int) -> bool:
        """Whether `layer` is a Gated DeltaNet linear-attention layer (Qwen3.5's; every other is attention)."""
        return self.arch in QWEN35 and (layer + 1) % self.full_attention_interval != 0

    @property
    def rotary_dim(self) -> int:
        """The width of each head that rotary rotates: the whole head, or Qwen3.5's partial share of it."""
        if self.arch in DEEPSEEK:
            return self.qk_rope_dim
        return int(self.head_dim * self.partial_rotary) if self.arch in (*QWEN35, *GLM) else self.head_dim

    @property
    def expert_ffn(self) -> int:
        return self.expert_width or self.ffn_width

    @property
    def gemma(self) -> bool:
        """Gemma's block: (1 + w) RMSNorms in fp32, norms after attention and MLP too, GeGLU, a scaled embedding."""
        return self.arch in GEMMA

    def sliding(self, layer: int) -> bool:
        """Whether `layer` attends within --sliding-window (else to every earlier token)."""
        if not self.sliding_window:
            return False
        return not self.sliding_window_pattern or (layer + 1) % self.sliding_window_pattern != 0

    @property
    def attn_scale(self) -> float:
        """The factor of q.k: 1 / sqrt(query_pre_attn_scalar or head_dim)."""
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def ffn_width(self) -> int:
        return self.intermediate_size or 4 * self.n_embd


@dataclass
class DataConfig:
    # What --data names is resolved in data/resolve.py.
    source: str = setting("python-stdlib", "python-stdlib (this Python's standard library as bytes), synthetic, "
                          "synthetic-varlen, a UTF-8 text file or folder, or token files (a folder with "
                          "train.bin/val.bin from zerotrain prepare, nanoGPT or llm.c); several, each PATH:WEIGHT "
                          "(TOML: a list): a mixture, rows drawn per step by weight", key="data", many=True)
    val_data: str = setting("", "validation data for --eval-every, as --data: a text file or folder or token files "
                            "(its validation split if it has one, else all of it)", shown="--data's validation split")
    # Packed sequences (True), or one document per sequence, padded and label-masked (False; documents
    # end with the end-of-text token).
    pack: bool = setting(True, "pack documents into full sequences (--no-pack: one document per sequence, "
                         "padded and masked)", methods=("sft",))
    # A record (JSON Lines, or a document with --no-pack) longer than a row: refused, or cut to its first seq_len + 1
    # tokens; never split over rows.
    truncate: bool = setting(False, "records longer than --seq-len + 1 tokens keep their first seq_len + 1 (else such "
                             "a record is refused, naming it)", methods=("sft",))
    glob: str = setting("**/*.txt", "a text folder's files", methods=("sft",))
    val_fraction: float = setting(0.05, "text: fraction of documents held out for validation (--method dpo with "
                                  "--eval-every and no --val-data: of the pairs' records)", rule=BELOW_ONE)
    cache_dir: str = setting("", "where text inputs are prepared", key="data_cache",
                             shown="$ZEROTRAIN_CACHE or ~/.cache/zerotrain", methods=("sft",))
    chat_template: str = setting("", "a Jinja chat template file to render chat records with for training, instead of "
                                 "the model's own or TRL's training variant of it", shown="the model's, or TRL's "
                                 "training variant of it", methods=("sft",))


@dataclass
class OptimConfig:
    lr: float = setting(3e-3, "peak learning rate", rule=POSITIVE, shown="0.003; with --init-from 2e-05")
    lr_schedule: str = setting("cosine", "the learning rate after warmup: cosine or linear decay to --min-lr-ratio x "
                               "--lr, constant, or wsd (warmup-stable-decay: --lr until the last --lr-decay-ratio of "
                               "the steps, then linear decay to --min-lr-ratio x --lr)",
                               rule=one_of("cosine", "linear", "constant", "wsd"))
    lr_decay_ratio: float = setting(0.2, "wsd: the share of the steps after warmup spent decaying", rule=FRACTION,
                                    applies=option_scope("--lr-schedule", lambda cfg: cfg.optim.lr_schedule, "wsd"))
    min_lr_ratio: float = setting(0.1, "final learning rate as a fraction of --lr", rule=FRACTION)
    warmup_steps: int = setting(-1, "linear warmup steps (-1: steps / 10, with --init-from steps x 0.03; at "
                                "least 1)", shown="steps/10; with --init-from steps x 0.03")
    weight_decay: float = setting(0.1, "AdamW weight decay on matrices", rule=NON_NEGATIVE,
                                  shown="0.1; with --init-from 0")
    beta1: float = setting(0.9, "AdamW's first-moment decay", rule=BELOW_ONE)
    beta2: float = setting(0.95, "AdamW's second-moment decay", rule=BELOW_ONE)
    eps: float = setting(1e-8, "AdamW's epsilon", rule=POSITIVE)
    grad_clip: float = setting(1.0, "clip the global gradient norm (0: off)", rule=NON_NEGATIVE)


@dataclass
class LaunchConfig:
    nproc: int = setting(1, "local ranks to spawn (ignored under torchrun)", rule=POSITIVE)
    device: str = setting("cpu", "cpu (gloo) or cuda (NCCL)", rule=one_of("cpu", "cuda"))
    threads: int = setting(0, "torch threads per rank (0: cores / local ranks)", rule=NON_NEGATIVE,
                           shown="cores / local ranks")
    timeout: float = setting(120.0, "collective timeout in seconds: a rank that stops answering fails the job",
                             rule=POSITIVE)
    io_timeout: float = setting(1800.0, "how long a rank waits in seconds for the others to write, read or verify "
                                "a checkpoint (saves, resume, restart, rollback), apart from --timeout",
                                rule=POSITIVE)
    max_restarts: int = setting(0, "restart the group after a worker dies, resuming from the newest checkpoint "
                                "that verifies (as torchrun's option)", rule=NON_NEGATIVE)
    deterministic: bool = setting(False, "CUDA: deterministic kernels (cuBLAS's fixed workspace, deterministic "
                                  "algorithms, no flash attention), so a resume is bitwise; without it a CUDA resume "
                                  "is equal within float noise (CPU runs are deterministic either way)")
    linear_attention_kernel: str = setting("auto", "qwen3_5: the Gated DeltaNet layers' delta rule and convolution "
                                           "on CUDA: fla (flash-linear-attention's fused kernels; needs the package "
                                           "and --device cuda), torch (zerotrain's plain torch), or auto: fla where "
                                           "it is installed, torch on CPU", rule=one_of("auto", "torch", "fla"),
                                           applies=archs_scope(*QWEN35))


@dataclass
class ParallelConfig:
    tp: int = setting(1, "tensor-parallel degree: ranks that split each layer's heads and MLP (divides --nproc; "
                      "rank = dp_index x tp + tp_index)", rule=POSITIVE)
    dp_replicate: int = setting(1, "hybrid sharding (FSDP2's HSDP): the data-parallel ranks form this many replica "
                                "groups; ZeRO shards its state over the ranks of a group and replicates it across the "
                                "groups (reduce-scatter within a group, then one all-reduce of the shard across the "
                                "groups); divides the data-parallel size (--nproc / --tp)", rule=POSITIVE)
    cp: int = setting(1, "context-parallel degree: each row split along its length over this many ranks of its DP "
                      "replica (zig-zag chunks, causal ring attention; ZeRO shards over them too; rank = (dp_index x cp "
                      "+ cp_index) x tp + tp_index); --seq-len divisible by 2 x cp", rule=POSITIVE)
    ep: int = setting(1, "expert-parallel degree: the experts of each MoE layer split in contiguous blocks over this "
                      "many consecutive DP ranks, tokens sent to their expert's rank and back by all-to-all (divides "
                      "the DP size and --n-experts)", rule=POSITIVE, applies=EXPERTS)
    precision: str = setting("fp32", "fp32, or bf16 parameters with an fp32 master shard (with --device cuda bf16 "
                             "unless given; fp32 there runs matmuls in TF32)", rule=one_of("fp32", "bf16"),
                             shown="fp32; bf16 with --device cuda")
    bucket_mb: float = setting(4.0, "gradient bucket size in MiB", rule=POSITIVE)
    overlap: str = setting("auto", "communicate during compute: reduce-scatter in backward, all-gather in the next "
                           "forward: on, off, or auto (on with CUDA, off on CPU)", rule=one_of("auto", "on", "off"))
    zero: int = setting(1, "ZeRO stage: 1 shards the optimizer state over the DP ranks; 2 also the gradients (each "
                        "bucket is reduce-scattered as its last gradient arrives, and its full-size storage freed); 3 "
                        "also the parameters (each transformer block's buckets gathered for its forward and again for "
                        "its backward, released after each)", rule=Rule("must be 1, 2 or 3", lambda v: v in (1, 2, 3)))
    grad_reduce: str = setting("auto", "how --zero 2 and 3 reduce accumulated gradients: micro-batch (each "
                               "micro-batch's buckets reduce-scattered into the owned fp32 shard, which accumulates in "
                               "a fixed order, as FSDP2 does: the shard and two buckets of gradient memory at any "
                               "--accum, --accum times the reduce-scatter traffic), step (every bucket's full-size "
                               "fp32 gradients held through the window, one reduce-scatter round per step: a full fp32 "
                               "gradient per rank at --accum > 1), or auto: micro-batch at --zero 3, step at --zero 2",
                               rule=one_of("auto", "step", "micro-batch"))
    activation_checkpointing: str = setting("none", "selective: keep each block's matmul and attention outputs and "
                                            "recompute the element-wise ops between them in the backward (norms, "
                                            "rotary, the gated unit); blocks: keep only each transformer block's "
                                            "input and recompute the block in the backward (less memory, more "
                                            "compute); full: the blocks, and the head with the loss too (not with "
                                            "--compile); or none",
                                            rule=one_of("none", "selective", "blocks", "full"))
    offload_activations: bool = setting(False, "keep what the forward saves for the backward in pinned host memory "
                                        "in between (with --activation-checkpointing: the blocks' inputs); CUDA only")

    @property
    def bucket_numel(self) -> int:
        """Values per gradient bucket (--bucket-mb of fp32)."""
        return max(1, int(self.bucket_mb * 2**20 / 4))


@dataclass
class LoopConfig:
    steps: int = setting(20, "optimizer steps", rule=POSITIVE)
    epochs: int = setting(0, "passes over the records instead of --steps (JSON Lines records, or documents with "
                          "--no-pack): each record once per epoch; the steps follow from the records and the global "
                          "batch, an epoch's last step taking what is left (0: --steps decides)", rule=NON_NEGATIVE,
                          methods=("sft",))
    micro_batch: int = setting(8, "sequences per rank per micro-batch", rule=POSITIVE)
    accum: int = setting(1, "micro-batches per optimizer step", rule=POSITIVE)
    seed: int = setting(0, "seed of the model init and the data")
    compile: bool = setting(False, "run the model's forward and backward through torch.compile")
    check_every: int = setting(10, "cross-rank drift check period in steps (0: only at the end)", rule=NON_NEGATIVE)
    eval_every: int = setting(0, "validation loss every K steps and at the end (0: never)", rule=NON_NEGATIVE)
    eval_batches: int = setting(8, "fixed validation batches of DP replicas x micro-batch sequences", rule=POSITIVE,
                                methods=("sft",))


@dataclass
class LoggingConfig:
    out: str = setting("", "run folder", shown="runs/<timestamp>")
    metrics: str = setting("", "metrics JSONL path", shown="<out>/metrics.jsonl")
    progress: bool = setting(True, "a progress line (--no-progress: none)")
    log_every: int = setting(10, "the host reads the steps' values (losses, gradient norms, flags) from the device "
                             "every N steps and at the first, the last, a checkpoint's and a validation's step: the guard judges "
                             "them and a stop takes effect there; with --no-progress, a line of the step's figures "
                             "then (0: no lines, and reads only at those steps)", rule=NON_NEGATIVE)
    tensorboard: bool = setting(False, "also log to <out>/tensorboard ('zerotrain[tb]')")
    wandb: str = setting("", "also log each step, the config and the summary to this Weights & Biases project, from "
                         "rank 0 ('zerotrain[wandb]'; WANDB_MODE=offline logs without a network)", shown="none")
    peak_flops: float = setting(0.0, "the peak FLOP/s of one device that MFU is measured against (0: CUDA devices "
                                "from zerotrain's table, at the run's precision; CPU: a matmul timed once and cached)",
                                rule=NON_NEGATIVE, shown="the device's")
    profile_steps: str = setting("", "trace steps A to B (A:B) with torch.profiler: one chrome trace per rank in "
                                 "<out>/profile/", rule=STEP_RANGE, shown="none")


@dataclass
class CheckpointConfig:
    dir: str = setting("", "checkpoint folder", key="ckpt_dir", shown="<out>/checkpoints")
    every: int = setting(0, "save every K steps (0: never)", key="ckpt_every", rule=NON_NEGATIVE)
    every_minutes: float = setting(0.0, "save every M minutes of wall clock (0: never); with --ckpt-every, "
                                   "whichever comes due first", key="ckpt_every_minutes", rule=NON_NEGATIVE)
    final_save: bool = setting(True, "commit a checkpoint when the run ends normally, its steps or epochs done "
                               "(--no-final-save: none but those --ckpt-every and --ckpt-every-minutes make; a stop "
                               "signal saves either way)")
    keep: int = setting(0, "committed checkpoints to keep (0: all)", rule=NON_NEGATIVE)
    resume: str = setting("", "'auto' (the newest checkpoint that verifies, if any) or a checkpoint folder",
                          shown="none")
    async_save: bool = setting(False, "write checkpoints in the background while training goes on")
    init_from: str = setting("", "start from these weights: a local Hugging Face folder (model_type gpt2, "
                             "llama, qwen2, qwen3, mistral, phi3, gemma2, gemma3_text, gemma3's language model, "
                             "qwen3_moe, qwen2_moe, mixtral or olmoe; "
                             "safetensors) or a zerotrain checkpoint or export; its architecture, sizes and "
                             "tokenizer come with it (weights only: a fresh optimizer and schedule)", shown="none")
    overwrite: bool = setting(False, "a fresh run may replace the checkpoints and metrics in its folder")


@dataclass
class GuardConfig:
    on_anomaly: str = setting("rollback", "rollback (restore the last checkpoint, skip the bad data) or abort: "
                              "what a non-finite loss or gradient norm or a loss spike does",
                              rule=one_of("rollback", "abort"))
    spike_factor: float = setting(3.0, "a loss above F x the median of the window is a spike", rule=ABOVE_ONE)
    spike_window: int = setting(20, "accepted steps the spike tests look back on: the loss median; the loss trend "
                                "and gradient-norm median of the outlier test, once full; the loss trend of the "
                                "ruin test (a loss back at ln(vocabulary)), from 5 steps; a window below 5 turns "
                                "both trend tests off", rule=POSITIVE)
    max_rollbacks: int = setting(3, "rollbacks allowed before the run stops with an error", rule=NON_NEGATIVE)


# The linears each architecture's blocks have, in Hugging Face's module names: what --lora-targets may name.
# Every member of the Llama family has Llama's (Phi-3's files fuse q, k, v and gate, up, but its model does not).
# Qwen3.5's: its attention layers' and its Gated DeltaNet layers' (in_proj_qkv, in_proj_z, in_proj_a, in_proj_b,
# out_proj; not the convolution), and the MLP's (the MoE's shared expert). Multi-head latent attention's are its
# low-rank projections (q_proj where the model has no query rank). Gemma 4's also its per-layer input's gate and
# projection (not the model's per_layer_model_projection, outside the blocks; a keys-as-values layer has no v_proj).
LORA_MODULES = {"gpt2": ("c_attn", "c_proj", "c_fc"),
                **{arch: ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
                   for arch in LLAMA_FAMILY},
                **{arch: ("q_proj", "k_proj", "v_proj", "o_proj", "in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b",
                          "out_proj", "gate_proj", "up_proj", "down_proj") for arch in QWEN35},
                **{arch: ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "gate_proj",
                          "up_proj", "down_proj") for arch in DEEPSEEK},
                **{arch: ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                          "per_layer_input_gate", "per_layer_projection") for arch in GEMMA4}}
ALL_LINEAR = "all"
LORA = Scope("LoRA runs (--lora-rank above 0)", lambda cfg: cfg.lora.rank > 0,
             lambda cfg, model: "this run trains every weight (--lora-rank 0)")
# A mixture of experts' routed experts, as --lora-targets names them: transformers holds them as 3-D tensors, not
# linears, so `all` (peft's all-linear on that model) leaves them out and a peft adapter cannot hold them.
LORA_EXPERTS = "experts"


@dataclass
class LoraConfig:
    # QLoRA (Dettmers et al. 2023) found adapters on every linear of the blocks needed to match full fine-tuning,
    # where attention-only adapters fall short; peft calls that choice "all-linear" (the head excluded), as here.
    rank: int = setting(0, "LoRA rank R: train low-rank adapters on the blocks' linears, the base frozen (0: every "
                        "weight trains)", key="lora_rank", rule=NON_NEGATIVE)
    alpha: float = setting(16.0, "LoRA alpha A: the adapters' output is scaled by A / R", key="lora_alpha",
                           rule=POSITIVE, applies=LORA)
    dropout: float = setting(0.0, "dropout on the adapters' input while training", key="lora_dropout",
                             rule=BELOW_ONE, applies=LORA)
    targets: str = setting(ALL_LINEAR, "the linears that get adapters, by Hugging Face module name, comma-separated "
                           "(the Llama family: q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj; Qwen3.5 "
                           "also its linear-attention layers' in_proj_qkv, in_proj_z, in_proj_a, in_proj_b, out_proj; "
                           "gpt2: c_attn, c_proj, c_fc), or all: every linear of the blocks (peft's all-linear, QLoRA's choice; "
                           "not the head; a mixture of experts' routed experts not either: name experts to adapt "
                           "each one's gate_proj, up_proj, down_proj)",
                           key="lora_targets", applies=LORA)

    def modules(self, arch: str) -> tuple[str, ...]:
        """The module names --lora-targets picks for `arch`, in the architecture's order."""
        if self.targets == ALL_LINEAR:
            return LORA_MODULES[arch]
        named = {t.strip() for t in self.targets.split(",")}
        return tuple(m for m in lora_target_names(arch) if m in named)


def lora_target_names(arch: str) -> tuple[str, ...]:
    """What --lora-targets may name for `arch`: its blocks' linears, and a mixture of experts' routed experts."""
    return LORA_MODULES[arch] + ((LORA_EXPERTS,) if arch in MOE else ())


DPO_LOSSES = ("sigmoid", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")  # losses without a reference model
WITH_REFERENCE = tuple(loss for loss in DPO_LOSSES if loss not in REFERENCE_FREE)


def _dpo_loss(*losses: str) -> Scope:
    return option_scope("--dpo-loss", lambda cfg: cfg.objective.dpo_loss, *losses)


GRPO_LOSSES = ("grpo", "dr_grpo", "dapo", "bnpo")  # training/grpo_loss.py's LOSS_TYPES
SCALE_REWARDS = ("group", "batch", "none")


@dataclass
class ObjectiveConfig:
    # What a batch is and its loss: training/objectives.py (sft), training/preference.py (dpo).
    method: str = setting("sft", "what the run trains on: sft (next-token loss on the data's tokens), dpo "
                          "(preference pairs {\"prompt\", \"chosen\", \"rejected\"}, with --init-from: docs/dpo.md) "
                          "or grpo (online RL on prompts {\"prompt\", ...} scored by --reward: docs/grpo.md)",
                          rule=one_of(*METHODS))
    dpo_loss: str = setting("sigmoid", "the preference loss of --method dpo: sigmoid (DPO), ipo, hinge, or simpo and "
                            "orpo (no reference model)", rule=one_of(*DPO_LOSSES), methods=("dpo",))
    dpo_beta: float = setting(0.1, "DPO's beta: the strength of the KL penalty against the reference (simpo, orpo: "
                              "their beta, the reward scale and the odds ratio's weight)", rule=POSITIVE,
                              methods=("dpo",))
    dpo_label_smoothing: float = setting(0.0, "sigmoid loss: the assumed probability that a pair's labels are "
                                         "flipped (robust DPO's; 0: plain DPO)", rule=Rule("must be in [0, 0.5)",
                                                                                          lambda v: 0 <= v < 0.5),
                                         methods=("dpo",), applies=_dpo_loss("sigmoid"))
    dpo_reference: str = setting("precomputed", "the reference log-probs: precomputed (from the initial weights, "
                                 "before step 1, over every pair; stored with the checkpoints) or live (each step: "
                                 "with LoRA the base with the adapters off; in full fine-tuning a frozen copy of the "
                                 "initial model, laid out like it)", rule=one_of("precomputed", "live"),
                                 methods=("dpo",), applies=_dpo_loss(*WITH_REFERENCE))
    simpo_gamma: float = setting(0.5, "simpo: the target reward margin gamma", rule=NON_NEGATIVE,
                                 methods=("dpo",), applies=_dpo_loss("simpo"))
    # grpo: TRL 1.16 GRPOConfig's names and defaults (training/grpo.py, docs/grpo.md)
    num_generations: int = setting(8, "GRPO: completions sampled per prompt (a group: their rewards' mean and std "
                                   "give each its advantage); --micro-batch counts completions",
                                   rule=Rule("must be at least 2", lambda v: v >= 2), methods=("grpo",))
    max_completion_length: int = setting(256, "GRPO: the most tokens a completion has (cut there, or at the first "
                                         "end-of-text or end-of-turn token)", rule=POSITIVE, methods=("grpo",))
    temperature: float = setting(1.0, "GRPO: the sampling temperature", rule=POSITIVE, methods=("grpo",))
    top_p: float = setting(1.0, "GRPO: nucleus sampling's mass (1: the whole vocabulary)",
                           rule=Rule("must be in (0, 1]", lambda v: 0 < v <= 1), methods=("grpo",))
    grpo_loss: str = setting("dapo", "GRPO's loss type (TRL's loss_type): grpo (each completion's token mean, then "
                             "the mean over completions), dr_grpo (the token sum / completions x "
                             "--max-completion-length), dapo (the global batch's token mean), bnpo (each "
                             "micro-batch's token mean)", rule=one_of(*GRPO_LOSSES), methods=("grpo",))
    grpo_beta: float = setting(0.0, "GRPO: the weight of the KL term against the reference, the initial model (0: "
                               "no reference model)", rule=NON_NEGATIVE, methods=("grpo",))
    grpo_epsilon: float = setting(0.2, "GRPO: the clip range of the policy ratio, below 1 (and above, unless "
                                  "--grpo-epsilon-high)", rule=POSITIVE, methods=("grpo",))
    grpo_epsilon_high: float = setting(-1.0, "GRPO: the clip range above 1 (DAPO's clip-higher; -1: --grpo-epsilon)",
                                       rule=Rule("must be positive, or -1 for --grpo-epsilon",
                                                 lambda v: v > 0 or v == -1), shown="--grpo-epsilon",
                                       methods=("grpo",))
    grpo_iterations: int = setting(1, "GRPO: optimizer steps on each step's rollouts (TRL's num_iterations, mu): "
                                   "above 1 the ratio is to the generating policy's log-probs", rule=POSITIVE,
                                   methods=("grpo",))
    scale_rewards: str = setting("group", "GRPO: the advantages' scale: the group's reward std, the batch's, or none "
                                 "(the centred reward)", rule=one_of(*SCALE_REWARDS), methods=("grpo",))
    mask_truncated_completions: bool = setting(False, "GRPO: a completion cut at --max-completion-length (no end "
                                               "token) is left out of the loss", methods=("grpo",))
    reward: str = setting("", "GRPO: a reward function: exact_answer (the record's \"answer\"), format (a regex, "
                          "--reward-format) or FILE.py:FUNC (TRL's signature); give it several times for several",
                          many=True, methods=("grpo",))
    reward_weights: str = setting("", "GRPO: each --reward's weight in the reward, comma-separated", shown="all 1",
                                  methods=("grpo",))
    reward_format: str = setting("", "GRPO: the regex --reward format matches the whole completion against",
                                 methods=("grpo",))
    # sft only: the balancing loss joins the training loss in objectives.py; preference.py adds none (yet)
    moe_aux_coef: float = setting(-1.0, "weight of a mixture of experts' load-balancing loss in the training loss "
                                  "(-1: the model's --router-aux-coef; 0: none)",
                                  rule=Rule("must be >= 0, or -1 for the model's", lambda v: v >= 0 or v == -1),
                                  shown="the model's", methods=("sft",), applies=EXPERTS)

    def aux_coef(self, model: ModelConfig) -> float:
        """The balancing loss's weight this run trains with."""
        return model.router_aux_coef if self.moe_aux_coef == -1 else self.moe_aux_coef


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    launch: LaunchConfig = field(default_factory=LaunchConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    guard: GuardConfig = field(default_factory=GuardConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    objective: ObjectiveConfig = field(default_factory=ObjectiveConfig)

    @property
    def dp(self) -> int:
        """Data-parallel replicas: the world size over the TP and CP degrees (a replica's CP ranks share its rows)."""
        return max(1, self.launch.nproc // (self.parallel.tp * self.parallel.cp))

    @property
    def global_batch(self) -> int:
        """Sequences per optimizer step: DP replicas x micro-batch x accumulation steps (TP ranks share theirs)."""
        return self.dp * self.loop.micro_batch * self.loop.accum

    @property
    def reduce_in_backward(self) -> bool:
        # On CPU gloo's transfers are copies by CPU threads, competing with compute for the cores, so
        # overlap is off by default there; compare on a machine with `zerotrain train --preset wide --micro-batch 1
        # --nproc 2 --overlap on` and `--overlap off` (step_ms in the metrics).
        overlap = self.parallel.overlap
        return overlap == "on" or (overlap == "auto" and self.launch.device == "cuda")

    @property
    def grad_reduce(self) -> str:
        """--grad-reduce resolved: auto is micro-batch at stage 3, whose accumulation must not hold a full gradient
        beside a sharded model (Llama-3-8B, DP 64, bf16, micro 1 x 8192: accum 4 held 86.47 GiB a rank by step,
        60.46 by micro-batch, accum 1's), and step at stages 1 and 2 (one reduce-scatter round per step)."""
        if self.parallel.grad_reduce != "auto":
            return self.parallel.grad_reduce
        return "micro-batch" if self.parallel.zero == 3 else "step"

    @property
    def gather_in_forward(self) -> bool:
        # The same switch, but a model compiled whole cannot stop midway to wait for a bucket; at stage 3 only the
        # blocks are compiled (model/compiled.py), and the gathers run between them, in the blocks' eager hooks.
        return self.reduce_in_backward and not (self.loop.compile and self.parallel.zero < 3)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        """{section: {key: value}}: the TOML a run could be started from."""
        return {section: {s.key: getattr(getattr(self, section), s.name) for s in declared(section)}
                for section in SECTIONS}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Config":
        """The inverse of to_dict; also reads the config of a checkpoint written before the sections were split."""
        cfg = cls()
        merge(cfg, upgrade(d), origin="config")
        return cfg


SECTIONS = ("model", "data", "optim", "launch", "parallel", "loop", "logging", "checkpoint", "guard", "lora",
            "objective")


@dataclass(frozen=True)
class Setting:
    """One declared setting: where it lives (section, field name) and how users name it (key, flag)."""

    section: str
    name: str
    key: str
    default: Any
    help: str
    rule: Rule | None
    shown: str | None
    many: bool = False
    methods: tuple[str, ...] | None = None  # None: every method
    applies: Scope | None = None  # None: every model and option

    @property
    def flag(self) -> str:
        return "--" + self.key.replace("_", "-")

    @property
    def scope(self) -> str:
        """The runs it does something in, in words (--help and docs/reference.md); "" for every run."""
        said = [f"--method {' or '.join(self.methods)}"] if self.methods else []
        return " with ".join(said + ([self.applies.runs] if self.applies else []))

    @property
    def type(self) -> type:
        return type(self.default)


def declared(section: str | None = None) -> Iterator[Setting]:
    """Every setting, in declaration order (of one section, or of all)."""
    for name in (section,) if section else SECTIONS:
        yield from _section_settings(name)


@functools.cache
def _section_settings(name: str) -> tuple[Setting, ...]:
    """A section's settings, read from its dataclass once: every command line is parsed by a parser of every
    command's flags, which asked for each setting ~30k times (half the CPU of a `zerotrain` call that stops at its
    settings, measured). A Setting is frozen: callers share it, and cannot change it."""
    owner = Config.__dataclass_fields__[name].default_factory
    return tuple(Setting(name, f.name, f.metadata.get("key") or f.name, f.default, f.metadata["help"],
                         f.metadata.get("rule"), f.metadata.get("shown"), bool(f.metadata.get("many")),
                         f.metadata.get("methods"), f.metadata.get("applies")) for f in fields(owner))


def setting_for(key: str) -> Setting:
    """The setting a key (or flag) names; ConfigError suggesting the closest key when none does."""
    key = key.lstrip("-").replace("-", "_")
    by_key = {s.key: s for s in declared()}
    if key not in by_key:
        close = difflib.get_close_matches(key, by_key, n=1)
        raise ConfigError(f"unknown setting {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    return by_key[key]


# Keys of configs written by zerotrain 0.1 (checkpoint manifests): one [run] table, and field names.
_OLD_KEYS = {("run", "timeout_s"): "timeout", ("data", "source"): "data", ("data", "cache_dir"): "data_cache",
             ("checkpoint", "dir"): "ckpt_dir", ("checkpoint", "every"): "ckpt_every",
             ("checkpoint", "every_minutes"): "ckpt_every_minutes"}


def upgrade(d: dict[str, Any]) -> dict[str, Any]:
    """A config dict in today's sections and keys, from one written before the [run] table was split."""
    if "run" not in d and not any((s, k) in _OLD_KEYS for s, values in d.items() for k in values):
        return d
    out: dict[str, dict] = {}
    for section, values in d.items():
        for key, value in values.items():
            key = _OLD_KEYS.get((section, key), key)
            owner = setting_for(key).section if section == "run" else section
            out.setdefault(owner, {})[key] = value
    return out


def merge(cfg: Config, overrides: dict[str, Any], origin: str) -> None:
    """Apply {section: {key: value}} onto cfg, rejecting unknown sections, keys and types by name."""
    for section, values in overrides.items():
        if section == "run":  # zerotrain 0.1's one table for all of these
            owners = sorted({_owner(k) for k in values if _owner(k)}, key=SECTIONS.index)
            raise ConfigError(f"{origin}: the [run] table is now [launch], [parallel], [loop] and [logging]"
                              + (f"; its settings here belong in {', '.join(f'[{o}]' for o in owners)}"
                                 if owners else ""))
        if section not in SECTIONS:
            close = difflib.get_close_matches(section, SECTIONS, n=1)
            hint = f"did you mean [{close[0]}]? " if close else ""
            raise ConfigError(f"{origin}: unknown table [{section}] ({hint}tables: {', '.join(SECTIONS)})")
        if not isinstance(values, dict):
            raise ConfigError(f"{origin}: [{section}] must be a table of settings, got {values!r}")
        known = {s.key: s for s in declared(section)}
        for key, value in values.items():
            if key not in known:
                raise ConfigError(f"{origin}: {_misplaced(section, key)}")
            s = known[key]
            if s.type is float and isinstance(value, int) and not isinstance(value, bool):
                value = float(value)
            if s.many and isinstance(value, list) and value and all(isinstance(v, str) for v in value):
                value = "\n".join(value)  # a list of several: kept one per line
            if type(value) is not s.type:
                expected = "true or false" if s.type is bool else s.type.__name__
                raise ConfigError(f"{origin}: {key} in [{section}] must be {expected}, got {value!r}")
            setattr(getattr(cfg, section), s.name, value)


def _owner(key: str) -> str | None:
    """The table a key belongs in, or None for a key that names no setting."""
    try:
        return setting_for(key).section
    except ConfigError:
        return None


def _misplaced(section: str, key: str) -> str:
    """An unknown key: the table it belongs in, or the closest key that exists."""
    try:
        owner = setting_for(key).section
    except ConfigError as e:
        return f"{key} in [{section}]: {e}"
    return f"{key} belongs in [{owner}], not [{section}]"


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


def _check_selective(cfg: Config) -> None:
    """What --activation-checkpointing selective does not cover yet (the memory plan counts what it keeps for dense
    blocks with fused attention), refused in one line each; blocks recomputes any of them."""
    m = cfg.model
    refused = [(m.moe, f"--arch {m.arch} with experts"), (m.arch in QWEN35, f"--arch {m.arch}"),
               (bool(m.attn_softcap), "--attn-softcap"), (m.attn_sinks, f"--arch {m.arch} (attention sinks)"),
               (cfg.lora.rank > 0, "--lora-rank")]
    for bad, what in refused:
        if bad:
            raise ConfigError(f"--activation-checkpointing selective does not work with {what} yet: use blocks")


def _check_dpo(cfg: Config) -> None:
    """What --method dpo needs: one file of records, and held-out pairs to validate on (the model to tune,
    --init-from, is asked for where the pairs are read: cli/flags.py; a plan is made without it)."""
    if is_mixture(cfg.data.source) or cfg.loop.epochs:
        raise ConfigError("--method dpo reads one file of preference pairs in --data and trains --steps: no mixture, "
                          "no --epochs")
    if cfg.loop.eval_every and not cfg.data.val_data and not cfg.data.val_fraction:
        raise ConfigError(f"--eval-every {cfg.loop.eval_every}: --method dpo validates on held-out pairs: give "
                          "--val-fraction above 0 (a share of --data's records) or --val-data (a file of pairs)")


def reward_weight_values(text: str) -> list[float] | None:
    """--reward-weights as numbers (None: not given); ConfigError naming a value that is not one."""
    if not text.strip():
        return None
    values = []
    for part in text.replace(",", " ").split():
        try:
            values.append(float(part))
        except ValueError:
            raise ConfigError(f"--reward-weights {text}: {part!r} is not a number") from None
        if not math.isfinite(values[-1]):
            raise ConfigError(f"--reward-weights {text}: {part!r} is not a finite number")
    return values


def _check_grpo(cfg: Config) -> None:
    """What --method grpo needs: one file of prompts, reward functions (and their weights, one each), each rank's
    completions whole groups of --num-generations; what it does not do yet refused."""
    o, loop, G = cfg.objective, cfg.loop, cfg.objective.num_generations
    if is_mixture(cfg.data.source) or loop.epochs:
        raise ConfigError("--method grpo reads one file of prompts in --data and trains --steps: no mixture, no --epochs")
    per_rank = loop.micro_batch * loop.accum
    if per_rank % G:
        raise ConfigError(f"--micro-batch {loop.micro_batch} x --accum {loop.accum} = {per_rank} completions a rank is "
                          f"not a multiple of --num-generations {G}: a prompt's {G} completions are sampled and scored "
                          "on one rank (the global batch counts completions)")
    rewards = [r for r in o.reward.split("\n") if r]
    if not rewards:
        raise ConfigError("--method grpo needs a reward: --reward exact_answer, --reward format or --reward FILE.py:FUNC")
    weights = reward_weight_values(o.reward_weights)
    if weights is not None and len(weights) != len(rewards):
        raise ConfigError(f"--reward-weights {o.reward_weights} gives {len(weights)} weights for {len(rewards)} "
                          "--reward functions: one each")
    if "format" in rewards and not o.reward_format:
        raise ConfigError("--reward format needs --reward-format REGEX (the pattern a whole completion matches)")
    refused = [(loop.compile, "--compile"), (loop.eval_every > 0, f"--eval-every {loop.eval_every}")]
    for bad, flag in refused:
        if bad:
            raise ConfigError(f"--method grpo does not work with {flag} yet: leave {flag} out")


def _check_experts(cfg: Config) -> None:
    """A mixture of experts' settings, on its archs only, each value in range."""
    m = cfg.model
    if m.arch in MOE and not m.n_experts:
        raise ConfigError(f"--arch {m.arch} is a mixture of experts: give --n-experts")
    if m.n_experts and m.arch not in (*MOE, *GEMMA4):
        raise ConfigError(f"--n-experts {m.n_experts} is for --arch {' or '.join((*MOE, *GEMMA4))}, not --arch "
                          f"{m.arch}")
    if not m.n_experts:
        given = [(m.expert_width, "--expert-width"), (m.shared_expert_width, "--shared-expert-width"),
                 (m.mlp_only_layers, "--mlp-only-layers"), (cfg.parallel.ep if cfg.parallel.ep > 1 else 0, "--ep")]
        for value, flag in given:
            if value:
                raise ConfigError(f"{flag} {value} is for a mixture of experts (--n-experts): --arch {m.arch} has none")
        return
    if m.experts_per_token > m.n_experts:
        raise ConfigError(f"--experts-per-token {m.experts_per_token} is more than the --n-experts {m.n_experts}")
    if m.shared_expert_width and m.arch not in ("qwen2_moe", "qwen3_5_moe", *LLAMA4):
        raise ConfigError(f"--shared-expert-width {m.shared_expert_width} is for --arch qwen2_moe, qwen3_5_moe or "
                          f"llama4, not {m.arch}")
    for token in (t.strip() for t in m.mlp_only_layers.split(",") if t.strip()):
        if not token.isdigit() or int(token) >= m.n_layer:
            raise ConfigError(f"--mlp-only-layers {m.mlp_only_layers!r}: {token!r} is not a layer 0-{m.n_layer - 1}")
    tp = cfg.parallel.tp
    for width, flag in ((m.expert_ffn, "the experts' width (--expert-width)"),
                        (m.shared_expert_width, "--shared-expert-width")):
        if width % tp:
            raise ConfigError(f"--tp {tp} does not divide {flag} {width}: each TP rank keeps a slice of every expert")
    projections = {"gate_proj", "up_proj", "down_proj", LORA_EXPERTS} & set(cfg.lora.modules(m.arch))
    if tp > 1 and cfg.lora.rank and projections:
        raise ConfigError(f"--tp {tp}: LoRA on the experts' projections ({', '.join(sorted(projections))}) trains "
                          "without tensor parallelism yet: give --lora-targets q_proj,k_proj,v_proj,o_proj, or --tp 1")
    _check_expert_parallel(cfg)


def _check_expert_parallel(cfg: Config) -> None:
    """--ep E: E divides the ranks ZeRO shards over (DP x CP: EP groups are consecutive ranks of dp_shard x cp) and
    the experts; no LoRA with it yet (--tp T splits each expert of a rank's block as it splits the dense MLP; at
    --zero 3 both engines are stage 3)."""
    m, p = cfg.model, cfg.parallel
    if p.ep == 1:
        return
    dp, cp = cfg.dp, f" x --cp {p.cp}" if p.cp > 1 else ""
    if dp * p.cp % p.ep:
        raise ConfigError(f"--ep {p.ep} does not divide the data-parallel size {dp}{cp} (--nproc {cfg.launch.nproc} "
                          f"/ --tp {p.tp})")
    if (dp // p.dp_replicate) * p.cp % p.ep:
        raise ConfigError(f"--ep {p.ep} does not divide the shard group's size {dp // p.dp_replicate}{cp} (the "
                          f"data-parallel size {dp} / --dp-replicate {p.dp_replicate}): each replica group holds "
                          "every block of experts")
    if m.n_experts % p.ep:
        raise ConfigError(f"--ep {p.ep} does not divide --n-experts {m.n_experts}: each EP rank holds a whole block "
                          "of experts")
    if cfg.lora.rank:
        raise ConfigError(f"--ep {p.ep} with --lora-rank {cfg.lora.rank}: expert parallelism trains every parameter "
                          "(no LoRA) yet")


def _check_context_parallel(cfg: Config) -> None:
    """--cp C: C divides the ranks left by TP, each row splits into 2C equal chunks, and the model's attention is one
    the ring computes (causal, rotary, packed records' masks, sliding windows, latent attention's widths, Llama 4's
    attention chunks; Gemma 4's two kinds of layers, shared KV, per-layer inputs and MoE block), or Qwen3.5's linear
    attention (each chunk's state map and convolution inputs gathered, model/delta_rule_cp.py: a chunk holds at least
    the convolution's K - 1 taps before a token): soft-caps, sinks and learned positions are not in it yet: refused.
    Mixtures of experts (--ep too), LoRA, --dp-replicate, DPO (each sequence's log-prob summed over its parts) and GRPO
    (each completion's token log-probs gathered) compose."""
    m, p = cfg.model, cfg.parallel
    if p.cp == 1:
        return
    if cfg.launch.nproc % (p.tp * p.cp):
        raise ConfigError(f"--cp {p.cp} x --tp {p.tp} does not divide the world size {cfg.launch.nproc} (--nproc): "
                          "ranks form DP x CP x TP")
    if m.seq_len % (2 * p.cp):
        raise ConfigError(f"--seq-len {m.seq_len} is not divisible by 2 x --cp {p.cp}: each CP rank holds 2 equal "
                          "chunks of every row")
    if m.arch in QWEN35 and m.seq_len // (2 * p.cp) < m.linear_conv_kernel - 1:
        raise ConfigError(f"--seq-len {m.seq_len} at --cp {p.cp} leaves chunks of {m.seq_len // (2 * p.cp)} tokens, "
                          f"fewer than the {m.linear_conv_kernel - 1} inputs --linear-conv-kernel "
                          f"{m.linear_conv_kernel} reads before a token: give a longer --seq-len or a smaller --cp")
    refused = [(m.arch == "gpt2", "--arch gpt2 (learned positions)"),
               (bool(m.attn_softcap), f"--attn-softcap {m.attn_softcap}"),
               (m.attn_sinks, f"--arch {m.arch} (attention sinks)"),
               (cfg.loop.compile, "--compile")]
    for hit, what in refused:
        if hit:
            raise ConfigError(f"--cp {p.cp} with {what}: context parallelism does not split that yet: give --cp 1")


def _check_qwen35(cfg: Config) -> None:
    """Qwen3.5's sizes: whole linear-attention heads on each TP rank, the MoE's shared expert and experts on every
    layer."""
    m, p = cfg.model, cfg.parallel
    if m.linear_value_heads % m.linear_key_heads:
        raise ConfigError(f"--linear-value-heads {m.linear_value_heads} is not a multiple of --linear-key-heads "
                          f"{m.linear_key_heads}: each key head serves a whole group of value heads")
    if m.rotary_dim < 2 or m.rotary_dim % 2:
        raise ConfigError(f"--partial-rotary {m.partial_rotary}: rotary would rotate {m.rotary_dim} of the head's "
                          f"{m.head_dim} units; it rotates an even number of them, at least 2")
    if m.linear_key_heads % p.tp or m.linear_value_heads % p.tp:
        raise ConfigError(f"--tp {p.tp} does not divide the linear-attention layers' key heads ({m.linear_key_heads}) "
                          f"and value heads ({m.linear_value_heads}): each TP rank keeps whole heads of both")
    if m.arch == "qwen3_5_moe" and not m.shared_expert_width:
        raise ConfigError("--arch qwen3_5_moe has a shared expert beside its routed ones: give --shared-expert-width")
    if m.arch == "qwen3_5_moe" and (m.moe_every != 1 or m.mlp_only_layers):
        raise ConfigError(f"--arch qwen3_5_moe has experts on every layer: --moe-every {m.moe_every} and "
                          f"--mlp-only-layers {m.mlp_only_layers!r} are for qwen3_moe and qwen2_moe")


def _check_group_routing(cfg: Config) -> None:
    """The routing sizes of DeepSeek-V3's experts (deepseek_v3's, mistral4's and glm4_moe's)."""
    m = cfg.model
    if not m.moe:
        raise ConfigError(f"--arch {m.arch} has experts after its --first-dense-layers: give --n-experts")
    if m.n_experts % m.expert_groups or m.n_experts // m.expert_groups < 2:
        raise ConfigError(f"--expert-groups {m.expert_groups} does not split the --n-experts {m.n_experts} into equal "
                          "groups of at least 2 (each group is scored by its two best experts)")
    if m.expert_groups_per_token > m.expert_groups:
        raise ConfigError(f"--expert-groups-per-token {m.expert_groups_per_token} is more than the --expert-groups "
                          f"{m.expert_groups}")
    if m.experts_per_token > m.expert_groups_per_token * (m.n_experts // m.expert_groups):
        raise ConfigError(f"--experts-per-token {m.experts_per_token} is more than the experts of "
                          f"--expert-groups-per-token {m.expert_groups_per_token} groups")
    if m.shared_expert_width or m.moe_every != 1 or m.mlp_only_layers:
        raise ConfigError(f"--arch {m.arch}'s dense layers are its --first-dense-layers and its shared experts "
                          "--shared-experts: --shared-expert-width, --moe-every and --mlp-only-layers are other "
                          "families'")
    if m.arch in ("deepseek_v3", *GLM) and m.routing_bias_speed and cfg.objective.method != "sft":
        raise ConfigError(f"--routing-bias-speed {m.routing_bias_speed} with --method {cfg.objective.method}: the bias "
                          "moves with the expert loads of --method sft's steps only in zerotrain yet: give "
                          "--routing-bias-speed 0")


def _check_deepseek(cfg: Config) -> None:
    """Mistral 4's rotary and DeepSeek-V3's rotary width."""
    m = cfg.model
    if m.arch == "mistral4" and m.rope_scaling != "yarn":
        # transformers' Mistral 4 rotates qk_nope_dim + qk_rope_dim units under any other rope type (it fails) and
        # reads the query scaling's period from YaRN's original context
        raise ConfigError(f"--rope-scaling {m.rope_scaling}: --arch mistral4 has YaRN rotary (--rope-scaling yarn)")
    if m.qk_rope_dim % 2:
        raise ConfigError(f"--qk-rope-dim {m.qk_rope_dim}: rotary rotates pairs of units; give an even width")


def _check_mtp(cfg: Config) -> None:
    """--mtp train: a model with MTP layers, trained by sft's token loss, in the parallel layouts it is built for."""
    m, p = cfg.model, cfg.parallel
    if not m.mtp_layers:
        raise ConfigError(f"--mtp {m.mtp}: the model has no multi-token-prediction layers (--mtp-layers 0)")
    refused = [(cfg.objective.method != "sft", f"--method {cfg.objective.method}"),
               (cfg.lora.rank > 0, f"--lora-rank {cfg.lora.rank}"), (p.cp > 1, f"--cp {p.cp}"),
               (p.activation_checkpointing == "full", "--activation-checkpointing full"),
               (cfg.loop.compile, "--compile")]
    for bad, flag in refused:
        if bad:
            raise ConfigError(f"{flag} does not train with --mtp train yet: give --mtp frozen")


def _check_glm(cfg: Config) -> None:
    """GLM-4.5's partial rotary: an even number of each head's units, at least 2."""
    m = cfg.model
    if m.rotary_dim < 2 or m.rotary_dim % 2:
        raise ConfigError(f"--partial-rotary {m.partial_rotary}: rotary would rotate {m.rotary_dim} of the head's "
                          f"{m.head_dim} units; it rotates an even number of them, at least 2")


def _check_llama4(cfg: Config) -> None:
    """Llama 4's experts: a shared expert of the routed experts' width beside them."""
    m = cfg.model
    if not m.n_experts or m.shared_expert_width != m.expert_ffn:
        raise ConfigError(f"--arch llama4 has experts and a shared expert of their width: give --n-experts and "
                          f"--shared-expert-width {m.expert_ffn} (got {m.n_experts} and {m.shared_expert_width})")


def _check_gemma4(cfg: Config) -> None:
    """Gemma 4's layer pattern (its last layer global, as transformers forces it), a layer of each kind before the
    shared-KV layers, the MoE block (--n-experts) on every layer, and --tp dividing both kinds' KV heads: else
    refused, never trained approximately."""
    m, p = cfg.model, cfg.parallel
    if not m.sliding_window or not m.sliding_window_pattern or m.n_layer % m.sliding_window_pattern:
        raise ConfigError(f"--arch gemma4's last layer is global and the others slide every --sliding-window-pattern: "
                          f"give --sliding-window and a pattern dividing --n-layer {m.n_layer} (got "
                          f"{m.sliding_window} and {m.sliding_window_pattern})")
    first = m.n_layer - m.kv_shared_layers
    if {m.sliding(i) for i in range(first)} != {m.sliding(i) for i in range(m.n_layer)}:
        raise ConfigError(f"--kv-shared-layers {m.kv_shared_layers}: the layers before the shared ones must hold a "
                          "sliding and a global layer whose keys and values the shared ones read")
    if m.global_kv_heads and not m.k_eq_v:
        raise ConfigError(f"--global-kv-heads {m.global_kv_heads} is for --k-eq-v (transformers' Gemma 4 takes "
                          "num_global_key_value_heads only with attention_k_eq_v)")
    if m.n_head % (m.global_kv_heads or m.kv_heads):
        raise ConfigError(f"--global-kv-heads {m.global_kv_heads} does not divide --n-head {m.n_head}")
    if m.global_head_width % 2:
        raise ConfigError(f"--global-head-width {m.global_head_width} must be even (rotary embeddings rotate pairs)")
    if m.n_experts and (m.moe_every != 1 or m.mlp_only_layers):  # transformers' MoE block is on every layer
        given = f"--moe-every {m.moe_every}" if m.moe_every != 1 else f"--mlp-only-layers {m.mlp_only_layers}"
        raise ConfigError(f"{given}: --arch gemma4's MoE block is on every layer: give --moe-every 1 and no "
                          "--mlp-only-layers")
    global_kv_heads = m.attention_shape(m.n_layer - 1)[0]  # the last layer is global
    if (m.kv_heads % p.tp or global_kv_heads % p.tp) and p.tp > 1:  # one TP group, no KV group per layer kind
        raise ConfigError(f"--tp {p.tp} does not divide the KV heads of both of --arch gemma4's layer kinds (sliding "
                          f"{m.kv_heads}, global {global_kv_heads}): zerotrain's Gemma 4 does not replicate a KV "
                          "head over TP ranks")


def validate(cfg: Config) -> Config:
    """Check every setting against its rule and the settings against each other; change nothing.

    Each error names the flag (the TOML key with underscores) of the value it refuses.
    """
    for s in declared():
        value = getattr(getattr(cfg, s.section), s.name)
        if s.type is float and not math.isfinite(value):
            raise ConfigError(f"{s.flag} must be a finite number, got {value}")
        if s.rule and not s.rule.holds(value):
            raise ConfigError(f"{s.flag} {s.rule.says}, got {value!r}")
    _check_mixture(cfg.data.source)
    if is_mixture(cfg.data.source) and cfg.data.val_data:
        raise ConfigError(f"--val-data {cfg.data.val_data}: a mixture validates each of its sources on its own "
                          "validation split; leave --val-data out")
    if is_mixture(cfg.data.source) and cfg.loop.epochs:
        raise ConfigError(f"--epochs {cfg.loop.epochs}: a mixture's sources each go through epochs at their own pace "
                          "(the step records count them per source): give --steps")
    m, p = cfg.model, cfg.parallel
    if m.n_embd % m.n_head and not m.head_width:
        raise ConfigError(f"--n-embd {m.n_embd} is not divisible by --n-head {m.n_head}")
    if m.context and m.context < m.seq_len:
        raise ConfigError(f"--context {m.context} is shorter than --seq-len {m.seq_len}: the model holds at least the "
                          "positions it trains on")
    if p.zero == 3 and cfg.loop.compile and cfg.lora.rank:  # the adapters' eager dropout inside the compiled blocks
        raise ConfigError("--compile at --zero 3 does not work with --lora-rank yet: use --zero 2 for it, or leave "
                          "--compile out")
    if p.grad_reduce == "micro-batch" and p.zero == 1:
        raise ConfigError("--grad-reduce micro-batch needs --zero 2 or 3: stage 1 keeps full gradients anyway")
    if cfg.launch.nproc % p.tp:
        raise ConfigError(f"--tp {p.tp} does not divide the world size {cfg.launch.nproc} (--nproc): "
                          "ranks form TP x DP")
    _check_context_parallel(cfg)
    if cfg.dp % p.dp_replicate:
        raise ConfigError(f"--dp-replicate {p.dp_replicate} does not divide the data-parallel size {cfg.dp} (--nproc "
                          f"{cfg.launch.nproc} / --tp {p.tp}): each replica group shards over an equal part of it")
    if m.n_head % m.kv_heads:
        raise ConfigError(f"--n-kv-head {m.n_kv_head} does not divide --n-head {m.n_head}: each KV head serves a whole "
                          "group of query heads")
    if m.arch == "gpt2" and m.kv_heads != m.n_head:
        raise ConfigError(f"--arch gpt2 has one KV head per head: --n-kv-head {m.n_kv_head} is for --arch llama")
    if m.arch == "gpt2" and not m.tie_embeddings:
        raise ConfigError("--arch gpt2 ties its head to the token embedding: --no-tie-embeddings is for --arch llama")
    if m.arch == "gpt2" and (m.head_width or m.rope_scaling != "none"):
        raise ConfigError(f"--arch gpt2 has heads of --n-embd / --n-head and no rotary embeddings: --head-width "
                          f"{m.head_width} and --rope-scaling {m.rope_scaling} are for the Llama family")
    if m.pad_token_id >= m.vocab_size:
        raise ConfigError(f"--pad-token-id {m.pad_token_id} is not an id of the vocabulary of {m.vocab_size}")
    if m.arch == "gpt2" and m.pad_token_id != -1:
        raise ConfigError(f"--pad-token-id {m.pad_token_id} is for the Llama family: GPT-2's embedding has no padding "
                          "row (transformers' GPT2Model trains every row)")
    if m.llama_family and m.head_dim % 2:
        raise ConfigError(f"--arch {m.arch}: the head width {m.head_dim} must be even (rotary embeddings rotate pairs)")
    if m.sliding_window and m.arch not in WINDOWED:
        raise ConfigError(f"--sliding-window {m.sliding_window} is for --arch {' or '.join(WINDOWED)}: --arch {m.arch} "
                          "attends to every earlier token")
    # Gemma's settings, each where transformers' model of the arch has it (its Gemma 3 never caps the scores, its
    # Gemma 2 has one rotary base), so that an export computes what was trained.
    gemma_only = [(m.sliding_window_pattern, "--sliding-window-pattern", ALTERNATING),
                  (m.rope_local_theta, "--rope-local-theta", ("gemma3", *GEMMA4)),
                  (m.query_pre_attn_scalar, "--query-pre-attn-scalar", GEMMA),
                  (m.attn_softcap, "--attn-softcap", ("gemma2",)),
                  (m.final_softcap, "--final-softcap", (*GEMMA, *GEMMA4)),
                  (m.rope_scaling == "linear", "--rope-scaling linear", GEMMA)]
    for value, flag, archs in gemma_only:
        if value and m.arch not in archs:
            raise ConfigError(f"{flag} is for --arch {' or '.join(archs)}, not --arch {m.arch}")
    if m.rope_scaling == "yarn" and m.rope_beta_slow > m.rope_beta_fast:  # equal: Kimi K2's (a ramp of one step)
        raise ConfigError(f"--rope-beta-slow {m.rope_beta_slow} must not be above --rope-beta-fast {m.rope_beta_fast}")
    _check_experts(cfg)
    if m.arch in QWEN35:
        _check_qwen35(cfg)
    if m.arch in GROUP_ROUTED:
        _check_group_routing(cfg)
    if m.arch in DEEPSEEK:
        _check_deepseek(cfg)
    if m.mtp == "train":
        _check_mtp(cfg)
    if m.arch in GLM:
        _check_glm(cfg)
    if m.arch in LLAMA4:
        _check_llama4(cfg)
    if m.arch in GEMMA4:
        _check_gemma4(cfg)
    if m.rope_scaling == "llama3" and m.rope_low_freq_factor >= m.rope_high_freq_factor:
        raise ConfigError(f"--rope-low-freq-factor {m.rope_low_freq_factor} must be below --rope-high-freq-factor "
                          f"{m.rope_high_freq_factor}")
    if m.n_head % p.tp:
        raise ConfigError(f"--tp {p.tp} does not divide --n-head {m.n_head}: each TP rank keeps whole attention heads")
    if m.kv_heads % p.tp and p.tp % m.kv_heads:
        raise ConfigError(f"--tp {p.tp} neither divides the KV heads (--n-kv-head {m.kv_heads}) nor is a multiple of "
                          "them: each TP rank keeps whole KV heads, or one KV head shared with the ranks of its group")
    if m.ffn_width % p.tp:
        raise ConfigError(f"--tp {p.tp} does not divide the MLP width (--intermediate-size {m.ffn_width})")
    if p.activation_checkpointing == "selective":
        _check_selective(cfg)
    if p.activation_checkpointing == "full" and cfg.loop.compile:
        raise ConfigError("--activation-checkpointing full recomputes the head outside the model's compiled forward: "
                          "use blocks with --compile")
    if p.offload_activations and cfg.launch.device == "cpu":
        raise ConfigError("--offload-activations moves saved activations from the GPU to host memory: with --device "
                          "cpu they are in host memory already")
    if cfg.launch.linear_attention_kernel == "fla" and cfg.launch.device != "cuda":
        raise ConfigError(f"--linear-attention-kernel fla runs flash-linear-attention's CUDA kernels: with --device "
                          f"{cfg.launch.device} give auto or torch")
    if p.offload_activations and cfg.loop.compile:
        raise ConfigError("--offload-activations' saved-tensor hooks do not reach into a compiled graph: drop --compile")
    if cfg.lora.targets != ALL_LINEAR:
        known = lora_target_names(m.arch)
        for name in (t.strip() for t in cfg.lora.targets.split(",")):
            if name not in known:
                raise ConfigError(f"--lora-targets {name!r} is not a linear of --arch {m.arch}'s blocks (they are "
                                  f"{', '.join(known)}, or {ALL_LINEAR})")
            if name in ("gate_proj", "up_proj", "down_proj") and m.moe and not m.shared_expert_width and all(
                    m.has_experts(layer) for layer in range(m.n_layer)):  # no dense MLP, no shared expert
                raise ConfigError(f"--lora-targets {name!r} adapts nothing: every MLP of this --arch {m.arch} model "
                                  f"is a mixture of experts without a shared expert; name {LORA_EXPERTS} to adapt "
                                  "the routed experts' projections")
    if cfg.objective.method == "dpo":
        _check_dpo(cfg)
    if cfg.objective.method == "grpo":
        _check_grpo(cfg)
    if cfg.optim.warmup_steps < -1:
        raise ConfigError(f"--warmup-steps must be >= 0 (or -1: steps / 10), got {cfg.optim.warmup_steps}")
    return cfg


def check_applicable(cfg: Config, given: dict[str, str], model: str) -> None:
    """Refuse, in one line, a setting the user gave that does nothing in this run: `given` maps each key the user
    stated (a flag or a TOML key; never a default, a command's own or a preset's) to how they stated it, `model` names
    the run's model as they gave it. The run's model must be known: a preset applied, --init-from's read."""
    for s in declared():
        if s.key not in given:
            continue
        method = cfg.objective.method
        if s.methods is not None and method not in s.methods:
            raise ConfigError(f"{given[s.key]} applies to --method {' or '.join(s.methods)}; this run is --method "
                              f"{method}")
        if s.applies is not None and not s.applies.holds(cfg):
            raise ConfigError(f"{given[s.key]} applies to {s.applies.runs}; {s.applies.otherwise(cfg, model)}")


def notes(cfg: Config) -> list[str]:
    """What a valid, resolved config does that its user may not expect: one line each, said before the run."""
    said = []
    o, steps = cfg.optim, cfg.loop.steps
    if o.warmup_steps >= steps > 0:
        said.append(f"--warmup-steps {o.warmup_steps} is not shorter than --steps {steps}: the learning rate rises "
                    f"for the whole run and ends at {steps / o.warmup_steps:.0%} of --lr {o.lr:g}")
    traced = step_range(cfg.logging.profile_steps)
    if traced and traced[1] > steps:
        said.append(f"--profile-steps {cfg.logging.profile_steps} " + (
            f"starts after the last step, {steps}: nothing is traced" if traced[0] > steps else
            f"ends after the last step, {steps}: the trace ends with the run"))
    return said


# Fine-tuning (--init-from) starts from a trained model, which pretraining's lr 3e-3 and weight decay 0.1 would
# wreck in its first steps. Full fine-tuning of small models is commonly run at 1e-5..5e-5 without weight decay
# and with a warmup of a few percent of the steps (Alpaca's and TRL's SFT recipes: lr 2e-5, warmup ratio 0.03;
# transformers' Trainer: weight decay 0). These apply where the user (flag or TOML) and the command set nothing.
FINE_TUNING = {"lr": 2e-5, "weight_decay": 0.0}
FINE_TUNING_WARMUP_PERCENT = 3  # of the steps, as --warmup-steps -1 means with --init-from


def fine_tuning_defaults(cfg: Config, stated: set[str]) -> None:
    """Set --init-from's optimizer defaults (FINE_TUNING) for the keys not in `stated`, those the user gave."""
    for key, value in FINE_TUNING.items():
        if key not in stated:
            setattr(cfg.optim, key, value)


def cuda_defaults(cfg: Config, stated: set[str]) -> None:
    """CUDA's default precision, as FSDP2 and torchtitan train there: bf16 parameters and compute with an fp32 master
    shard, where the user (flag or TOML) set no --precision."""
    if cfg.launch.device == "cuda" and "precision" not in stated:
        cfg.parallel.precision = "bf16"


def resolve(cfg: Config) -> Config:
    """Fill in the derived values, after validation: the one place a default depends on another setting."""
    if cfg.optim.warmup_steps < 0:
        percent = FINE_TUNING_WARMUP_PERCENT if cfg.checkpoint.init_from else 10
        cfg.optim.warmup_steps = max(1, cfg.loop.steps * percent // 100)
    return cfg
