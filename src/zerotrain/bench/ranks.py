"""`zerotrain bench ranks`: each rank's bytes at start-up, step, save, resume and export, planned beside measured.

For each mesh (ZeRO-3 on 4 ranks, and TP 2 x DP 2 at ZeRO-3; `--meshes`), on a Llama of the shape the flags give,
written as a Hugging Face folder in bf16 (transformers' save_pretrained, in files of `--shard-mb` so that the
ranks share their hashing), the bench runs the product's own commands, each in fresh processes, as a user would:

    zerotrain plan --json  ...                             the plan (training/io_plan.py, memory_plan.py)
    zerotrain train --init-from HF ... --steps S            start-up, S steps, one save at step S
    zerotrain train --init-from HF ... --steps S+1 --resume auto     resume from it, one step more, no save
    zerotrain export RUN/checkpoints/step_S OUT --format hf

and reads what each rank counted (summary.json's per_rank: init_bytes_read, checkpoint_bytes_read and _written,
start_rss_bytes, startup_peak_rss_bytes, peak_rss_bytes); the export's bytes are its files', its memory the
process's peak resident bytes (os.wait4) less a bare interpreter's that imports the same libraries (both started
from this process, whose own resident bytes at the fork a child's peak includes: the Hugging Face folder is written
by a process of its own for that reason). Resident bytes count the pages of files a process maps, too: safetensors
maps the shards it reads, so an export's peak includes the masters' file pages it touched. Held figures
are resident memory past the rank's own at the start of train() (the interpreter, torch and the launcher's pages
are not the run's), on a machine other engineers share: they are what the CPU's pages say, not exact bytes. The
byte counts are exact and deterministic. Writes bench-ranks.json and bench-ranks.md into --out.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import subprocess
import sys
import time

from .report import report_header, write_report

SCHEMA = "zerotrain.bench.ranks"
# Held figures, measured as resident memory, agree with the plan this well on an idle machine at a few hundred M
# parameters; the byte counts agree exactly (io_plan.TOLERANCE).
PHASES = (("start-up read", "startup_read", "init_bytes_read"),
          ("start-up hashed (and headers)", "startup_hashed", "hashed"),
          ("start-up held", "startup_held", "startup_held"),
          ("step held", "step_held", "step_held"),
          ("save written", "save_written", "checkpoint_bytes_written"),
          ("resume read", "resume_read", "resume_read"),
          ("resume held", "resume_held", "resume_held"))


def add_parser(sub) -> None:
    p = sub.add_parser("ranks", help="each rank's bytes at start-up, step, save, resume and export: the plan beside a "
                                     "real init-from, train, save, resume and export on CPU",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder for the runs and bench-ranks.json / .md")
    p.add_argument("--quick", action="store_true", help="a tiny Llama (seconds): the plumbing, not the figures")
    p.add_argument("--meshes", default="1x4,2x2", help="TPxDP meshes, comma-separated (default 1x4,2x2)")
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=1024)
    p.add_argument("--n-head", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn-width", type=int, default=3584)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--precision", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--shard-mb", type=int, default=150, help="the Hugging Face folder's files, at most this size")
    p.set_defaults(func=cmd_bench_ranks)


QUICK = {"n_layer": 2, "n_embd": 64, "n_head": 4, "kv_heads": 2, "ffn_width": 128, "vocab_size": 512, "seq_len": 16,
         "steps": 1, "shard_mb": 1}


def cmd_bench_ranks(args: argparse.Namespace) -> int:
    if args.quick:
        for key, value in QUICK.items():
            setattr(args, key, value)
    out, t0 = os.path.abspath(args.out), time.perf_counter()
    os.makedirs(out, exist_ok=True)
    hf = os.path.join(out, "hf")
    if not os.path.isfile(os.path.join(hf, "config.json")):  # in a process of its own: see the module docstring
        context = multiprocessing.get_context("spawn")
        writer = context.Process(target=write_hf_llama, args=(hf, vars(args)))
        writer.start()
        writer.join()
        if writer.exitcode:
            raise SystemExit(f"bench ranks: writing the Hugging Face folder {hf} failed (exit {writer.exitcode})")
    results = [run_mesh(out, hf, args, *map(int, mesh.split("x"))) for mesh in args.meshes.split(",")]
    report = {**report_header(SCHEMA), "shape": {k: getattr(args, k) for k in QUICK}, "precision": args.precision,
              "meshes": results, "wall_s": time.perf_counter() - t0}
    write_report(out, "bench-ranks", report, markdown(report))
    return 0


def write_hf_llama(folder: str, shape: dict) -> None:
    """A Llama of the bench's shape as Hugging Face saves one: bf16, in files of at most --shard-mb."""
    import torch
    import transformers  # the [hf] extra

    args = argparse.Namespace(**shape)
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.n_embd,
                                      intermediate_size=args.ffn_width, num_hidden_layers=args.n_layer,
                                      num_attention_heads=args.n_head, num_key_value_heads=args.kv_heads,
                                      max_position_embeddings=max(256, args.seq_len), tie_word_embeddings=False,
                                      bos_token_id=0, eos_token_id=0)
    model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder, max_shard_size=f"{args.shard_mb}MB")


def run_flags(hf: str, args: argparse.Namespace, tp: int, dp: int, run: str, steps: int) -> list[str]:
    return ["--init-from", hf, "--zero", "3", "--tp", str(tp), "--nproc", str(tp * dp), "--micro-batch", "1",
            "--seq-len", str(args.seq_len), "--steps", str(steps), "--data", "synthetic", "--threads", "1",
            "--precision", args.precision, "--out", run, "--no-progress"]


def zerotrain(*argv: str) -> tuple[str, int]:
    """Run `zerotrain ARGV` in a fresh process: (its stdout, its peak resident bytes)."""
    proc = subprocess.Popen([sys.executable, "-m", "zerotrain", *argv], stdout=subprocess.PIPE, text=True)
    stdout = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        raise SystemExit(f"bench ranks: zerotrain {' '.join(argv[:2])} failed (exit {proc.returncode})")
    return stdout, usage.ru_maxrss * 1024


def bare_rss() -> int:
    """A process's peak resident bytes with the libraries an export imports, and nothing done."""
    proc = subprocess.Popen([sys.executable, "-c", "import torch, safetensors, zerotrain.cli.main"])
    _, _, usage = os.wait4(proc.pid, 0)
    return usage.ru_maxrss * 1024


def run_mesh(out: str, hf: str, args: argparse.Namespace, tp: int, dp: int) -> dict:
    """Plan, train and save, resume, export on one mesh; planned and measured per rank."""
    run = os.path.join(out, f"tp{tp}-dp{dp}")
    steps = args.steps
    plan = json.loads(zerotrain("plan", "--json", *run_flags(hf, args, tp, dp, run, steps))[0])["io"]
    zerotrain("train", *run_flags(hf, args, tp, dp, run, steps), "--ckpt-every", str(steps))
    trained = summary(run)["per_rank"]
    zerotrain("train", *run_flags(hf, args, tp, dp, run, steps + 1), "--resume", "auto", "--ckpt-every", "0",
              "--no-final-save")
    resumed = summary(run)["per_rank"]
    checkpoint = os.path.join(run, "checkpoints", f"step_{steps:08d}")
    export = os.path.join(out, f"export-tp{tp}-dp{dp}")
    _, export_rss = zerotrain("export", checkpoint, export, "--format", "hf", "--overwrite")
    written = sum(os.path.getsize(os.path.join(export, n)) for n in os.listdir(export))
    model_file = os.path.getsize(os.path.join(export, "model.safetensors"))
    bare = bare_rss()
    hashed = trained["checkpoint_bytes_read"]  # a fresh run reads no checkpoint: its reads are the hashing
    measured = []
    for r in range(tp * dp):
        start = trained["start_rss_bytes"][r]
        measured.append({
            "init_bytes_read": trained["init_bytes_read"][r], "hashed": hashed[r],
            "startup_held": trained["startup_peak_rss_bytes"][r] - start,
            "step_held": trained["peak_rss_bytes"][r] - start,
            "checkpoint_bytes_written": trained["checkpoint_bytes_written"][r],
            # the resumed run, given --init-from as the first was, hashes its share of the files again for the record
            # (not their headers: it reads nothing else of them): its checkpoint reads less that hashing are the
            # resume's
            "resume_read": resumed["checkpoint_bytes_read"][r] - hashed[r] + plan["ranks"][r]["startup_headers"],
            "resume_reread": resumed["init_bytes_read"][r],
            "resume_held": resumed["startup_peak_rss_bytes"][r] - resumed["start_rss_bytes"][r]})
    return {"tp": tp, "dp": dp, "planned": plan, "measured": measured,
            "export": {"written": written, "model_file": model_file, "peak_rss": export_rss, "bare_rss": bare,
                       "held_beyond": export_rss - bare - model_file}}


def planned(rank: dict, key: str) -> int:
    """The plan's figure for a row: the hashing row with the headers every rank reads (counted alike)."""
    return rank[key] + (rank.get("startup_headers", 0) if key == "startup_hashed" else 0)


def summary(run: str) -> dict:
    with open(os.path.join(run, "summary.json")) as f:
        return json.load(f)


def mb(n: int) -> str:
    return f"{n / 1e6:,.1f}"


def markdown(report: dict) -> str:
    s = report["shape"]
    lines = [f"Llama {s['n_layer']} layers, width {s['n_embd']}, {s['n_head']} heads ({s['kv_heads']} KV), FFN "
             f"{s['ffn_width']}, vocabulary {s['vocab_size']}, {s['seq_len']} tokens, {report['precision']} "
             f"(files bf16); MB (10^6 bytes) per rank, planned / measured; held: resident memory past the rank's "
             "own at the start of train(), on a shared machine", ""]
    for m in report["meshes"]:
        ranks = len(m["measured"])
        lines += [f"**TP {m['tp']} x DP {m['dp']}, ZeRO-3**", "",
                  "| phase | " + " | ".join(f"rank {r}" for r in range(ranks)) + " |",
                  "| --- |" + " ---: |" * ranks]
        for label, key, measured in PHASES:
            cells = [f"{mb(planned(m['planned']['ranks'][r], key))} / {mb(m['measured'][r][measured])}"
                     for r in range(ranks)]
            lines.append(f"| {label} | " + " | ".join(cells) + " |")
        reread = [m["measured"][r]["resume_reread"] for r in range(ranks)]
        lines.append("| resume: --init-from read again | " + " | ".join(f"0 / {mb(v)}" for v in reread) + " |")
        e = m["export"]
        lines += ["", f"export (one process): written {mb(m['planned']['export_written'])} / {mb(e['model_file'])} "
                      f"MB (model.safetensors; {mb(e['written'])} with the config files), held beyond what it writes "
                      f"{mb(m['planned']['export_held_beyond'])} / {mb(e['held_beyond'])} MB (peak RSS "
                      f"{mb(e['peak_rss'])} less a bare interpreter's {mb(e['bare_rss'])} and the model file)", ""]
    return "\n".join(lines)
