"""What zerotrain's step does on one GPU, measured in one process in at most 8 minutes on one H100: one table.

    python scripts/device_check.py --out DIR           # on a CUDA machine (scripts/device-check.sh runs it)
    python scripts/device_check.py --out DIR --tiny    # the same checks on the CPU, tiny models: seconds

Rows (each a check; `bound` is what fails it, and the script exits 1 when any row is out of bounds):
  syncs/step      a Llama-3.2-1B-shaped bf16 run at seq 4096 (--tiny: llama-tiny at 64) under
                  torch.cuda.set_sync_debug_mode("warn"), each warning a host sync, counted per step after the
                  warm-up; on CPU, where no sync is a sync, every read of a tensor's values by the host (item, tolist,
                  float, int, bool, numpy, nonzero) counts instead. Bound: --max-syncs-per-step.
  tokens/s, MFU   that run's, and a plain FSDP2 loop's (fully_shard per block and the root, torch.compile per block,
                  fused AdamW, bf16 parameters over fp32 with MixedPrecisionPolicy) on the same model shape, token
                  file, batch and steps, in the same process: the ratio. Bound: --min-ratio (0: reported only).
  attention       which attention kernel ran in the step (the profiler's op names: flash, efficient, cudnn, flex,
                  math, or the CPU flash kernel).
  peak memory     torch.cuda.max_memory_allocated of the zerotrain run against the plan's total (memory_plan); the
                  bound is the plan itself: above it fails. On CPU the device row is the plan alone (RSS counts the
                  interpreter), reported, not bounded.
  determinism     two --deterministic runs of 3 steps from one seed: their losses and final parameter digests equal
                  bit for bit. Bound: equal.
  MoE grouped     a bf16 MoE step (qwen3-moe-tiny widened) on the grouped path (moe.GroupedLinear, counted) with the
                  plan's check strict (ZEROTRAIN_STRICT_PLAN=1: a state row off the plan stops the run) and the first
                  micro-batch's saved activations equal to the plan's row. Bound: the path taken, saved == planned.
  DPO             one DPO step (--method dpo) from a tiny Llama folder made here (transformers + tokenizers; the row
                  says skipped without them). Bound: a finite loss.
The 1B runs take 10 steps; the baseline's torch.compile takes most of its time. --tiny keeps the baseline eager
(compiling on a CPU would take longer than everything else) and says so in its row.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import os
import statistics
import sys
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

MAX_SYNCS_PER_STEP = 1.0  # the goal: nothing read between log steps; the loss read at log time


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", required=True, help="folder for the runs, the token file and device-check.json")
    p.add_argument("--tiny", action="store_true", help="the CPU rehearsal: tiny models, eager baseline")
    p.add_argument("--steps", type=int, default=None, help="steps of the throughput runs (default 10; tiny 4)")
    p.add_argument("--max-syncs-per-step", type=float, default=MAX_SYNCS_PER_STEP)
    p.add_argument("--min-ratio", type=float, default=0.0, help="zerotrain's tokens/s over the baseline's, at least")
    return p.parse_args(argv)


class HostReads:
    """Host syncs counted: CUDA's sync debug warnings, or on CPU every read of a tensor's values by the host."""

    CPU_READS = ("item", "tolist", "__float__", "__int__", "__bool__", "numpy", "nonzero")

    def __init__(self, device: str):
        self.device, self.count, self._undo = device, 0, []

    def __enter__(self):
        if self.device == "cuda":
            self._warnings = warnings.catch_warnings(record=True)
            self._seen = self._warnings.__enter__()
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
        else:
            for name in self.CPU_READS:
                real = getattr(torch.Tensor, name)
                setattr(torch.Tensor, name, self._counted(real))
                self._undo.append((name, real))
        return self

    def _counted(self, real):
        def read(tensor, *a, **k):
            self.count += 1
            return real(tensor, *a, **k)
        return read

    def take(self) -> int:
        """The syncs since the last take."""
        if self.device == "cuda":
            n = sum("synchronizing" in str(w.message) for w in self._seen)
            self._seen.clear()
            return n
        n, self.count = self.count, 0
        return n

    def __exit__(self, *exc):
        if self.device == "cuda":
            torch.cuda.set_sync_debug_mode(0)
            self._warnings.__exit__(*exc)
        for name, real in self._undo:
            setattr(torch.Tensor, name, real)
        self._undo = []


@contextlib.contextmanager
def world_of_one(device: str):
    """A process group of one rank (NCCL on CUDA, gloo on CPU) and its Comm."""
    from zerotrain.parallel import Comm

    if device == "cuda":
        torch.cuda.set_device(0)
    store = dist.TCPStore("127.0.0.1", 0, 1, True)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=store, rank=0, world_size=1)
    try:
        yield Comm(timeout_s=300)
    finally:
        dist.destroy_process_group()


def config(argv: list[str]):
    from zerotrain.cli.flags import config_from_args
    from zerotrain.cli.main import build_parser
    from zerotrain.runtime.run_folder import resolve_paths

    return resolve_paths(config_from_args(build_parser().parse_args(["train", "--no-progress", *argv])))


class Shape:
    """The model and batch of the throughput runs."""

    def __init__(self, tiny: bool, steps: int | None):
        self.preset = "llama-tiny" if tiny else "llama-3.2-1b"
        self.seq_len = 64 if tiny else 4096
        self.micro_batch = 2 if tiny else 1
        self.steps = steps or (4 if tiny else 10)
        self.warmup = 2
        self.device = "cpu" if tiny else "cuda"

    def argv(self, out: str, data: str) -> list[str]:
        return ["--preset", self.preset, "--seq-len", str(self.seq_len), "--micro-batch", str(self.micro_batch),
                "--steps", str(self.steps), "--device", self.device, "--precision", "bf16", "--data", data,
                "--val-fraction", "0", "--out", out, "--ckpt-every", "0", "--no-final-save", "--check-every", "0",
                "--lr", "1e-4"]


def token_file(path: str, vocab: int, tokens: int) -> str:
    from zerotrain.data.tokenfiles import write_llmc

    if not os.path.exists(path):
        write_llmc(path, np.random.default_rng(0).integers(0, vocab, tokens), vocab)
    return path


def zerotrain_run(shape: Shape, comm, out: str, data: str) -> dict:
    """tokens/s, MFU and syncs per step of zerotrain's step, its attention kernel, its peak against the plan."""
    from zerotrain.training.loop import train
    from zerotrain.training.throughput import model_flops_per_token, peak_flops

    cfg = config(shape.argv(out, data))
    syncs: list[int] = []
    kernels: set[str] = set()
    reads = HostReads(shape.device)

    def after_update(step, engine):
        syncs.append(reads.take())

    if shape.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    with reads:
        result = train(cfg, comm, after_update=after_update, announce=False)
    kernels |= attention_kernels(cfg, comm)
    steady = result.records[shape.warmup:]
    tokens_per_s = statistics.median(r["tokens_per_s"] for r in steady)
    peak = peak_flops(cfg, comm.device)
    flops = tokens_per_s * model_flops_per_token(cfg.model)
    return {"tokens_per_s": tokens_per_s, "mfu": flops / peak.flops if peak.flops else None,
            "syncs_per_step": statistics.mean(syncs[shape.warmup:]), "syncs": syncs,
            "attention": sorted(kernels) or ["none seen"],
            "peak_device_bytes": torch.cuda.max_memory_allocated() if shape.device == "cuda" else None,
            "plan_total": result.plan.get("total"), "peak_flops": peak.flops, "peak_source": peak.source}


# The attention kernels by the profiler's names: aten's SDPA backends (flash, efficient, cudnn, math, CPU flash),
# FlexAttention, and on CUDA the kernels themselves (flash_fwd..., fmha_cutlass..., cudnn's).
ATTENTION_OPS = ("aten::_scaled_dot_product_", "aten::_flash_attention", "aten::_efficient_attention",
                 "flex_attention", "flash_fwd", "fmha", "cudnn_generated_fort_native_sdpa")


def attention_kernels(cfg, comm) -> set[str]:
    """The attention ops and kernels one forward and backward of the run's model runs, by the profiler's names."""
    from torch.profiler import ProfilerActivity, profile

    from zerotrain.model import build_model

    model = build_model(cfg.model, 0).to(comm.device, torch.bfloat16)
    ids = torch.randint(0, cfg.model.vocab_size, (1, cfg.model.seq_len), device=comm.device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if comm.device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        model(ids).float().logsumexp(-1).mean().backward()
    names = {e.key for e in prof.key_averages()}
    return {n.removeprefix("aten::")[:60] for n in names if any(op in n for op in ATTENTION_OPS)}


def baseline_run(shape: Shape, data: str) -> dict:
    """A plain FSDP2 loop on the same model shape, token file, batch and steps: fully_shard per block and the root,
    torch.compile per block (not --tiny), bf16 compute over fp32 parameters, fused AdamW (foreach on CPU)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from zerotrain.config import PRESETS, ModelConfig
    from zerotrain.data.tokenfiles import open_token_file
    from zerotrain.model import build_model
    from zerotrain.training.throughput import model_flops_per_token

    device = torch.device(shape.device)
    cfg = ModelConfig(**{**PRESETS[shape.preset], "seq_len": shape.seq_len})
    model = build_model(cfg, 0).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    blocks = [m for m in model.modules() if type(m).__name__.endswith("Block")]
    for block in blocks:
        if shape.device == "cuda":
            block.compile()
        fully_shard(block, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=shape.device == "cuda")
    tokens = open_token_file(data).tokens
    rows, T = shape.micro_batch, shape.seq_len
    times = []
    for step in range(shape.steps):
        start = step * rows * (T + 1)
        window = torch.from_numpy(np.asarray(tokens[start:start + rows * (T + 1)], dtype=np.int64)).view(rows, T + 1)
        x, y = window[:, :-1].to(device), window[:, 1:].to(device)
        sync(device)
        t0 = time.perf_counter()
        logits = model(x)
        loss = torch.nn.functional.cross_entropy(logits.float().view(-1, logits.size(-1)), y.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync(device)
        times.append(time.perf_counter() - t0)
    tokens_per_s = rows * T / statistics.median(times[shape.warmup:])
    return {"tokens_per_s": tokens_per_s, "flops_per_token": model_flops_per_token(cfg),
            "compiled": shape.device == "cuda", "blocks": len(blocks)}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def release(device: str) -> None:
    """What the check before held on the device, given back before the next one builds its model."""
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()


def determinism_pair(shape: Shape, comm, out: str, data: str) -> dict:
    """Two --deterministic runs of 3 steps: their losses and parameter digests, bit for bit."""
    from zerotrain.runtime import cuda_settings
    from zerotrain.training.loop import train

    if shape.device == "cuda":
        cuda_settings.deterministic_kernels()
    runs = []
    for i in range(2):
        argv = shape.argv(os.path.join(out, f"determinism{i}"), data)
        argv[argv.index("--steps") + 1] = "3"
        result = train(config([*argv, "--deterministic", "--n-layer", "2"]), comm, announce=False)
        runs.append(([r["loss"] for r in result.records], result.digests))
    if shape.device == "cuda":
        torch.use_deterministic_algorithms(False)
        torch.backends.cuda.enable_flash_sdp(True)
    return {"equal": runs[0] == runs[1], "losses": [runs[0][0], runs[1][0]]}


def moe_step(shape: Shape, comm, out: str) -> dict:
    """A bf16 MoE step on the grouped path, the plan's check strict, its saved activations against the plan."""
    from zerotrain.model import moe
    from zerotrain.training.loop import train

    from zerotrain.model import activation_memory

    taken = []
    real_apply, real_path = moe.GroupedLinear.apply, moe.MoE.expert_path
    real_offsets = activation_memory.grouped_offsets
    moe.GroupedLinear.apply = lambda *a: taken.append(1) or real_apply(*a)
    if shape.device == "cpu":  # CPU's auto path is the loop; the rehearsal takes CUDA's, and plans it
        moe.MoE.expert_path = lambda self, flat: "grouped"
        activation_memory.grouped_offsets = lambda cfg, device, *a, **k: real_offsets(cfg, "cuda", *a, **k)
    strict = os.environ.get("ZEROTRAIN_STRICT_PLAN")  # a caller's own setting (the test suite's), given back after
    os.environ["ZEROTRAIN_STRICT_PLAN"] = "1"
    try:
        width = ["--n-embd", "64", "--expert-width", "64"] if shape.device == "cpu" else \
            ["--n-embd", "1024", "--expert-width", "512", "--n-head", "8", "--n-kv-head", "4", "--n-layer", "4",
             "--n-experts", "16", "--experts-per-token", "4"]
        cfg = config(["--preset", "qwen3-moe-tiny", *width, "--seq-len", "64" if shape.device == "cpu" else "1024",
                      "--micro-batch", "2", "--steps", "2", "--device", shape.device, "--precision", "bf16",
                      "--data", "synthetic", "--out", os.path.join(out, "moe"), "--ckpt-every", "0",
                      "--no-final-save"])
        result = train(cfg, comm, announce=False)
    finally:
        moe.GroupedLinear.apply, moe.MoE.expert_path = real_apply, real_path
        activation_memory.grouped_offsets = real_offsets
        if strict is None:
            os.environ.pop("ZEROTRAIN_STRICT_PLAN", None)
        else:
            os.environ["ZEROTRAIN_STRICT_PLAN"] = strict
    plan = result.plan
    return {"grouped_calls": len(taken), "saved": plan.get("activations_measured"),
            "planned": plan["rows"]["activations"], "loss": result.records[-1]["loss"]}


def dpo_step(shape: Shape, comm, out: str) -> dict:
    """One DPO step from a tiny Llama folder made here."""
    try:
        import transformers
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    except ImportError as e:
        return {"skipped": f"needs transformers and tokenizers ({e.name})"}
    from zerotrain.training.loop import train

    folder, pairs = os.path.join(out, "dpo-base"), os.path.join(out, "pairs.jsonl")
    texts = [f"What is {a} plus {b}? It is {a + b}." for a in range(20) for b in range(5)]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<unk>", "<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, bos_token="<s>", eos_token="</s>",
                                              unk_token="<unk>")
    hf.save_pretrained(folder)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=len(hf), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=128, bos_token_id=1, eos_token_id=2)).save_pretrained(folder)
    with open(pairs, "w") as f:
        for a in range(16):
            f.write(json.dumps({"prompt": f"What is {a} plus 2?", "chosen": f" It is {a + 2}.",
                                "rejected": f" It is {a + 3}."}) + "\n")
    cfg = config(["--method", "dpo", "--init-from", folder, "--data", pairs, "--seq-len", "32", "--micro-batch", "2",
                  "--steps", "1", "--device", shape.device, "--out", os.path.join(out, "dpo"), "--val-fraction", "0",
                  "--ckpt-every", "0", "--no-final-save"])
    result = train(cfg, comm, announce=False)
    return {"loss": result.records[-1]["loss"]}


def table(rows: list[tuple[str, str, str, bool]]) -> str:
    """One table: check | measured | bound | ok."""
    head = ("check", "measured", "bound", "ok")
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(3)]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(head[:3], widths)) + " | ok"]
    lines.append("-+-".join("-" * w for w in widths) + "-+---")
    for check, measured, bound, ok in rows:
        lines.append(" | ".join(str(c).ljust(w) for c, w in zip((check, measured, bound), widths)) +
                     (" | yes" if ok else " | NO"))
    return "\n".join(lines)


def gib(n) -> str:
    if n is None:
        return "-"
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


def main(argv=None) -> int:
    args = parse(argv)
    shape = Shape(args.tiny, args.steps)
    if shape.device == "cuda" and not torch.cuda.is_available():
        print("device_check.py: no CUDA device here: run it on a GPU machine, or rehearse it with --tiny",
              file=sys.stderr)
        return 2
    os.makedirs(args.out, exist_ok=True)
    out = os.path.abspath(args.out)
    if shape.device == "cuda":
        from zerotrain.runtime import cuda_settings
        cuda_settings.apply("bf16", deterministic=False)  # as a rank sets them, before the first CUDA call
    else:
        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    t0 = time.monotonic()
    from zerotrain.config import PRESETS
    data = token_file(os.path.join(out, "tokens.bin"), PRESETS[shape.preset]["vocab_size"],
                      (shape.steps + 1) * shape.micro_batch * (shape.seq_len + 1) * 4)
    rows, report = [], {"device": torch.cuda.get_device_name(0) if shape.device == "cuda" else "cpu",
                        "torch": torch.__version__, "tiny": args.tiny}
    with world_of_one(shape.device) as comm:
        ours = zerotrain_run(shape, comm, os.path.join(out, "zerotrain"), data)
        report["zerotrain"] = ours
        rows.append((f"syncs per step ({shape.preset}, seq {shape.seq_len}, steps {shape.warmup + 1}-{shape.steps})",
                     f"{ours['syncs_per_step']:.1f}", f"<= {args.max_syncs_per_step:g}",
                     ours["syncs_per_step"] <= args.max_syncs_per_step))
        release(shape.device)
        base = baseline_run(shape, data)
        release(shape.device)
        report["baseline"] = base
        ratio = ours["tokens_per_s"] / base["tokens_per_s"]
        mfu = f", MFU {100 * ours['mfu']:.1f}%" if ours["mfu"] else ""
        base_mfu = ours["peak_flops"] and base["tokens_per_s"] * base["flops_per_token"] / ours["peak_flops"]
        rows.append(("tokens/s: zerotrain", f"{ours['tokens_per_s']:,.0f}{mfu}", "-", True))
        rows.append((f"tokens/s: fully_shard{' + compile' if base['compiled'] else ' (eager: --tiny)'}",
                     f"{base['tokens_per_s']:,.0f}" + (f", MFU {100 * base_mfu:.1f}%" if base_mfu else ""), "-", True))
        rows.append(("ratio zerotrain / baseline", f"{ratio:.2f}x", f">= {args.min_ratio:g}", ratio >= args.min_ratio))
        rows.append(("attention kernel", ", ".join(ours["attention"]), "-", True))
        if shape.device == "cuda":
            fits = ours["peak_device_bytes"] <= ours["plan_total"]
            rows.append(("peak memory vs plan", f"{gib(ours['peak_device_bytes'])} of {gib(ours['plan_total'])}",
                         "<= plan", fits))
        else:
            rows.append(("peak memory vs plan", f"plan {gib(ours['plan_total'])} (CPU: RSS not bounded)", "-", True))
        pair = determinism_pair(shape, comm, out, data)
        release(shape.device)
        report["determinism"] = pair
        rows.append(("determinism pair (--deterministic, 3 steps)", "bitwise equal" if pair["equal"] else "DIFFER",
                     "equal", pair["equal"]))
        try:
            moe = moe_step(shape, comm, out)
            ok = moe["grouped_calls"] > 0 and moe["saved"] == moe["planned"]
            measured = f"{moe['grouped_calls']} grouped calls, saved {moe['saved']:,} B, plan {moe['planned']:,} B"
        except Exception as e:  # noqa: BLE001 - the strict plan's refusal is this row's failure, in one line
            moe, ok, measured = {"error": str(e)}, False, f"failed: {str(e).splitlines()[0][:120]}"
        report["moe"] = moe
        rows.append(("MoE bf16 step, grouped path, plan strict", measured, "grouped, saved == plan", ok))
        dpo = dpo_step(shape, comm, out)
        report["dpo"] = dpo
        if "skipped" in dpo:
            rows.append(("DPO step", f"skipped: {dpo['skipped']}", "finite loss", True))
        else:
            rows.append(("DPO step", f"loss {dpo['loss']:.4f}", "finite loss", math.isfinite(dpo["loss"])))
    rows.append(("wall time", f"{time.monotonic() - t0:.0f} s", "<= 480 s" if shape.device == "cuda" else "-",
                 shape.device != "cuda" or time.monotonic() - t0 <= 480))
    text = table(rows)
    print(text)
    report["table"] = text
    report["ok"] = verdict(rows) == 0
    report["when"] = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with open(os.path.join(out, "device-check.json"), "w") as f:
        json.dump(report, f, indent=1, default=str)
    return verdict(rows)


def verdict(rows: list[tuple[str, str, str, bool]]) -> int:
    """The exit code: 1 when any row is out of its bound."""
    return 0 if all(row[3] for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
