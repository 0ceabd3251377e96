"""Gemma 4's text model against transformers' Gemma4ForCausalLM (eager attention): a tiny model built by transformers
with every kind of layer (layers 0-5 sliding, global, sliding, global, then a sliding and a global layer reading the
keys and values of layers 2 and 3), the global layers' heads twice as wide with one KV head and keys as values
(attention_k_eq_v), a proportional rotary turning half their frequencies, per-layer input embeddings on, the
shared-KV layers' MLPs doubled, the logits soft-capped, a window of 8 in sequences of 24; norms moved off 1 and each
layer_scalar off 1 (the released checkpoints' are); read by `load_model` and --init-from.

Logits within 1e-4 of transformers' (measured 5.2e-5 on logits of magnitude ~10: the unscaled scores of normalised q
and k make a sharp softmax; in fp64 4e-6, transformers' own fp32 norms and softmax); the planted bugs below move them
by more than 1e-2. Planted in the functions zerotrain runs and caught: the per-layer input embedding left out, the
shared-KV layers reading the first layer of their kind instead of the last, the global layers' rotary on the sliding
layers. Packed records equal each record alone (in fp64, within 1e-9); the cache's decoding equals the full forward
(the shared-KV layers reading their source's cache).

Training: 8 AdamW steps of --init-from at 1 rank (in this process) and at ZeRO-3 on 2 ranks equal a plain
transformers + AdamW loop (test_qwen35's) over transformers' SDPA attention, the kernel zerotrain runs: losses,
gradient norms and final weights within 1e-5 relative (measured at 1 rank / ZeRO-3: losses 8.3e-8 / 6.7e-8, gradient
norms 3.2e-6 / 2.6e-6, weights 4.6e-7 / 4.2e-7); the layer scalars never move. Against transformers' eager loop the
gradient norms are 1.1e-5 / 8.9e-6 off: fp32's rounding in two attention kernels, which the sharp softmax of unscaled
scores amplifies (transformers' eager and SDPA loops are 1.2e-5 apart themselves, 1.5e-5 and 1.1e-5 from an fp64
loop; in fp64 throughout, norms and softmax included, zerotrain's loop and transformers' agree within 1.2e-14).
At ZeRO-3 and ZeRO-2 with buckets small enough to hold the per-layer inputs' parameters alone, the runs equal the
default buckets' run (their reduction waits for every block's gradient); those parameters registered after the
blocks, reduced with the last block, is caught. The trained model exports with --format hf to Gemma4ForCausalLM
computing the run's logits, config.json both ways. What zerotrain does not have for Gemma 4 (bidirectional attention,
another rotary) is refused in one line. The MoE block: test_gemma4_moe.py; --tp: test_gemma4_tp.py.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from gemma4_jobs import per_layer_inputs_after_the_blocks_job
from test_gemma import one_thread
from test_qwen35 import STEPS, ZERO3, config_for, gaps, one_folder_runs

import zerotrain
from zerotrain.config import ModelConfig
from zerotrain.hub import mapping
from zerotrain.hub.export import export_model
from zerotrain.model import gemma4
from zerotrain.model.kv_cache import KVCache
from zerotrain.runtime.launch import JobFailed, run_job

pytestmark = pytest.mark.timeout(600)

VOCAB, SEQ, WINDOW = 300, 24, 8
IDS = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(3))
EXACT, CAUGHT = 1e-4, 1e-2
RECORDS = (9, 17, 12)  # one row of 38: each longer than the window but the first
LIMIT = 300  # seconds: a deadlocked job fails the test instead of hanging CI
LOCAL_THETA, GLOBAL_THETA, PARTIAL = 100.0, 10000.0, 0.5


# the MoE block's sizes (test_gemma4_moe.py): 4 experts of width 32, top-2, on every layer
MOE_BLOCK = dict(enable_moe_block=True, num_experts=4, top_k_experts=2, moe_intermediate_size=32)


def hf_config(initializer_range: float = 0.1, moe: bool = False, global_kv_heads: int = 1
              ) -> transformers.Gemma4TextConfig:
    return transformers.Gemma4TextConfig(
        **(MOE_BLOCK if moe else {}), vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, global_head_dim=32,
        num_global_key_value_heads=global_kv_heads, attention_k_eq_v=True,
        layer_types=["sliding_attention", "full_attention"] * 3, sliding_window=WINDOW, num_kv_shared_layers=2,
        hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, use_double_wide_mlp=True,
        max_position_embeddings=128, final_logit_softcapping=5.0, initializer_range=initializer_range,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": LOCAL_THETA},
                         "full_attention": {"rope_type": "proportional", "partial_rotary_factor": PARTIAL,
                                            "rope_theta": GLOBAL_THETA}})


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def hf_model(folder, initializer_range: float = 0.1, qk_gain: float = 1.0, moe: bool = False,
             global_kv_heads: int = 1):
    """A tiny random Gemma 4 saved by transformers in `folder`; the model in eval mode, eager attention. `qk_gain`:
    the q and k norms' gains about it; `moe`: with the MoE block (MOE_BLOCK)."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(hf_config(initializer_range, moe, global_kv_heads),
                                                          attn_implementation="eager")
    with torch.no_grad():  # the RMSNorms, the router's scales and the layer scalars start at 1: moved off it
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(("router.scale", "per_expert_scale")):
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.mul_(qk_gain)
        for name, b in model.named_buffers():
            if name.endswith("layer_scalar"):
                b.copy_(torch.rand_like(b) + 0.3)
    model.save_pretrained(str(folder))
    return model.eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("gemma4")
    with one_thread():
        return root / "gemma4", hf_model(root / "gemma4")


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
        return out if isinstance(out, torch.Tensor) else out.logits


def test_load_model_computes_the_logits_transformers_does(folder):
    path, hf = folder
    model = zerotrain.load_model(str(path))
    cfg = model.cfg
    assert [cfg.global_layer(i) for i in range(6)] == [False, True] * 3
    assert [cfg.kv_source(i) for i in range(6)] == [0, 1, 2, 3, 2, 3]
    assert [cfg.attention_shape(i) for i in range(2)] == [(2, 16), (1, 32)]
    assert (cfg.arch, cfg.per_layer_width, cfg.partial_rotary, cfg.final_softcap) == ("gemma4", 8, PARTIAL, 5.0)
    assert {float(b.layer_scalar) for b in model.model.layers} != {1.0}
    assert (logits(model) - logits(hf)).abs().max() < EXACT


_kv_source, _rotary_tables = ModelConfig.kv_source, gemma4.rotary_tables


def first_of_its_kind(cfg, layer):
    """kv_source with the shared-KV layers reading the first layer of their kind, not the last before them."""
    source = _kv_source(cfg, layer)
    return source if source == layer else min(i for i in range(layer) if cfg.sliding(i) == cfg.sliding(layer))


PLANTED = {
    "the per-layer input embedding left out": (gemma4.Gemma4, "per_layer_inputs", lambda self, idx, x: None),
    "the shared-KV layers reading the wrong layer": (ModelConfig, "kv_source", first_of_its_kind),
    "the global layers' rotary on the sliding layers": (
        gemma4, "rotary_tables", lambda positions, width, theta, scaling=None: _rotary_tables(
            positions, width, GLOBAL_THETA, gemma4.ProportionalRotary(int(PARTIAL * width // 2)))),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_changes_the_logits(folder, monkeypatch, bug):
    path, hf = folder
    monkeypatch.setattr(*PLANTED[bug])
    assert (logits(zerotrain.load_model(str(path))) - logits(hf)).abs().max() > CAUGHT


def packed_vs_alone(model) -> float:
    """The largest gap between a row packing RECORDS' ids and each record alone, over every logit."""
    g = torch.Generator().manual_seed(5)
    records = [torch.randint(0, VOCAB, (1, n), generator=g) for n in RECORDS]
    segments = torch.cat([torch.full((1, n), i) for i, n in enumerate(RECORDS)], dim=1)
    with torch.no_grad():
        packed = model(torch.cat(records, dim=1), segments=segments)
        alone = torch.cat([model(ids) for ids in records], dim=1)
    return (packed - alone).abs().max().item()


def test_packed_records_equal_each_record_alone(folder):
    """In fp64 (fp32's gap, 5.2e-5, is the masked kernel's rounding against the causal one's, which the unscaled
    scores' sharp softmax amplifies; fp64's is 8.9e-16)."""
    assert packed_vs_alone(zerotrain.load_model(str(folder[0])).double()) < 1e-9


def test_a_packed_record_seeing_the_one_before_it_is_caught(folder, monkeypatch):
    layer_mask = gemma4.layer_mask
    monkeypatch.setattr(gemma4, "layer_mask", lambda cfg, idx, dtype, cache, segments, window: layer_mask(
        cfg, idx, dtype, cache, None if segments is None else torch.zeros_like(segments), window))
    assert packed_vs_alone(zerotrain.load_model(str(folder[0])).double()) > CAUGHT


def cached_logits(model, ids) -> torch.Tensor:
    """The prompt's 13 tokens (past the window) through the cache, then one token at a time."""
    cache = KVCache(model.cfg, ids.shape[0], dtype=model.embedding.weight.dtype)
    with torch.no_grad():
        steps = [model(ids[:, :13], cache=cache)] + [model(ids[:, t:t + 1], cache=cache) for t in range(13, SEQ)]
    return torch.cat(steps, dim=1)


def test_decoding_through_the_cache_equals_the_full_forward(folder, monkeypatch):
    """Every layer attends with its source's keys and values of every position so far, the shared-KV layers with the
    cache of the layer they share (in fp64, as the packed records': fp32's gap is 8.0e-5). The cache's earlier
    positions lost (zeros) is caught."""
    model = zerotrain.load_model(str(folder[0])).double()
    assert (cached_logits(model, IDS) - logits(model)).abs().max() < 1e-9
    append = KVCache.append

    def earlier_positions_lost(self, layer, k, v):
        keys, values = append(self, layer, k, v)
        earlier = keys.shape[2] - k.shape[2]
        return (torch.cat((torch.zeros_like(keys[:, :, :earlier]), k), dim=2),
                torch.cat((torch.zeros_like(values[:, :, :earlier]), v), dim=2))

    monkeypatch.setattr(KVCache, "append", earlier_positions_lost)
    assert (cached_logits(model, IDS) - logits(model)).abs().max() > CAUGHT


def test_sample_runs_on_the_cache_as_it_does_without(folder):
    from zerotrain.model.generate import generate

    model = zerotrain.load_model(str(folder[0]))
    prompt = IDS[:1, :10]
    with_cache, without = (generate(model, prompt, 12, temperature=0.0,
                                    kv_cache=cached) for cached in (True, False))
    assert torch.equal(with_cache, without)


@pytest.fixture(scope="module")
def training_folder(tmp_path_factory):
    """At transformers' own initialisation scale (0.02), as test_qwen35's training models, the q and k norms' gains
    about 0.3: the scores are not scaled by 1 / sqrt(head width), and unit-RMS heads would make each softmax nearly
    one-hot, where fp32's rounding decides which key wins (with gains about 1, transformers' own fp32 and fp64 loops
    part by 1e-4 in the loss at step 1 and 1e-2 by step 7, gradient norms of 55-115 clipped to 1; at 0.3 the three
    loops agree within 1e-6 and the norms are 2-6)."""
    root = tmp_path_factory.mktemp("gemma4-training")
    with one_thread():
        return root / "gemma4", hf_model(root / "gemma4", 0.02, qk_gain=0.3)


# The guard's trend tests off (a window below 5), as test_llama4's: the tiny model's loss on synthetic data may rise
# back near ln(300), which the ruin test refuses; transformers' loop takes the same steps.
UNGUARDED = ("--spike-window", "4")


# Buckets of about 26 values: the per-layer inputs' norm (8 values) and each of several blocks' norms in buckets of
# their own. ZeRO-2 and ZeRO-3 reduce each bucket as its gradients are complete, in backward.
TINY_BUCKETS = ("--bucket-mb", "0.0001")
IN_BUCKETS = {"zero3 tiny buckets": ("--zero", "3", "--micro-batch", "1", *TINY_BUCKETS),
              "zero2 tiny buckets": ("--zero", "2", "--micro-batch", "1", *TINY_BUCKETS)}


@pytest.fixture(scope="module")
def runs(training_folder, tmp_path_factory):
    """{"1 rank" | "zero3" | "zero3 tiny buckets" | "zero2 tiny buckets" | "transformers": {"loss", "grad_norm",
    "weights"}, "folder": the 1-rank run's}."""
    path = training_folder[0]
    out = one_folder_runs(path, tmp_path_factory.mktemp("gemma4-runs"), ZERO3 | IN_BUCKETS, LIMIT, *UNGUARDED,
                          attention="sdpa")
    out["file bytes"] = (path / "model.safetensors").stat().st_size
    return out


@pytest.mark.parametrize("run", ["1 rank", "zero3"])
def test_eight_steps_train_as_transformers_and_adamw_do(runs, run):
    theirs, ours = runs["transformers"], runs[run]
    assert len(ours["loss"]) == STEPS
    gap = gaps(ours, theirs)
    # measured: gradient norms 3.2e-6 (1 rank) and 2.6e-6 (ZeRO-3), losses 8.3e-8, weights 4.6e-7 (module docstring)
    assert gap["loss"] <= 1e-5 and gap["grad_norm"] <= 1e-5 and gap["weights"] <= 1e-5, gap
    assert max(theirs["loss"]) != min(theirs["loss"])  # it trained
    scalars = {n: w for n, w in ours["weights"].items() if n.endswith("layer_scalar")}
    assert scalars and all(torch.equal(w, theirs["weights"][n]) for n, w in scalars.items())  # never trained


@pytest.mark.parametrize("run", list(IN_BUCKETS))
def test_tiny_buckets_train_as_the_default_buckets_do(runs, run):
    """Every block reads the per-layer inputs, so their parameters' gradients are complete only as the backward ends:
    in buckets of their own they are reduced last, with the embedding's (gemma4.beside_the_embedding). The losses and
    final weights equal the default buckets' run's, the gradient norms within 1e-8 relative (measured 2.7e-9: the
    norm's partial sums, by bucket); so they take the 1-rank run's as the default buckets' run does."""
    ours, default = runs[run], runs["zero3"]
    assert len(ours["loss"]) == STEPS and ours["loss"] == default["loss"]
    assert all(torch.equal(w, default["weights"][n]) for n, w in ours["weights"].items())
    assert gaps(ours, default)["grad_norm"] <= 1e-8
    alone = gaps(ours, runs["1 rank"])
    assert alone["loss"] <= 1e-5 and alone["grad_norm"] <= 1e-5 and alone["weights"] <= 1e-5, alone


def test_per_layer_inputs_reduced_before_their_gradients_are_complete_are_caught(training_folder, tmp_path):
    """Planted: the per-layer inputs' modules registered after the blocks, as they were: ZeRO-3 reduced their bucket
    with the last block's, before the other blocks' gradients reached them, and the run stops in one line."""
    cfg = config_for(training_folder[0], tmp_path / "run", *UNGUARDED, "--nproc", "2", "--steps", "1",
                     *IN_BUCKETS["zero3 tiny buckets"])
    with one_thread(), pytest.raises(JobFailed, match="the gradient of model.per_layer_.* arrived after its bucket"):
        run_job(per_layer_inputs_after_the_blocks_job, cfg, time_limit=LIMIT)


def test_init_from_at_zero3_reads_each_ranks_slice_of_the_folder(runs):
    """Each of the 2 ranks reads its share of the folder's tensors (the per-layer input table's rows among them), not
    the whole file."""
    reads = runs["zero3"]["read"]
    assert len(reads) == 2 and all(0 < r < 0.75 * runs["file bytes"] for r in reads), (reads, runs["file bytes"])


def test_a_trained_export_is_loaded_by_transformers_as_gemma4_with_the_same_logits(training_folder, runs, tmp_path):
    trained = zerotrain.load_model(str(runs["folder"]))
    ours = logits(trained)
    assert (ours - logits(training_folder[1])).abs().max() > 1e-3  # it moved from where it started
    out = tmp_path / "hf"
    export_model(trained, str(out), "hf", tokenizer_folder=None, eot_id=None)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out), attn_implementation="eager").eval()
    assert type(loaded).__name__ == "Gemma4ForCausalLM"
    assert (logits(loaded) - ours).abs().max() < EXACT
    config = json.loads((out / "config.json").read_text())
    cfg = trained.cfg  # its context is the file's max_position_embeddings, which reads back as the window
    assert mapping.model_config_from_hf(config, "config.json") == dataclasses.replace(cfg, seq_len=cfg.positions,
                                                                                      context=0)


# google/gemma-4-12B's text model as transformers builds it from the config.json zerotrain writes: its parameters
# and the 48 layer scalars (buffers there, parameters here)
GEMMA4_12B = 11_907_350_320


def test_the_12b_preset_is_the_model_transformers_builds_from_its_config():
    from zerotrain.config import PRESETS
    from zerotrain.model import param_count

    cfg = ModelConfig(**PRESETS["gemma4-12b"])
    config = mapping.hf_config(cfg, None)
    with torch.device("meta"):
        theirs = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.for_model(**config))
    scalars = sum(b.numel() for n, b in theirs.named_buffers() if n.endswith("layer_scalar"))
    assert param_count(cfg) == sum(p.numel() for p in theirs.parameters()) + scalars == GEMMA4_12B
    assert [i for i in range(cfg.n_layer) if cfg.global_layer(i)] == list(range(5, 48, 6))
    assert mapping.model_config_from_hf(config, "gemma4-12b") == dataclasses.replace(cfg, seq_len=cfg.positions,
                                                                                      context=0)


@pytest.mark.parametrize("field, value, said", [
    ("use_bidirectional_attention", "all", "use_bidirectional_attention = 'all'"),
    ("hidden_activation", "gelu", "hidden_activation = 'gelu'"),
    ("rope_parameters", {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                         "full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}},
     "rope_parameters full_attention has rope_type 'yarn'"),
    ("layer_types", ["sliding_attention", "full_attention", "full_attention"] * 2, "layer_types"),
    ("vocab_size_per_layer_input", 200, "vocab_size_per_layer_input 200 differs"),
    ("per_layer_config", {"1": {"head_dim": 32}}, "per_layer_config .* does not give every global layer"),
])
def test_a_config_zerotrain_does_not_compute_is_refused_naming_the_field(field, value, said):
    from zerotrain.errors import CheckpointError

    config = hf_config().to_dict()
    config[field] = value
    with pytest.raises(CheckpointError, match="^config.json: .*" + said.replace("(", r"\(")):
        mapping.model_config_from_hf(config, "config.json")


def test_the_published_global_head_dim_reads_as_transformers_per_layer_config_does():
    """The released configs give the global layers' shape as global_head_dim and num_global_key_value_heads;
    transformers 5 writes per_layer_config: both read the same."""
    config = hf_config().to_dict()
    published = {k: v for k, v in config.items() if k != "per_layer_config"}
    published.update(global_head_dim=32, num_global_key_value_heads=1)
    ours = mapping.model_config_from_hf(published, "config.json")
    assert ours == mapping.model_config_from_hf(config, "config.json")
    assert (ours.global_head_width, ours.global_kv_heads) == (32, 1)
