"""Packed attention on a device: each packed record's loss and gradients equal the record alone, and the kernels.

usage: python scripts/packed_attention_check.py [cuda|cpu]

On CUDA this runs what CPU tests cannot: FlexAttention (compiled, with its backward) for GPT-2 and Llama (the tiny
presets with heads of 16, the narrowest FlexAttention's kernels take) in fp32 and bf16, Llama's grouped-query attention in fp32 through a fused SDPA kernel (the KV heads repeated: the math
kernel is excluded and would raise), and the memory of one attention forward and backward at T = 4096 through
the block mask against the T x T mask. On CPU the same comparisons run through the mask. Exit 1 on a failure.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from zerotrain.config import PRESETS, ModelConfig
from zerotrain.model import attention, build_model, summed_token_loss
from zerotrain.model.loss import head_loss

TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-2}  # relative; bf16 rounds each record's sums differently


def packed(vocab: int, lengths: list[int], T: int, device: str):
    g = torch.Generator().manual_seed(0)
    recs = [torch.randint(0, vocab, (n + 1,), generator=g) for n in lengths]
    x = F.pad(torch.cat([r[:-1] for r in recs]), (0, T - sum(lengths)))
    y = F.pad(torch.cat([r[1:] for r in recs]), (0, T - sum(lengths)), value=-100)
    seg = F.pad(torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)]), (0, T - sum(lengths)),
                value=len(lengths))
    return [r.to(device) for r in recs], x[None].to(device), y[None].to(device), seg[None].to(device)


# The tiny presets widened to heads of 16: FlexAttention's CUDA kernels refuse narrower ones (the tiny presets' 8
# take the mask, attention.document_kernel), and this check is about FlexAttention.
WIDTH = {"n_embd": 4 * attention.FLEX_MIN_HEAD_DIM, "seq_len": 64}


def packed_vs_alone(arch: str, dtype: torch.dtype, device: str, recompute: bool) -> tuple[float, float]:
    preset = PRESETS["tiny"] if arch == "gpt2" else {**PRESETS["llama-tiny"], "intermediate_size": 128}
    cfg = ModelConfig(**{**preset, **WIDTH})
    model = build_model(cfg, seed=0).to(device=device, dtype=dtype)
    model.recompute_blocks = recompute
    recs, x, y, seg = packed(cfg.vocab_size, [20, 7, 30], 64, device)
    per_token = F.cross_entropy(model(x, segments=seg).float().transpose(1, 2), y, ignore_index=-100,
                                reduction="none")[0].detach()
    head_loss(model, x, y, summed_token_loss, recompute, seg).backward()
    packed_grads = {n: p.grad.float().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss_err = 0.0
    for i, r in enumerate(recs):
        alone = head_loss(model, r[:-1][None], r[1:][None], summed_token_loss, recompute)
        alone.backward()
        loss_err = max(loss_err, abs(per_token[seg[0] == i].sum().item() - alone.item()) / alone.item())
    grad_err = max(((packed_grads[n] - p.grad.float()).abs().max() / p.grad.float().abs().max()).item()
                   for n, p in model.named_parameters())
    return loss_err, grad_err


def attention_peak(kernel: str, T: int = 4096) -> int:
    """Peak bytes of one document-masked attention forward and backward, B 1, 8 heads of 64, bf16."""
    seg = (torch.arange(T, device="cuda") // 512)[None]
    q, k, v = (torch.randn(1, 8, T, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    documents = attention.document_block_mask(seg) if kernel == "flex" else attention.document_mask(seg, torch.bfloat16)
    attention.attend(q, k, v, documents=documents).sum().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - base


def main(device: str) -> int:
    failed = []
    dtypes = (torch.float32, torch.bfloat16) if device == "cuda" else (torch.float32,)
    kernel = attention.document_kernel(device, WIDTH["n_embd"] // PRESETS["tiny"]["n_head"])
    for arch in ("gpt2", "llama"):
        for dtype in dtypes:
            for recompute in (False, True):
                loss_err, grad_err = packed_vs_alone(arch, dtype, device, recompute)
                ok = max(loss_err, grad_err) <= TOLERANCE[dtype]
                failed += [] if ok else [f"{arch} {dtype}"]
                print(f"packed vs alone, {arch} {str(dtype)[6:]} {kernel}{' recompute' if recompute else ''}: "
                      f"loss {loss_err:.1e}, gradients {grad_err:.1e} {'ok' if ok else 'FAILED'}")
    if device == "cuda":
        try:  # without the math kernel: SDPA raises if Llama's fp32 GQA still needs it
            with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
                cfg = ModelConfig(**PRESETS["llama-tiny"])
                model = build_model(cfg, seed=0).cuda()
                summed_token_loss(model(torch.zeros(2, 16, dtype=torch.long, device="cuda")),
                                  torch.zeros(2, 16, dtype=torch.long, device="cuda")).backward()
            print("Llama GQA fp32 on CUDA runs a fused SDPA kernel (KV heads repeated): ok")
        except RuntimeError as e:
            failed.append("gqa fp32")
            print(f"Llama GQA fp32 on CUDA needs the math kernel: FAILED ({str(e).splitlines()[0]})")
        flex, mask = attention_peak("flex"), attention_peak("mask")
        print(f"document-masked attention at T 4096, bf16, forward and backward: peak {flex / 2**20:.1f} MiB through "
              f"FlexAttention's block mask, {mask / 2**20:.1f} MiB through the T x T mask")
        if flex >= mask:
            failed.append("flex memory")
    print("packed attention check:", "FAILED " + ", ".join(failed) if failed else "ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ("cuda" if torch.cuda.is_available() else "cpu")))
