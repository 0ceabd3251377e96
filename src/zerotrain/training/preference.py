"""Preference tuning (--method dpo): sequence log-probs, the reference, the DPO family's losses, one step's pairs.

A pair's chosen and rejected completions are scored in one forward of one micro-batch (its 2B rows: chosen, then
rejected): a completion's log-prob is the sum, in fp32, of log p(token) over its tokens (the rows' unmasked
labels). With the reference's log-probs (r_c, r_r) and the policy's (p_c, p_r), Delta = (p_c - r_c) - (p_r - r_r):

    sigmoid   -log sigmoid(beta Delta); with --dpo-label-smoothing e the robust variant (Chowdhury et al. 2024):
              (-(1 - e) log sigmoid(beta Delta) + e log sigmoid(-beta Delta)) / (1 - 2e)
    ipo       ((p_c - r_c) / n_c - (p_r - r_r) / n_r - 1 / (2 beta))^2     n: the completion's tokens (TRL's IPO)
    hinge     max(0, 1 - beta Delta)
    simpo     -log sigmoid(beta (p_c / n_c - p_r / n_r) - gamma)            no reference (SimPO)
    orpo      -p_c / n_c - beta log sigmoid(log odds(p_c / n_c) - log odds(p_r / n_r)),  odds(a) = e^a / (1 - e^a)
              no reference (ORPO; its NLL term is the pair's chosen mean, so that pairs stay the unit)

The rewards are beta (p - r) (simpo and orpo: beta p / n). Each micro-batch's gradient is of its pairs' summed
loss over the global batch's pair count, so a step's loss is the mean over the global batch's pairs whatever the
split: the pairs are the unit, as tokens are for SFT.

The reference is by default precomputed before step 1, from the initial weights, over every pair: each DP replica
scores its share in micro-batches of --micro-batch pairs, every rank running the same number of forwards (the last
padded with pair 0: ZeRO-3's gathers are collective), and one all-reduce gives every rank all of them. Rank 0
stores them beside the checkpoints (dpo_reference.safetensors, keyed by the sha256 of the pairs' tokens and the
digests of the base's weight files), and every checkpoint's manifest records the file's sha256: a resume reads them
back, verified, and never scores them again from the trained policy; a resume with another base or other pairs is refused.

--dpo-reference live scores each micro-batch's pairs again, without gradients, before the policy's forward: with
LoRA, the base with the adapters off (no memory beyond it); in full fine-tuning, a frozen copy of the initial policy
laid out like it (reference_model.py), built from the base before step 1 and again at a resume, whose manifests
record the base's digests as the precomputed reference's do (a resume with another base is refused). Both score with
the head's log-probs as the precomputed reference does, so live and precomputed give the same losses.

With --eval-every, held-out pairs (--val-data, or --data's records that --val-fraction sets aside) are scored against
the same reference: their log-probs are scored with the training pairs' and stored after them (pair n + j), and each
validation scores every held-out pair once, each replica its share, every rank the same number of forwards.

With --cp C each row of a pair is split over the C ranks of its replica as SFT's rows are (parallel/context.py: the
schedule and the reference's and validation's shares keep this rank's zig-zag part): each rank's head sums the
log-probs (and counts the tokens) of its part of each row, and one all-reduce over the cp group per forward makes them
the whole sequences' (sum_over_parts, which carries the gradient back to every part), policy and live reference
alike; every rank of the group then computes the same pair losses and figures, which it counts once (counted_once).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors.torch import load, save

from zerotrain.checkpoint.stream import count_read, sha256_file, storage_delay
from zerotrain.config import REFERENCE_FREE, Config, ObjectiveConfig
from zerotrain.data import IGNORE, MicroBatch, on_device
from zerotrain.data.pairs import PairBatch, PreferenceSchedule, PreferenceSource, pairs_digest, read_splits
from zerotrain.durable import write_atomic
from zerotrain.errors import ConfigError
from zerotrain.hub.base_digest import first_difference, shown, tagged_digests
from zerotrain.model.loss import TokenLogpsLoss, head_loss
from zerotrain.model.lora import adapters_off
from zerotrain.parallel.context import context_parallel

from . import reference_model
from .executor import LOSS_SUM_DTYPE, Micro, MicroLoss, run_micro_batches
from .faults import Faults
from .guard import LossRule, near_zero_loss_rule

REFERENCE_FILE = "dpo_reference.safetensors"
# The sums each step reduces, per pair: what the step's record reports as their means over the global batch
STATS = ("rewards_chosen", "rewards_rejected", "rewards_accuracy", "logps_chosen", "logps_rejected")


class PairMicro(NamedTuple):
    """A micro-batch of pairs as the step's loss reads it: its 2B rows (chosen, then rejected), the pairs' ids and
    their reference log-probs ([2, B]; None for the losses without one)."""

    micro: MicroBatch
    ids: list[int]
    reference: torch.Tensor | None


@TokenLogpsLoss
def sequence_logps(token_logps: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """[2, rows]: each row's summed log p(label) over its unmasked labels, in fp32, and how many there are, from each
    token's log p(label) (rows, T), which the head computes (vocab.token_logps: 0 where masked, never the full
    logits): head_loss(model, inputs, labels, sequence_logps, recompute)."""
    return torch.stack([token_logps.sum(dim=1), (labels != IGNORE).sum(dim=1).float()])


def pair_losses(o: ObjectiveConfig, policy: torch.Tensor, reference: torch.Tensor | None,
                counts: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(each pair's loss, chosen rewards, rejected rewards) from [2, B] policy log-probs (chosen, rejected), the
    reference's (None for simpo and orpo) and the completions' token counts."""
    beta, (p_c, p_r), (n_c, n_r) = o.dpo_beta, policy, counts
    if o.dpo_loss in REFERENCE_FREE:
        a_c, a_r = p_c / n_c, p_r / n_r
        if o.dpo_loss == "simpo":
            loss = -F.logsigmoid(beta * (a_c - a_r) - o.simpo_gamma)
        else:  # orpo: log odds(a) = a - log(1 - e^a)
            log_odds = (a_c - a_r) - (torch.log1p(-torch.exp(a_c)) - torch.log1p(-torch.exp(a_r)))
            loss = -a_c - beta * F.logsigmoid(log_odds)
        return loss, beta * a_c.detach(), beta * a_r.detach()
    ratio_c, ratio_r = p_c - reference[0], p_r - reference[1]
    delta = ratio_c - ratio_r
    if o.dpo_loss == "sigmoid":
        e = o.dpo_label_smoothing
        loss = -F.logsigmoid(beta * delta)
        if e:
            loss = ((1 - e) * loss + e * F.logsigmoid(-beta * delta)) / (1 - 2 * e)
    elif o.dpo_loss == "ipo":
        loss = (ratio_c / n_c - ratio_r / n_r - 1 / (2 * beta)) ** 2
    else:  # hinge
        loss = torch.relu(1 - beta * delta)
    return loss, beta * ratio_c.detach(), beta * ratio_r.detach()


def pair_stats(policy: torch.Tensor, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """The STATS of a micro-batch's pairs, summed (float64, where they are: a step's stay on the device until its
    all-reduce)."""
    return torch.stack([chosen.sum(), rejected.sum(), (chosen > rejected).float().sum(), policy[0].sum(),
                        policy[1].sum()]).detach().to(LOSS_SUM_DTYPE)


class Preference:
    """The --method dpo objective: what the loop asks of a method (its schedule, its step's gradients and loss, the
    figures of its record), and the reference it keeps."""

    def __init__(self, cfg: Config):
        self.cfg, self.o = cfg, cfg.objective
        self.reference: torch.Tensor | None = None  # [pairs, 2] float64: the precomputed reference's log-probs
        self.reference_model: reference_model.ReferenceCopy | None = None  # full fine-tuning's live reference
        self.record: dict = {}  # what the manifests record of the stored reference
        self.stats = torch.zeros(len(STATS), dtype=LOSS_SUM_DTYPE)
        self.source: PreferenceSource | None = None
        self.held_out: PreferenceSource | None = None  # --eval-every's pairs: their reference follows the training's
        self.cp = None  # --cp: parallel/context.py's ContextParallel (each row split over the cp group)

    def all_pairs(self) -> list:
        """The pairs the reference scores: the training pairs, then the held-out ones (their index: n + j)."""
        return self.source.pairs + (self.held_out.pairs if self.held_out else [])

    def pair_logps(self, model, micro: MicroBatch, recompute: bool = False) -> torch.Tensor:
        """[2, rows]: each row's summed log-prob and token count under `model` (head_loss with sequence_logps); at
        --cp the whole rows', summed over the parts on the cp group (with the gradient back to this rank's part)."""
        logps = head_loss(model, micro.inputs, micro.labels, sequence_logps, recompute)
        return logps if self.cp is None else self.cp.sum_over_parts(logps)

    def counted(self, x: torch.Tensor) -> torch.Tensor:
        """A sum of whole pairs' figures as the step's and the validation's all-reduces count it: at --cp once per
        group (each rank computed the same)."""
        return x if self.cp is None else self.cp.counted_once(x)

    @property
    def precomputed(self) -> bool:
        return self.o.dpo_loss not in REFERENCE_FREE and self.o.dpo_reference == "precomputed"

    @property
    def live(self) -> bool:
        return self.o.dpo_loss not in REFERENCE_FREE and self.o.dpo_reference == "live"

    @property
    def live_copy(self) -> bool:
        """A live reference in full fine-tuning: a frozen copy of the initial policy (with LoRA: the base itself)."""
        return self.live and not self.cfg.lora.rank

    def schedule(self, mesh) -> PreferenceSchedule:
        cfg, d, seq = self.cfg, self.cfg.data, self.cfg.model.seq_len
        (pairs, counts), held = read_splits(d.source, d.val_data, d.val_fraction, bool(cfg.loop.eval_every),
                                            cfg.checkpoint.init_from, seq)
        self.source = PreferenceSource(pairs, counts, seq, cfg.loop.seed, cfg.global_batch, f"--data {d.source}")
        if held:
            held, held_counts = held
            self.held_out = PreferenceSource(held, held_counts, seq, cfg.loop.seed, len(held), "validation")
            where = f"--val-data {d.val_data}" if d.val_data else f"--val-fraction {d.val_fraction:g} of --data"
            self.source.held_out = f"validation on {held_counts.describe()} from {where}"
        self.cp = context_parallel(mesh)  # --cp: the replica's pairs, this rank's part of each row
        return PreferenceSchedule(self.source, micro_batch=cfg.loop.micro_batch, accum=cfg.loop.accum,
                                  rank=mesh.dp_rank, world_size=mesh.dp_size, part=self.cp.part if self.cp else None)

    def validation_source(self) -> PreferenceSource | None:
        return self.held_out

    def loss_units(self, batch: PairBatch) -> int:
        return batch.global_pairs

    def loss_rule(self) -> LossRule:
        """How the guard judges this loss: one that falls to 0, never by a ratio to its median, with the loss of a
        policy that learned nothing as its chance loss (pair_losses at margin 0: the policy's log-probs its reference's;
        simpo and orpo: a uniform guess over the vocabulary at each completion token)."""
        o, n = self.o, torch.ones(2, 1, dtype=torch.float64)
        policy = -math.log(self.cfg.model.vocab_size) * n
        reference = None if o.dpo_loss in REFERENCE_FREE else policy
        chance = float(pair_losses(o, policy, reference, n)[0])
        return near_zero_loss_rule(chance, f"{chance:.4g}, the {o.dpo_loss} loss of a policy that learned nothing")

    # ------------------------------------------------------------------ the reference

    def refuse(self, manifest: dict, path: str, base: dict | None) -> str | None:
        """Why the checkpoint at `path` cannot be resumed by this run: another method, or its stored reference was
        scored on another base or other pairs (rank 0 asks, before anything is read)."""
        theirs = Config.from_dict(manifest["config"]).objective.method
        if theirs != "dpo":
            return (f"--resume {path}: its run trained --method {theirs}; --method dpo resumes its own checkpoints "
                    "(start from this one's export with --init-from)")
        stored = manifest.get("dpo_reference")
        if not (self.precomputed or self.live_copy):
            return None
        if stored is None:
            kept = "precomputed reference" if self.precomputed else "record of its reference's base"
            return f"--resume {path}: its run kept no {kept} (--dpo-reference {self.o.dpo_reference})"
        differs = first_difference(stored["base"], base or {})  # a live copy is built from this run's base: the one
        if differs is not None:  # the checkpoint's run had
            name, now, was = differs
            return (f"--init-from {self.cfg.checkpoint.init_from} is not the base the reference of {path} was scored "
                    f"on: its {name} has {shown(now)}, the reference's {shown(was)}")
        if self.live_copy:
            return None
        if stored["data"] != pairs_digest(self.all_pairs()):
            held = " and its held-out pairs (--eval-every)" if self.held_out else ""
            return (f"--data {self.cfg.data.source}{held} (at --seq-len {self.cfg.model.seq_len}) is not the pairs "
                    f"the reference of {path} was scored on")
        return None

    def prepare(self, engine, comm, manifest: dict, resumed_from: str | None, base: dict | None) -> dict:
        """Before step 1: the reference log-probs, read back (verified) when the run resumes, else scored from the
        initial weights and stored; what the manifests record of them ({} without a precomputed reference). A live
        reference in full fine-tuning: the frozen copy, built from the base, resumed or not (its sha256 recorded)."""
        if self.live_copy:
            self.reference_model = reference_model.frozen_copy(self.cfg, engine)
            self.record = {"live": "frozen copy", "base": tagged_digests(base)}
            return {"dpo_reference": self.record}
        if not self.precomputed:
            return {}
        folder = self.cfg.checkpoint.dir
        faults = Faults.from_env(comm.rank, tp=engine.mesh.tp_size)  # the drills of the reference pass and its writes
        if resumed_from:
            self.record = manifest["dpo_reference"]
            stored = os.path.join(os.path.dirname(resumed_from), REFERENCE_FILE)
            data = read_reference_bytes(stored, self.record)
            self.reference = reference_logps(stored, data, self.record)
            here = os.path.join(folder, REFERENCE_FILE)  # this run's checkpoints record it: beside them too
            if comm.rank == 0 and not (os.path.isfile(here) and os.path.samefile(here, stored)):
                os.makedirs(folder, exist_ok=True)
                # whole or absent, and durable before any checkpoint recording its sha256 commits: a crash in the
                # copy must not leave a file that every checkpoint of this folder would be refused for
                write_atomic(here, data, halfway=faults.reference_hook())
        else:
            self.reference = self.score_reference(engine, faults)
            pairs = self.all_pairs()
            record = {"file": REFERENCE_FILE, "pairs": len(pairs), "data": pairs_digest(pairs),
                      "base": tagged_digests(base)}
            if self.held_out:  # the last ones: scored with the rest, stored and verified with them
                record["held_out"] = len(self.held_out.pairs)
            if comm.rank == 0:
                record["sha256"] = write_reference(os.path.join(folder, REFERENCE_FILE), self.reference, record,
                                                   faults.reference_hook())
            self.record = comm.io.all_gather_json(record if comm.rank == 0 else None, "dpo_reference")[0]
        return {"dpo_reference": self.record}

    @torch.no_grad()
    def score_reference(self, engine, faults=None) -> torch.Tensor:
        """[pairs, 2]: every pair's (chosen, rejected) log-probs under the model as it is now, on every rank (the
        training pairs, then the held-out ones)."""
        mesh, n = engine.mesh, len(self.source.pairs)
        out = torch.zeros(len(self.all_pairs()), 2, dtype=torch.float64)
        forwards = 0
        for source, offset in [(self.source, 0)] + ([(self.held_out, n)] if self.held_out else []):
            for ids, real, micro in self.shares(engine, source):
                logps = self.pair_logps(engine.model, micro)[0].view(2, len(ids)).t().cpu()
                for b in real:
                    out[offset + ids[b]] = logps[b].to(torch.float64)
                forwards += 1
                if faults is not None:
                    faults.in_reference_pass(forwards)
        if mesh.tp_rank != 0 or mesh.cp_rank != 0:  # the TP and CP ranks of a replica scored the same pairs: the
            out.zero_()  # first one's count
        return mesh.world.all_reduce(out.to(mesh.world.device), "all_reduce_reference").cpu()

    def shares(self, engine, source: PreferenceSource):
        """This replica's share of all the pairs of `source`, --micro-batch at a time: (pair ids, the places in them
        that are this share's, the micro-batch on the device). Every rank runs the same number of forwards (ZeRO-3's
        gathers are collective): the last ones of a replica with fewer pairs are filled with pair 0, not counted."""
        mesh, B, n = engine.mesh, self.cfg.loop.micro_batch, len(source.pairs)
        for f in range(math.ceil(n / (mesh.dp_size * B))):
            first = (f * mesh.dp_size + mesh.dp_rank) * B
            ids = [j if j < n else 0 for j in range(first, first + B)]
            real = [b for b in range(B) if first + b < n]
            rows = source.rows(ids)
            yield ids, real, next(iter(on_device([self.cp.part(rows) if self.cp else rows], engine.device)))

    @torch.no_grad()
    def validate(self, engine, source: PreferenceSource) -> dict:
        """--eval-every: the loss and figures of every held-out pair under the model as it is now, against the same
        reference as training (the precomputed one's held-out rows, or LoRA's base live), the same on every rank:
        each replica scores its share (shares), and one all-reduce sums them; the means over the held-out pairs."""
        mesh, offset = engine.mesh, len(self.source.pairs)
        sums = torch.zeros(1 + len(STATS), dtype=LOSS_SUM_DTYPE)
        for ids, real, micro in self.shares(engine, source):
            logps = self.pair_logps(engine.model, micro)
            policy, counts = logps[0].view(2, len(ids)), logps[1].view(2, len(ids))
            reference = self.reference_of(engine, engine.model, micro, [offset + j for j in ids])
            losses, chosen, rejected = pair_losses(self.o, policy, reference, counts)
            keep = torch.tensor(real, dtype=torch.int64)
            policy, losses, chosen, rejected = (t.cpu().index_select(-1, keep) for t in (policy, losses, chosen,
                                                                                         rejected))
            sums += torch.cat([losses.sum().to(LOSS_SUM_DTYPE).view(1), pair_stats(policy, chosen, rejected)])
        if mesh.tp_rank != 0 or mesh.cp_rank != 0:  # the TP and CP ranks of a replica scored the same pairs
            sums.zero_()
        totals = mesh.world.all_reduce(sums.to(mesh.world.device), "all_reduce_eval").cpu().tolist()
        n = len(source.pairs)
        means = {f"val_{k}": v / n for k, v in zip(("loss",) + STATS, totals)}
        means["val_rewards_margins"] = means["val_rewards_chosen"] - means["val_rewards_rejected"]
        return {"val_pairs": n, **means}

    # ------------------------------------------------------------------ the step

    def accumulate(self, engine, batch: PairBatch, forward=None, loss_factor: float = 1.0,
                   saved: list | None = None) -> torch.Tensor:
        """Forward and backward every micro-batch of pairs of this rank (executor.run_micro_batches); return its
        summed pair loss (a 0-d float64 tensor on the device) and keep its STATS' sums for the step's all-reduce
        (`extras`).

        A micro-batch's gradient is of its pairs' summed loss over the global batch's pair count. LoRA's dropout
        rows are numbered by the pair's place in the global batch (chosen 2g, rejected 2g + 1), whatever the split.
        """
        recompute = getattr(engine.model, "recompute_head", False)

        def scored(model, pairs: PairMicro) -> torch.Tensor:
            return self.pair_logps(model, pairs.micro, recompute)

        def loss(pairs: PairMicro, logps: torch.Tensor) -> MicroLoss:
            B = len(pairs.ids)
            policy, counts = logps[0].view(2, B), logps[1].view(2, B)
            losses, chosen, rejected = pair_losses(self.o, policy, pairs.reference, counts)
            return MicroLoss(losses.sum(), B, metrics=pair_stats(policy.detach(), chosen, rejected))

        totals = run_micro_batches(engine, self.micro_batches(engine, batch, forward), len(batch.micro_batches),
                                   scored, loss, batch.global_pairs, model=forward, loss_factor=loss_factor,
                                   saved=saved)
        self.stats = self.counted(totals.metrics)
        return self.counted(totals.loss_sum)

    def micro_batches(self, engine, batch: PairBatch, forward=None):
        """This rank's micro-batches of pairs on the device, each with its rows' places in the global batch and the
        reference's log-probs of its pairs, scored as the executor comes to it (before its policy's forward)."""
        forward = engine.model if forward is None else forward
        first = engine.mesh.dp_rank * sum(len(ids) for ids in batch.pair_ids)
        for ids, micro in zip(batch.pair_ids, on_device(batch.micro_batches, engine.device)):
            B = len(ids)
            rows = [2 * (first + b) for b in range(B)] + [2 * (first + b) + 1 for b in range(B)]
            first += B
            # The reference first: at ZeRO-3 its forward gathers each unit alone, before the policy's holds the
            # root (and an untied head) whole into its backward; its working set is gone before the policy's
            # activations are kept
            yield Micro(rows, PairMicro(micro, ids, self.reference_of(engine, forward, micro, ids)))

    def reference_of(self, engine, forward, micro, ids: list[int]) -> torch.Tensor | None:
        """[2, B]: the reference log-probs of the micro-batch's pairs (None for the losses without one)."""
        if self.precomputed:
            return self.reference[ids].t().to(torch.float32).to(micro.inputs.device)
        if not self.live:
            return None
        if self.reference_model is not None:  # full fine-tuning: the frozen copy of the initial policy
            with torch.no_grad():
                return self.pair_logps(self.reference_model.model, micro)[0].view(2, len(ids))
        with torch.no_grad(), adapters_off(engine.model):
            return self.pair_logps(forward, micro)[0].view(2, len(ids))

    def held_state(self) -> dict[str, reference_model.ReferenceCopy]:
        """What the objective holds beyond the engine, for the memory plan's check: the live reference's copy."""
        return {"reference_model": self.reference_model} if self.reference_model is not None else {}

    def extras(self) -> torch.Tensor:
        """What the step's all-reduce sums besides the loss: this rank's STATS sums (on the device, unread)."""
        return self.stats

    def figures(self, totals: list[float], batch: PairBatch) -> dict:
        """The step record's preference figures: the means over the global batch's pairs."""
        means = {k: v / batch.global_pairs for k, v in zip(STATS, totals)}
        means["rewards_margins"] = means["rewards_chosen"] - means["rewards_rejected"]
        return {"pairs": batch.global_pairs, **means}


def write_reference(path: str, logps: torch.Tensor, record: dict, halfway=None) -> str:
    """Store the reference log-probs with their keys, durably and whole or absent; their sha256. `halfway`: the fault
    drills' hook, midway through the write."""
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    data = save({"logps": logps.contiguous()}, metadata={"record": json.dumps(record, sort_keys=True)})
    write_atomic(path, data, halfway=halfway)
    return sha256_file(path)[1]


def read_reference(path: str, record: dict) -> torch.Tensor:
    """The stored reference log-probs, verified against the manifest's record; ConfigError naming the file."""
    return reference_logps(path, read_reference_bytes(path, record), record)


def read_reference_bytes(path: str, record: dict) -> bytes:
    """The stored reference's bytes, verified against the sha256 the manifest records; ConfigError naming the file."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: the precomputed reference log-probs this checkpoint was trained against are "
                          "missing (they are stored beside its folder)")
    with open(path, "rb") as f:
        data = f.read()
    count_read(len(data))
    storage_delay(len(data))
    digest = hashlib.sha256(data).hexdigest()
    if digest != record.get("sha256"):
        raise ConfigError(f"{path}: sha256 {digest[:12]}... is not the {str(record.get('sha256'))[:12]}... the "
                          "checkpoint's manifest records: the reference log-probs changed")
    return data


def reference_logps(path: str, data: bytes, record: dict) -> torch.Tensor:
    """[pairs, 2]: the log-probs in the reference file's verified bytes `data`; ConfigError naming the file."""
    logps = load(data)["logps"]
    if logps.shape != (record["pairs"], 2):
        raise ConfigError(f"{path}: {tuple(logps.shape)} log-probs, not the {record['pairs']} pairs recorded")
    return logps
