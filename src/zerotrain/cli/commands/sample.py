"""`zerotrain sample CKPT`: generate text from a trained model; the text on stdout, the speed on stderr."""

from __future__ import annotations

import argparse
import math
import sys
import time

import torch

from zerotrain.cli.flags import checked
from zerotrain.config import NON_NEGATIVE, POSITIVE
from zerotrain.errors import ConfigError
from zerotrain.hub.pretrained import load_from, locate, tokenizer_of
from zerotrain.model.generate import default_keep, generate

SEPARATOR = "---"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sample", help="generate text from a checkpoint or an exported model",
        description="Prints the generated continuation of --prompt on stdout (with --num-samples > 1, samples are "
                    f"separated by a line '{SEPARATOR}'); the speed goes to stderr. CKPT is a checkpoint folder, a "
                    "checkpoint root (what `latest` names), a run folder, or an exported folder. Past the model's "
                    "context (seq_len tokens) the window jumps forward keeping its last 3/4 and the KV cache is "
                    "refilled from those tokens, with or without the cache alike.")
    p.add_argument("checkpoint", metavar="CKPT", help="the model to sample from")
    p.add_argument("--prompt", default="", help="text to continue (default: empty, start from the end-of-text token)")
    p.add_argument("--max-new-tokens", type=checked(int, POSITIVE), default=256, help="tokens to generate per sample (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=1.0,
                   help="softmax temperature; 0 is greedy (default: %(default)s)")
    p.add_argument("--top-k", type=checked(int, POSITIVE), default=None, help="draw only from the K most likely tokens (default: all)")
    p.add_argument("--seed", type=int, default=0, help="seed of the draws: the same seed gives the same text "
                                                       "(default: %(default)s)")
    p.add_argument("--num-samples", type=checked(int, POSITIVE), default=1, help="samples, generated as one batch (default: %(default)s)")
    p.add_argument("--no-kv-cache", action="store_true", help="recompute the whole context for every token")
    p.add_argument("--threads", type=checked(int, NON_NEGATIVE), default=0,
                   help="torch threads (default: %(default)s, PyTorch's choice: one per core). On a machine whose "
                        "cores are busy with other work, 1 avoids waiting on descheduled threads at every small op")
    p.set_defaults(func=cmd_sample)


def check_sampling_args(args: argparse.Namespace) -> None:
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")


def cmd_sample(args: argparse.Namespace) -> int:
    check_sampling_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    source = locate(args.checkpoint)
    model, tokenizer = load_from(source), tokenizer_of(source.folder)
    V = model.cfg.vocab_size
    ids = tokenizer.encode(args.prompt) if args.prompt else [tokenizer.eot_id if tokenizer.eot_id < V else 0]
    if not ids:
        raise ConfigError(f"--prompt {args.prompt!r} encodes to no tokens")
    if max(ids) >= V:
        raise ConfigError(f"--prompt encodes to token id {max(ids)}, outside this model's vocabulary of {V} "
                          f"(trained on data with another tokenizer?)")
    prompt = torch.tensor([ids] * args.num_samples)
    generator = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   generator=generator, kv_cache=not args.no_kv_cache, vocab_limit=min(V, tokenizer.vocab_size))
    seconds = time.perf_counter() - t0
    texts = [tokenizer.decode(row.tolist()) for row in out]
    print(f"\n{SEPARATOR}\n".join(texts))
    tokens = out.numel()
    keep = default_keep(model.cfg.seq_len)
    print(f"sampled {args.num_samples} x {args.max_new_tokens} tokens in {seconds:.2f} s: {tokens / seconds:,.0f} "
          f"tokens/s ({'no KV cache' if args.no_kv_cache else 'KV cache'}, context {model.cfg.seq_len}, "
          f"window keeps {keep} past it, {torch.get_num_threads()} thread(s))", file=sys.stderr)
    return 0
