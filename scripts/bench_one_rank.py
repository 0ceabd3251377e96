"""One rank's optimizer step and peak memory: zerotrain's engine against a plain transformers + torch AdamW loop.

Every run is a fresh process (peak resident memory cannot be split between two models in one), the runs alternate
in rounds whose order reverses each round, so that drift in the machine's load spreads over all of them. All train
the preset's shape on the same random tokens with fused AdamW and gradient clipping at 1.0; transformers' model is
GPT2LMHeadModel or, for a Llama-family preset, LlamaForCausalLM, with SDPA; `--litgpt` adds litgpt's GPT in the
same loop (a Llama-family preset, litgpt installed beside zerotrain). zerotrain runs as the local launcher's ranks
run, with their allocator settings (runtime/allocator.py: huge pages asked for; large blocks back to the OS at stage
3 only, not the stage trained here); the others as a script runs, with glibc's defaults, and transformers, with
`--same-allocator`, once more with zerotrain's settings. `--variant NAME=SRC` adds zerotrain from another source folder (e.g. an older commit's
`git archive` unpacked), for before/after tables.

    python scripts/bench_one_rank.py --preset gpt2 --seq-len 128 --rounds 3 --steps 4
    python scripts/bench_one_rank.py --preset smollm-135m --seq-len 128 --rounds 3 --steps 5 --litgpt
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def run_one(kind: str, args: argparse.Namespace) -> dict:
    """This process trains `kind` (zerotrain or transformers) for args.steps steps: seconds per step, peak RSS, and
    the page faults and CPU seconds of a step past the first."""
    import torch

    from zerotrain.config import PRESETS, Config

    if args.rank_allocator:
        from zerotrain.runtime.allocator import rank_allocator

        try:  # where the rank's placement gathers units (stage 3); an older zerotrain took the stage number
            from zerotrain.parallel.parts import parts_for

            rank_allocator(parts_for(Config()).placement.gathers_units)
        except ImportError:
            rank_allocator(Config().parallel.zero)
    torch.set_num_threads(args.threads)
    shape = {**PRESETS[args.preset], "seq_len": args.seq_len}
    ids = torch.randint(0, shape["vocab_size"], (args.micro_batch, args.seq_len + 1),
                        generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    step = {"zerotrain": _zerotrain_step, "transformers": _transformers_step, "litgpt": _litgpt_step}[kind](
        shape, x, y, args)
    times, then = [], None
    for i in range(args.steps):
        if i == 1:
            then = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    use, counted = resource.getrusage(resource.RUSAGE_SELF), max(1, args.steps - 1)
    then = then or use
    faults = (use.ru_minflt - then.ru_minflt) / counted
    user, system = (use.ru_utime - then.ru_utime) / counted, (use.ru_stime - then.ru_stime) / counted
    return {"step_s": times, "peak_rss_mib": use.ru_maxrss / 1024, "page_faults_per_step": faults,
            "user_s": user, "system_s": system}


def _zerotrain_step(shape: dict, x, y, args):
    import torch
    import torch.distributed as dist

    from zerotrain.bench.baselines import ZeroTrainStrategy
    from zerotrain.config import Config, resolve, validate
    from zerotrain.data import MicroBatch, StepBatch
    from zerotrain.parallel import Comm

    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, 1, True), rank=0, world_size=1)
    cfg = Config()
    for key, value in shape.items():
        setattr(cfg.model, key, value)
    cfg.data.source = "synthetic"
    cfg.loop.micro_batch, cfg.launch.nproc, cfg.launch.threads = x.shape[0], 1, args.threads
    strategy = ZeroTrainStrategy(resolve(validate(cfg)), Comm())
    batch = StepBatch([MicroBatch(x, y, None)], x.numel())

    def step() -> None:
        strategy.step(batch, cfg.optim.lr)
        strategy.settle()

    return step


def _transformers_step(shape: dict, x, y, args):
    import torch
    import transformers

    if shape["arch"] == "gpt2":
        config = transformers.GPT2Config(n_layer=shape["n_layer"], n_head=shape["n_head"], n_embd=shape["n_embd"],
                                         n_positions=shape["seq_len"], vocab_size=shape["vocab_size"])
    else:  # the Llama family's shape, as a LlamaForCausalLM
        config = transformers.LlamaConfig(
            hidden_size=shape["n_embd"], intermediate_size=shape["intermediate_size"],
            num_hidden_layers=shape["n_layer"], num_attention_heads=shape["n_head"],
            num_key_value_heads=shape["n_kv_head"] or shape["n_head"], vocab_size=shape["vocab_size"],
            max_position_embeddings=shape["seq_len"], rope_theta=shape["rope_theta"], rms_norm_eps=shape["norm_eps"],
            tie_word_embeddings=shape["tie_embeddings"])
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    optimizer = _adamw(model)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        model(x, labels=x).loss.backward()  # transformers shifts the labels itself: the same next-token loss
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def _litgpt_step(shape: dict, x, y, args):
    """litgpt's model (litgpt.GPT) of the Llama-family shape in the same loop as transformers'. litgpt keeps its
    output head apart from the token embedding: tied here when the shape ties them, so all hold the same
    parameters. (Tied at nn.Embedding's N(0, 1) instead, the logits saturate and the head's gradient matmuls run
    on subnormal numbers, 30x slower.)"""
    import litgpt
    import torch

    config = litgpt.Config(
        n_layer=shape["n_layer"], n_head=shape["n_head"], n_query_groups=shape["n_kv_head"] or shape["n_head"],
        n_embd=shape["n_embd"], intermediate_size=shape["intermediate_size"], vocab_size=shape["vocab_size"],
        padded_vocab_size=shape["vocab_size"], block_size=shape["seq_len"], rope_base=int(shape["rope_theta"]),
        norm_eps=shape["norm_eps"], bias=False, norm_class_name="RMSNorm", mlp_class_name="LLaMAMLP",
        parallel_residual=False, rotary_percentage=1.0)
    model = litgpt.GPT(config).train()
    model.apply(model._init_weights)  # N(0, 0.02), as litgpt's pretraining starts (and transformers' models)
    if shape["tie_embeddings"]:
        model.lm_head.weight = model.transformer.wte.weight
    optimizer = _adamw(model)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        logits = model(x)
        torch.nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()

    return step


def _adamw(model):
    """Fused AdamW, weight decay 0.1 on the matrices only: zerotrain's defaults."""
    import torch

    groups = [{"params": [p for p in model.parameters() if p.dim() >= 2], "weight_decay": 0.1},
              {"params": [p for p in model.parameters() if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), fused=True)


def rank_environment(env: dict[str, str]) -> dict[str, str]:
    """What the local launcher of the zerotrain that `env` imports adds to its ranks' environment at their start
    (nothing, for a zerotrain from before it asked for huge pages)."""
    ask = ("import json\ntry:\n    from zerotrain.runtime.allocator import huge_pages_environment\n"
           "except ImportError:\n    huge_pages_environment = dict\nprint(json.dumps(huge_pages_environment()))")
    return json.loads(subprocess.run([sys.executable, "-c", ask], env=env, capture_output=True, text=True,
                                     check=True).stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt2")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=4, help="steps per run; the first is not counted")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=SRC",
                   help="also zerotrain from the source folder SRC, labelled NAME")
    p.add_argument("--same-allocator", action="store_true",
                   help="also transformers with the allocator settings of zerotrain's ranks")
    p.add_argument("--litgpt", action="store_true",
                   help="also litgpt's model in the same loop (a Llama-family preset; litgpt installed beside)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a child process: run this one and print its result
    p.add_argument("--rank-allocator", action="store_true", help=argparse.SUPPRESS)  # the child's malloc: a rank's
    args = p.parse_args()
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return 0
    from zerotrain.config import PRESETS

    if args.litgpt and PRESETS[args.preset]["arch"] == "gpt2":
        p.error(f"--litgpt needs a Llama-family preset (litgpt has no GPT-2), not {args.preset}")
    runs = {"zerotrain": ("zerotrain", None), "transformers": ("transformers", None)}
    if args.same_allocator:
        runs["transformers, zerotrain's allocator settings"] = ("transformers", None)
    if args.litgpt:
        runs["litgpt"] = ("litgpt", None)
    runs.update({name: ("zerotrain", src) for name, src in (v.split("=", 1) for v in args.variant)})
    results: dict[str, list[dict]] = {name: [] for name in runs}
    for r in range(args.rounds):
        for name in list(runs) if r % 2 == 0 else reversed(list(runs)):
            kind, src = runs[name]
            as_rank = kind == "zerotrain" or name.endswith("allocator settings")
            env = {**os.environ, **({"PYTHONPATH": src} if src else {})}
            env.update(rank_environment(env) if as_rank else {})
            child = ["--preset", args.preset, "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch),
                     "--threads", str(args.threads), "--steps", str(args.steps), "--one", kind,
                     *(["--rank-allocator"] if as_rank else [])]
            out = subprocess.run([sys.executable, __file__, *child], env=env, capture_output=True, text=True,
                                 check=True).stdout
            results[name].append(json.loads(out.strip().splitlines()[-1]))
    print(f"| {args.preset}, seq {args.seq_len} x micro-batch {args.micro_batch}, {args.threads} thread(s), "
          f"{args.rounds} rounds | step s (median past the first) | peak RSS MiB per run | "
          "page faults per step (past the first) | "
          "CPU s per step, user + system (median) |\n| --- | ---: | ---: | ---: | ---: |")
    for name, rs in results.items():
        step = statistics.median(t for r in rs for t in r["step_s"][1:])
        peaks = " / ".join(f"{r['peak_rss_mib']:.0f}" for r in rs)
        faults = statistics.median(r["page_faults_per_step"] for r in rs)
        user, system = (statistics.median(r[k] for r in rs) for k in ("user_s", "system_s"))
        print(f"| {name} | {step:.3f} | {peaks} | {faults:,.0f} | {user:.3f} + {system:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
