"""`zerotrain sample CKPT`: generate text from a trained model; the text on stdout, the speed on stderr."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time

import torch

from zerotrain.cli.flags import checked
from zerotrain.config import NON_NEGATIVE, POSITIVE
from zerotrain.data.chat import check_messages
from zerotrain.data.tokenizer_config import model_facts, stop_ids
from zerotrain.errors import ConfigError
from zerotrain.hub.chat_prompt import chat_prompt, chat_tokenizer, end_of_turn
from zerotrain.hub.pretrained import load_from, locate, tokenizer_of
from zerotrain.model.generate import default_keep, generate, until_stop

SEPARATOR = "---"


def add_parser(sub) -> None:
    p = sub.add_parser(
        "sample", help="generate text from a checkpoint or an exported model",
        description="Prints the generated continuation of --prompt, or the reply to --chat or --messages, on "
                    "stdout, up to the model's end-of-text token (the eos ids of its generation_config.json or "
                    "config.json, and the tokenizer's end of text; with a chat also the template's end of turn), "
                    "which is not printed "
                    f"(with --num-samples > 1, samples are separated by a line '{SEPARATOR}'); the speed goes to "
                    "stderr. CKPT is a checkpoint folder, a checkpoint root (what `latest` names), a run folder, or "
                    "an exported folder. Past the model's context (seq_len tokens) the window jumps forward keeping "
                    "its last 3/4 and the KV cache is refilled from those tokens, with or without the cache alike.")
    p.add_argument("checkpoint", metavar="CKPT", help="the model to sample from")
    text = p.add_mutually_exclusive_group()
    text.add_argument("--prompt", default="", help="text to continue (default: empty, start from the end-of-text "
                                                   "token)")
    text.add_argument("--chat", metavar="MESSAGE", default=None,
                      help="a user message, rendered with the model's chat template exactly as training renders a "
                           "chat record (the template's text with the assistant's turn opened; the tokenizer's BOS "
                           "before a template that writes none); the reply ends at the template's end-of-turn token "
                           "or the model's end of text. Greedy unless --temperature is given")
    text.add_argument("--messages", metavar="FILE", default=None,
                      help="a JSON file of the conversation so far, rendered as --chat renders its message: a list "
                           "of {\"role\", \"content\"} objects, or a training record ({\"messages\": [...], "
                           "\"tools\": [...], \"documents\": [...]}: its tools, tool calls and tool results written "
                           "by the template as training writes them) whose last message is a user's or a tool's; the "
                           "assistant's reply is generated. Greedy unless --temperature is given")
    p.add_argument("--system", metavar="TEXT", default=None,
                   help="with --chat: a system message before the user's, as in chats the model was fine-tuned on")
    p.add_argument("--ignore-eos", action="store_true",
                   help="generate all --max-new-tokens, past the end-of-text token (e.g. to measure speed)")
    p.add_argument("--max-new-tokens", type=checked(int, POSITIVE), default=256, help="tokens to generate per sample (default: %(default)s)")
    p.add_argument("--temperature", type=float, default=None,
                   help="softmax temperature; 0 is greedy (default: 0 with --chat and --messages, else 1)")
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
    """Refuse what cannot be sampled; a chat's default temperature is 0 (a reply, not a draw), text's 1."""
    if args.temperature is None:
        args.temperature = 0.0 if args.chat is not None or args.messages is not None else 1.0
    if not (math.isfinite(args.temperature) and args.temperature >= 0):
        raise ConfigError(f"--temperature must be a finite number >= 0 (0: greedy), got {args.temperature}")
    if args.system is not None and args.chat is None:
        raise ConfigError("--system goes with --chat (with --messages FILE, a system message is FILE's first)"
                          if args.messages is not None else "--system goes with --chat: a system message before "
                          "the user's")


def conversation(args: argparse.Namespace) -> tuple[list[dict], dict] | None:
    """The messages --chat (with --system) or --messages FILE give, with the context (a record's `tools` and
    `documents`) the template writes beside them, or None (plain text); ConfigError naming the file for a
    conversation that is not one to reply to. A record is checked as training checks one (data.chat), so a
    tool-calling conversation is sampled with its tools, its assistant turns' tool calls and the tools' results."""
    if args.chat is not None:
        system = [{"role": "system", "content": args.system}] if args.system is not None else []
        return [*system, {"role": "user", "content": args.chat}], {}
    if args.messages is None:
        return None
    where = f"--messages {args.messages}"
    try:
        with open(args.messages, encoding="utf-8") as f:
            messages = json.load(f)
    except OSError as e:
        raise ConfigError(f"{where}: {e.strerror}") from None
    except ValueError as e:
        raise ConfigError(f"{where}: not JSON ({e})") from None
    record = messages if isinstance(messages, dict) and "messages" in messages else {"messages": messages}
    if not isinstance(record["messages"], list) or not record["messages"]:
        raise ConfigError(f"{where}: expected a list of {{\"role\", \"content\"}} objects (or {{\"messages\": "
                          f"[...], \"tools\": [...]}}), got {str(messages)[:80]}")
    return check_messages(record, where, to_reply=True)


def cmd_sample(args: argparse.Namespace) -> int:
    check_sampling_args(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    source = locate(args.checkpoint)
    model, tokenizer = load_from(source), tokenizer_of(source.folder)
    V = model.cfg.vocab_size
    facts = model_facts(source.folder)  # what the checkpoint kept of its --init-from model
    # the model's eos ids, and the end-of-text token zerotrain's data ends each document and record with (where a
    # folder's config.json states transformers' placeholder ids, only this one is the model's)
    stops = set(stop_ids(facts)) | {tokenizer.eot_id} - {None}
    chat_input = conversation(args)
    if chat_input is not None:
        messages, context = chat_input
        where = "--chat" if args.chat is not None else f"--messages {args.messages}"
        chat = chat_tokenizer(source.folder, where)
        ids = chat_prompt(tokenizer, messages, where, **context)
        stops |= {end_of_turn(chat)} - {None}
    else:
        ids = tokenizer.encode(args.prompt) if args.prompt else [tokenizer.eot_id if tokenizer.eot_id < V else 0]
    if not ids:
        raise ConfigError(f"--prompt {args.prompt!r} encodes to no tokens")
    if max(ids) >= V:
        raise ConfigError(f"--prompt encodes to token id {max(ids)}, outside this model's vocabulary of {V} "
                          f"(trained on data with another tokenizer?)")
    stops = set() if args.ignore_eos else {i for i in stops if i < V}
    prompt = torch.tensor([ids] * args.num_samples)
    generator = torch.Generator().manual_seed(args.seed)
    t0 = time.perf_counter()
    out = generate(model, prompt, args.max_new_tokens, temperature=args.temperature, top_k=args.top_k,
                   generator=generator, kv_cache=not args.no_kv_cache, vocab_limit=min(V, tokenizer.vocab_size),
                   stop_ids=stops)
    seconds = time.perf_counter() - t0
    rows = [until_stop(row.tolist(), stops) for row in out]
    texts = [tokenizer.decode(row[:-1] if ended else row) for row, ended in rows]  # the text, not its stop token
    print(f"\n{SEPARATOR}\n".join(texts))
    tokens, ended = sum(len(row) for row, _ in rows), sum(e for _, e in rows)
    keep = default_keep(model.cfg.positions)
    at = "/".join(tokenizer.decode([i]) for i in sorted(stops))
    stopped = f"{ended} of {args.num_samples} ended at {at}" if stops else "--ignore-eos"
    print(f"sampled {tokens} tokens ({args.num_samples} x at most {args.max_new_tokens}; {stopped}) in {seconds:.2f} "
          f"s: {tokens / seconds:,.0f} tokens/s ({'no KV cache' if args.no_kv_cache else 'KV cache'}, context "
          f"{model.cfg.positions}, window keeps {keep} past it, {torch.get_num_threads()} thread(s))", file=sys.stderr)
    return 0
