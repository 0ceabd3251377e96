"""`zerotrain plan [training flags] [--device-memory 80GiB]`: what each rank will hold, before the run."""

from __future__ import annotations

import argparse
import dataclasses
import json

from zerotrain.cli.flags import add_training_flags, config_from_args
from zerotrain.config import REFERENCE_FREE, Config
from zerotrain.data import packs_records
from zerotrain.model import ARCH_NAMES
from zerotrain.model.vocab import chunk_tokens, logps_logit_bytes, loss_logit_bytes, vocab_rows
from zerotrain.parallel.parts import parts_for
from zerotrain.training.io_plan import describe, io_plan
from zerotrain.training.memory_plan import (EXPERT_ROWS, ROWS, PlannedModel, fit_advice, gib, largest_micro_batch,
                                            largest_model, largest_seq_len, memory_plan, parse_bytes, planned_layouts)

# How each row is computed, as the table says it (P: the rank's parameters, padded; shard = P / DP).
HOW = {
    "parameters": "{params}",
    "parameter_units": "{units}",
    "frozen_base": "{frozen}",
    "gradients": "{grads}",
    "optimizer_state": "shard x 8 (AdamW's two moments)",
    "master_weights": "{master}",
    "gradient_buckets": "{buckets}",
    "activations": "{saved}",
    "activations_host": "{host}",
    "reference": "{reference}",
    "reference_model": "{reference_model}",
    "kv_cache": "{kv_cache}",
    "loss_working_set": "{loss}",
    "communication": "{comm}",
    "all_to_all": "{a2a}",
    "checkpoint_staging": "{staging}",
}


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="what each rank will hold (parameters, gradients, optimizer, activations...), "
                                    "and the largest micro-batch and model depth that fit",
                       description="Prints, for the run the training flags describe, the bytes each rank will hold "
                                   "by kind: exact for the state (from the layout the engine builds), the activations "
                                   "from the model's formula. `zerotrain train` prints the total in its start line "
                                   "and checks it after its first step.")
    add_training_flags(p)
    p.add_argument("--device-memory", metavar="SIZE", help="memory of one rank's device (80GiB, 40GB, 512MiB): "
                                                           "also print the largest micro-batch that fits, the "
                                                           "largest model of this shape (the most --n-layer, every "
                                                           "other setting as given), the longest --seq-len (at "
                                                           "this --cp) and, where the run does not "
                                                           "fit, what does not and the settings that would make it, "
                                                           "in order of cost, each planned")
    p.add_argument("--json", action="store_true", help="print the plan as JSON instead of a table")
    p.set_defaults(func=cmd_plan)


def cmd_plan(args: argparse.Namespace) -> int:
    device_bytes = parse_bytes(args.device_memory) if args.device_memory is not None else None
    cfg = config_from_args(args, environment=False)  # a plan for a machine that is not this one
    documents = packs_records(cfg)  # packed records: the attention's document mask is saved too
    # the model built once on the meta device, for every plan of this run's model and layout (DeepSeek-V3-671B's
    # build takes seconds)
    planned = planned_layouts(cfg, cfg.launch.nproc // cfg.parallel.tp)
    plan = memory_plan(cfg, documents=documents, planned=planned)
    fits = largest_micro_batch(cfg, device_bytes, documents=documents, planned=planned) \
        if device_bytes is not None else None
    deepest = largest_model(cfg, device_bytes, documents=documents, planned=planned) \
        if device_bytes is not None else None
    longest = largest_seq_len(cfg, device_bytes, documents=documents, planned=planned) \
        if device_bytes is not None else None
    advice = fit_advice(cfg, device_bytes, documents=documents, planned=planned) if device_bytes is not None else None
    io = io_plan(cfg, memory=plan, planned=planned)  # start-up, save, resume and export per rank
    report = {"model": ARCH_NAMES[cfg.model.arch], "parameters": planned.parameters, "tp": plan.tp,
              "dp": plan.dp, "zero": cfg.parallel.zero, "precision": cfg.parallel.precision,
              "micro_batch": plan.micro_batch, "seq_len": cfg.model.seq_len,
              "activation_checkpointing": cfg.parallel.activation_checkpointing, "device": plan.device,
              "rows": plan.rows, "total": plan.total, "device_memory": device_bytes, "largest_micro_batch": fits,
              "does_not_fit": advice.to_dict() if advice else None,
              "largest_model": dataclasses.asdict(deepest) if deepest else None, "lora_rank": cfg.lora.rank,
              "largest_seq_len": longest[0] if longest else None, "cp": cfg.parallel.cp,
              "seq_len_capped_by_context": bool(longest and longest[1]),
              "grad_reduce": grad_reduce_costs(cfg, plan.total, documents, planned),
              "dpo_reference": reference_costs(cfg, plan, documents, planned), "io": io.to_dict(),
              "ep": plan.ep, "experts": plan.experts, "expert_bytes_by_rank": plan.expert_bytes_by_rank,
              "all_to_all_most": plan.all_to_all_most, "dp_replicate": plan.replicas, "traffic": plan.traffic}
    print(json.dumps(report, indent=2) if args.json else "\n".join([table(cfg, report), "",
                                                                      *describe(io, parts_for(cfg).placement, gib)]))
    return 0


def grad_reduce_costs(cfg: Config, total: int, documents: bool, planned: PlannedModel) -> dict:
    """What --grad-reduce costs at stages 2 and 3 with accumulation, both ways: the mode this run takes (auto
    resolved) with its reduce-scatter rounds a step, and the other mode's rounds, gradient buckets and total (None
    where there is no choice: stage 1, or --accum 1, where both are one round and two buckets). `planned`: the
    run's planned_layouts, which the mode does not change (its buckets are the layout's either way)."""
    mode, accum = cfg.grad_reduce, cfg.loop.accum
    rounds = {"micro-batch": accum, "step": 1}
    out = {"mode": mode, "reduce_scatter_rounds": rounds[mode], "total": total, "other": None}
    if parts_for(cfg).gradients.reduce_choice:  # buckets, accumulating
        other = "step" if mode == "micro-batch" else "micro-batch"
        alt = memory_plan(dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, grad_reduce=other)),
                          documents=documents, planned=planned)
        out["other"] = {"mode": other, "reduce_scatter_rounds": rounds[other],
                        "gradient_buckets": alt.rows["gradient_buckets"], "total": alt.total}
    return out


def reference_costs(cfg: Config, plan, documents: bool, planned: PlannedModel) -> dict | None:
    """What DPO's reference costs, both ways (None without one: sft, simpo, orpo): this run's --dpo-reference with
    its rows, and the other one's rows and total. A precomputed reference holds 16 bytes a pair; a live one in full
    fine-tuning a frozen copy of the model (LoRA's live reference is its base: nothing more). `planned`: the run's
    planned_layouts, the policy's either way."""
    o = cfg.objective
    if o.method != "dpo" or o.dpo_loss in REFERENCE_FREE:
        return None
    other = "precomputed" if o.dpo_reference == "live" else "live"
    alt = memory_plan(dataclasses.replace(cfg, objective=dataclasses.replace(o, dpo_reference=other)),
                      documents=documents, planned=planned)
    return {"mode": o.dpo_reference, "reference": plan.rows["reference"],
            "reference_model": plan.rows["reference_model"], "total": plan.total,
            "other": {"mode": other, "reference": alt.rows["reference"],
                      "reference_model": alt.rows["reference_model"], "total": alt.total}}


def table(cfg: Config, r: dict) -> str:
    p, parts = cfg.parallel, parts_for(cfg)
    bf16 = p.precision == "bf16"
    placed = parts.placement.notes(bf16, cfg.gather_in_forward)  # each part says its own rows
    dpo, grpo = cfg.objective.method == "dpo", cfg.objective.method == "grpo"
    rows = vocab_rows(cfg.model.vocab_size, p.tp)  # a micro-batch of DPO pairs is twice as many sequences
    per_logit = (logps_logit_bytes if dpo else loss_logit_bytes)(2 if bf16 else 4, bool(cfg.model.final_softcap))
    chunk = chunk_tokens((2 if dpo else 1) * r["micro_batch"] * r["seq_len"], rows, per_logit)
    mine = " (this TP rank's)" if rows < cfg.model.vocab_size else ""
    batch = f"{2 * r['micro_batch']} ({r['micro_batch']} pairs)" if dpo else r["micro_batch"]
    recompute = {"none": "", "selective": ", each block's element-wise ops recomputed (its matmul outputs kept)",
                 "blocks": ", blocks recomputed",
                 "full": ", blocks, head and loss recomputed"}[p.activation_checkpointing]
    notes = {
        "params": placed["params"],
        "units": placed["units"],
        "frozen": (f"the base's parameters{placed['frozen']}"
                   f" x {2 if bf16 else 4}: no gradients, no optimizer state (LoRA rank {cfg.lora.rank}: P is its "
                   "adapters)") if cfg.lora.rank else "none: every weight trains",
        **parts.gradients.notes(bf16, r["dp"]),  # grads, buckets
        "master": "shard x 4 (fp32 copy of bf16 parameters)" if bf16 else "none: fp32 masters are the parameters",
        "saved": "none on the device: --offload-activations keeps them on the host (below)" if p.offload_activations
                 else f"saved for the backward, {batch} x {r['seq_len']} tokens{recompute}",
        "host": (f"--offload-activations: saved for the backward, {batch} x {r['seq_len']} tokens{recompute}, each "
                 "storage once (the hooks copy each saved tensor: more)") if p.offload_activations else
                "none (--offload-activations keeps them here)",
        "reference": "16 bytes a pair (two float64 log-probs), every pair" if r["rows"]["reference"] else
                     "none: a live reference or a loss without one, or no pairs here to count" if dpo else
                     f"none ({cfg.objective.method})",
        "reference_model": ("a frozen copy of the initial policy" + (" (--grpo-beta > 0)" if grpo else "") +
                            ", laid out as its parameters (" + placed["copy"] + "): no gradients, no optimizer state")
                           if r["rows"]["reference_model"] else
                           "none: --dpo-reference live in full fine-tuning holds one" if dpo else
                           "none: --grpo-beta > 0 in full fine-tuning holds one" if grpo else "none (sft)",
        "kv_cache": ("keys and values of every layer, the rank's largest sampling batch x --seq-len positions; gone "
                     "before the loss's forward") if grpo else "none: --method grpo samples",

        "comm": "(DP - 2) x shard x 4 (gloo receive room)" if r["rows"]["communication"] else "none",
        "a2a": (f"one MoE layer's rows: N k sent, N k received (balanced routing); "
                f"{gib(r['all_to_all_most'])} if one rank received all of its EP group's")
               if r["rows"]["all_to_all"] else "none: no --ep",
        "loss": f"fp32 logits of {chunk} tokens x {rows:,} vocabulary rows{mine}, not the whole micro-batch's",
        "staging": ("--async-save: shard x 12" +
                    (" (host memory)" if r["device"] == "cuda" else "")) if cfg.checkpoint.async_save else
                   "none (--async-save stages copies)",
    }
    # the ZeRO shard group spans DP x CP (plan.dp); the batch is split over DP = that / CP
    cp = cfg.parallel.cp
    mesh = " x ".join([f"TP {r['tp']}"] * (r["tp"] > 1) + [f"CP {cp}"] * (cp > 1) + [f"DP {r['dp'] // cp}"])
    if r["dp_replicate"] > 1:  # hybrid sharding: the state sharded within each replica group
        mesh += f" ({r['dp_replicate']} replica groups of {r['dp'] // r['dp_replicate']})"
    lora = f" with LoRA rank {r['lora_rank']} adapters" if r["lora_rank"] else ""
    lines = [f"zerotrain plan: {r['model']} {r['parameters']:,} parameters{lora} on {mesh} ({r['device']}), ZeRO-{r['zero']}, "
             f"{r['precision']}, micro-batch {r['micro_batch']} x {r['seq_len']} tokens, accum {cfg.loop.accum}; "
             "per rank (rank 0):", ""]
    width = max(len(label) for _, label in ROWS)
    for key, label in ROWS:
        lines.append(f"  {label:<{width}}  {gib(r['rows'][key]):>11}  {HOW[key].format(**notes)}")
    if r["experts"] is not None:  # inside the state rows above, not added to the total
        how = (f"EP rank 0's block of {cfg.model.n_experts // r['ep']} experts of each MoE layer over its replica "
               f"group of {r['dp'] // r['ep']} ranks (--ep {r['ep']})" if r["ep"] > 1 else
               f"all {cfg.model.n_experts} experts of each MoE layer, in the one flat layout (--ep 1)")
        for key, label in EXPERT_ROWS:
            lines.append(f"  {label:<{width}}  {gib(r['experts'][key]):>11}  {how if key == 'parameters' else ''}")
    where = "on the device; staging and offloaded activations are host memory" if r["device"] == "cuda" else "in RAM"
    lines += ["", f"  {'total, at the peak of a step':<{width}}  {gib(r['total']):>11}  {where}; torch's own "
              "runtime not included"]
    if "all_reduce_replicas" in r["traffic"]:
        lines.append(f"  --dp-replicate {r['dp_replicate']}: {gib(r['traffic']['all_reduce_replicas'])} sent a step "
                     f"across the replica groups (the gradient shard's all-reduce, shard x 4 x 2(R-1)/R, once a step "
                     f"at any --accum), beside the reduce-scatters and all-gathers within a group of "
                     f"{r['dp'] // r['dp_replicate']}")
    costs = r["grad_reduce"]
    if costs["other"] is not None:
        o = costs["other"]
        lines.append(f"  --grad-reduce {costs['mode']}{' (auto)' if p.grad_reduce == 'auto' else ''}: "
                     f"{rounds(costs['reduce_scatter_rounds'])} a step; --grad-reduce {o['mode']} "
                     f"would take {rounds(o['reduce_scatter_rounds'])} and hold {gib(o['gradient_buckets'])} of gradient "
                     f"buckets, {gib(o['total'])} in all")
    ref = r["dpo_reference"]
    if ref is not None:
        o = ref["other"]
        held = {m: gib(c["reference"] + c["reference_model"]) for m, c in ((ref["mode"], ref), (o["mode"], o))}
        lines.append(f"  --dpo-reference {ref['mode']}: {held[ref['mode']]} for the reference; --dpo-reference "
                     f"{o['mode']} would hold {held[o['mode']]}, {gib(o['total'])} in all" +
                     ("; live scores every pair again each step (a forward without gradients)"
                      if "live" in (ref["mode"], o["mode"]) else ""))
    if r["device_memory"] is not None:
        fits, advice = r["largest_micro_batch"], r["does_not_fit"]
        lines.append(f"  largest micro-batch in {gib(r['device_memory'])}: {fits if fits else 'none'}")
        if r["total"] <= r["device_memory"]:  # what the plan does not count lives in what is left
            lines.append(f"  slack in {gib(r['device_memory'])}: {gib(r['device_memory'] - r['total'])} "
                         f"({(r['device_memory'] - r['total']) / r['device_memory']:.0%}) beyond the plan, for what it "
                         "does not count: the CUDA context, NCCL's buffers, the allocator's fragmentation")
        if advice is not None:
            lines += advice_lines(advice, r["micro_batch"])
        lines.append(f"  largest model of this shape in {gib(r['device_memory'])}: "
                     f"{deepest_line(r['largest_model'], r['micro_batch'])}")
        lines.append(f"  largest sequence in {gib(r['device_memory'])}: {longest_line(r)}")
    return "\n".join(lines)


def advice_lines(advice: dict, micro_batch: int) -> list[str]:
    """The table's words for fit_advice's answer (the report's dict of it): what does not fit, then what would."""
    lines = [f"  does not fit: {advice['short']}"]
    found = advice["remedies"] or ([advice["together"]] if advice["together"] else [])
    if not found:
        return lines + ["  nothing the plan tries fits, even all together (--zero 3, --activation-checkpointing full, "
                        "--precision bf16, --ep 8, --tp 8, 8x --nproc): a shorter --seq-len or a smaller model"]
    lines.append("  what would fit, in order of cost (each planned with the setting changed):" if advice["remedies"]
                 else "  no one setting fits; together, in order of cost:")
    width = max(len(r["flags"]) for r in found)
    for r in found:
        lines.append(f"    {r['flags']:<{width}}  {gib(r['total'])} at micro-batch {micro_batch}, largest micro-batch "
                     f"{r['largest_micro_batch']}" + (f": {r['cost']}" if r["cost"] else ""))
    return lines


def longest_line(r: dict) -> str:
    """The table's words for largest_seq_len's answer: the tokens a row, at this --cp and micro-batch."""
    n, at = r["largest_seq_len"], f"at --cp {r['cp']}, micro-batch {r['micro_batch']}"
    if not n:
        return f"none: not even {2 * r['cp']} tokens a row fit {at}"
    capped = " (the model's --context: longer would need a longer context)" if r["seq_len_capped_by_context"] else ""
    per_rank = f", {n // r['cp']:,} on each CP rank" if r["cp"] > 1 else ""
    return f"{n:,} tokens a row {at}{per_rank}{capped}"


def deepest_line(deepest: dict | None, micro_batch: int) -> str:
    """The table's words for largest_model's answer (the report's dict of it)."""
    if deepest is None:
        return f"none: not even one block fits at micro-batch {micro_batch}"
    n, count = deepest["n_layer"], deepest["parameters"]
    size = f"{count / 1e9:.1f}B" if count >= 1e9 else f"{count / 1e6:.1f}M" if count >= 1e6 else f"{count:,}"
    layers = f"{n} layer{'s' if n > 1 else ''}"
    if deepest["capped"]:
        return f"{layers} or more at micro-batch {micro_batch} ({size} parameters at {n}, where the search stops)"
    return f"{layers} ({size} parameters) at micro-batch {micro_batch}"


def rounds(n: int) -> str:
    return f"{n} reduce-scatter round{'s' * (n != 1)}"
