"""A LoRA run's adapters outside training: the base a resume must train them on, and their PEFT folder.

A checkpoint of a LoRA run holds the adapters and their optimizer state, not the base: its manifest records the
base's identity instead (init_from: the --init-from folder and each weight file's digest, base_digest's), or, for
a random base, its config holds the model and the seed that build it again. `zerotrain export --format peft` writes what
`peft.PeftModel.from_pretrained(base, OUT)` loads: adapter_config.json and adapter_model.safetensors, the
adapters under peft's names (`base_model.model.` + zerotrain's, which are Hugging Face's module paths), in their
full shapes as the checkpoint holds them (checkpoint.checkpoint_model: its model file, or its shards' masters). A
mixture of experts' adapters export when they are on the attention alone (moe_peft_problem).
"""

from __future__ import annotations

import json
import os
import shutil

from safetensors.torch import save_file

from zerotrain.checkpoint import checkpoint_model
from zerotrain.config import Config
from zerotrain.errors import ConfigError

from .base_digest import first_difference, shown, tagged_digests
from .export import make_staging_folder
from .pretrained import ModelSource

ADAPTER_CONFIG, ADAPTER_MODEL = "adapter_config.json", "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."  # what peft's LoraModel puts before the wrapped model's own names
MLP_INFIX, EXPERT_INFIX = ".mlp.", ".mlp.experts."  # in zerotrain's names: a block's MLP, a routed expert's linears


def base_mismatch(manifest: dict, cfg: Config, path: str, base: dict | None) -> str | None:
    """Why resuming the checkpoint at `path` with `cfg` would train other adapters (or every weight where it trained
    adapters, or adapters where it trained every weight) or its adapters on another base, or None.

    A LoRA run's base is the --init-from files it recorded (compared by digest, base_digest's, so a copy elsewhere
    is the same base; a record of another kind, an older manifest's whole-file sha256, by hashing the file again)
    or, without --init-from, the random model its seed builds. `base`: this run's record of its --init-from
    files (WeightSource.record, hashed once for its own manifests too), None without --init-from.
    """
    theirs = manifest.get("init_from")
    run = Config.from_dict(manifest["config"])
    if describe(run) != describe(cfg):
        return (f"--resume {path}: its run trained {describe(run)}, this one would train {describe(cfg)}: give the "
                "checkpoint's --lora-rank, --lora-alpha and --lora-targets")
    if not run.lora.rank:
        return None
    if theirs is None:
        if cfg.checkpoint.init_from:
            return (f"--resume {path}: its adapters were trained on a random base (--seed {run.loop.seed}), not on "
                    f"--init-from {cfg.checkpoint.init_from}")
        if cfg.loop.seed != run.loop.seed:
            return (f"--resume {path}: --seed {cfg.loop.seed} builds another random base than the one its adapters "
                    f"were trained on (--seed {run.loop.seed})")
        return None
    if not cfg.checkpoint.init_from:
        return f"--resume {path}: its adapters were trained on the base {theirs['path']}: give it as --init-from"
    differs = first_difference(tagged_digests(theirs), base)
    if differs is not None:
        name, now, was = differs
        return (f"--init-from {cfg.checkpoint.init_from} is not the base the adapters of {path} were trained on: "
                f"its {name} has {shown(now)}, the base's {shown(was)}")
    return None


def describe(cfg: Config) -> str:
    """What a run trains, as resume messages say it: every weight, or which adapters at which scale."""
    lora = cfg.lora
    if not lora.rank:
        return "every weight (--lora-rank 0)"
    return f"LoRA adapters of rank {lora.rank}, alpha {lora.alpha:g}, on {','.join(lora.modules(cfg.model.arch))}"


def peft_config(run: Config, base_path: str | None, adapted: tuple[str, ...] = ()) -> dict:
    """adapter_config.json: peft's LoraConfig of the run's adapters (GPT-2's Conv1D layers are fan-in-fan-out). The
    targets are the names --lora-targets gives that some linear of `adapted` (the adapted linears' names, when given)
    has: a mixture of experts' MLP names, which its routed experts take none of, are left out, as peft would take
    them for the experts' 3-D tensors (moe_peft_problem)."""
    targets = [m for m in run.lora.modules(run.model.arch) if not adapted or any(n.endswith("." + m) for n in adapted)]
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_path,
            "r": run.lora.rank, "lora_alpha": run.lora.alpha, "lora_dropout": run.lora.dropout,
            "target_modules": targets, "bias": "none",
            "fan_in_fan_out": run.model.arch == "gpt2", "inference_mode": True, "init_lora_weights": True,
            "use_rslora": False}


def moe_peft_problem(run: Config, adapters: dict) -> str | None:
    """Why peft cannot load a mixture of experts' adapters on transformers' model, or None: they must be on the
    attention alone.

    transformers 5 holds each layer's routed experts as 3-D tensors (gate_up_proj, down_proj), not linears: peft
    cannot adapt them as zerotrain does, one linear per expert. And peft 0.21 takes every MLP name of a mixture of
    experts' target_modules (gate_proj, up_proj, down_proj; as short names, full names or a pattern) for a target of
    those 3-D parameters (target_parameters): it wraps the experts in a ParamWrapper the file holds nothing for, and
    leaves a dense layer's or a shared expert's linear of that name without its adapter.
    """
    if not run.model.moe:
        return None
    mlp = next((n.rpartition(".lora_")[0] for n in sorted(adapters) if MLP_INFIX in n), None)
    if mlp is None:
        return None
    if EXPERT_INFIX in mlp:
        return (f"has adapters on the routed experts of a mixture of experts ({mlp}), which transformers stacks in "
                "3-D tensors, not linears peft adapts")
    return (f"has adapters on an MLP of a mixture of experts ({mlp}), which peft takes for the routed experts' 3-D "
            "tensors of that name, not this linear")


def export_peft(source: ModelSource, out: str) -> list[str]:
    """Write the adapters of the LoRA checkpoint `source` to folder `out` as peft's; the names of the files written.

    `out` was checked by export.check_destination. The files go into a folder beside `out`, then into place.
    """
    if source.kind != "checkpoint" or not (source.config or {}).get("lora", {}).get("lora_rank"):
        raise ConfigError(f"--format peft: {source.folder} is not a checkpoint of a LoRA run (--lora-rank): it has "
                          "no adapters; export it as hf or safetensors")
    run = Config.from_dict(source.config)
    if run.model.arch == "phi3":  # its Hugging Face layers fuse q, k, v and gate, up: peft's targets are those
        raise ConfigError(f"--format peft: {source.folder} is a Phi-3, whose Hugging Face model fuses q, k, v in "
                          "qkv_proj and gate, up in gate_up_proj, where zerotrain's adapters are on each; export "
                          "the merged model with --format hf")
    adapters = checkpoint_model(source.folder, source.manifest)
    problem = moe_peft_problem(run, adapters)
    if problem:
        raise ConfigError(f"--format peft: {source.folder} {problem}; export the merged model with --format hf, or "
                          "train adapters on the attention alone (--lora-targets q_proj,k_proj,v_proj,o_proj)")
    record = source.manifest.get("init_from")
    tmp = make_staging_folder(out)
    try:
        with open(os.path.join(tmp, ADAPTER_CONFIG), "w") as f:
            adapted = tuple(sorted({n.rpartition(".lora_")[0] for n in adapters}))
            json.dump(peft_config(run, record["path"] if record else None, adapted), f, indent=2)
            f.write("\n")
        save_file({PEFT_PREFIX + n: t.contiguous() for n, t in adapters.items()}, os.path.join(tmp, ADAPTER_MODEL),
                  metadata={"format": "pt"})
        shutil.copymode(os.path.join(tmp, ADAPTER_CONFIG), os.path.join(tmp, ADAPTER_MODEL))
        written = sorted(os.listdir(tmp))
        os.makedirs(out, exist_ok=True)
        for name in written:
            os.replace(os.path.join(tmp, name), os.path.join(out, name))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return written
