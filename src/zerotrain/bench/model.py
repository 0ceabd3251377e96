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
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch

from zerotrain.cli.flags import checked
from zerotrain.config import LLAMA_FAMILY, POSITIVE, WINDOWED, ModelConfig
from zerotrain.errors import ConfigError

from .report import report_header, write_report

SCHEMA = "zerotrain.bench.model"
SIZES = {  # the model's shape, the training batch, the generation's prompt and new tokens, alternating rounds
    "full": dict(n_layer=6, n_head=8, n_kv_head=4, n_embd=512, intermediate_size=1408, vocab_size=8192,
                 batch=4, seq_len=256, prompt=16, new_tokens=128, repeats=5),
    "quick": dict(n_layer=2, n_head=4, n_kv_head=2, n_embd=128, intermediate_size=352, vocab_size=1024,
                  batch=2, seq_len=64, prompt=8, new_tokens=32, repeats=3),
}


def add_parser(benches) -> None:
    p = benches.add_parser("model", help="zerotrain's model vs transformers' of the same shape: train step and "
                                         "generation", description=__doc__.split("\n\n")[1])
    p.add_argument("--arch", choices=(*LLAMA_FAMILY, "gpt2"), default="llama",
                   help="the architecture (mistral and phi3 with a sliding window of half the training sequence)")
    p.add_argument("--quick", action="store_true", help="a small model: seconds")
    p.add_argument("--repeats", type=checked(int, POSITIVE), help="alternating rounds (default 5, quick 3)")
    p.add_argument("--out", default="", help="folder for bench-model.json and bench-model.md")
    p.set_defaults(func=cmd_model)


def cmd_model(args: argparse.Namespace) -> int:
    try:
        import transformers
    except ImportError:
        raise ConfigError("bench model compares with transformers: pip install 'zerotrain[hf]'") from None
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


def _models(transformers, arch: str, size: dict):
    """transformers' model at random initialisation and zerotrain's holding the same weights; fp32, SDPA.

    transformers' config is the one `export --format hf` writes for zerotrain's (hub/mapping.py: hf_config).
    """
    from zerotrain.hub.mapping import MAPPINGS, hf_config
    from zerotrain.model import model_class

    shape = {k: size[k] for k in ("n_layer", "n_head", "n_embd", "vocab_size")}
    if arch in LLAMA_FAMILY:
        shape.update(n_kv_head=size["n_kv_head"], intermediate_size=size["intermediate_size"], tie_embeddings=False,
                     norm_eps=1e-6, sliding_window=size["seq_len"] // 2 if arch in WINDOWED else 0)
    cfg = ModelConfig(arch=arch, seq_len=size["seq_len"] + size["new_tokens"], **shape)
    config = hf_config(cfg, None)
    torch.manual_seed(0)
    theirs = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model(config.pop("model_type"), **config), attn_implementation="sdpa")
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
