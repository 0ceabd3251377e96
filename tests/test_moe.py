"""Mixtures of experts against transformers: Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE; the router, the experts' two paths.

Every model is a tiny random transformers model built locally (model_folders.moe_folder: fp32, hidden 64, 4-8
experts), read through --init-from's path. For each family: the logits within 1e-5 of transformers', and a planted bug
of what sets it apart (renormalisation skipped, the shared expert's gate dropped, the window ignored, OLMoE's q/k norms
taken per head) caught by the same comparison. The experts' grouped path (torch._grouped_mm) equals the per-expert
loop, forward and backward, and a planted offset is caught.
"""

from __future__ import annotations

import pytest
import torch
import transformers  # a [test] dependency: missing, the module fails to import, loudly
from model_folders import MOE_FAMILIES, WINDOW, moe_folder

from zerotrain.hub import init_from
from zerotrain.model import build_model, llama as llama_module, moe

pytestmark = pytest.mark.timeout(300)

SEQ, VOCAB = 32, 96
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
EXACT, CAUGHT = 1e-5, 1e-3


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """{family: (folder, the transformers model saved there)}."""
    root = tmp_path_factory.mktemp("moe")
    return {family: (root / family, moe_folder(root / family, family)) for family in MOE_FAMILIES}


def init_from_model(folder):
    """The folder's model as --init-from reads it, on one process."""
    source = init_from.weight_source(str(folder))
    model = build_model(source.model, 0)
    init_from.load_local(model, source, {}, 0)
    return model.eval()


def logits_gap(folder, hf) -> float:
    with torch.no_grad():
        return (init_from_model(folder)(IDS) - hf(IDS).logits).abs().max().item()


def test_each_family_computes_the_logits_transformers_does(folders):
    read = {}
    for family in MOE_FAMILIES:
        folder, hf = folders[family]
        assert logits_gap(folder, hf) < EXACT, family
        cfg = init_from.weight_source(str(folder)).model
        read[family] = (cfg.n_experts, cfg.experts_per_token, cfg.renormalizes, cfg.shared_expert_width,
                        cfg.sliding_window, cfg.dense_layers)
    assert read == {"qwen3_moe": (8, 2, True, 0, 0, (1,)), "qwen2_moe": (4, 2, False, 40, 0, ()),
                    "mixtral": (4, 2, True, 0, WINDOW, ()), "olmoe": (8, 2, False, 0, 0, ())}


def per_head_norms(mp):
    """Planted: OLMoE's q/k norms taken per head (as Qwen3's), their gains cut to a head's width."""
    real = llama_module.LlamaAttention.__init__

    def init(self, cfg, layer=0):
        real(self, cfg, layer)
        self.whole_qk_norm = False

    mp.setattr(llama_module.LlamaAttention, "__init__", init)
    mp.setattr(llama_module, "normalize_heads", lambda norm, x, comm: norm(x, norm.weight[: x.shape[-1]]))


PLANTED = {  # family: the bug, planted in zerotrain's own code
    "qwen3_moe": lambda mp: mp.setattr(moe.MoE, "route", unrenormalised(moe.MoE.route)),
    "qwen2_moe": lambda mp: dropped_shared_gate(mp),
    "mixtral": lambda mp: mp.setattr(llama_module, "window_attention", lambda *a: None),
    "olmoe": per_head_norms,
}


def dropped_shared_gate(mp):
    """Planted: the reading path gives zeros for the shared expert's gate (a gate of 1/2 for every token)."""
    read = init_from._read_rows
    mp.setattr(init_from, "_read_rows", lambda f, name, *a: torch.zeros_like(read(f, name, *a))
               if name.endswith("shared_expert_gate.weight") else read(f, name, *a))


def unrenormalised(route):
    def planted(self, flat, B, T):
        self.renormalize = False
        return route(self, flat, B, T)
    return planted


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_a_planted_bug_of_each_family_changes_the_logits(folders, monkeypatch, family):
    folder, hf = folders[family]
    PLANTED[family](monkeypatch)
    assert logits_gap(folder, hf) > CAUGHT


def run_paths(model, path: str) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The model's logits on IDS and its gradients of their sum of squares, with every MoE layer on `path`."""
    for layer in moe.moe_layers(model):
        layer.path = path
    model.zero_grad()
    logits = model(IDS)
    logits.pow(2).sum().backward()
    return logits.detach(), [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for p in model.parameters()]


def test_the_grouped_experts_equal_the_per_expert_loop_and_a_planted_offset_is_caught(folders, monkeypatch):
    assert moe.grouped_mm_works("cpu", torch.float32), "torch 2.13's CPU build runs _grouped_mm"
    model = init_from_model(folders["qwen3_moe"][0]).train()
    calls = []
    real = moe.expert_grouped
    monkeypatch.setattr(moe, "expert_grouped", lambda *a: calls.append(1) or real(*a))
    loop, grouped = run_paths(model, "loop"), run_paths(model, "grouped")
    assert calls, "the grouped path was taken"
    assert (loop[0] - grouped[0]).abs().max() < 1e-5
    assert max((a - b).abs().max().item() for a, b in zip(loop[1], grouped[1])) < 1e-4
    # planted: the offsets one row off (the first expert's last row computed by the second)
    monkeypatch.setattr(moe, "expert_grouped", lambda experts, tokens, counts: real(
        experts, tokens, counts + torch.nn.functional.one_hot(torch.tensor(0), len(counts)) * -1
        + torch.nn.functional.one_hot(torch.tensor(1), len(counts))))
    assert (run_paths(model, "grouped")[0] - loop[0]).abs().max() > CAUGHT


# Training: 3 steps of --init-from each folder, the first loss (with the balancing term) against transformers' loss
# with output_router_logits, and the export loaded by transformers.

def train_from(folder, out, *flags):
    from conftest import world_of_one  # noqa: F401  (the caller holds the world)
    from zerotrain.cli.flags import config_from_args
    from zerotrain.cli.main import build_parser
    from zerotrain.runtime.run_folder import resolve_paths
    from zerotrain.training.loop import train

    args = build_parser().parse_args(["train", "--init-from", str(folder), "--data", "synthetic", "--no-progress",
                                      "--seq-len", str(SEQ - 1), "--out", str(out), "--micro-batch", "1",
                                      "--lr", "1e-3", "--steps", "3", *flags])
    cfg = resolve_paths(config_from_args(args))
    return cfg, train(cfg, comm_of_test, announce=False)


def first_row(cfg):
    """Step 1's one sequence as the run reads it: (inputs, labels), each (1, T)."""
    from zerotrain.data import BatchSchedule, make_source

    micro = BatchSchedule(make_source(cfg), micro_batch=1, accum=1, rank=0, world_size=1).batch(0).micro_batches[0]
    return micro.inputs, micro.labels


def transformers_loss(hf, inputs, labels) -> tuple[float, float]:
    """transformers' loss (cross-entropy + router_aux_loss_coef x aux_loss) and aux_loss on zerotrain's row: the
    row and its last target as input_ids, the last position masked out of attention and of the balancing loss,
    so that the T targets and the T routed tokens are zerotrain's."""
    ids = torch.cat([inputs, labels[:, -1:]], dim=1)
    mask = torch.ones_like(ids)
    mask[:, -1] = 0
    with torch.no_grad():
        out = hf(ids, attention_mask=mask, labels=ids, output_router_logits=True)
    return out.loss.item(), out.aux_loss.item()


comm_of_test = None


@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_three_steps_from_each_folder_start_at_transformers_loss_and_export_what_transformers_computes(
        folders, one_rank, tmp_path, monkeypatch, family):
    global comm_of_test
    comm_of_test = one_rank
    folder, hf = folders[family]
    cfg, result = train_from(folder, tmp_path / "run", "--moe-aux-coef", "0.5")
    inputs, labels = first_row(cfg)
    assert torch.equal(inputs[:, 1:], labels[:, :-1]) and (labels >= 0).all()
    monkeypatch.setattr(hf, "router_aux_loss_coef", 0.5)  # --moe-aux-coef's, read by its forward
    their_loss, their_aux = transformers_loss(hf, inputs, labels)
    first = result.records[0]
    assert abs(first["aux_loss"] - their_aux) <= 1e-5 * their_aux
    assert abs(first["loss"] - their_loss) <= 1e-5 * their_loss
    assert 0.5 * their_aux > 100 * 1e-5 * their_loss  # the balancing term is well above the bound
    assert len(result.records) == 3 and len(first["expert_load"]) == len(moe.moe_layers(result.engine.model))
    # the trained model exported, and loaded by transformers: the same logits
    from zerotrain.hub.export import export_model

    model = result.engine.model.eval()
    export_model(model, str(tmp_path / "hf"), "hf", tokenizer_folder=None, eot_id=None)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    with torch.no_grad():
        ours, theirs = model(IDS), loaded(IDS).logits
    assert type(loaded).__name__ == type(hf).__name__
    assert (ours - theirs).abs().max() < EXACT
    assert (theirs - hf(IDS).logits).abs().max() > CAUGHT  # it trained: the export is not the folder's model


# The memory plan: what a mixture of experts saves for its backward, to the byte, whatever the routing (dropless).

def test_the_activation_bytes_of_every_moe_family_are_counted_to_the_byte_and_uncounted_experts_are_caught(
        monkeypatch):
    import dataclasses

    from test_activation_bytes import measured_bytes, packed_segments, predicted_bytes

    from zerotrain.config import PRESETS, ModelConfig
    from zerotrain.model import activation_memory

    base = ModelConfig(**PRESETS["qwen3-moe-tiny"])
    configs = [base, dataclasses.replace(base, arch="qwen2_moe", norm_topk_prob=False, shared_expert_width=24,
                                         mlp_only_layers="1"),
               dataclasses.replace(base, arch="olmoe", norm_topk_prob=False), dataclasses.replace(base, arch="mixtral")]
    for cfg in configs:
        for precision, segments in (("fp32", None), ("bf16", packed_segments(2, 16))):
            kw = dict(precision=precision, recompute="none", documents=segments is not None)
            measured = measured_bytes(build_model(cfg, seed=0), 2, 16, precision, "none", segments)
            assert predicted_bytes(cfg, 2, 16, **kw) == measured, (cfg.arch, precision)
            with monkeypatch.context() as m:  # planted: the experts counted as the dense MLP they replace
                m.setattr(activation_memory, "experts", lambda s, cfg, tp=1: activation_memory.swiglu_mlp(s))
                assert predicted_bytes(cfg, 2, 16, **kw) < measured


# LoRA on the experts: each expert's gate, up and down projections get their own adapters; the merged export is what
# the run computes; peft's export is refused (transformers' experts are 3-D tensors, not linears peft adapts). On the
# attention alone, peft's export loads on transformers' model with the run's logits.

def test_lora_adapts_every_experts_projections_exports_them_merged_and_refuses_peft_in_one_line(folders, tmp_path,
                                                                                               capfd):
    from conftest import zerotrain_here
    from safetensors import safe_open

    from zerotrain import load_model
    from zerotrain.config import LoraConfig
    from zerotrain.model import lora

    folder, _ = folders["qwen3_moe"]
    model = init_from_model(folder)
    lora.add_adapters(model, LoraConfig(rank=4, targets="q_proj,experts"), seed=0)
    adapted = {n for n, _ in lora.adapted_modules(model, LoraConfig(targets="q_proj,experts").modules("qwen3_moe"))}
    assert {f"model.layers.0.mlp.experts.{e}.{p}" for e in range(8) for p in ("gate_proj", "up_proj", "down_proj")} \
        <= adapted and not any(n.endswith("mlp.gate") for n in adapted)  # the router stays as it is
    out = tmp_path / "run"
    r = zerotrain_here(capfd, "train", "--init-from", str(folder), "--data", "synthetic", "--seq-len", "16",
                       "--micro-batch", "2", "--lora-rank", "4", "--lora-targets", "q_proj,experts", "--lr", "5e-2",
                       "--steps", "1", "--ckpt-every", "1", "--no-progress", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    r = zerotrain_here(capfd, "export", str(out), str(tmp_path / "adapter"), "--format", "peft")
    assert r.returncode == 2 and "has adapters on the routed experts of a mixture of experts (model.layers.0.mlp." \
        "experts.0.down_proj)" in r.stderr and r.stderr.count("\n") == 1, r.stderr[-2000:]
    r = zerotrain_here(capfd, "export", str(out), str(tmp_path / "merged"), "--format", "hf")
    assert r.returncode == 0, r.stderr[-2000:]
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    with torch.no_grad():
        assert (merged(IDS).logits - load_model(str(out))(IDS)).abs().max() < EXACT
    name = "model.layers.0.mlp.experts.3.down_proj.weight"
    with safe_open(str(folder / "model.safetensors"), "pt") as a, \
            safe_open(str(tmp_path / "merged" / "model.safetensors"), "pt") as b:
        assert (a.get_tensor(name) - b.get_tensor(name)).abs().max() > 1e-4  # the expert's adapters merged in


def lora_export_gaps(folder, out, comm, ids, monkeypatch, *flags) -> tuple[float, float]:
    """1 step of LoRA from `folder` (adapters on every expert) and its merged export (load_model folds the adapters
    in), loaded by transformers: (its logits' gap from the run's model with its adapters live, on `ids`; the same
    with the experts' adapters left out of load_model's merge, planted). `flags`: train_from's others."""
    global comm_of_test
    import zerotrain
    from zerotrain.hub import pretrained
    from zerotrain.hub.export import export_model
    from zerotrain.model import lora

    comm_of_test = comm
    _, result = train_from(folder, out / "run", "--lora-rank", "4", "--lora-targets", "q_proj,experts", "--lr", "5e-2",
                           "--steps", "1", "--ckpt-every", "1", *flags)
    live = result.engine.model.eval()
    assert any(".experts." in n for n in lora.adapter_names(live))

    def exported_gap(name: str) -> float:
        export_model(zerotrain.load_model(str(out / "run")), str(out / name), "hf", tokenizer_folder=None, eot_id=None)
        merged = transformers.AutoModelForCausalLM.from_pretrained(str(out / name)).eval()
        with torch.no_grad():
            return (merged(ids).logits - live(ids)).abs().max().item()

    merged = exported_gap("merged")
    real = pretrained.merge_adapters

    def experts_left_out(model):
        for name, module in model.named_modules():
            if ".experts." in name and hasattr(module, "lora_hooks"):
                module.lora_scale = 0.0
        return real(model)
    with monkeypatch.context() as m:
        m.setattr(pretrained, "merge_adapters", experts_left_out)
        return merged, exported_gap("planted")


@pytest.mark.parametrize("family", ["qwen2_moe", "mixtral", "olmoe"])
def test_lora_on_each_familys_experts_exports_merged_what_the_run_computes_and_unmerged_experts_are_caught(
        folders, one_rank, tmp_path, monkeypatch, family):
    """The other families' LoRA runs (Qwen2-MoE's shared expert adapted too, Mixtral's w1/w2/w3 names, OLMoE's
    whole-projection norms beside adapted q and k; gpt-oss's in test_gpt_oss.py): the merged export computes the
    run's logits with its adapters live in transformers. Planted in load_model's merge: the experts' adapters left
    out (measured: 2.5 to 3.5 off)."""
    merged, planted = lora_export_gaps(folders[family][0], tmp_path, one_rank, IDS, monkeypatch)
    assert merged < 5e-5, merged  # the folded W + s B A against the adapters' own matmuls: measured 1.0e-5 to 1.2e-5
    assert planted > CAUGHT, planted
@pytest.mark.parametrize("family", MOE_FAMILIES)
def test_attention_adapters_of_a_mixture_of_experts_export_to_peft_with_the_runs_logits_and_an_mlp_target_is_caught(
        family, folders, tmp_path, capfd, monkeypatch):
    import peft
    from conftest import zerotrain_here

    from zerotrain import load_model
    from zerotrain.hub import adapter

    folder, _ = folders[family]
    out = tmp_path / "run"
    r = zerotrain_here(capfd, "train", "--init-from", str(folder), "--data", "synthetic", "--seq-len", "16",
                       "--micro-batch", "2", "--lora-rank", "4", "--lora-targets", "q_proj,k_proj,v_proj,o_proj",
                       "--lr", "5e-2", "--steps", "2", "--ckpt-every", "2", "--no-progress", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    r = zerotrain_here(capfd, "export", str(out), str(tmp_path / "adapter"), "--format", "peft")
    assert r.returncode == 0, r.stderr[-2000:]

    def adapted():
        """peft's model of the base and the adapter: its logits, and its adapted modules with their kinds."""
        base = transformers.AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        model = peft.PeftModel.from_pretrained(base, str(tmp_path / "adapter")).eval()
        with torch.no_grad():
            logits = model(IDS).logits
        return logits, {n.removeprefix(adapter.PEFT_PREFIX): type(m).__name__ for n, m in model.named_modules()
                        if hasattr(m, "lora_A")}

    theirs, modules = adapted()
    ours_modules = {f"model.layers.{i}.self_attn.{p}" for i in range(2) for p in ("q_proj", "k_proj", "v_proj",
                                                                                    "o_proj")}
    assert modules == dict.fromkeys(ours_modules, "Linear")  # the attention's linears, nothing of the experts
    with torch.no_grad():
        ours = load_model(str(out))(IDS)
        base = transformers.AutoModelForCausalLM.from_pretrained(str(folder))(IDS).logits
    assert (theirs - ours).abs().max() < 1e-4  # peft adds the adapters' product, zerotrain's model has them merged
    assert (base - ours).abs().max() > CAUGHT  # the adapters trained: the base's logits are not the run's
    real = adapter.peft_config
    # planted: the adapters' scale written wrong (alpha doubled)
    with monkeypatch.context() as m:
        m.setattr(adapter, "peft_config", lambda run, path, adapted: {
            **real(run, path, adapted), "lora_alpha": 2 * real(run, path, adapted)["lora_alpha"]})
        r = zerotrain_here(capfd, "export", str(out), str(tmp_path / "adapter"), "--format", "peft", "--overwrite")
        assert r.returncode == 0, r.stderr[-2000:]
    assert (adapted()[0] - ours).abs().max() > CAUGHT
    if family == "mixtral":  # peft takes no MLP name for Mixtral's experts: the next bug does no harm there
        return
    # planted: an MLP name among the targets (--lora-targets all's names as they are): peft wraps the experts' 3-D
    # tensors (qwen3_moe, olmoe) or a shared expert's linear (qwen2_moe) the file holds no adapters for
    monkeypatch.setattr(adapter, "peft_config", lambda run, path, adapted: {
        **real(run, path, adapted), "target_modules": [*real(run, path, adapted)["target_modules"], "down_proj"]})
    r = zerotrain_here(capfd, "export", str(out), str(tmp_path / "adapter"), "--format", "peft", "--overwrite")
    assert r.returncode == 0, r.stderr[-2000:]
    assert adapted()[1] != modules


def test_peft_refuses_a_mixture_of_experts_mlp_adapter_naming_it_and_takes_a_dense_models():
    from zerotrain.config import Config
    from zerotrain.hub.adapter import moe_peft_problem

    def run(arch):
        cfg = Config()
        cfg.model.arch, cfg.model.n_experts = arch, 0 if arch == "llama" else 4
        return cfg

    attention = {"model.layers.0.self_attn.q_proj.lora_A.weight": None}
    shared = {**attention, "model.layers.0.mlp.shared_expert.down_proj.lora_B.weight": None}
    assert moe_peft_problem(run("qwen3_moe"), attention) is None
    assert "an MLP of a mixture of experts (model.layers.0.mlp.shared_expert.down_proj), which peft takes for the " \
        "routed experts' 3-D tensors" in moe_peft_problem(run("qwen2_moe"), shared)
    assert moe_peft_problem(run("llama"), {"model.layers.0.mlp.down_proj.lora_A.weight": None}) is None
    # the targets written are the names of the linears adapted: --lora-targets all on a mixture of experts whose
    # adapters are on the attention alone writes no MLP name (which peft would take for the experts' 3-D tensors)
    from zerotrain.hub.adapter import peft_config

    linears = tuple(f"model.layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    assert peft_config(run("qwen3_moe"), None, linears)["target_modules"] == ["q_proj", "k_proj", "v_proj", "o_proj"]
    assert "down_proj" in peft_config(run("qwen3_moe"), None)["target_modules"]  # without them: every name of all


@pytest.mark.parametrize("family, field, value", [("mixtral", "router_jitter_noise", 0.1), ("olmoe", "clip_qkv", 8.0),
                                                  ("qwen2_moe", "qkv_bias", False),
                                                  ("qwen3_moe", "use_sliding_window", True)])
def test_what_a_family_computes_that_zerotrain_does_not_is_refused_naming_the_field(family, field, value):
    import re

    from model_folders import moe_config

    from zerotrain.errors import CheckpointError
    from zerotrain.hub import mapping

    config = moe_config(family).to_dict()
    assert mapping.model_config_from_hf(config, "config.json").n_experts  # as transformers writes it: read
    config[field] = value
    with pytest.raises(CheckpointError, match="^config.json: " + re.escape(f"{field} = {value!r}")):
        mapping.model_config_from_hf(config, "config.json")
