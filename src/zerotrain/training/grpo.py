"""Online RL (--method grpo): each step samples G completions of its prompts with the model being trained, scores
them, and trains on them with GRPO's clipped loss (grpo_loss.py), as TRL 1.16's GRPOTrainer does.

One step, on every rank:

    1. rollouts   this rank's prompts (a contiguous block of the step's P = global batch / G prompts, so a prompt's G
                  completions are on one rank) get G completions each, sampled under torch.no_grad (inference mode)
                  by the model as the engine holds it (with LoRA, its adapters on), its prompts of one length in one
                  batch: at ZeRO-3 its forwards gather each unit as training's do, and with --ep send tokens to
                  every rank's experts, so there every rank runs the same number of them (a batch per prompt, no
                  early stop when all rows ended). Prompt j's generator is seeded from (seed, generation, j), so the
                  draws do not depend on the split and a resumed run draws the same completions; a DP rank's TP
                  ranks draw the same ones (same_draws checks), counted once (per_dp_rank).
    2. rewards    each rank scores its own completions (rewards.score: TRL's signature, the records' other fields as
                  columns); one all-gather gives every rank every score and length, from which each computes the
                  same rewards, advantages (scaled by the group's std, the batch's, or not at all) and the step's
                  completion-token count; rank 0 gathers the texts too and writes <out>/rollouts.jsonl.
    3. the loss   through the executor (executor.run_micro_batches): --micro-batch completions a forward (prompt and
                  completion, padded to --seq-len), each completion token's log-prob at --temperature (TRL scales the
                  logits by it), the reference's first when --grpo-beta > 0 (the initial model: with LoRA the
                  base itself, its adapters off (lora.adapters_off), as DPO's live reference; else a frozen copy of
                  it, reference_model.frozen_copy), and grpo_loss with the step's normaliser: the global batch's
                  completions (grpo), completions x --max-completion-length (dr_grpo), completion tokens (dapo), or
                  the micro-batches (bnpo, each micro-batch's own tokens inside).

With --grpo-iterations MU > 1 a generation is trained on for MU steps: the generating policy's log-probs (old) are
scored once, before the first, and each step's ratio is to them (TRL's num_iterations).

With --cp C generation is not split (the KV cache's forwards run whole on every rank, and a DP rank's CP ranks draw
the same completions, as its TP ranks do); the loss's forwards are: each row of a micro-batch split over the C ranks
as SFT's rows are (parallel/context.py), each rank's head gives its part's token log-probs and entropies, and one
all-gather over the cp group makes them the whole rows' (ContextParallel.whole_rows, whose backward keeps this rank's
part of the gradient), for the policy, the reference and the generating policy alike. Every rank of the group then
computes the same loss and figures, counted once (counted_once).

The loss hovers around 0 and changes sign: the guard judges it with no chance loss and no ratio test (NaN and
non-finite gradients are still refused).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

import numpy as np
import torch

from zerotrain.config import Config, reward_weight_values
from zerotrain.data import IGNORE, MicroBatch, StepBatch
from zerotrain.data.batches import BatchSchedule
from zerotrain.data.jsonl import record_tokenizer
from zerotrain.data.prompts import Prompt, PromptSource, read_prompts
from zerotrain.data.tokenizer_config import model_facts, stop_ids
from zerotrain.errors import InvariantError
from zerotrain.model.generate import sample_completions, until_stop
from zerotrain.model.lora import adapters_off
from zerotrain.model.loss import head_loss
from zerotrain.parallel.context import context_parallel

from . import grpo_loss as gl
from . import reference_model, rewards
from .executor import LOSS_SUM_DTYPE, Micro, MicroLoss, run_micro_batches
from .guard import LossRule
from .rollouts import FILE as ROLLOUTS_FILE
from .rollouts import RolloutWriter, rollout_records

# The figures each micro-batch sums for the step's all-reduce: grpo_loss.GRPOStats' fields
STATS = ("tokens", "kl", "entropy", "clipped_low", "clipped_high", "clipped")


@dataclass
class GroupBatch(StepBatch):
    """A step's prompts on this rank (their places among the step's P prompts, and the records), filled in by the
    step itself with what its rollouts give: the normaliser and the figures of the whole global batch."""

    generation: int = 0  # which generation of rollouts the step trains on (data step // MU)
    prompts: list[tuple[int, Prompt]] = field(default_factory=list)
    normaliser: float = 1.0  # the executor's: the step's loss is its summed losses / this
    figures: dict = field(default_factory=dict)


class PromptSchedule(BatchSchedule):
    """The batch schedule over prompts: the global batch counts completions; rank r's (micro-batch x accum) / G
    prompts are a contiguous block of the step's P."""

    def __init__(self, source: PromptSource, *, num_generations: int, iterations: int, **split):
        super().__init__(source, **split)
        self.G, self.iterations = num_generations, iterations

    def batch(self, step: int) -> GroupBatch:
        per_rank = self.micro_batch * self.accum // self.G
        generation = step // self.iterations
        first = self.rank * per_rank
        prompts = [(j, self.source.prompts[self.source.prompt_index(generation, j)])
                   for j in range(first, first + per_rank)]
        return GroupBatch([], 0, generation=generation, prompts=prompts)


def sampling_generator(seed: int, generation: int, prompt: int, device: torch.device) -> torch.Generator:
    """The random stream prompt `prompt` of generation `generation` draws its G completions with: a function of these
    alone, so any split of the prompts over ranks, and a resume, draw the same."""
    state = np.random.SeedSequence([seed, generation, prompt, 0x6290]).generate_state(2, dtype=np.uint32)
    return torch.Generator(device=device).manual_seed(int(state[0]) << 32 | int(state[1]))


def completion_logps(temperature: float):
    """The loss head_loss hands the logits to: each target token's log-prob under softmax(logits / temperature)
    (TRL's per-token log-probs), and the entropy of that distribution (a figure, without gradient), (rows, T) each."""
    def scored(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logp = torch.log_softmax(logits.float() / temperature, dim=-1)
        token = logp.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        with torch.no_grad():
            entropy = -(logp.exp() * logp).sum(-1)
        return token, entropy

    return scored


@dataclass
class GroupMicro:
    """A micro-batch of completions as the loss reads it: the rows (prompt and completion, padded), where each
    completion token is predicted (B, L) and which count (B, L), the advantages, and the generating policy's and the
    reference's log-probs (B, L) where they are used."""

    micro: MicroBatch
    positions: torch.Tensor
    mask: torch.Tensor
    advantages: torch.Tensor
    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None


def rows_of(prompts: list[tuple[int, ...]], completions: list[list[int]], seq_len: int, L: int,
            device: torch.device) -> tuple[MicroBatch, torch.Tensor]:
    """The forward's rows of completions after their prompts, padded to seq_len, and the (B, L) positions at which
    each completion token is predicted (0 past a completion's end: masked)."""
    B = len(completions)
    inputs = torch.zeros((B, seq_len), dtype=torch.int64)
    labels = torch.full((B, seq_len), IGNORE, dtype=torch.int64)
    positions = torch.zeros((B, L), dtype=torch.int64)
    for row, (prompt, completion) in enumerate(zip(prompts, completions)):
        tokens = list(prompt) + list(completion)
        n, p = len(tokens) - 1, len(prompt)
        inputs[row, :n] = torch.tensor(tokens[:-1])
        if completion:
            labels[row, p - 1 : n] = torch.tensor(completion)
            positions[row, : len(completion)] = torch.arange(p - 1, n)
    return MicroBatch(inputs.to(device), labels.to(device)), positions.to(device)


class GroupRelative:
    """The --method grpo objective: what the loop asks of a method (its schedule, its step's gradients and loss, the
    figures of its record), the reward functions, the reference copy (--grpo-beta > 0 without LoRA) and the rollouts
    file."""

    def __init__(self, cfg: Config):
        self.cfg, self.o = cfg, cfg.objective
        self.functions = rewards.resolve_rewards([r for r in self.o.reward.split("\n") if r],
                                                 self.o.reward_format or None)
        self.names = [rewards.reward_name(f) for f in self.functions]
        self.weights = rewards.reward_weights(reward_weight_values(self.o.reward_weights), len(self.functions))
        self.reference_model: reference_model.ReferenceCopy | None = None
        self.writer: RolloutWriter | None = None
        self.stats = torch.zeros(len(STATS), dtype=LOSS_SUM_DTYPE)
        self.generated: tuple[int, list] | None = None  # (generation, this rank's rollouts) kept for MU steps
        self.cp = None  # --cp: parallel/context.py's ContextParallel (the loss's rows split over the cp group)
        tok = record_tokenizer(cfg.checkpoint.init_from)
        self.tokenizer = tok
        # TRL's: the tokenizer's end of text and the model's generation eos ids end a completion
        self.stop_ids = sorted(({tok.eot_id} | set(stop_ids(model_facts(cfg.checkpoint.init_from)))) - {None})

    @property
    def epsilon_high(self) -> float:
        return self.o.grpo_epsilon if self.o.grpo_epsilon_high == -1 else self.o.grpo_epsilon_high

    def schedule(self, mesh) -> PromptSchedule:
        cfg = self.cfg
        prompts = read_prompts(cfg.data.source, cfg.checkpoint.init_from, cfg.model.seq_len,
                               self.o.max_completion_length)
        source = PromptSource(prompts, cfg.loop.seed, cfg.global_batch // self.o.num_generations,
                              f"--data {cfg.data.source}")
        self.cp = context_parallel(mesh)
        return PromptSchedule(source, num_generations=self.o.num_generations, iterations=self.o.grpo_iterations,
                              micro_batch=cfg.loop.micro_batch, accum=cfg.loop.accum, rank=mesh.dp_rank,
                              world_size=mesh.dp_size)

    def refuse(self, manifest: dict, path: str, base: dict | None) -> str | None:
        theirs = Config.from_dict(manifest["config"]).objective.method
        if theirs != "grpo":
            return (f"--resume {path}: its run trained --method {theirs}; --method grpo resumes its own checkpoints "
                    "(start from this one's export with --init-from)")
        if manifest["step"] % self.o.grpo_iterations:
            return (f"--resume {path}: step {manifest['step']} is inside a generation of --grpo-iterations "
                    f"{self.o.grpo_iterations} (its generating policy's log-probs are not kept): resume from a step "
                    f"that is a multiple of {self.o.grpo_iterations}")
        return None

    def prepare(self, engine, comm, manifest: dict, resumed_from: str | None, base: dict | None) -> dict:
        """Before step 1: the reference copy (--grpo-beta > 0 without LoRA: with it the reference is the base the
        engine holds), built from the base resumed or not, and the rollouts file, whose records after the resumed
        step are dropped."""
        if self.o.grpo_beta > 0 and not self.cfg.lora.rank:
            self.reference_model = reference_model.frozen_copy(self.cfg, engine)
        self.writer = RolloutWriter(os.path.join(self.cfg.logging.out, ROLLOUTS_FILE), active=comm.rank == 0,
                                    start=manifest.get("step", 0))
        return {}

    def validation_source(self):
        return None

    def validate(self, engine, source) -> dict:
        return {}

    def loss_units(self, batch: GroupBatch) -> float:
        return batch.normaliser

    def loss_rule(self) -> LossRule:
        """GRPO's loss hovers around 0 and changes sign: no chance loss, no ratio, outlier or gives-back test (a
        non-finite loss or gradient norm is still refused)."""
        return LossRule(None, "", ratio_test=False, outlier_test=False, gives_back_test=False)

    def held_state(self) -> dict:
        """What the objective holds beyond the engine, for the memory plan's check: the reference copy."""
        return {"reference_model": self.reference_model} if self.reference_model is not None else {}

    def extras(self) -> torch.Tensor:
        return self.stats.cpu()

    def token_logps(self, model, micro: MicroBatch, recompute: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Each target token's log-prob at --temperature and the entropy there, (rows, T) each, under `model`; at --cp
        `micro` is this rank's part of the rows, and both are gathered whole (the log-probs with their gradient)."""
        logps, entropy = head_loss(model, micro.inputs, micro.labels, completion_logps(self.o.temperature),
                                   recompute)
        if self.cp is None:
            return logps, entropy
        return self.cp.whole_rows(logps), self.cp.whole_rows(entropy)

    # ------------------------------------------------------------------ the step

    def accumulate(self, engine, batch: GroupBatch, forward=None, loss_factor: float = 1.0,
                   saved: list | None = None) -> torch.Tensor:
        """Sample, score and train on this rank's share of the step (the module docstring); its summed loss (a 0-d
        float64 tensor on the device)."""
        o, cfg = self.o, self.cfg
        forward = engine.model if forward is None else forward
        if self.generated is None or self.generated[0] != batch.generation:
            self.generated = (batch.generation, self.rollouts(engine, batch))
        groups = self.generated[1]
        micro_batches = [groups[i : i + cfg.loop.micro_batch] for i in range(0, len(groups), cfg.loop.micro_batch)]
        if o.grpo_iterations > 1 and groups and groups[0].get("old") is None:  # the generating policy's, once
            with torch.no_grad():
                for chunk in micro_batches:
                    micro = self.group_micro(engine, chunk, reference=False)
                    old = self.token_logps(engine.model, micro.micro)[0].gather(1, micro.positions).detach()
                    for row, rollout in zip(old, chunk):
                        rollout["old"] = row
        batch.normaliser, batch.global_tokens, batch.figures = self.step_figures(engine)
        recompute = getattr(engine.model, "recompute_head", False)

        def scored(model, group: GroupMicro):
            return self.token_logps(model, group.micro, recompute)

        def loss(group: GroupMicro, out) -> MicroLoss:
            token_logps, entropy = out
            logps, entropies = token_logps.gather(1, group.positions), entropy.gather(1, group.positions)
            # bnpo: the micro-batch's own tokens divide its sum here, the step's micro-batches in the executor
            inner = group.mask.sum().float().clamp(min=1.0) if o.grpo_loss == "bnpo" else 1.0
            summed, stats = gl.grpo_loss(logps, group.advantages, group.mask, inner, loss_type=o.grpo_loss,
                                         old_logps=group.old, ref_logps=group.ref, beta=o.grpo_beta,
                                         epsilon_low=o.grpo_epsilon, epsilon_high=self.epsilon_high,
                                         entropies=entropies)
            figures = torch.stack([stats.tokens.to(LOSS_SUM_DTYPE),
                                   (stats.kl if stats.kl is not None else torch.zeros(())).to(LOSS_SUM_DTYPE),
                                   stats.entropy.to(LOSS_SUM_DTYPE), stats.clipped_low.to(LOSS_SUM_DTYPE),
                                   stats.clipped_high.to(LOSS_SUM_DTYPE), stats.clipped.to(LOSS_SUM_DTYPE)])
            return MicroLoss(summed, len(group.advantages), metrics=figures)

        def micros():
            row = engine.mesh.dp_rank * len(groups)
            for chunk in micro_batches:
                yield Micro(range(row, row + len(chunk)), self.group_micro(engine, chunk))
                row += len(chunk)

        totals = run_micro_batches(engine, micros(), len(micro_batches), scored, loss, batch.normaliser, model=forward,
                                   loss_factor=loss_factor, saved=saved)
        self.stats, loss_sum = totals.metrics, totals.loss_sum
        if self.cp is not None:  # every rank of the cp group computed the same loss of the whole rows
            self.stats, loss_sum = self.cp.counted_once(self.stats), self.cp.counted_once(loss_sum)
        return loss_sum

    def group_micro(self, engine, chunk: list[dict], reference: bool = True) -> GroupMicro:
        """A micro-batch of rollouts on the device, with the reference's log-probs when --grpo-beta > 0 and
        `reference` (scored before the policy's forward: at ZeRO-3 the copy's units and the policy's are never whole
        together; with LoRA, by the policy with its adapters off). At --cp the rows are this rank's part of each, the
        positions and the rest the whole rows'."""
        o, device = self.o, engine.device
        micro, positions = rows_of([r["prompt_ids"] for r in chunk], [r["completion_ids"] for r in chunk],
                                   self.cfg.model.seq_len, o.max_completion_length, device)
        if self.cp is not None:
            micro = self.cp.part(micro)
        mask = torch.tensor([r["mask"] for r in chunk], dtype=torch.int64, device=device)
        advantages = torch.tensor([r["advantage"] for r in chunk], dtype=torch.float32, device=device)
        old = torch.stack([r["old"] for r in chunk]) if chunk[0].get("old") is not None else None
        group = GroupMicro(micro, positions, mask, advantages, old)
        if o.grpo_beta > 0 and reference:
            group.ref = self.reference_logps(engine, micro).gather(1, positions)
        return group

    def reference_logps(self, engine, micro: MicroBatch) -> torch.Tensor:
        """The initial model's log-prob of each target token (B, T): the frozen copy's, or with LoRA the base's (the
        engine's model with its adapters off)."""
        if self.reference_model is not None:
            with torch.no_grad():
                return self.token_logps(self.reference_model.model, micro)[0]
        with torch.no_grad(), adapters_off(engine.model):
            return self.token_logps(engine.model, micro)[0]

    def rollouts(self, engine, batch: GroupBatch) -> list[dict]:
        """This rank's G completions of each of its prompts, scored, with their advantages over the global batch; rank
        0 writes every rank's to rollouts.jsonl."""
        o, cfg, mesh = self.o, self.cfg, engine.mesh
        G, L = o.num_generations, o.max_completion_length
        # at ZeRO-3 and with --ep every rank of the shard (or expert) group runs the same forwards (each gathers the
        # units, or sends tokens to every rank's experts): no stop before L tokens, the rows cut after; the draws of
        # a row are those it has with the stop (generate's docstring). A TP group's ranks stop together: they draw
        # the same tokens (their logits are the same all-gathered bytes, their generators the same seeds)
        # Elsewhere the rank's prompts of one length are one batch (measured at 4 prompts x G = 4 on CPU: ~2x the
        # tokens/s of a batch per prompt); where the ranks must run the same forwards, a batch per prompt, as many
        # on every rank whatever the prompts' lengths
        same_forwards = getattr(engine, "stage", 1) == 3 or mesh.ep_size > 1
        prompts = [prompt for _, prompt in batch.prompts]
        generators = [sampling_generator(cfg.loop.seed, batch.generation, j, engine.device) for j, _ in batch.prompts]
        batches = [[i] for i in range(len(prompts))] if same_forwards else [list(range(len(prompts)))]
        drawn = []
        for chunk in batches:
            drawn += sample_completions(engine.model, [prompts[i].ids for i in chunk], G, L, temperature=o.temperature,
                                        top_p=o.top_p if o.top_p < 1 else None,
                                        generator=[generators[i] for i in chunk],
                                        stop_ids=None if same_forwards else self.stop_ids,
                                        vocab_limit=min(cfg.model.vocab_size, self.tokenizer.vocab_size))
        out = []
        for row, ids in enumerate(drawn):
            prompt = prompts[row // G]
            ids, ended = until_stop(ids, self.stop_ids)
            text = self.tokenizer.decode(ids[:-1] if ended else ids)
            out.append({"prompt": prompt, "prompt_ids": prompt.ids, "completion_ids": ids, "text": text,
                        "ended": ended})
        scores = self.score(out)
        lengths = torch.tensor([[len(r["completion_ids"]), float(r["ended"])] for r in out], dtype=torch.float64)
        mine = torch.cat([scores.double(), lengths], dim=1)
        everyone = per_dp_rank(mesh, mesh.world.all_gather_rows(mine, "all_gather_rewards"))
        everyone = everyone.reshape(-1, mine.shape[1])
        per_function, lengths, ended = everyone[:, :-2].float(), everyone[:, -2], everyone[:, -1].bool()
        reward = rewards.weighted_reward(per_function, self.weights)
        advantages, zero_std = gl.group_advantages(reward, G, o.scale_rewards)
        in_loss = ended | (not o.mask_truncated_completions)
        self.step_rows, self.step_tokens = len(reward), (lengths * in_loss).sum().clamp(min=1.0)
        self.rollout_figures = self.reward_figures(per_function, reward, zero_std, lengths, ended, in_loss)
        first = mesh.dp_rank * len(out)
        for i, r in enumerate(out):
            r["advantage"] = float(advantages[first + i])
            n = len(r["completion_ids"]) if bool(in_loss[first + i]) else 0
            r["mask"] = [1] * n + [0] * (L - n)
        texts = mesh.world.io.all_gather_json([[list(r["prompt_ids"]), r["completion_ids"], r["text"]] for r in out],
                                             "all_gather_rollouts")
        same_draws(mesh, texts)
        if mesh.world.rank == 0:
            rows = [row for rank in per_dp_rank(mesh, texts) for row in rank]
            self.writer.write(rollout_records(mesh.world.step, [r[0] for r in rows], [r[1] for r in rows],
                                              [r[2] for r in rows], self.names, per_function, reward, advantages,
                                              self.stop_ids))
        return out

    def score(self, out: list[dict]) -> torch.Tensor:
        """Each reward function's scores of this rank's completions (N, functions), NaN for None: TRL's arguments (the
        prompts as given, the completions' texts, or assistant messages after a conversation, their ids, and the
        records' other fields as lists)."""
        prompts = [r["prompt"].text for r in out]
        completions = [[{"role": "assistant", "content": r["text"]}] if r["prompt"].conversational else r["text"]
                       for r in out]
        keys = sorted({k for r in out for k in r["prompt"].columns})
        columns = {k: [r["prompt"].columns.get(k) for r in out] for k in keys}
        return rewards.score(self.functions, prompts, completions, [r["completion_ids"] for r in out], columns)

    def reward_figures(self, per_function, reward, zero_std, lengths, ended, in_loss) -> dict:
        """The step record's reward and completion figures, from the whole global batch (TRL's names, flattened)."""
        groups = reward.view(-1, self.o.num_generations)
        figures = {"completions": len(reward), "reward": float(torch.nanmean(reward)),
                   "reward_std": float(torch.nanmean(gl.nanstd(groups, dim=1))) if groups.shape[1] > 1 else 0.0,
                   "frac_reward_zero_std": float(zero_std.view(-1, self.o.num_generations)[:, 0].float().mean()),
                   "completion_length": float(lengths.mean()), "completion_length_min": int(lengths.min()),
                   "completion_length_max": int(lengths.max()),
                   "truncated_ratio": float((~ended).float().mean())}
        figures["rewards"] = {name: {"mean": _number(torch.nanmean(per_function[:, i])),
                                     "std": _number(gl.nanstd(per_function[:, i]))}
                              for i, name in enumerate(self.names)}
        return figures

    def step_figures(self, engine) -> tuple[float, int, dict]:
        """(the executor's normaliser, the completion tokens in the loss, the reward figures) of the step: bnpo's is
        the step's micro-batches, each micro-batch's own tokens dividing its loss inside (GroupRelative.accumulate)."""
        o = self.o
        normaliser = gl.loss_normaliser(o.grpo_loss, rows=self.step_rows, tokens=self.step_tokens,
                                        max_completion_length=o.max_completion_length,
                                        micro_batch_tokens=torch.ones(()),
                                        micro_batches=engine.mesh.dp_size * self.cfg.loop.accum)
        return float(normaliser), int(self.step_tokens), self.rollout_figures

    def figures(self, totals: list[float], batch: GroupBatch) -> dict:
        """The step record's GRPO figures: rewards and completions (from the rollouts), and the loss's means over the
        completion tokens in it (TRL's kl, entropy, clip_ratio/*)."""
        sums = dict(zip(STATS, totals))
        tokens = max(sums["tokens"], 1.0)
        out = dict(batch.figures)
        out.update({"entropy": sums["entropy"] / tokens, "clip_ratio": sums["clipped"] / tokens,
                    "clip_ratio_low": sums["clipped_low"] / tokens, "clip_ratio_high": sums["clipped_high"] / tokens})
        if self.o.grpo_beta > 0:
            out["kl"] = sums["kl"] / tokens
        return out


def per_dp_rank(mesh, gathered):
    """One entry per data-parallel rank of what every rank gathered (world ranks in order): a DP rank's TP ranks
    sample the same completions of the same prompts, so the first one's stand for them all."""
    return gathered[:: mesh.world.world_size // mesh.dp_size]


def same_draws(mesh, gathered: list) -> None:
    """Refuse the step on every rank alike when a TP group's ranks drew different completions (they must: the same
    seeds, the same all-gathered logits), which their losses would then disagree on silently."""
    group = mesh.world.world_size // mesh.dp_size
    for rank in range(mesh.world.world_size):
        if gathered[rank] != gathered[rank - rank % group]:
            raise InvariantError(f"GRPO: rank {rank} sampled other completions than rank {rank - rank % group} of its "
                               "tensor-parallel group: their generators or logits differ")


def _number(x: torch.Tensor) -> float | None:
    value = float(x)
    return None if math.isnan(value) else value
