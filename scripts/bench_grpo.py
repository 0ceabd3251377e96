"""A GRPO step on one CPU rank: zerotrain's `--method grpo` beside TRL's GRPOTrainer (use_vllm=False: it generates
with transformers' `generate`) on the same tiny Llama, prompts, reward, G, completion length and batch.

Both train the same folder (a random Llama written by transformers' save_pretrained, zerotrain's byte tokenizer
beside it), on prompts of one length (so that both sample each step's completions as one batch of rows: TRL left-pads
its prompts, zerotrain batches the prompts of one length), with the same loss (dapo), beta 0, lr and threads. Per step,
each reports:

- `generate_s`: the time in the sampler (zerotrain's `sample_completions`, TRL's call of the model's `generate`), read
  by wrapping the one function each calls, in the training process itself;
- `step_s`: the optimizer step's wall time (zerotrain's `step_ms`; TRL's from a callback's `on_step_begin` to
  `on_step_end`), so `generate_s / step_s` is the share spent generating and the rest training (scoring, the
  forward and backward of the loss, AdamW);
- `tokens`: completion tokens drawn (each completion cut after its first EOS, which counts), and tokens / generate_s.

Every run is a fresh process in its own session; the runs alternate zerotrain, TRL, TRL, zerotrain, ... in rounds, so
that drift in the machine's load spreads over both, and each round's ratios are paired. The first step of each run
(warm-up) is left out of its medians.

    python scripts/bench_grpo.py --rounds 3 --steps 6 --out runs/bench-grpo
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

SHAPE = dict(vocab_size=256, hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=128)
LETTERS = "abcdefghijklmnopqrstuvwxyz"
REWARD = '''
def named_letter(prompts, completions, completion_ids, letter, **kwargs):
    """1.0 where the completion holds the letter its prompt names, else 0.0."""
    return [float(want in text) for text, want in zip(completions, letter)]
'''


def build(folder: str) -> None:
    """The tiny Llama (transformers' random init, seed 0) with zerotrain's byte tokenizer as a transformers tokenizer,
    the prompts (one length: `Write the letter x:`) and the reward file."""
    import torch
    import transformers

    from zerotrain.data.tokenizer import EOT_TEXT, ByteTokenizer

    os.makedirs(folder, exist_ok=True)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**SHAPE, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    transformers.LlamaForCausalLM(config).save_pretrained(os.path.join(folder, "model"))
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=ByteTokenizer().to_hf(), eos_token=EOT_TEXT,
                                                     pad_token=EOT_TEXT)
    tokenizer.save_pretrained(os.path.join(folder, "model"))
    with open(os.path.join(folder, "prompts.jsonl"), "w") as f:
        for c in LETTERS:
            f.write(json.dumps({"prompt": f"Write the letter {c}:", "letter": c}) + "\n")
    with open(os.path.join(folder, "letters.py"), "w") as f:
        f.write(REWARD)


class Timed:
    """Wraps a function: the seconds spent in it and the completion tokens it drew, per call."""

    def __init__(self, fn, count):
        self.fn, self.count, self.calls = fn, count, []

    def __call__(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.calls.append((time.perf_counter() - t0, self.count(out, args, kwargs)))
        return out


def run_zerotrain(args: argparse.Namespace) -> dict:
    """zerotrain's steps in this process (one gloo rank, its threads as the launcher sets a rank's), its sampler
    wrapped."""
    import torch
    import torch.distributed as dist

    from zerotrain.cli.flags import config_from_args
    from zerotrain.cli.main import build_parser
    from zerotrain.parallel import Comm
    from zerotrain.runtime.run_folder import prepare_run
    from zerotrain.training import grpo
    from zerotrain.training.loop import train

    timed = Timed(grpo.sample_completions, lambda out, a, k: sum(len(c) for c in out))
    grpo.sample_completions = timed
    steps_begin = []  # where each step's calls of the sampler begin
    rollouts = grpo.GroupRelative.rollouts

    def marked(self, *a, **k):
        steps_begin.append(len(timed.calls))
        return rollouts(self, *a, **k)

    grpo.GroupRelative.rollouts = marked
    out = os.path.join(args.folder, "zerotrain-run")
    argv = ["train", "--method", "grpo", "--init-from", os.path.join(args.folder, "model"),
            "--data", os.path.join(args.folder, "prompts.jsonl"),
            "--reward", os.path.join(args.folder, "letters.py") + ":named_letter",
            "--num-generations", str(args.G), "--max-completion-length", str(args.L),
            "--micro-batch", str(args.batch), "--accum", "1", "--seq-len", str(SHAPE["max_position_embeddings"]),
            "--grpo-loss", "dapo", "--grpo-beta", "0", "--lr", "1e-5", "--warmup-steps", "0", "--min-lr-ratio", "1",
            "--steps", str(args.steps), "--threads", str(args.threads), "--no-progress", "--overwrite", "--out", out]
    cfg = prepare_run(config_from_args(build_parser().parse_args(argv)))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", store=dist.TCPStore("127.0.0.1", 0, 1, True), rank=0, world_size=1)
    try:
        train(cfg, Comm())
    finally:
        dist.destroy_process_group()
    records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r["step_ms"] / 1000 for r in records if "loss" in r]
    calls = [timed.calls[a:b] for a, b in zip(steps_begin, [*steps_begin[1:], len(timed.calls)])]
    return {"step_s": steps, "generate_s": [sum(c[0] for c in s) for s in calls],
            "tokens": [sum(c[1] for c in s) for s in calls]}


def run_trl(args: argparse.Namespace) -> dict:
    """TRL's GRPOTrainer in this process, the model's generate wrapped, a callback timing each optimizer step."""
    import datasets
    import torch
    import transformers
    from trl import GRPOConfig, GRPOTrainer

    torch.set_num_threads(args.threads)
    sys.path.insert(0, args.folder)
    import letters

    folder = os.path.join(args.folder, "model")
    tokenizer = transformers.AutoTokenizer.from_pretrained(folder)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)

    def drawn(out, a, k) -> int:  # completion tokens, each cut after its first EOS
        completion = out[:, k["input_ids"].shape[1]:]
        ended = completion == tokenizer.eos_token_id
        first = torch.where(ended.any(1), ended.int().argmax(1) + 1, completion.shape[1])
        return int(first.sum())

    timed = Timed(model.generate, drawn)
    model.generate = timed
    steps, started = [], []

    class StepTimes(transformers.TrainerCallback):
        def on_step_begin(self, *a, **k):
            started.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            steps.append(time.perf_counter() - started[-1])

    config = GRPOConfig(output_dir=os.path.join(args.folder, "trl-run"), per_device_train_batch_size=args.batch,
                        num_generations=args.G, max_completion_length=args.L, loss_type="dapo", beta=0.0,
                        learning_rate=1e-5, lr_scheduler_type="constant", max_steps=args.steps, report_to="none",
                        use_cpu=True, bf16=False, seed=0, logging_steps=10**6, save_strategy="no",
                        dataloader_num_workers=0)
    records = [json.loads(line) for line in open(os.path.join(args.folder, "prompts.jsonl"))]
    trainer = GRPOTrainer(model=model, reward_funcs=[letters.named_letter], args=config,
                          train_dataset=datasets.Dataset.from_list(records), processing_class=tokenizer,
                          callbacks=[StepTimes()])
    trainer.train()
    return {"step_s": steps, "generate_s": [c[0] for c in timed.calls], "tokens": [c[1] for c in timed.calls]}


def summary(run: dict) -> dict:
    """Medians over the steps after the first."""
    step, gen, tokens = (run[k][1:] for k in ("step_s", "generate_s", "tokens"))
    return {"step_s": statistics.median(step), "generate_s": statistics.median(gen),
            "tokens_per_step": statistics.median(tokens),
            "tokens_per_s": statistics.median(t / g for t, g in zip(tokens, gen)),
            "generate_share": statistics.median(g / s for g, s in zip(gen, step))}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="runs/bench-grpo")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--G", type=int, default=4, help="completions per prompt")
    parser.add_argument("--L", type=int, default=32, help="max completion length")
    parser.add_argument("--batch", type=int, default=16, help="completions per step (--micro-batch)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--one", choices=["zerotrain", "trl"], help=argparse.SUPPRESS)  # a round's child
    parser.add_argument("--folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        result = (run_zerotrain if args.one == "zerotrain" else run_trl)(args)
        print("RESULT " + json.dumps(result))
        return 0
    os.makedirs(args.out, exist_ok=True)
    folder = os.path.abspath(os.path.join(args.out, "inputs"))
    build(folder)
    rounds = []
    for r in range(args.rounds):
        order = ["zerotrain", "trl"] if r % 2 == 0 else ["trl", "zerotrain"]
        runs = {}
        for kind in order:
            child = [sys.executable, __file__, "--one", kind, "--folder", os.path.join(folder), *[
                f"--{k}={getattr(args, k)}" for k in ("steps", "G", "L", "batch", "threads")]]
            done = subprocess.run(child, capture_output=True, text=True, start_new_session=True,
                                  cwd=os.path.dirname(folder), env={**os.environ, "TOKENIZERS_PARALLELISM": "false"})
            line = next((x for x in done.stdout.splitlines() if x.startswith("RESULT ")), None)
            if done.returncode or line is None:
                sys.stderr.write(done.stdout[-3000:] + done.stderr[-3000:])
                return 1
            runs[kind] = {"raw": json.loads(line[7:]), **summary(json.loads(line[7:]))}
        ratio = {k: runs["zerotrain"][k] / runs["trl"][k] for k in ("step_s", "generate_s", "tokens_per_s")}
        rounds.append({"order": order, **runs, "zerotrain_over_trl": ratio})
        print(f"round {r + 1} ({' then '.join(order)}, load average {os.getloadavg()[0]:.1f}): " + "; ".join(
            f"{k}: step {runs[k]['step_s']:.3f} s, generating {runs[k]['generate_s']:.3f} s "
            f"({100 * runs[k]['generate_share']:.0f}%), {runs[k]['tokens_per_s']:.0f} tokens/s"
            for k in ("zerotrain", "trl")) + "; zerotrain/TRL step {step_s:.2f}x, generate {generate_s:.2f}x, "
            "tokens/s {tokens_per_s:.2f}x".format(**ratio), flush=True)
    table = ["| round | order | zerotrain step s | gen s (share) | tokens/s | TRL step s | gen s (share) | tokens/s |"
             " step ratio | tokens/s ratio |", "|" + " --- |" * 10]
    for i, r in enumerate(rounds, 1):
        z, t = r["zerotrain"], r["trl"]
        table.append(f"| {i} | {', '.join(r['order'])} | {z['step_s']:.3f} | {z['generate_s']:.3f} "
                     f"({100 * z['generate_share']:.0f}%) | {z['tokens_per_s']:.0f} | {t['step_s']:.3f} | "
                     f"{t['generate_s']:.3f} ({100 * t['generate_share']:.0f}%) | {t['tokens_per_s']:.0f} | "
                     f"{r['zerotrain_over_trl']['step_s']:.2f} | {r['zerotrain_over_trl']['tokens_per_s']:.2f} |")
    with open(os.path.join(args.out, "bench-grpo.json"), "w") as f:
        json.dump({"shape": SHAPE, "settings": {k: getattr(args, k) for k in ("G", "L", "batch", "threads", "steps")},
                   "rounds": rounds}, f, indent=1)
    with open(os.path.join(args.out, "bench-grpo.md"), "w") as f:
        f.write("\n".join(table) + "\n")
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
