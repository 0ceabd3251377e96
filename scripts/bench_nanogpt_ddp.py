"""Two ranks on the CPU: `zerotrain train --nproc 2` against nanoGPT's own DDP step on nanoGPT's model, gloo.

nanoGPT (github.com/karpathy/nanoGPT, MIT licence, Andrej Karpathy) is embedded below: its model.py's GPT (the
classes the training uses, unchanged but for the omitted generation, pretrained loading and MFU estimate) and the
body of its train.py's loop (learning-rate schedule, `require_backward_grad_sync` on the last micro-step, its
memmap `get_batch` prefetched after the forward, `clip_grad_norm_` at 1.0, AdamW from its `configure_optimizers`,
`zero_grad(set_to_none=True)`, `loss.item()` on the master), launched as its README launches it, with torchrun. What
differs from train.py is what a CPU run needs: `device="cpu"`, backend gloo, DDP without device_ids (train.py sets a
CUDA device whenever it runs under DDP), no torch.compile, no GradScaler (train.py disables it without CUDA), and no
evaluation or checkpoint in the timed loop. Its AdamW is its own: not fused off CUDA (`configure_optimizers`), hence
torch's per-tensor loop on the CPU; `--fused-adamw` gives it the fused AdamW zerotrain uses, for the stricter
comparison.

Both train GPT-2 small's shape as nanoGPT builds it (12 layers, 12 heads, width 768, biases, tied head; the
vocabulary padded to 50,304, train.py's default without a meta.pkl) on the same token file (random uint16 ids,
written once in nanoGPT's headerless layout, which zerotrain reads as it is), at `--micro-batch` x `--seq-len` per
rank and `--accum` micro-batches per step, one thread per rank. Each run is a fresh command in a session of its own
(setsid), one at a time, alternating in rounds whose order reverses each round. Step seconds: nanoGPT's `dt` as
train.py measures it (from one iteration's end to the next's, on the master), zerotrain's `step_ms` from its
metrics.jsonl (rank 0); medians past the first step of every run. Peak resident memory: rank 0's.

    python scripts/bench_nanogpt_ddp.py --rounds 5 --steps 6
    python scripts/bench_nanogpt_ddp.py --rounds 1 --steps 2 --n-layer 2 --n-embd 128 --n-head 4   # the plumbing
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from dataclasses import dataclass

VOCAB = 50304  # train.py's vocabulary without a meta.pkl: GPT-2's 50,257 padded to a multiple of 64


# ----------------------------------------------------------------------------- nanoGPT's model.py (what training uses)
def nanogpt_classes():
    """nanoGPT's model.py classes, defined on first use (torch is imported in the child processes only)."""
    import torch
    import torch.nn as nn
    from torch.nn import functional as F

    class LayerNorm(nn.Module):
        """ LayerNorm but with an optional bias. PyTorch doesn't support simply bias=False """

        def __init__(self, ndim, bias):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(ndim))
            self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

        def forward(self, input):
            return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)

    class CausalSelfAttention(nn.Module):

        def __init__(self, config):
            super().__init__()
            assert config.n_embd % config.n_head == 0
            self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
            self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
            self.attn_dropout = nn.Dropout(config.dropout)
            self.resid_dropout = nn.Dropout(config.dropout)
            self.n_head = config.n_head
            self.n_embd = config.n_embd
            self.dropout = config.dropout

        def forward(self, x):
            B, T, C = x.size()
            q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
            k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
            y = y.transpose(1, 2).contiguous().view(B, T, C)
            return self.resid_dropout(self.c_proj(y))

    class MLP(nn.Module):

        def __init__(self, config):
            super().__init__()
            self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
            self.gelu = nn.GELU()
            self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
            self.dropout = nn.Dropout(config.dropout)

        def forward(self, x):
            return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))

    class Block(nn.Module):

        def __init__(self, config):
            super().__init__()
            self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
            self.attn = CausalSelfAttention(config)
            self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
            self.mlp = MLP(config)

        def forward(self, x):
            x = x + self.attn(self.ln_1(x))
            x = x + self.mlp(self.ln_2(x))
            return x

    @dataclass
    class GPTConfig:
        block_size: int = 1024
        vocab_size: int = 50304
        n_layer: int = 12
        n_head: int = 12
        n_embd: int = 768
        dropout: float = 0.0
        bias: bool = True

    class GPT(nn.Module):

        def __init__(self, config):
            super().__init__()
            self.config = config
            self.transformer = nn.ModuleDict(dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, bias=config.bias),
            ))
            self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
            self.transformer.wte.weight = self.lm_head.weight
            self.apply(self._init_weights)
            for pn, p in self.named_parameters():
                if pn.endswith('c_proj.weight'):
                    torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

        def _init_weights(self, module):
            if isinstance(module, nn.Linear):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
                if module.bias is not None:
                    torch.nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

        def forward(self, idx, targets=None):
            device = idx.device
            b, t = idx.size()
            pos = torch.arange(0, t, dtype=torch.long, device=device)
            tok_emb = self.transformer.wte(idx)
            pos_emb = self.transformer.wpe(pos)
            x = self.transformer.drop(tok_emb + pos_emb)
            for block in self.transformer.h:
                x = block(x)
            x = self.transformer.ln_f(x)
            logits = self.lm_head(x)
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
            return logits, loss

        def configure_optimizers(self, weight_decay, learning_rate, betas, device_type, fused=None):
            param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
            decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
            nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
            optim_groups = [
                {'params': decay_params, 'weight_decay': weight_decay},
                {'params': nodecay_params, 'weight_decay': 0.0}
            ]
            use_fused = device_type == 'cuda' if fused is None else fused  # nanoGPT: fused on CUDA only
            extra_args = dict(fused=True) if use_fused else dict()
            return torch.optim.AdamW(optim_groups, lr=learning_rate, betas=betas, **extra_args)

    return GPTConfig, GPT


# ----------------------------------------------------------------------------- nanoGPT's train.py loop, on the CPU
def nanogpt_worker(args: argparse.Namespace) -> None:
    """One rank of nanoGPT's train.py under torchrun (RANK, WORLD_SIZE set): rank 0 prints its iterations' dt."""
    import time

    import numpy as np
    import torch
    from torch.distributed import destroy_process_group, init_process_group
    from torch.nn.parallel import DistributedDataParallel as DDP

    GPTConfig, GPT = nanogpt_classes()
    init_process_group(backend="gloo")
    ddp_rank, ddp_world_size = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    master_process, device, device_type = ddp_rank == 0, "cpu", "cpu"
    gradient_accumulation_steps = args.accum  # per rank (train.py divides its global figure by the world size)
    batch_size, block_size = args.micro_batch, args.seq_len
    learning_rate, min_lr, warmup_iters, lr_decay_iters = 6e-4, 6e-5, 2000, 600000
    torch.manual_seed(1337 + ddp_rank)
    ctx = nullcontext()

    def get_batch(split):
        data = np.memmap(os.path.join(args.data, f"{split}.bin"), dtype=np.uint16, mode='r')
        ix = torch.randint(len(data) - block_size, (batch_size,))
        x = torch.stack([torch.from_numpy((data[i:i + block_size]).astype(np.int64)) for i in ix])
        y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + block_size]).astype(np.int64)) for i in ix])
        return x.to(device), y.to(device)

    def get_lr(it):
        if it < warmup_iters:
            return learning_rate * (it + 1) / (warmup_iters + 1)
        decay_ratio = (it - warmup_iters) / (lr_decay_iters - warmup_iters)
        return min_lr + 0.5 * (1.0 + math.cos(math.pi * decay_ratio)) * (learning_rate - min_lr)

    model = GPT(GPTConfig(n_layer=args.n_layer, n_head=args.n_head, n_embd=args.n_embd, block_size=block_size,
                          bias=True, vocab_size=VOCAB, dropout=0.0))
    model.to(device)
    optimizer = model.configure_optimizers(0.1, learning_rate, (0.9, 0.95), device_type,
                                           fused=True if args.fused_adamw else None)
    model = DDP(model)
    X, Y = get_batch('train')
    t0, times = time.time(), []
    for iter_num in range(args.steps):
        lr = get_lr(iter_num)
        for param_group in optimizer.param_groups:
            param_group['lr'] = lr
        for micro_step in range(gradient_accumulation_steps):
            model.require_backward_grad_sync = (micro_step == gradient_accumulation_steps - 1)
            with ctx:
                logits, loss = model(X, Y)
                loss = loss / gradient_accumulation_steps
            X, Y = get_batch('train')
            loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        t1 = time.time()
        dt, t0 = t1 - t0, t1
        if master_process:
            lossf = loss.item() * gradient_accumulation_steps
            times.append(dt)
            print(f"iter {iter_num}: loss {lossf:.4f}, time {dt * 1000:.2f}ms", file=sys.stderr)
    if master_process:
        print(json.dumps({"step_s": times, "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
    destroy_process_group()


# ----------------------------------------------------------------------------- the comparison
def write_tokens(folder: str, tokens: int) -> None:
    """train.bin and val.bin: random ids below VOCAB (the last one included, so zerotrain infers the vocabulary)."""
    import numpy as np

    rng = np.random.default_rng(0)
    for split, n in (("train", tokens), ("val", tokens // 10)):
        ids = rng.integers(0, VOCAB, n, dtype=np.uint16)
        ids[-1] = VOCAB - 1
        ids.tofile(os.path.join(folder, f"{split}.bin"))


def run_nanogpt(args: argparse.Namespace, data: str) -> dict:
    child = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", __file__,
             "--worker", "--data", data, *shape_flags(args), *(["--fused-adamw"] if args.fused_adamw else [])]
    out = subprocess.run(child, capture_output=True, text=True, start_new_session=True,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    if out.returncode:
        raise SystemExit(f"nanoGPT's run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def run_zerotrain(args: argparse.Namespace, data: str, folder: str) -> dict:
    zerotrain = os.path.join(os.path.dirname(sys.executable), "zerotrain")
    child = [zerotrain, "train", "--nproc", "2", "--threads", "1", "--preset", "gpt2", "--data", data,
             "--vocab-size", str(VOCAB), "--n-layer", str(args.n_layer), "--n-head", str(args.n_head),
             "--n-embd", str(args.n_embd), "--seq-len", str(args.seq_len), "--context", str(args.seq_len),
             "--micro-batch", str(args.micro_batch),
             "--accum", str(args.accum), "--steps", str(args.steps), "--lr", "6e-4", "--check-every", "0",
             "--no-progress", "--out", folder]
    out = subprocess.run(child, capture_output=True, text=True, start_new_session=True)
    if out.returncode:
        raise SystemExit(f"zerotrain's run failed ({out.returncode}):\n{out.stderr[-3000:]}")
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    steps = [r for r in rows if "step_ms" in r]
    shutil.rmtree(folder)
    return {"step_s": [r["step_ms"] / 1000 for r in steps],
            "peak_rss_mib": max(r.get("peak_host_bytes", 0) for r in steps) / 2**20}


def shape_flags(args: argparse.Namespace) -> list[str]:
    return ["--n-layer", str(args.n_layer), "--n-head", str(args.n_head), "--n-embd", str(args.n_embd),
            "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--accum", str(args.accum),
            "--steps", str(args.steps)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n-layer", type=int, default=12)
    p.add_argument("--n-head", type=int, default=12)
    p.add_argument("--n-embd", type=int, default=768)
    p.add_argument("--seq-len", type=int, default=128, help="nanoGPT's block_size")
    p.add_argument("--micro-batch", type=int, default=2, help="nanoGPT's batch_size, per rank")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step per rank")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=6, help="steps per run; the first is not counted")
    p.add_argument("--fused-adamw", action="store_true", help="nanoGPT with torch's fused AdamW, as zerotrain's")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)  # one rank of nanoGPT, under torchrun
    p.add_argument("--data", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        nanogpt_worker(args)
        return 0
    results: dict[str, list[dict]] = {"zerotrain": [], "nanoGPT": []}
    with tempfile.TemporaryDirectory(prefix="bench-nanogpt-") as tmp:
        data = os.path.join(tmp, "data")
        os.makedirs(data)
        write_tokens(data, 2_000_000)
        for r in range(args.rounds):
            for name in list(results) if r % 2 == 0 else reversed(list(results)):
                results[name].append(run_nanogpt(args, data) if name == "nanoGPT" else
                                     run_zerotrain(args, data, os.path.join(tmp, f"run{r}")))
    adamw = "fused AdamW" if args.fused_adamw else "its own AdamW (not fused on the CPU)"
    print(f"| {args.n_layer} layers, width {args.n_embd}, vocab {VOCAB}, {args.micro_batch} x {args.seq_len} tokens "
          f"x accum {args.accum} per rank, 2 ranks x 1 thread, {args.rounds} rounds | step s (median past the first) "
          f"| peak RSS MiB, rank 0, per run |\n| --- | ---: | ---: |")
    medians = {}
    for name, rs in results.items():
        medians[name] = statistics.median(t for r in rs for t in r["step_s"][1:])
        label = f"nanoGPT DDP, {adamw}" if name == "nanoGPT" else "zerotrain train --nproc 2"
        peaks = " / ".join(f"{r['peak_rss_mib']:.0f}" for r in rs)
        print(f"| {label} | {medians[name]:.3f} | {peaks} |")
    per_round = [statistics.median(z["step_s"][1:]) / statistics.median(n["step_s"][1:])
                 for z, n in zip(results["zerotrain"], results["nanoGPT"])]
    print(f"\nzerotrain / nanoGPT: {medians['zerotrain'] / medians['nanoGPT']:.3f}x (per round: "
          + ", ".join(f"{x:.3f}" for x in per_round) + ")")
    return 0


if __name__ == "__main__":
    sys.exit(main())
