"""`zerotrain equivalence`: prove on the user's config that splitting the global batch changes neither gradient nor step.

One global batch (that of step 0) is computed several ways: once as a single full-batch backward in
plain PyTorch (the reference), then through the ZeRO-1 engine as one micro-batch on 1 rank, as
ranks x accum micro-batches on 1 rank, and as the configured split on N ranks (with `--tp T`, on the
TP x DP mesh, beside the same ranks as plain data parallelism). Each engine run is
compared with the reference on the reduced gradient, on the parameters after one plain SGD step
(p - lr * g, which unlike AdamW is not invariant to the gradient's scale) and after the engine's own
AdamW step. Two deliberately wrong loss weightings run on the same split and must fail the bound:
that shows the check can tell.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
from collections import Counter
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F

from zerotrain.config import Config
from zerotrain.data import IGNORE, BatchSchedule, make_source
from zerotrain.errors import ConfigError
from zerotrain.model.gpt2 import build_model, summed_token_loss
from zerotrain.parallel import Comm, ZeroOneEngine
from zerotrain.parallel.optim import adamw_param_groups
from zerotrain.runtime.launch import rank_device
from zerotrain.training.loop import build_engine

BOUND = 1e-4  # max-abs difference allowed on gradients and on parameters after one step
STEP = 0  # the global batch of this step is the one checked

# Variable-length data by default, where per-micro-batch mean weighting is visibly wrong.
EQUIVALENCE_DEFAULTS = {
    "nproc": 2, "micro_batch": 2, "accum": 4, "data": "synthetic-varlen", "progress": False,
}

# How a micro-batch's summed token loss is scaled before its backward.
WEIGHTINGS = {
    "token": "sum of token losses / global unmasked token count",
    "unscaled": "no loss scaling: each micro-batch's mean loss as is, no 1/(accum x ranks)",
    "mean": "per-micro-batch mean weighting: each micro-batch's mean loss / (accum x ranks)",
}
BREAKS = {"scaling": "unscaled", "mean-weighting": "mean"}


@dataclass(frozen=True)
class Split:
    """One way to compute the step: ranks x micro-batch x accumulation, and the loss weighting used."""

    ranks: int
    micro_batch: int
    accum: int
    weighting: str = "token"
    data: str = ""  # "" -> the configured data source
    expect_pass: bool = True  # False for the deliberately wrong variants
    note: str = ""
    tp: int = 1  # tensor-parallel degree: ranks / tp data-parallel replicas

    @property
    def name(self) -> str:
        mesh = f" (TP {self.tp} x DP {self.ranks // self.tp})" if self.tp > 1 else ""
        return f"{self.ranks} x {self.micro_batch} x {self.accum}{mesh}"


def add_parser(sub) -> None:
    from zerotrain.cli.flags import add_training_flags

    p = sub.add_parser("equivalence", help="prove that micro-batching and ranks do not change the gradient or the step")
    add_training_flags(p, defaults=EQUIVALENCE_DEFAULTS)
    p.add_argument("--json", dest="json_path", help="also write the report as JSON to this path")
    p.add_argument("--time-limit", type=float, default=300.0, help="hard wall-clock limit per job in seconds")
    # Applies a known bug to the checked runs, so a test can see the command fail.
    p.add_argument("--break", dest="break_", choices=sorted(BREAKS), help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_equivalence)


# ------------------------------------------------------------------------------------------ reference
def full_batch_reference(cfg: Config, lr: float) -> dict:
    """One backward over the whole global batch in plain PyTorch, then one SGD and one AdamW step."""
    device = rank_device(cfg)
    model = build_model(cfg.model, cfg.loop.seed).to(device)
    x, y = make_source(cfg).sequences(STEP, range(cfg.global_batch))
    initial = _by_name(model.named_parameters())
    logits = model(x.to(device))
    # The definition the splits must reproduce: the mean over every unmasked token of the global batch.
    loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), y.to(device).view(-1), ignore_index=IGNORE)
    loss.backward()
    grads = {n: p.grad.detach().float().cpu().clone() for n, p in model.named_parameters()}
    o = cfg.optim
    groups = adamw_param_groups(model.named_parameters(), o.weight_decay)
    if o.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
    torch.optim.AdamW(groups, lr=lr, betas=(o.beta1, o.beta2), eps=o.eps).step()
    return {
        "loss": loss.item(),
        "tokens": int((y != IGNORE).sum()),
        "initial": initial,
        "grads": grads,
        "sgd": {n: initial[n] - lr * grads[n] for n in initial},
        "adamw": _by_name(model.named_parameters()),
    }


# ------------------------------------------------------------------------------------------ engine runs
def engine_step(cfg: Config, comm: Comm, split: Split, lr: float) -> dict:
    """One optimizer step of `split` through the engine, as train.train runs it; full tensors on every rank."""
    meshed = copy.deepcopy(cfg)
    meshed.parallel.tp = split.tp
    engine = build_engine(meshed, comm)
    mesh = engine.mesh
    schedule = BatchSchedule(make_source(_with_data(cfg, split.data)), micro_batch=split.micro_batch,
                             accum=split.accum, rank=mesh.dp_rank, world_size=mesh.dp_size)
    batch = schedule.batch(STEP)
    initial = engine.full_state_dict()
    before = Counter(mesh.counters()[0])
    engine.zero_grad()
    loss_sum = backward_micro_batches(engine, batch, split.weighting, chunks=split.accum * mesh.dp_size)
    counted = loss_sum if mesh.tp_rank == 0 else 0.0  # a replica's TP ranks compute the same loss
    grad_norm, totals = engine.reduce_grads(torch.tensor([counted], dtype=torch.float64))
    grads = reduced_grads(engine)
    engine.apply(lr, grad_norm)
    calls = Counter(mesh.counters()[0]) - before
    return {
        "loss": float(totals[0]) / batch.global_tokens,
        "initial": initial,
        "grads": grads,
        "sgd": {n: initial[n] - lr * grads[n] for n in initial},
        "adamw": engine.full_state_dict(),
        "buckets": len(engine.layout.buckets),
        "reduce_scatter_calls": calls["reduce_scatter_grads"],
        "all_gather_calls": calls["all_gather_params"],
        "micro_batch_tokens": [int((y != IGNORE).sum()) for _, y in batch.micro_batches],
    }


def backward_micro_batches(engine: ZeroOneEngine, batch, weighting: str, chunks: int) -> float:
    """The loop of train.train, with the loss weighting made a choice; returns this rank's summed token loss."""
    model, device = engine.model, engine.flat_params.device
    loss_sum, last = 0.0, len(batch.micro_batches) - 1
    for i, (x, y) in enumerate(batch.micro_batches):
        with engine.no_sync(i < last):
            token_loss = summed_token_loss(model(x.to(device)), y.to(device))
            micro_tokens = max(1, int((y != IGNORE).sum()))
            if weighting == "token":
                scale = 1.0 / batch.global_tokens
            elif weighting == "unscaled":
                scale = 1.0 / micro_tokens
            else:  # "mean": exact only when every micro-batch holds the same number of tokens
                scale = 1.0 / (micro_tokens * chunks)
            (token_loss * scale).backward()
        loss_sum += token_loss.item()
    return loss_sum


def reduced_grads(engine: ZeroOneEngine) -> dict[str, torch.Tensor]:
    """The reduced gradient of the full model by parameter name, from every rank's shard and TP slice.

    Compared by name, in the unpadded per-parameter order: the flat layout's padding, and so every
    offset, depends on the world size, while a parameter's gradient must not.
    """
    L = engine.layout
    flat = L.assemble(engine.dp.all_gather_rows(engine.grad_shard, "all_gather_equivalence"))
    return engine.full_tensors(flat.to(engine.grad_shard.device))


def equivalence_job(cfg: Config, comm: Comm, *, splits: list[Split], lr: float) -> list[dict] | None:
    """Every rank runs each split of this world size; rank 0 compares with the reference it computes itself."""
    references: dict[str, dict] = {}
    rows = []
    for split in splits:
        run = engine_step(cfg, comm, split, lr)
        if comm.rank != 0:
            continue
        if split.data not in references:
            references[split.data] = full_batch_reference(_with_data(cfg, split.data), lr)
        rows.append(compare(split, run, references[split.data]))
    return rows if comm.rank == 0 else None


def compare(split: Split, run: dict, ref: dict) -> dict:
    initial = _max_abs_diff(run["initial"], ref["initial"])
    row = {
        **asdict(split),
        "split": split.name,
        "weighting_text": WEIGHTINGS[split.weighting],
        "loss": run["loss"],
        "loss_abs_diff": abs(run["loss"] - ref["loss"]),
        "initial_params_match": initial == 0.0,
        "initial_param_max_abs_diff": initial,
        "grad_max_abs_diff": _max_abs_diff(run["grads"], ref["grads"]),
        "sgd_param_max_abs_diff": _max_abs_diff(run["sgd"], ref["sgd"]),
        "adamw_param_max_abs_diff": _max_abs_diff(run["adamw"], ref["adamw"]),
        "buckets": run["buckets"],
        "reduce_scatter_rounds": run["reduce_scatter_calls"] / run["buckets"],
        "all_gather_rounds": run["all_gather_calls"] / run["buckets"],
        "micro_batch_tokens_rank0": run["micro_batch_tokens"],
    }
    row["within_bound"] = max(row["grad_max_abs_diff"], row["sgd_param_max_abs_diff"],
                              row["adamw_param_max_abs_diff"]) <= BOUND
    row["passed"] = (row["within_bound"] and row["initial_params_match"]
                     and row["reduce_scatter_rounds"] == 1 and row["all_gather_rounds"] == 1)
    return row


# ------------------------------------------------------------------------------------------ command
def plan(cfg: Config, weighting: str, tokens: list[int]) -> tuple[list[Split], list[Split]]:
    """The 1-rank splits and the N-rank splits of the configured global batch (1-rank only if N is 1).

    `tokens` are the unmasked tokens of each micro-batch, which decide where mean weighting can be shown wrong.
    """
    G, chunks = cfg.global_batch, cfg.dp * cfg.loop.accum
    one_rank = [Split(1, G, 1, weighting, note="full batch through the engine"),
                Split(1, cfg.loop.micro_batch, chunks, weighting, note=f"{chunks} chunked backwards on 1 rank")]
    n_ranks = [Split(cfg.launch.nproc, cfg.loop.micro_batch, cfg.loop.accum, weighting, note="the configured split", tp=cfg.parallel.tp)] \
        if cfg.launch.nproc > 1 else []
    if cfg.parallel.tp > 1 and G % cfg.launch.nproc == 0:
        n_ranks.append(Split(cfg.launch.nproc, G // cfg.launch.nproc, 1, weighting, note="the same ranks, data-parallel only"))
    mean_data, mean_note = "", ""
    if len(set(tokens)) == 1:
        # Mean weighting is exact when every micro-batch holds as many tokens; show it where it is not.
        mean_data, mean_note = "synthetic-varlen", "on synthetic-varlen: every micro-batch of this data has equal tokens"
    wrong = [Split(cfg.launch.nproc, cfg.loop.micro_batch, cfg.loop.accum, "unscaled", expect_pass=False, tp=cfg.parallel.tp),
             Split(cfg.launch.nproc, cfg.loop.micro_batch, cfg.loop.accum, "mean", data=mean_data, expect_pass=False, note=mean_note,
                   tp=cfg.parallel.tp)]
    if cfg.launch.nproc > 1:
        return one_rank, n_ranks + wrong
    return one_rank[:1] + [Split(1, cfg.loop.micro_batch, cfg.loop.accum, weighting, note="the configured split")] + wrong, []


def micro_batch_tokens(cfg: Config, data: str) -> list[int]:
    """Unmasked target tokens of each micro-batch of the global batch, in global order."""
    source, m = make_source(_with_data(cfg, data)), cfg.loop.micro_batch
    return [int((source.sequences(STEP, range(j * m, (j + 1) * m))[1] != IGNORE).sum())
            for j in range(cfg.global_batch // m)]


def cmd_equivalence(args: argparse.Namespace) -> int:
    from zerotrain.cli.flags import config_from_args
    from zerotrain.runtime.launch import run_job

    cfg = config_from_args(args)
    if cfg.dp * cfg.loop.accum < 2:
        raise ConfigError(f"{cfg.dp} DP replica(s) x --accum {cfg.loop.accum} gives one micro-batch per step: "
                          "nothing to compare; raise --accum")
    if cfg.parallel.precision != "fp32":
        raise ConfigError(f"--precision {cfg.parallel.precision}: equivalence is checked in fp32, where rounding "
                          f"stays far below the {BOUND:g} bound; drop --precision")
    cfg.logging.progress = False
    weighting = BREAKS[args.break_] if args.break_ else "token"
    lr = cfg.optim.lr
    tokens = micro_batch_tokens(cfg, "")
    one_rank, n_ranks = plan(cfg, weighting, tokens)
    _print_header(cfg, lr, tokens, args.break_)
    rows = run_job(functools.partial(equivalence_job, splits=one_rank, lr=lr), _on_one_rank(cfg),
                   time_limit=args.time_limit)
    if n_ranks:
        rows += run_job(functools.partial(equivalence_job, splits=n_ranks, lr=lr), cfg, time_limit=args.time_limit)
    checked = [row for row in rows if row["expect_pass"]]
    wrong = [row for row in rows if not row["expect_pass"]]
    passed = all(row["passed"] for row in checked)
    report = {
        "bound": BOUND,
        "step": STEP,
        "lr": lr,
        "global_batch": cfg.global_batch,
        "micro_batch_tokens": tokens,
        "break": args.break_,
        "checked": checked,
        "wrong_variants": wrong,
        "wrong_variants_caught": all(not row["within_bound"] for row in wrong),
        "passed": passed,
        "config": cfg.to_dict(),
    }
    _print_report(report)
    if args.json_path:
        os.makedirs(os.path.dirname(os.path.abspath(args.json_path)), exist_ok=True)
        with open(args.json_path, "w") as f:
            json.dump(report, f, indent=1)
    return 0 if passed else 1


def _print_header(cfg: Config, lr: float, tokens: list[int], broken: str | None) -> None:
    m = cfg.model
    print(f"zerotrain equivalence: GPT {m.n_layer} layers, width {m.n_embd}, seq {m.seq_len}, vocab {m.vocab_size}; "
          f"data {cfg.data.source}{'' if cfg.data.pack else ' (unpacked)'}; seed {cfg.loop.seed}")
    ranks = f"DP {cfg.dp} replicas (TP {cfg.parallel.tp} x DP {cfg.dp} = {cfg.launch.nproc} ranks)" if cfg.parallel.tp > 1 else f"{cfg.launch.nproc} ranks"
    print(f"global batch of step {STEP}: {cfg.global_batch} sequences = {ranks} x micro-batch "
          f"{cfg.loop.micro_batch} x accum {cfg.loop.accum}; {sum(tokens)} unmasked target tokens")
    print(f"unmasked tokens per micro-batch: {tokens}")
    print(f"reference: one full-batch backward in plain PyTorch (mean over every unmasked token); "
          f"one step at lr {lr:g}; bound {BOUND:g} max-abs")
    if broken:
        print(f"--break {broken}: the checked runs use {WEIGHTINGS[BREAKS[broken]]}")
    print(flush=True)


def _print_report(rep: dict) -> None:
    head = (f"{'split (ranks x micro x accum)':31} {'init':>5} {'grad |diff|':>11} {'SGD |diff|':>11} "
            f"{'AdamW |diff|':>12} {'RS/AG rounds':>12}  result")
    print(head)
    print("-" * len(head))
    for row in rep["checked"]:
        print(_row_line(row, "PASS" if row["passed"] else "FAIL") + f"   {row['note']}")
    print("\ndeliberately wrong variants (expected to FAIL):")
    for row in rep["wrong_variants"]:
        result = "FAIL (caught)" if not row["within_bound"] else "pass (NOT caught)"
        print(_row_line(row, result))
        print(f"    {row['weighting_text']}" + (f"; {row['note']}" if row["note"] else ""))
    rounds = {(r["reduce_scatter_rounds"], r["all_gather_rounds"], r["buckets"]) for r in rep["checked"]}
    for rs, ag, buckets in sorted(rounds):
        print(f"\ngradient collectives per optimizer step: {rs:g} reduce-scatter round and {ag:g} all-gather round "
              f"({buckets} bucket(s), one call per bucket per round), whatever the accumulation")
    initial = all(r["initial_params_match"] for r in rep["checked"] + rep["wrong_variants"])
    print(f"initial parameters match the reference on every run: {'yes (bitwise)' if initial else 'NO'}")
    if rep["passed"]:
        print(f"PASS: every split gives the full-batch gradient and step within {rep['bound']:g}")
    else:
        print(f"FAIL: at least one split differs from the full-batch reference by more than {rep['bound']:g}")


def _row_line(row: dict, result: str) -> str:
    return (f"{row['split']:31} {'yes' if row['initial_params_match'] else 'NO':>5} "
            f"{row['grad_max_abs_diff']:11.2e} {row['sgd_param_max_abs_diff']:11.2e} "
            f"{row['adamw_param_max_abs_diff']:12.2e} {row['reduce_scatter_rounds']:>5g} / {row['all_gather_rounds']:<4g}  "
            f"{result}")


# ------------------------------------------------------------------------------------------ small pieces
def _by_name(named) -> dict[str, torch.Tensor]:
    return {n: p.detach().float().cpu().clone() for n, p in named}


def _max_abs_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    if a.keys() != b.keys():
        raise ValueError(f"parameter names differ: {sorted(a.keys() ^ b.keys())}")
    return max(float((a[n] - b[n]).abs().max()) for n in a)


def _with_data(cfg: Config, data: str) -> Config:
    if not data:
        return cfg
    out = copy.deepcopy(cfg)
    out.data.source = data
    return out


def _on_one_rank(cfg: Config) -> Config:
    """The same global batch on one rank: its accumulation takes over every rank's micro-batches."""
    out = copy.deepcopy(cfg)
    out.launch.nproc, out.parallel.tp, out.loop.accum = 1, 1, cfg.dp * cfg.loop.accum
    return out
