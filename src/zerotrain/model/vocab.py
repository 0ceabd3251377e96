"""The vocabulary's two ends, whole or split across TP ranks by rows: the token embedding, the LM head (tied to the
embedding or its own), and the summed token loss computed from the head's input in chunks of tokens, never from the
full logits.

Under TP, when --tp divides the vocabulary V, rank r holds rows r V/T .. (r + 1) V/T of the embedding and of the head
(one tensor when they are tied), as Megatron's vocab-parallel layers do:

    embedding   each rank looks up the ids among its rows (zeros for the others'); one all-reduce sums the ranks'
    head        column-parallel over the vocabulary: each rank's logits for its rows; full logits (sampling one
                position, evaluating another loss) are all-gathered only where asked for (`LMHead.forward` without
                targets)
    loss        per token, the max of the logits all-reduced (max) over the TP group, then the sum of exp(logit - max)
                and the target's logit (from the rank holding it, zero elsewhere) all-reduced (sum) in one call:
                loss = log(sum) + max - target logit, in fp32, equal on every TP rank

A vocabulary the TP degree does not divide (GPT-2's 50,257) stays whole on every rank, as every parameter did before.
Padding it (Megatron pads to a multiple of 128 x T) would change the model's shape with the TP degree: the checkpoint's
full tensors, the export and a resume at another TP degree would each need the padding cut or added; an uneven split
would give the TP ranks flat layouts of different sizes, which the engine and the checkpoint's reshard arithmetic take
to be one. Every large-vocabulary family zerotrain trains divides by 8 (Llama 3's 128,256, Qwen's 151,936, Mistral's
32,768, Phi-3's 32,064, SmolLM's 49,152, Gemma's 256,000 and 262,144).

The loss runs over chunks of tokens (`chunk_tokens`: as many as a chunk's logits fit in LOSS_CHUNK_BYTES), each
chunk's logits in fp32 only while that chunk is computed. Its gradient, softmax - one-hot, is taken in the same pass
and multiplied at once into the gradient of the head's input and of its weight (as Liger's fused linear
cross-entropy does), so the backward only scales them by the loss's incoming gradient: autograd keeps the input's
gradient (tokens x width) and the weight's (rows x width) whatever the vocabulary and the number of tokens, the head's
matmul runs three times per step as it does unchunked, and nothing is recomputed. An optional soft-cap
(cap tanh(logit / cap), Gemma 2's final logits) is applied to each rank's logits before the max.

Each token's log-prob of its target (`token_logps`, for DPO's sequence log-probs) is computed the same way, chunk by
chunk and vocab-parallel: logit of the target - log-sum-exp, with the same two all-reduces. Its upstream gradient is
any tensor over tokens (DPO's loss is not linear in them), so the gradients cannot be taken in the forward: it keeps
only the head's input, each token's log-sum-exp (fp32) and the targets, and its backward computes each chunk's
logits again, upstream x (one-hot - softmax), into the gradients of the head's input and weight.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from .tensor_parallel import ReduceFromTP, TPSlice, blocks, copy_to_tp

IGNORE = -100  # the label of a token that is not trained on (data.IGNORE)
# Fewer tokens per chunk would read the head's weight once per few tokens: on a GPU its matmul would wait on memory
# (an H100 needs ~300 tokens per read of a bf16 weight to be bound by compute, not by bandwidth).
MIN_CHUNK_TOKENS = 256
# What one chunk's logits may hold while the loss runs (loss_logit_bytes or logps_logit_bytes per logit, this rank's
# vocabulary rows). Liger's fused linear cross-entropy sizes its chunk by the vocabulary / width ratio (logits about
# the size of the head's input), which bounds no bytes: a budget is what the memory plan leaves room for, whatever
# the width. 512 MiB is under 1% of an 80 GiB device and gives a 128K vocabulary in bf16 512-token chunks (twice the
# floor above) and a TP 8 slice of it 4,096; a small model's micro-batch is one chunk. A fixed count of tokens would
# hold 10x more at Gemma's 262K rows in fp32 than at GPT-2's 50K in bf16.
LOSS_CHUNK_BYTES = 512 * 2**20
FP32 = 4  # bytes of the chunk's logits as the loss computes them


def splits_vocab(vocab_size: int, tp: int) -> bool:
    """Whether the embedding and the head are split across `tp` TP ranks: when tp divides the vocabulary."""
    return tp > 1 and vocab_size % tp == 0


def vocab_rows(vocab_size: int, tp: int) -> int:
    """The rows of the embedding and the head each TP rank holds."""
    return vocab_size // tp if splits_vocab(vocab_size, tp) else vocab_size


def vocab_slice(vocab_size: int, width: int, tp: int) -> TPSlice:
    """The TP slice of the embedding and the head: rank r holds rows r V/T .. (r + 1) V/T."""
    return TPSlice(0, (vocab_size, width), blocks(vocab_size // tp, tp))


def loss_logit_bytes(dtype_bytes: int, softcap: bool) -> int:
    """Bytes each logit of a chunk holds while the summed token loss runs (loss_and_grads): its fp32 value, the
    matmul's product in the compute dtype before it (and the gradient's copy in it after; one at a time) where that
    is not fp32, and tanh(logit / cap) beside it under a soft-cap."""
    return FP32 + (dtype_bytes if dtype_bytes != FP32 else 0) + (FP32 if softcap else 0)


def logps_logit_bytes(dtype_bytes: int, softcap: bool) -> int:
    """Bytes each logit of a chunk holds at the largest in token_logps' backward: its fp32 value made again, the
    product in the compute dtype and the gradient's copy in it both (where that is not fp32), and under a soft-cap
    the tanh and its derivative."""
    return FP32 + (2 * dtype_bytes if dtype_bytes != FP32 else 0) + (2 * FP32 if softcap else 0)


def chunk_tokens(tokens: int, rows: int, logit_bytes: int) -> int:
    """Tokens per chunk of the loss: the largest power of two whose logits (x `rows`, this rank's, `logit_bytes`
    each) fit in LOSS_CHUNK_BYTES, at least MIN_CHUNK_TOKENS, at most all `tokens`. The plan's loss working set
    (model/activation_memory.py) is sized by this same call."""
    fit = max(1, LOSS_CHUNK_BYTES // (rows * logit_bytes))
    return min(tokens, max(MIN_CHUNK_TOKENS, 1 << (fit.bit_length() - 1)))


def capped(logits: torch.Tensor, softcap: float) -> torch.Tensor:
    """softcap tanh(logits / softcap) (Gemma 2's final logits); the logits themselves when softcap is 0."""
    return logits if not softcap else torch.tanh(logits / softcap) * softcap


class LMHead(nn.Linear):
    """The LM head, logits = h W^T (no bias), optionally soft-capped. Given the targets, it returns the summed token
    loss instead (`token_loss`: chunked, the full logits never held), inside its own call, so that hooks around the
    head (ZeRO-3's units) see the loss's use of its weight."""

    def __init__(self, width: int, vocab_size: int, softcap: float = 0.0):
        super().__init__(width, vocab_size, bias=False)
        self.softcap = softcap

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None, per_token: bool = False,
                recompute: bool = False) -> torch.Tensor:
        """The logits; given `targets`, their summed token loss (`recompute`: its gradients computed in the
        backward, from h kept), or with `per_token` each token's log-prob of its target (token_logps)."""
        if targets is not None and per_token:
            return token_logps(h, self.weight, targets, softcap=self.softcap)
        if targets is not None:
            return token_loss(h, self.weight, targets, softcap=self.softcap, recompute=recompute)
        return capped(F.linear(h, self.weight), self.softcap)


class VocabParallelHead(nn.Module):
    """This TP rank's rows of the head (column-parallel over the vocabulary). Without targets: the full logits,
    all-gathered; with them: the summed token loss computed vocab-parallel, never gathering the logits."""

    def __init__(self, full: LMHead, tp_slice: TPSlice, rank: int, comm):
        super().__init__()
        self.comm, self.softcap = comm, full.softcap
        self.vocab_start = tp_slice.parts[rank][0][0]
        self.weight = nn.Parameter(tp_slice.take(full.weight.detach(), rank))

    def forward(self, h: torch.Tensor, targets: torch.Tensor | None = None, per_token: bool = False,
                recompute: bool = False) -> torch.Tensor:
        h = copy_to_tp(h, self.comm, "all_reduce_tp_head_grads")  # each rank's rows' share of h's gradient, summed
        if targets is not None and per_token:
            return token_logps(h, self.weight, targets, comm=self.comm, vocab_start=self.vocab_start,
                               softcap=self.softcap)
        if targets is not None:
            return token_loss(h, self.weight, targets, comm=self.comm, vocab_start=self.vocab_start,
                              softcap=self.softcap, recompute=recompute)
        return _GatherFromTP.apply(capped(F.linear(h, self.weight), self.softcap), self.comm)


def tied_head_hook(head: str, embedding: str):
    """A load_state_dict pre-hook for a head tied to the token embedding: strict loading accepts a state dict
    without the head (model.safetensors stores the one tensor once, under the embedding's name); one that
    holds both must hold the same values in each."""

    def hook(module, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys, error_msgs) -> None:
        h, e = prefix + head, prefix + embedding
        if e not in state_dict:
            return
        if h not in state_dict:
            state_dict[h] = state_dict[e]
        elif state_dict[h] is not state_dict[e] and not torch.equal(state_dict[h], state_dict[e]):
            error_msgs.append(f"{h} differs from {e}, but the two are one tied tensor")

    return hook


def token_embedding(vocab_size: int, width: int, padding_idx: int | None) -> nn.Embedding:
    """The token embedding, with the model's padding row where it has one: as transformers' Llama family builds it
    (nn.Embedding's padding_idx), a lookup of the padding id gives its row no gradient, so padding positions train
    nothing of it (the row starts at zero: model/init.py; a tied head still trains it as a row of the head)."""
    return nn.Embedding(vocab_size, width, padding_idx=padding_idx)


class VocabParallelEmbedding(nn.Module):
    """This TP rank's rows of the token embedding: ids among them are looked up, the others give zeros, and one
    all-reduce over the TP group sums the ranks' rows into every rank's whole embedding (exact: one rank's value
    plus zeros). The padding row, on the rank holding it, gets no gradient from its lookups, as the whole
    embedding's."""

    def __init__(self, full: nn.Embedding, tp_slice: TPSlice, rank: int, comm):
        super().__init__()
        self.comm = comm
        self.vocab_start = tp_slice.parts[rank][0][0]
        self.weight = nn.Parameter(tp_slice.take(full.weight.detach(), rank))
        pad = full.padding_idx
        self.padding_idx = pad - self.vocab_start if pad is not None and 0 <= pad - self.vocab_start < \
            self.weight.shape[0] else None

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        local = idx - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.masked_fill(outside, 0), self.weight, self.padding_idx)
        x = x.masked_fill(outside.unsqueeze(-1), 0.0)
        return ReduceFromTP.apply(x, self.comm, "all_reduce_tp_embedding")  # each rank's rows, summed


class _GatherFromTP(torch.autograd.Function):
    """Every TP rank's logits for its rows, concatenated along the vocabulary (all-gather); backward, this rank's
    columns of the gradient (every TP rank computes the same function of the full logits)."""

    @staticmethod
    def forward(ctx, x, comm):
        ctx.comm = comm
        parts = torch.empty((comm.world_size, *x.shape), dtype=x.dtype, device=x.device)
        comm.all_gather(parts.view(-1), x.contiguous().view(-1), "all_gather_tp_logits")
        return torch.cat(parts.unbind(0), dim=-1)

    @staticmethod
    def backward(ctx, grad):
        rows = grad.shape[-1] // ctx.comm.world_size
        return grad.narrow(-1, ctx.comm.rank * rows, rows).contiguous(), None


def token_loss(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, comm=None, vocab_start: int = 0,
               softcap: float = 0.0, chunk: int | None = None, recompute: bool = False) -> torch.Tensor:
    """The sum over tokens of cross-entropy(h W^T, targets) (label IGNORE: not counted), h (..., width) and targets
    (...): `weight` is the head's (rows, width), this TP rank's rows from `vocab_start` when `comm` (the TP group)
    is given. Chunks of `chunk` tokens (default chunk_tokens); with gradients wanted, those of h and the weight are
    computed with the loss (module docstring), or with `recompute` (--activation-checkpointing full) in the backward,
    which keeps h and the targets instead."""
    h2, y = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    per_logit = loss_logit_bytes(weight.element_size(), bool(softcap))
    chunk = chunk or chunk_tokens(h2.shape[0], weight.shape[0], per_logit)
    if torch.is_grad_enabled() and (h2.requires_grad or weight.requires_grad):
        kind = _RecomputedTokenLoss if recompute else _TokenLoss
        return kind.apply(h2, weight, y, comm, vocab_start, softcap, chunk)
    return loss_and_grads(h2, weight, y, comm, vocab_start, softcap, chunk, False, False)[0]


class _TokenLoss(torch.autograd.Function):
    """The summed token loss, with the gradients of h and the weight computed in the forward and saved; the
    backward scales them by the loss's gradient in place and hands them over. Once the node lets its saved tensors go,
    autograd holds the only reference to the weight's, so a tied embedding's gradient is added into it where it is.
    (Scaled into new tensors, each step allocated and faulted in a head-sized tensor and autograd summed the tied pair
    into a third: its cost in docs/benchmarks.md.) A second backward through the same forward
    (retain_graph) is refused by autograd's check of the saved tensors' versions."""

    @staticmethod
    def forward(ctx, h, weight, targets, comm, vocab_start, softcap, chunk):
        loss, grad_h, grad_w = loss_and_grads(h, weight, targets, comm, vocab_start, softcap, chunk,
                                              ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        ctx.save_for_backward(grad_h, grad_w)
        return loss

    @staticmethod
    def backward(ctx, grad):
        grad_h, grad_w = ctx.saved_tensors
        return (None if grad_h is None else grad_h.mul_(grad), None if grad_w is None else grad_w.mul_(grad),
                None, None, None, None, None)


class _RecomputedTokenLoss(torch.autograd.Function):
    """The summed token loss keeping h, the weight and the targets (not the gradients, rows x width for the weight's)
    for the backward, which computes the loss's chunks again with their gradients (loss_and_grads: the same values
    as _TokenLoss's, bitwise): the head's matmul once in the forward, three times in the backward. A checkpoint
    around _TokenLoss would run all three in the forward, drop their results, and run them again."""

    @staticmethod
    def forward(ctx, h, weight, targets, comm, vocab_start, softcap, chunk):
        ctx.save_for_backward(h, weight, targets)
        ctx.comm, ctx.vocab_start, ctx.softcap, ctx.chunk = comm, vocab_start, softcap, chunk
        return loss_and_grads(h, weight, targets, comm, vocab_start, softcap, chunk, False, False)[0]

    @staticmethod
    def backward(ctx, grad):
        h, weight, targets = ctx.saved_tensors
        _, grad_h, grad_w = loss_and_grads(h, weight, targets, ctx.comm, ctx.vocab_start, ctx.softcap, ctx.chunk,
                                           ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return (None if grad_h is None else grad_h.mul_(grad), None if grad_w is None else grad_w.mul_(grad),
                None, None, None, None, None)


def global_max(m: torch.Tensor, comm) -> torch.Tensor:
    """Each token's largest logit over the TP group's rows (all-reduce, max)."""
    if comm is not None:
        comm.all_reduce(m, "all_reduce_loss_max", op=dist.ReduceOp.MAX)
    return m


def global_sums(sums: torch.Tensor, comm) -> torch.Tensor:
    """Each token's sum of exp(logit - max) and target logit over the TP group's rows (all-reduce, sum): (2, tokens)."""
    if comm is not None:
        comm.all_reduce(sums, "all_reduce_loss_sums")
    return sums


def chunk_bounds(tokens: int, chunk: int) -> list[tuple[int, int]]:
    """The chunks' [lo, hi) of `tokens` tokens, `chunk` each (the last shorter)."""
    return [(lo, min(tokens, lo + chunk)) for lo in range(0, tokens, chunk)]


def loss_and_grads(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, comm, vocab_start: int,
                   softcap: float, chunk: int, want_h: bool, want_w: bool):
    """(summed token loss (fp32, 0-d), its gradient in h or None, in the weight or None) of h (tokens, width) over
    the head's rows `weight` (rows, width) from `vocab_start`; chunk by chunk of tokens, one chunk's fp32 logits at a
    time. Every TP rank computes the same loss and its own rows' gradients; h's is the rows' share (copy_to_tp sums
    it)."""
    rows = weight.shape[0]
    bounds = chunk_bounds(h.shape[0], chunk)
    losses = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
    grad_h = torch.empty_like(h) if want_h else None
    grad_w = None
    for lo, hi in bounds:
        hc, y = h[lo:hi], targets[lo:hi]
        z, tanh = chunk_logits(hc, weight, softcap)
        local, owned = owned_targets(y, vocab_start, rows)
        top, sums = exp_and_sums(z, local, owned, comm)
        e = z
        trained = y != IGNORE
        losses[lo:hi] = torch.where(trained, top + sums[0].log() - sums[1], 0.0)
        if not (want_h or want_w):
            continue
        p = e.div_(sums[0].unsqueeze(1))  # softmax, then minus the one-hot of the target on its rank
        # the target's column on the rank that holds it; -0.0 elsewhere, which changes no value (no nonzero(): its
        # count of rows is a read of the device, one a chunk)
        p.scatter_add_(1, local.unsqueeze(1), -owned.to(p.dtype).unsqueeze(1))
        p.mul_(trained.unsqueeze(1).to(p.dtype))
        if tanh is not None:  # d(cap tanh(x / cap)) / dx = 1 - tanh^2
            p.mul_(1.0 - tanh.square_())
            del tanh
        grad_w = chunk_grads(p, weight, hc, grad_h[lo:hi] if want_h else None, grad_w, len(bounds), want_w)
    if want_w:
        grad_w = grad_w.to(weight.dtype)
    return losses.sum(), grad_h, grad_w


def chunk_grads(g: torch.Tensor, weight: torch.Tensor, hc: torch.Tensor, grad_h: torch.Tensor | None,
                grad_w: torch.Tensor | None, chunks: int, want_w: bool) -> torch.Tensor | None:
    """A chunk's share of the head's gradients, from g (tokens, rows), the loss's gradient in the chunk's logits: g
    weight written into `grad_h` (the chunk's rows of the input's gradient; None: not wanted), and, `want_w`, g^T hc
    added to `grad_w` (the weight's so far: None before the first chunk), which is returned."""
    g = g.to(weight.dtype)
    if grad_h is not None:
        torch.mm(g, weight, out=grad_h)
    return weight_grad(grad_w, g, hc, chunks) if want_w else grad_w


def weight_grad(acc: torch.Tensor | None, g: torch.Tensor, hc: torch.Tensor, chunks: int) -> torch.Tensor:
    """The weight's gradient with this chunk's g^T hc added: one chunk's product as it is; over several, summed in
    fp32 (a bf16 sum would round once per chunk)."""
    if chunks == 1:
        return g.t().mm(hc)
    if acc is None:
        return g.t().mm(hc).float()
    if g.dtype == torch.float32:
        return acc.addmm_(g.t(), hc)
    return acc.add_(g.t().mm(hc))


def token_logps(h: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, comm=None, vocab_start: int = 0,
                softcap: float = 0.0, chunk: int | None = None) -> torch.Tensor:
    """Each token's log p(target) under softmax(h W^T) (fp32, shaped as `targets`; 0 where the target is IGNORE),
    h (..., width): `weight`, `comm`, `vocab_start`, `softcap` and `chunk` as token_loss's. The full logits are never
    held: one chunk's at a time, in the forward and again in the backward (module docstring)."""
    h2, y = h.reshape(-1, h.shape[-1]), targets.reshape(-1)
    per_logit = logps_logit_bytes(weight.element_size(), bool(softcap))
    chunk = chunk or chunk_tokens(h2.shape[0], weight.shape[0], per_logit)
    return _TokenLogps.apply(h2, weight, y, comm, vocab_start, softcap, chunk).view(targets.shape)


def chunk_logits(hc: torch.Tensor, weight: torch.Tensor, softcap: float) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(a chunk's logits over the head's rows in fp32, soft-capped; tanh(logits / cap) under a soft-cap, else None)."""
    z = F.linear(hc, weight).float()  # a new tensor in either precision: worked on in place by the callers
    if not softcap:
        return z, None
    tanh = z.div_(softcap).tanh_()
    return tanh * softcap, tanh


def exp_and_sums(z: torch.Tensor, local: torch.Tensor, owned: torch.Tensor, comm) -> tuple[torch.Tensor, torch.Tensor]:
    """(each token's largest logit over the TP group; [the sum of exp(logit - that max), the target's logit], summed
    over the group: the log-sum-exp is max + log(sum)) of a chunk's logits `z` over this rank's rows, which become
    exp(z - max) in place; `local`, `owned`: owned_targets'."""
    target = torch.where(owned, z.gather(1, local.unsqueeze(1)).squeeze(1), 0.0)
    top = global_max(z.max(dim=1).values, comm)
    sums = global_sums(torch.stack([z.sub_(top.unsqueeze(1)).exp_().sum(dim=1), target]), comm)
    return top, sums


def owned_targets(y: torch.Tensor, vocab_start: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(each target's row among this rank's, clamped into them; whether this rank holds it)."""
    local = y - vocab_start
    owned = (local >= 0) & (local < rows)
    return local.clamp(0, rows - 1), owned


class _TokenLogps(torch.autograd.Function):
    """log p(target) per token; saves h, the targets and each token's log-sum-exp, and recomputes each chunk's logits
    in the backward."""

    @staticmethod
    def forward(ctx, h, weight, targets, comm, vocab_start, softcap, chunk):
        rows = weight.shape[0]
        logps = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        for lo, hi in chunk_bounds(h.shape[0], chunk):
            y = targets[lo:hi]
            z, _ = chunk_logits(h[lo:hi], weight, softcap)
            local, owned = owned_targets(y, vocab_start, rows)
            top, sums = exp_and_sums(z, local, owned, comm)
            torch.add(top, sums[0].log(), out=lse[lo:hi])
            logps[lo:hi] = torch.where(y != IGNORE, sums[1] - lse[lo:hi], 0.0)
        ctx.save_for_backward(h, weight, targets, lse)
        ctx.comm, ctx.vocab_start, ctx.softcap, ctx.chunk = comm, vocab_start, softcap, chunk
        return logps

    @staticmethod
    def backward(ctx, grad):
        h, weight, targets, lse = ctx.saved_tensors
        want_h, want_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        rows, bounds = weight.shape[0], chunk_bounds(h.shape[0], ctx.chunk)
        up = torch.where(targets != IGNORE, grad.float(), 0.0)  # an ignored target: no gradient
        grad_h = torch.empty_like(h) if want_h else None
        grad_w = None
        for lo, hi in bounds:
            hc, u = h[lo:hi], up[lo:hi]
            z, tanh = chunk_logits(hc, weight, ctx.softcap)
            local, owned = owned_targets(targets[lo:hi], ctx.vocab_start, rows)
            g = z.sub_(lse[lo:hi].unsqueeze(1)).exp_().mul_(-u.unsqueeze(1))  # upstream x (one-hot - softmax)
            g.scatter_add_(1, local.unsqueeze(1), torch.where(owned, u, -0.0).unsqueeze(1))  # as in loss_and_grads
            if tanh is not None:  # d(cap tanh(x / cap)) / dx = 1 - tanh^2
                g.mul_(1.0 - tanh.square_())
                del tanh
            grad_w = chunk_grads(g, weight, hc, grad_h[lo:hi] if want_h else None, grad_w, len(bounds), want_w)
        if want_w:
            grad_w = grad_w.to(weight.dtype)
        return grad_h, grad_w, None, None, None, None, None
