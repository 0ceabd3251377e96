"""`zerotrain bench model`: zerotrain's model against transformers' of the same shape, on one CPU process.

Both models hold the same weights (transformers' random initialisation, read through the architecture's
table in hub/mapping.py), fp32, with PyTorch's scaled-dot-product attention in both; the report first
checks that their logits agree. Two measures, each alternating the two models (A B, B A, ...) so that
drift in the machine's load spreads over both, as medians:

    train step   forward, backward and an AdamW step (torch's AdamW, the same options) of one batch
    generation   greedy decoding of --new-tokens tokens after a prompt, with the KV cache: zerotrain's
                 generate() against transformers' model.generate()

Target: zerotrain no slower than transformers on both (time ratio <= 1.0). Writes bench-model.json and
bench-model.md to --out.

With --lora: the train step of LoRA at rank 16 (alpha 32, adapters on every linear of the blocks) on the
smollm-135m shape (--layers fewer of its blocks for a quicker run), against zerotrain's full fine-tuning and peft's
LoRA on transformers' model, the same weights, batch and adapters, alternated; and each one's memory: the
parameter, gradient and AdamW state bytes it holds, and what its forward saves for the backward. Writes
bench-model-lora.json and bench-model-lora.md.

With --arch qwen3_moe: a mixture of experts (MOE_SIZES: 16 experts, top-4; --quick 8, top-2), zerotrain's model
against transformers' Qwen3MoeForCausalLM, the same weights, on the same tokens, each loss with the balancing term
(transformers' with output_router_logits): the train step of zerotrain's per-expert loop and its grouped path
(torch._grouped_mm, where the CPU build has it) beside transformers' "eager" experts (a loop over the experts hit)
and its default "grouped_mm", alternated; tokens/s; and each one's memory as --lora reports it (parameters,
gradients, AdamW state, what the forward saves for the backward: their sum bounds the step's peak from above, the
allocator's scratch aside). The targets: zerotrain's loop no slower than transformers' eager experts, its grouped
path no slower than transformers' grouped_mm. Writes bench-model-moe.json and bench-model-moe.md.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import tempfile
import time

import torch

from zerotrain.cli.flags import checked
from zerotrain.config import LLAMA_FAMILY, MOE, POSITIVE, WINDOWED, ModelConfig
from zerotrain.errors import ConfigError

from .report import report_header, write_report

SCHEMA = "zerotrain.bench.model"
SIZES = {  # the model's shape, the training batch, the generation's prompt and new tokens, alternating rounds
    "full": dict(n_layer=6, n_head=8, n_kv_head=4, n_embd=512, intermediate_size=1408, vocab_size=8192,
                 batch=4, seq_len=256, prompt=16, new_tokens=128, repeats=5),
    "quick": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=352, vocab_size=1024,
                  batch=2, seq_len=64, prompt=8, new_tokens=32, repeats=3),
}
MOE_SIZES = {  # --arch qwen3_moe: the shape (every layer's MLP a mixture of experts), the batch, alternating rounds
    "full": dict(n_layer=4, n_head=8, n_kv_head=4, n_embd=512, n_experts=16, experts_per_token=4, expert_width=256,
                 vocab_size=8192, batch=4, seq_len=256, repeats=5),
    "quick": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=64, n_experts=8, experts_per_token=2, expert_width=32,
                  vocab_size=1024, batch=2, seq_len=32, repeats=3),
}
BENCHED_MOE = ("qwen3_moe",)  # the mixture of experts the bench builds (MOE_SIZES's shapes are Qwen3-MoE's)


def add_parser(benches) -> None:
    p = benches.add_parser("model", help="zerotrain's model vs transformers' of the same shape: train step and "
                                         "generation", description=__doc__.split("\n\n")[1])
    p.add_argument("--arch", choices=(*(a for a in LLAMA_FAMILY if a not in MOE), "gpt2", *BENCHED_MOE),
                   default="llama", help="the architecture (mistral and phi3 with a sliding window of half the "
                                         "training sequence; qwen3_moe: a mixture of experts, the train step only)")
    p.add_argument("--quick", action="store_true", help="a small model: seconds")
    p.add_argument("--repeats", type=checked(int, POSITIVE), help="alternating rounds (default 5, quick 3)")
    p.add_argument("--out", default="", help="folder for bench-model.json and bench-model.md")
    p.add_argument("--lora", action="store_true", help="LoRA rank 16 on the smollm-135m shape against full "
                                                       "fine-tuning and peft on transformers: step time and memory")
    p.add_argument("--layers", type=checked(int, POSITIVE), help="--lora: blocks of the smollm-135m shape (30)")
    p.add_argument("--seq-len", type=checked(int, POSITIVE), default=128, help="--lora: tokens per sequence")
    p.add_argument("--batch", type=checked(int, POSITIVE), default=1, help="--lora: sequences per step")
    p.set_defaults(func=cmd_model)


def cmd_model(args: argparse.Namespace) -> int:
    try:
        import transformers
    except ImportError:
        raise ConfigError("bench model compares with transformers: pip install 'zerotrain[hf]'") from None
    if args.lora:
        return cmd_lora(args, transformers)
    if args.arch in MOE:
        return cmd_moe(args, transformers)
    size = dict(SIZES["quick" if args.quick else "full"])
    if args.repeats:
        size["repeats"] = args.repeats
    out = args.out or os.path.join("runs", "model-" + time.strftime("%Y%m%d-%H%M%S"))
    t0 = time.perf_counter()
    ours, theirs, cfg = _models(transformers, args.arch, size)
    ids = torch.randint(0, cfg.vocab_size, (size["batch"], size["seq_len"]), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits_diff = (ours(ids) - theirs(ids).logits).abs().max().item()
    train = _alternate(size["repeats"], {"zerotrain": _train_step(ours, ids, lambda m, x: _our_loss(m, x)),
                                         "transformers": _train_step(theirs, ids, lambda m, x: m(x, labels=x).loss)})
    prompt = ids[:1, : size["prompt"]]
    generation = _alternate(size["repeats"], {"zerotrain": _our_generation(ours, prompt, size["new_tokens"]),
                                              "transformers": _their_generation(theirs, prompt, size["new_tokens"])})
    report = {**report_header(SCHEMA), "arch": args.arch, "size": "quick" if args.quick else "full",
              "model": vars(cfg), "params": sum(p.numel() for p in ours.parameters()),
              "threads": torch.get_num_threads(), "batch": size["batch"], "seq_len": size["seq_len"],
              "new_tokens": size["new_tokens"], "logits_max_abs_diff": logits_diff,
              "train_step_s": {k: statistics.median(v) for k, v in train.items()},
              "generation_s": {k: statistics.median(v) for k, v in generation.items()},
              "samples": {"train_step_s": train, "generation_s": generation}}
    report["train_ratio"] = report["train_step_s"]["zerotrain"] / report["train_step_s"]["transformers"]
    report["generation_ratio"] = report["generation_s"]["zerotrain"] / report["generation_s"]["transformers"]
    report["met"] = {"train": report["train_ratio"] <= 1.0, "generation": report["generation_ratio"] <= 1.0}
    report["wall_s"] = time.perf_counter() - t0
    write_report(out, "bench-model", report, markdown(report))
    return 0


def _models(transformers, arch: str, size: dict, tie_embeddings: bool = False):
    """transformers' model at random initialisation and zerotrain's holding the same weights; fp32, SDPA.

    transformers' config is the one `export --format hf` writes for zerotrain's (hub/mapping.py: hf_config).
    """
    from zerotrain.hub.mapping import MAPPINGS, hf_config
    from zerotrain.model import model_class

    shape = {k: size[k] for k in ("n_layer", "n_head", "n_embd", "vocab_size")}
    if arch in LLAMA_FAMILY:
        shape.update(n_kv_head=size["n_kv_head"], intermediate_size=size["intermediate_size"],
                     tie_embeddings=tie_embeddings, norm_eps=1e-6,
                     sliding_window=size["seq_len"] // 2 if arch in WINDOWED else 0)
    cfg = ModelConfig(arch=arch, seq_len=size["seq_len"] + size["new_tokens"], **shape)
    config = hf_config(cfg, None)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(config.pop("model_type"), **config),
        attn_implementation="eager" if arch == "gemma2" else "sdpa")  # Gemma 2's soft-cap: transformers has no SDPA
    ours = model_class(cfg)(cfg)
    ours.load_state_dict(MAPPINGS[arch].from_hf(theirs.state_dict(), cfg), strict=True)
    theirs.generation_config.eos_token_id = None  # generate every token asked for
    theirs.generation_config.pad_token_id = 0
    return ours.train(), theirs.train(), cfg


def _our_loss(model, ids: torch.Tensor) -> torch.Tensor:
    from zerotrain.model import summed_token_loss

    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return summed_token_loss(model(x), y) / y.numel()


def _train_step(model, ids: torch.Tensor, loss_of):
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        loss_of(model, ids).backward()
        optimizer.step()

    step()  # warm-up: allocations, AdamW's state
    return step


def _our_generation(model, prompt: torch.Tensor, new_tokens: int):
    from zerotrain.model.generate import generate

    return lambda: generate(model, prompt, new_tokens, temperature=0.0)


def _their_generation(model, prompt: torch.Tensor, new_tokens: int):
    def run() -> None:
        with torch.inference_mode():
            model.generate(prompt, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False)

    return run


def _alternate(repeats: int, runs: dict) -> dict[str, list[float]]:
    """Seconds of each run per round, the order alternating every round; one untimed round first."""
    names = list(runs)
    for name in names:
        runs[name]()
    times = {name: [] for name in names}
    for r in range(repeats):
        for name in names if r % 2 == 0 else reversed(names):
            t0 = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - t0)
    return times


def markdown(report: dict) -> str:
    t, g = report["train_step_s"], report["generation_s"]
    m = report["machine"]
    rows = [
        ("train step (forward, backward, AdamW)", f"{t['zerotrain'] * 1e3:.1f} ms", f"{t['transformers'] * 1e3:.1f} ms",
         f"{report['train_ratio']:.2f}x", "met" if report["met"]["train"] else "NOT met"),
        (f"greedy generation, {report['new_tokens']} tokens, KV cache", f"{g['zerotrain'] * 1e3:.1f} ms",
         f"{g['transformers'] * 1e3:.1f} ms", f"{report['generation_ratio']:.2f}x",
         "met" if report["met"]["generation"] else "NOT met"),
    ]
    head = (f"# bench model: {report['arch']} ({report['size']}), {report['params']:,} parameters, batch "
            f"{report['batch']} x {report['seq_len']}, fp32, {report['threads']} threads, {m['cpu_count']} cores, "
            f"torch {m['torch']}; logits agree to {report['logits_max_abs_diff']:.1e}\n\n"
            "| measure | zerotrain | transformers | zerotrain / transformers | target <= 1.0 |\n|---|---|---|---|---|\n")
    return head + "".join(f"| {' | '.join(row)} |\n" for row in rows)


LORA_RANK, LORA_ALPHA = 16, 32.0


def cmd_lora(args: argparse.Namespace, transformers) -> int:
    """--lora: the three train steps, alternated, and what each holds."""
    try:
        import peft
    except ImportError:
        raise ConfigError("bench model --lora compares with peft: pip install 'zerotrain[peft]'") from None
    from zerotrain.config import PRESETS, LoraConfig
    from zerotrain.model.lora import add_adapters

    shape = {k: v for k, v in PRESETS["smollm-135m"].items() if k != "seq_len"}
    shape["n_layer"] = args.layers or (2 if args.quick else shape["n_layer"])
    size = {**shape, "batch": args.batch, "seq_len": args.seq_len + 1, "new_tokens": 0}
    repeats = args.repeats or (3 if args.quick else 5)
    out = args.out or os.path.join("runs", "model-lora-" + time.strftime("%Y%m%d-%H%M%S"))
    t0 = time.perf_counter()
    lora = LoraConfig(rank=LORA_RANK, alpha=LORA_ALPHA)
    full, theirs, cfg = _models(transformers, "llama", size, tie_embeddings=True)
    ours = copy.deepcopy(full)
    add_adapters(ours, lora, seed=0)
    twin = peft.get_peft_model(theirs, peft.LoraConfig(r=LORA_RANK, lora_alpha=LORA_ALPHA, lora_dropout=0.0,
                                                      target_modules=list(lora.modules("llama"))))
    ours_by_name = dict(ours.named_parameters())
    with torch.no_grad():  # the same adapters in both: A drawn by zerotrain, B zero
        for name, p in twin.named_parameters():
            if ".lora_" in name:
                p.copy_(ours_by_name[name.removeprefix("base_model.model.").replace(".default", "")])
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq_len + 1), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        logits_diff = (ours(ids) - twin(input_ids=ids).logits).abs().max().item()
    peft_loss = lambda m, x: m(input_ids=x, labels=x).loss  # noqa: E731
    runs = {"zerotrain LoRA": (ours, _our_loss), "peft LoRA": (twin, peft_loss), "zerotrain full": (full, _our_loss)}
    memory = {name: _held_bytes(model, ids, loss) for name, (model, loss) in runs.items()}
    steps = _alternate(repeats, {name: _train_step(model, ids, loss) for name, (model, loss) in runs.items()})
    median = {k: statistics.median(v) for k, v in steps.items()}
    report = {**report_header(SCHEMA + ".lora"), "model": vars(cfg), "lora_rank": LORA_RANK, "lora_alpha": LORA_ALPHA,
              "layers": cfg.n_layer, "threads": torch.get_num_threads(), "batch": args.batch,
              "seq_len": args.seq_len, "params": sum(p.numel() for p in full.parameters()),
              "adapter_params": sum(p.numel() for p in ours.parameters() if p.requires_grad),
              "logits_max_abs_diff": logits_diff, "train_step_s": median, "memory_bytes": memory,
              "samples": {"train_step_s": steps},
              "ratio_to_peft": median["zerotrain LoRA"] / median["peft LoRA"],
              "ratio_to_full": median["zerotrain LoRA"] / median["zerotrain full"]}
    report["met"] = {"no_slower_than_peft": report["ratio_to_peft"] <= 1.0}
    report["wall_s"] = time.perf_counter() - t0
    write_report(out, "bench-model-lora", report, lora_markdown(report))
    return 0


def _held_bytes(model, ids: torch.Tensor, loss_of) -> dict[str, int]:
    """Parameter, gradient and AdamW state bytes after one step, and the bytes its forward saves for the backward
    (the parameters left out)."""
    from zerotrain.training.activations import saved_for_backward

    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-4)
    saved, loss = saved_for_backward(lambda: loss_of(model, ids), list(model.parameters()))
    loss.backward()
    optimizer.step()
    state = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values() if t.dim() > 0)
    held = {"parameters": sum(p.numel() * p.element_size() for p in model.parameters()),
            "gradients": sum(p.grad.numel() * p.grad.element_size() for p in trained if p.grad is not None),
            "optimizer_state": state, "activations": saved}
    optimizer.zero_grad(set_to_none=True)
    return held


def lora_markdown(report: dict) -> str:
    t, mem, m = report["train_step_s"], report["memory_bytes"], report["machine"]
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    head = (f"# bench model --lora: smollm-135m shape, {report['layers']} of its 30 blocks, {report['params']:,} "
            f"parameters, LoRA rank {report['lora_rank']} ({report['adapter_params']:,} adapter parameters), batch "
            f"{report['batch']} x {report['seq_len']}, fp32, {report['threads']} threads, {m['cpu_count']} cores, "
            f"torch {m['torch']}; logits agree with peft's to {report['logits_max_abs_diff']:.1e}\n\n"
            "| run | train step | parameters | gradients | AdamW state | activations saved |\n"
            "|---|---|---|---|---|---|\n")
    rows = [f"| {name} | {t[name] * 1e3:.1f} ms | {mib(mem[name]['parameters'])} | {mib(mem[name]['gradients'])} | "
            f"{mib(mem[name]['optimizer_state'])} | {mib(mem[name]['activations'])} |\n" for name in t]
    verdict = "met" if report["met"]["no_slower_than_peft"] else "NOT met"
    return head + "".join(rows) + (f"\nzerotrain LoRA / peft LoRA: {report['ratio_to_peft']:.2f}x (target <= 1.0: "
                                   f"{verdict}); zerotrain LoRA / full fine-tuning: {report['ratio_to_full']:.2f}x\n")


def cmd_moe(args: argparse.Namespace, transformers) -> int:
    """--arch qwen3_moe: the train steps of zerotrain's two expert paths and transformers' two, alternated, and
    what each holds."""
    from zerotrain.model.moe import grouped_mm_works
    from zerotrain.training.throughput import matmul_params

    size = dict(MOE_SIZES["quick" if args.quick else "full"])
    repeats = args.repeats or size["repeats"]
    out = args.out or os.path.join("runs", "model-moe-" + time.strftime("%Y%m%d-%H%M%S"))
    t0 = time.perf_counter()
    grouped = grouped_mm_works("cpu", torch.float32)
    runs, cfg = _moe_models(transformers, args.arch, size, grouped)
    # seq_len + 1 tokens a row: both models run on all of them and predict the last seq_len (transformers shifts
    # its labels so), the same positions through the same matmuls
    ids = torch.randint(0, cfg.vocab_size, (size["batch"], size["seq_len"] + 1),
                        generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        reference = runs["transformers eager"][0](ids).logits
        logits_diff = {name: (_logits(model, ids) - reference).abs().max().item() for name, (model, _) in runs.items()}
    memory = {name: _held_bytes(model, ids, loss) for name, (model, loss) in runs.items()}
    steps = _alternate(repeats, {name: _train_step(model, ids, loss) for name, (model, loss) in runs.items()})
    median = {k: statistics.median(v) for k, v in steps.items()}
    tokens = size["batch"] * size["seq_len"]
    pairs = {"loop": ("zerotrain loop", "transformers eager"),
             "grouped": ("zerotrain grouped", "transformers grouped_mm")}
    ratios = {path: median[ours] / median[theirs] for path, (ours, theirs) in pairs.items() if ours in median}
    report = {**report_header(SCHEMA + ".moe"), "arch": args.arch, "size": "quick" if args.quick else "full",
              "model": vars(cfg), "params": sum(p.numel() for p in runs["zerotrain loop"][0].parameters()),
              "active_params_per_token": matmul_params(cfg), "threads": torch.get_num_threads(),
              "batch": size["batch"], "seq_len": size["seq_len"], "grouped_mm": grouped,
              "logits_max_abs_diff": logits_diff, "train_step_s": median,
              "tokens_per_s": {k: tokens / v for k, v in median.items()}, "memory_bytes": memory,
              "samples": {"train_step_s": steps}, "ratios": ratios,
              "met": {path: ratio <= 1.0 for path, ratio in ratios.items()}}
    report["wall_s"] = time.perf_counter() - t0
    write_report(out, "bench-model-moe", report, moe_markdown(report))
    return 0


def _moe_models(transformers, arch: str, size: dict, grouped: bool) -> tuple[dict, ModelConfig]:
    """{run: (model, its loss)}: transformers' Qwen3MoeForCausalLM with eager experts and with grouped_mm (each at the
    same random initialisation), zerotrain's holding the same weights with the per-expert loop and (`grouped`) the
    grouped path; fp32, SDPA; every loss the token loss plus the balancing term at the config's coefficient."""
    from zerotrain.hub.init_from import load_local, weight_source
    from zerotrain.hub.mapping import hf_config
    from zerotrain.model import build_model
    from zerotrain.model.moe import moe_layers

    shape = {k: size[k] for k in ("n_layer", "n_head", "n_kv_head", "n_embd", "n_experts", "experts_per_token",
                                  "expert_width", "vocab_size")}
    cfg = ModelConfig(arch=arch, seq_len=size["seq_len"] + 1, norm_eps=1e-6, tie_embeddings=False,
                      norm_topk_prob=True, intermediate_size=size["expert_width"] * size["experts_per_token"], **shape)
    config = hf_config(cfg, None)
    config.update(output_router_logits=True, router_aux_loss_coef=cfg.router_aux_coef)
    hf = transformers.AutoConfig.for_model(config.pop("model_type"), **config)
    runs = {}
    torch.manual_seed(0)
    for implementation in ("eager", "grouped_mm"):
        runs[f"transformers {implementation}"] = (transformers.AutoModelForCausalLM.from_config(
            hf, attn_implementation="sdpa", experts_implementation=implementation).train(), _their_moe_loss)
    eager = runs["transformers eager"][0]
    runs["transformers grouped_mm"][0].load_state_dict(eager.state_dict())
    # transformers holds each layer's experts stacked (gate_up_proj (E, 2 I, d)); its folder stores them per expert,
    # as --init-from reads them
    with tempfile.TemporaryDirectory() as folder:
        eager.save_pretrained(folder)
        loop = build_model(cfg, 0)
        load_local(loop, weight_source(folder), {}, 0)
    coef = cfg.router_aux_coef
    variants = {"loop": loop}
    if grouped:
        variants["grouped"] = copy.deepcopy(loop)
    for path, model in variants.items():
        for layer in moe_layers(model):
            layer.path = path
        runs[f"zerotrain {path}"] = (model.train(), lambda m, x: _our_moe_loss(m, x, coef))
    order = ["zerotrain loop", "transformers eager", "zerotrain grouped", "transformers grouped_mm"]
    return {name: runs[name] for name in order if name in runs}, cfg


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(ids)
    return out if isinstance(out, torch.Tensor) else out.logits


def _our_moe_loss(model, ids: torch.Tensor, coef: float) -> torch.Tensor:
    """The mean token loss of the row's last seq_len positions, plus coef x the balancing loss (its rows' mean)."""
    from zerotrain.model import summed_token_loss
    from zerotrain.model.moe import balancing_loss

    # the targets shifted and the last position ignored (-100), as transformers' loss does: no copy of the logits
    y = torch.nn.functional.pad(ids[:, 1:], (0, 1), value=-100)
    token_loss = summed_token_loss(model(ids), y) / (ids.numel() - len(ids))
    per_row, _ = balancing_loss(model)
    return token_loss + coef * per_row.mean()


def _their_moe_loss(model, ids: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, labels=ids).loss  # the token loss plus router_aux_loss_coef x aux_loss


def moe_markdown(report: dict) -> str:
    t, tok, mem, m = report["train_step_s"], report["tokens_per_s"], report["memory_bytes"], report["machine"]
    c = report["model"]
    mib = lambda n: f"{n / 2**20:.1f} MiB"  # noqa: E731
    head = (f"# bench model: {report['arch']} ({report['size']}), {report['params']:,} parameters "
            f"({report['active_params_per_token']:,} matmul weights active per token), {c['n_experts']} experts, "
            f"top-{c['experts_per_token']}, batch {report['batch']} x {report['seq_len']}, fp32, "
            f"{report['threads']} threads, {m['cpu_count']} cores, torch {m['torch']}; logits agree with "
            f"transformers' to {max(report['logits_max_abs_diff'].values()):.1e}\n\n"
            "| run | train step | tokens/s | parameters | gradients | AdamW state | activations saved | sum |\n"
            "|---|---|---|---|---|---|---|---|\n")
    rows = [f"| {name} | {t[name] * 1e3:.1f} ms | {tok[name]:,.0f} | {mib(mem[name]['parameters'])} | "
            f"{mib(mem[name]['gradients'])} | {mib(mem[name]['optimizer_state'])} | "
            f"{mib(mem[name]['activations'])} | {mib(sum(mem[name].values()))} |\n" for name in t]
    verdicts = [f"zerotrain {path} / transformers {'eager' if path == 'loop' else 'grouped_mm'}: {ratio:.2f}x "
                f"({'met' if report['met'][path] else 'NOT met'})" for path, ratio in report["ratios"].items()]
    missing = "" if report["grouped_mm"] else "; torch._grouped_mm does not run here: no grouped path"
    return head + "".join(rows) + "\n" + "; ".join(verdicts) + f" (target <= 1.0){missing}\n"
