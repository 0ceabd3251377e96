"""gpt-oss's attention and positions in the Llama family's decoder, against transformers' own code as the oracle:
attention sinks, YaRN rope, sliding and full layers alternating, biases on q, k, v and o.

Each layer of zerotrain's LlamaAttention (with gpt-oss's options) computes what transformers' GptOssAttention
(eager attention: transformers' gpt-oss has no SDPA path) computes from the same weights, rotated by
GptOssRotaryEmbedding's YaRN tables: within 1e-5, on the explicit-scores path CPU runs and on FlexAttention's
(CUDA's; its reference implementation here), packed records each as if alone, and through the KV cache. YaRN's
frequencies and magnitude equal transformers' _compute_yarn_parameters, and a Qwen3 folder with rope_type yarn gives
transformers' logits. Each piece left out (the sinks, the sinks' renormalization on FlexAttention, YaRN's magnitude,
its ramp, the window, the output bias), planted in the function zerotrain runs, is caught by the same comparison.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from model_folders import family_folder
from torch.nn.attention.flex_attention import flex_attention
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.models.gpt_oss import modeling_gpt_oss

import zerotrain
from zerotrain.config import ModelConfig
from zerotrain.hub import mapping
from zerotrain.model import attention as attention_module
from zerotrain.model import positions as positions_module
from zerotrain.model import rotary as rotary_module
from zerotrain.model import tensor_parallel
from zerotrain.model import llama as llama_module
from zerotrain.model.kv_cache import KVCache

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(autouse=True)
def _one_thread():
    """torch on one thread: the tiny models' ops gain nothing from a second on busy cores (test_gemma's reason)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)

SEQ, WINDOW, EXACT, CAUGHT = 24, 6, 1e-5, 1e-3
# YaRN's ramp made to span the tiny heads' dimensions (rope_theta 500, an original context of 256: dimensions 0.3 to
# 4.8 of 8 blended), with gpt-oss's truncate false, so that each of its parts moves the output.
YARN = {"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
        "original_max_position_embeddings": 256, "rope_theta": 500.0}


def hf_config(**changes) -> transformers.GptOssConfig:
    config = transformers.GptOssConfig(**{
        "vocab_size": 100, "hidden_size": 64, "intermediate_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "sliding_window": WINDOW, "max_position_embeddings": SEQ,
        "num_local_experts": 4, "num_experts_per_tok": 2, "rope_parameters": dict(YARN), "initializer_range": 0.2,
        **changes})
    config._attn_implementation = "eager"
    return config


def our_config(**changes) -> ModelConfig:
    """The same attention in zerotrain's settings (what hub/mapping.py reads from the folder once gpt_oss is a
    family: test_gpt_oss_family)."""
    return ModelConfig(**{
        "arch": "gpt_oss", "n_layer": 2, "n_head": 4, "n_kv_head": 2, "n_embd": 64, "head_width": 16,
        "intermediate_size": 32, "seq_len": SEQ, "vocab_size": 100, "rope_theta": 500.0, "rope_scaling": "yarn",
        "rope_factor": 8.0, "rope_original_context": 256, "rope_truncate": False, "sliding_window": WINDOW,
        "sliding_window_pattern": 2, "norm_eps": 1e-5, "tie_embeddings": False, **changes})


@pytest.fixture(scope="module")
def pair():
    """(transformers' attention of each layer, zerotrain's with the same weights): layer 0 slides, layer 1 is full."""
    torch.manual_seed(0)
    config, cfg = hf_config(), our_config()
    theirs = [modeling_gpt_oss.GptOssAttention(config, layer).eval() for layer in range(2)]
    for attention in theirs:
        with torch.no_grad():
            for p in attention.parameters():  # biases and sinks well away from 0, as trained ones are
                p.normal_(0.0, 0.1 if p.dim() == 2 else 0.5)
    return config, theirs, cfg, built(cfg, theirs)


def built(cfg, theirs, strict: bool = True) -> list:
    """zerotrain's attention of each layer, with transformers' weights (the same names)."""
    ours = []
    for layer, attention in enumerate(theirs):
        mine = llama_module.LlamaAttention(cfg, layer)
        mine.load_state_dict(attention.state_dict(), strict=strict)
        ours.append(mine.eval())
    return ours


X = torch.randn(2, SEQ, 64, generator=torch.Generator().manual_seed(1))


def transformers_output(config, attention, x=X) -> torch.Tensor:
    positions = torch.arange(x.shape[1])[None]
    cos, sin = modeling_gpt_oss.GptOssRotaryEmbedding(config)(x, positions)
    make = create_sliding_window_causal_mask if attention.sliding_window else create_causal_mask
    mask = make(config=config, inputs_embeds=x, attention_mask=None, cache=None, position_ids=positions)
    with torch.no_grad():
        return attention(x, (cos, sin), mask)[0]


def our_output(cfg, attention, layer: int, x=X, segments=None) -> torch.Tensor:
    """zerotrain's attention as Llama.hidden runs it: its rotary tables and the layer's mask from llama.layer_mask."""
    idx = torch.zeros(x.shape[:2], dtype=torch.long)
    positions = positions_module.new_positions(idx, None, cfg.positions, segments)
    rotary = rotary_module.rotary_tables(positions, cfg.head_dim, cfg.rope_theta, llama_module.rope_scaling(cfg))
    window = cfg.sliding_window if cfg.sliding(layer) else 0
    mask = llama_module.layer_mask(cfg, idx, x.dtype, None, segments, window)
    with torch.no_grad():
        return attention(x, rotary, None, layer, mask)


def gap(pair, layer: int) -> float:
    config, theirs, cfg, ours = pair
    return (our_output(cfg, ours[layer], layer) - transformers_output(config, theirs[layer])).abs().max().item()


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_each_layer_computes_what_transformers_gpt_oss_attention_does(pair, layer):
    config, theirs, cfg, ours = pair
    assert (theirs[layer].sliding_window is not None) == cfg.sliding(layer) == (layer == 0)
    assert gap(pair, layer) < EXACT


def no_sinks(mp):
    real = attention_module.softcapped_attention
    mp.setattr(attention_module, "softcapped_attention",
               lambda q, k, v, mask, scale, cap, sinks=None: real(q, k, v, mask, scale, cap))


PLANTED = {  # the bug, planted in the function zerotrain runs
    "sinks left out": no_sinks,
    "yarn magnitude left out": lambda mp: mp.setattr(rotary_module.YarnScaling, "magnitude",
                                                     property(lambda self: 1.0)),
    "yarn ramp left out (every frequency slowed)": lambda mp: mp.setattr(
        rotary_module.YarnScaling, "rescale", lambda self, inv_freq: inv_freq / self.factor),
    "window ignored": lambda mp: mp.setattr(llama_module, "window_attention", lambda *a: None),
    "output bias left out": lambda mp: mp.setattr(ModelConfig, "o_bias", property(lambda self: False)),
    "q, k, v biases left out": lambda mp: mp.setattr(ModelConfig, "qkv_bias", property(lambda self: False)),
}


@pytest.mark.parametrize("bug", list(PLANTED))
def test_a_planted_bug_in_each_piece_is_caught(pair, monkeypatch, bug):
    config, theirs, cfg, _ = pair
    PLANTED[bug](monkeypatch)
    ours = built(cfg, theirs, strict=False)  # a model built without a bias leaves the stored one unread
    assert max(gap((config, theirs, cfg, ours), layer) for layer in (0, 1)) > CAUGHT


def as_flex(mp):
    """CUDA's kernel choice, FlexAttention (uncompiled: its reference implementation, which CPU has)."""
    mp.setattr(attention_module, "document_kernel", lambda device_type, head_dim: "flex")
    mp.setattr(attention_module, "compiled_flex_attention", lambda: flex_attention)


def test_flex_attention_renormalizes_by_its_log_sum_exp_and_without_it_is_caught(pair, monkeypatch):
    """CUDA's kernel: FlexAttention over the full layer's causal block mask and the sliding layer's window, its
    output renormalized by the sinks through the log-sum-exp it returns (attention.with_sinks)."""
    as_flex(monkeypatch)
    assert max(gap(pair, 0), gap(pair, 1)) < EXACT
    monkeypatch.setattr(attention_module, "with_sinks", lambda out, lse, sinks: out)  # planted: not renormalized
    assert gap(pair, 1) > CAUGHT


def test_the_renormalization_has_the_explicit_sink_columns_gradients():
    """FlexAttention differentiates its log-sum-exp (it has no backward on CPU: the log-sum-exp is computed here from
    the scores): with_sinks gives q, k, v and the sinks the gradients of the explicit scores with a sink column."""
    g = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(2, n, 8, 16, generator=g, requires_grad=True) for n in (4, 2, 2))
    sinks = torch.randn(4, generator=g, requires_grad=True)
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    weights = torch.randn(2, 4, 8, 16, generator=g)

    def grads(attend):
        for t in (q, k, v, sinks):
            t.grad = None
        (attend() * weights).sum().backward()
        return [t.grad.clone() for t in (q, k, v, sinks)]

    def renormalized():
        scores = (q @ attention_module.repeat_kv(k, 2).transpose(2, 3) * 16**-0.5).masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ attention_module.repeat_kv(v, 2)
        return attention_module.with_sinks(out, torch.logsumexp(scores, dim=-1), sinks)

    explicit = grads(lambda: attention_module.softcapped_attention(q, k, v, mask, None, 0.0, sinks=sinks))
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads(renormalized), explicit))
    assert explicit[3].abs().min() > 1e-4  # the sinks learn
    real = attention_module.with_sinks  # planted: the factor detached, the sinks learn nothing
    layers_with_sinks = lambda out, lse, s: real(out, lse.detach(), s.detach())  # noqa: E731
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(attention_module, "with_sinks", layers_with_sinks)
        sinks.grad = None
        (renormalized() * weights).sum().backward()
        assert sinks.grad is None


RECORDS = (10, 14)  # tokens of two records packed in one row: each longer than the window


@pytest.mark.parametrize("kernel", ["mask", "flex"])
def test_packed_records_equal_each_record_alone(pair, monkeypatch, kernel):
    if kernel == "flex":
        as_flex(monkeypatch)
    config, theirs, cfg, ours = pair
    segments = torch.cat([torch.full((n,), i) for i, n in enumerate(RECORDS)]).expand(2, SEQ).contiguous()
    for layer in (0, 1):
        packed = our_output(cfg, ours[layer], layer, segments=segments)
        alone = torch.cat([transformers_output(config, theirs[layer], X[:, a:b])
                           for a, b in ((0, RECORDS[0]), (RECORDS[0], SEQ))], dim=1)
        assert (packed - alone).abs().max() < EXACT


def test_decoding_through_the_kv_cache_keeps_the_sinks_and_the_window(pair, monkeypatch):
    config, theirs, cfg, ours = pair
    rotary = rotary_module.rotary_tables(torch.arange(SEQ), 16, cfg.rope_theta, llama_module.rope_scaling(cfg))

    def cached(layer: int) -> torch.Tensor:
        cache = KVCache(dataclasses.replace(cfg, n_layer=2), X.shape[0])
        steps, at = [], 0
        with torch.no_grad():
            for n in (3,) + (1,) * (SEQ - 3):
                steps.append(ours[layer](X[:, at : at + n], tuple(t[at : at + n] for t in rotary), cache, layer))
                cache.length += n
                at += n
        return torch.cat(steps, dim=1)

    for layer in (0, 1):
        assert (cached(layer) - transformers_output(config, theirs[layer])).abs().max() < EXACT
    no_sinks(monkeypatch)
    assert (cached(1) - transformers_output(config, theirs[1])).abs().max() > CAUGHT


# YaRN: the frequencies and the magnitude, and a Llama-family folder with rope_type yarn.

@pytest.mark.parametrize("rope", [
    {**YARN, "truncate": True},
    YARN,
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,  # gpt-oss's own
     "original_max_position_embeddings": 4096, "rope_theta": 150000.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 10000.0,
     "attention_factor": 0.8},
], ids=["truncated", "untruncated", "gpt-oss-20b", "attention factor"])
def test_yarns_frequencies_and_magnitude_are_transformers(rope):
    config = transformers.Qwen3Config(hidden_size=128, num_attention_heads=2, num_key_value_heads=2, head_dim=64,
                                      max_position_embeddings=4096,
                                      rope_parameters=dict(rope))
    inv_freq, magnitude = ROPE_INIT_FUNCTIONS["yarn"](config)
    cfg = mapping.model_config_from_hf(config.to_dict(), "config.json")  # read as zerotrain reads a folder's
    scaling = llama_module.rope_scaling(cfg)
    cos, sin = rotary_module.rotary_tables(torch.arange(4096), 64, cfg.rope_theta, scaling)
    theirs = torch.arange(4096)[:, None].float() * inv_freq
    assert scaling.magnitude == magnitude
    assert torch.allclose(cos[:, :32], theirs.cos() * magnitude, atol=1e-6, rtol=0)
    assert torch.allclose(sin[:, :32], theirs.sin() * magnitude, atol=1e-6, rtol=0)


def test_a_qwen3_folder_with_yarn_rope_gives_transformers_logits_and_exports_it(tmp_path, monkeypatch):
    """YaRN is a Llama-family option: Qwen3's long-context configs use it."""
    rope = {"rope_type": "yarn", "factor": 8.0, "original_max_position_embeddings": 64, "truncate": False}
    hf = family_folder(tmp_path / "qwen3", "qwen3", rope_scaling=rope)
    ids = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(2))
    model = zerotrain.load_model(str(tmp_path / "qwen3"))
    assert (model.cfg.rope_scaling, model.cfg.rope_factor, model.cfg.rope_truncate) == ("yarn", 8.0, False)
    with torch.no_grad():
        theirs = hf(ids).logits
        assert (model(ids) - theirs).abs().max() < EXACT
        config = mapping.hf_config(model.cfg, None)  # written as read
        assert mapping.model_config_from_hf(config, "config.json") == model.cfg
        monkeypatch.setattr(rotary_module.YarnScaling, "magnitude", property(lambda self: 1.0))  # planted
        assert (model(ids) - theirs).abs().max() > CAUGHT


@pytest.mark.parametrize("rope, said", [
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "mscale": 1.0,
      "mscale_all_dim": 1.0}, "mscale = 1.0"),
    ({"rope_type": "yarn", "original_max_position_embeddings": 32}, "no 'factor'"),
    ({"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "truncate": "no"},
     "truncate must be true or false"),
])
def test_what_zerotrains_yarn_does_not_have_is_refused_naming_it(rope, said):
    config = {**transformers.Qwen3Config(hidden_size=64).to_dict(), "rope_parameters": None, "rope_scaling": rope}
    with pytest.raises(zerotrain.errors.CheckpointError, match=said):
        mapping.model_config_from_hf(config, "config.json")


# The memory plan: the explicit scores with the sinks' column, to the byte (on a Llama given sinks).

@pytest.mark.parametrize("recompute", ["none", "blocks"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_sinks_activation_bytes_are_counted_to_the_byte_and_an_omission_is_caught(monkeypatch, precision,
                                                                                      recompute):
    from test_activation_bytes import measured_bytes, packed_segments, predicted_bytes

    from zerotrain.config import PRESETS
    from zerotrain.model import activation_memory, build_model

    monkeypatch.setattr(ModelConfig, "attn_sinks", property(lambda self: True))
    cfg = dataclasses.replace(ModelConfig(**PRESETS["llama-tiny"]), sliding_window=5)
    for segments in (None, packed_segments(2, 16)):
        measured = measured_bytes(build_model(cfg, seed=0), 2, 16, precision, recompute, segments)
        kw = dict(precision=precision, recompute=recompute, documents=segments is not None)
        assert predicted_bytes(cfg, 2, 16, **kw) == measured
        with monkeypatch.context() as m:  # planted: counted as SDPA's
            m.setattr(activation_memory, "sink_attention", lambda s, eager: activation_memory.attention(s))
            assert (predicted_bytes(cfg, 2, 16, **kw) < measured) == (recompute == "none")


# The family: a tiny GptOssForCausalLM built by transformers (4 experts, top-2, hidden 64, two layers: sliding, full),
# read by load_model and --init-from, trained, exported. transformers' gpt-oss runs eager attention (it declares no
# SDPA); its experts the per-expert loop.

IDS = torch.randint(0, 100, (2, SEQ), generator=torch.Generator().manual_seed(5))


def gpt_oss_folder(folder) -> transformers.GptOssForCausalLM:
    """A tiny random gpt-oss saved by transformers in `folder`; the model in eval mode. Weights drawn at std 0.2
    (biases, sinks and norm gains moved as much), the router's wider so that the choices are not near ties, the
    experts' up to where the SwiGLU clamp at 7 binds for some tokens."""
    torch.manual_seed(0)
    model = transformers.GptOssForCausalLM(hf_config(max_position_embeddings=SEQ, pad_token_id=0, eos_token_id=2))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
            elif "experts" in name:
                p.normal_(0.0, 0.6)
            else:
                p.normal_(0.0, 1.0 if "router" in name else 0.2)
    model.save_pretrained(str(folder))
    return model.eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("gpt_oss") / "hf"
    return path, gpt_oss_folder(path)


def logits(model, ids=IDS) -> torch.Tensor:
    with torch.no_grad():
        out = model(ids)
        return out if isinstance(out, torch.Tensor) else out.logits


def init_from_model(path):
    """The folder's model as --init-from reads it (each expert's slice of the stacked tensors), on one process."""
    from zerotrain.hub import init_from
    from zerotrain.model import build_model

    source = init_from.weight_source(str(path))
    model = build_model(source.model, 0)
    init_from.load_local(model, source, {}, 0)
    return model.eval()


def clamp_binds(hf) -> bool:
    """Whether some token's gate or up projection passes the clamp (so that leaving it out shows)."""
    seen = []
    handle = hf.model.layers[0].mlp.experts.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    logits(hf)
    handle.remove()
    experts = hf.model.layers[0].mlp.experts
    return bool((seen[0] @ experts.gate_up_proj[0] + experts.gate_up_proj_bias[0]).abs().max() > 7.0)


def test_load_model_and_init_from_compute_transformers_logits(folder):
    path, hf = folder
    theirs = logits(hf)
    for model in (zerotrain.load_model(str(path)), init_from_model(path)):
        assert (logits(model) - theirs).abs().max() < EXACT
    cfg = model.cfg
    assert (cfg.arch, cfg.n_experts, cfg.experts_per_token, cfg.expert_ffn, cfg.sliding_window,
            cfg.sliding_window_pattern, cfg.rope_scaling, cfg.rope_truncate) == ("gpt_oss", 4, 2, 32, WINDOW, 2, "yarn",
                                                                                False)
    assert clamp_binds(hf)


def interleaving_lost(mp):
    """Planted: gate_up_proj read as its two halves (gate, then up) rather than alternating columns."""
    from zerotrain.hub import mapping as hub_mapping

    halves = hub_mapping.StackedExperts(
        "mlp.experts.gate_up_proj", ("gate_proj.weight", "up_proj.weight"),
        lambda t: (t[:, : t.shape[1] // 2].t(), t[:, t.shape[1] // 2 :].t()), lambda g, u: torch.cat([g.t(), u.t()], 1))
    gpt_oss = hub_mapping.MAPPINGS["gpt_oss"]
    mp.setitem(hub_mapping.MAPPINGS, "gpt_oss", dataclasses.replace(gpt_oss, experts=(halves, *gpt_oss.experts[1:])))


def top_k_of_the_softmax(model):
    for block in model.model.layers:  # planted: the top-k probabilities of all experts, not a softmax of the top-k
        block.mlp.softmax_of_top_k = False


def no_router_bias(model):
    for block in model.model.layers:
        block.mlp.gate.bias = None


FAMILY_PLANTED = {  # planted in the code path load_model runs: before the load, or on the loaded model
    "gate and up not interleaved": (interleaving_lost, None),
    "SwiGLU unclamped": (lambda mp: mp.setattr("zerotrain.model.moe.clamped_swiglu", lambda gate, up: (up + 1) * (
        gate * torch.sigmoid(gate * 1.702))), None),
    "top-k of the softmax": (None, top_k_of_the_softmax),
    "router bias left out": (None, no_router_bias),
    "sinks left out": (no_sinks, None),
    "yarn magnitude left out": (PLANTED["yarn magnitude left out"], None),
}


@pytest.mark.parametrize("bug", list(FAMILY_PLANTED))
def test_a_planted_bug_in_each_piece_changes_the_logits(folder, monkeypatch, bug):
    path, hf = folder
    before, after = FAMILY_PLANTED[bug]
    if before:
        before(monkeypatch)
    model = zerotrain.load_model(str(path))
    if after:
        after(model)
    assert (logits(model) - logits(hf)).abs().max() > CAUGHT


def test_the_grouped_experts_equal_the_per_expert_loop_with_biases_and_the_clamp(folder):
    from zerotrain.model import moe

    model = zerotrain.load_model(str(folder[0]))
    block = model.model.layers[0].mlp
    x = torch.randn(3, 16, 64, generator=torch.Generator().manual_seed(6))
    outs = {}
    for path in ("loop", "grouped"):
        block.path = path
        outs[path] = block(x)
    assert moe.grouped_mm_works("cpu", torch.float32) and (outs["loop"] - outs["grouped"]).abs().max() < 1e-5


def bf16_routing(route, router, x: torch.Tensor, upstream: torch.Tensor):
    """((weights, chosen), the gradient of x for upstream . weights) of route(x) (zerotrain's) or router(x)
    (transformers': (logits, scores, indices))."""
    x = x.detach().clone().requires_grad_()
    routed = route(x) if route is not None else router(x)[1:]
    (routed[0] * upstream).sum().backward()
    return routed, x.grad


def test_the_bf16_router_weighs_experts_as_transformers_bf16_router_and_an_fp32_upcast_is_caught(folder,
                                                                                                   monkeypatch):
    """transformers' GptOssTopKRouter runs in the model's dtype: the top-k of the bf16 logits, softmaxed in bf16.
    zerotrain's bf16 router gives its weights (dtype included), its choices and the gradient of its input for any
    upstream of the weights, bitwise. Planted in the router zerotrain runs: the logits upcast to fp32 before the top-k
    softmax (as zerotrain did): measured, weights 1.9e-3 apart and the input's gradient 1.2e-2."""
    import copy

    import torch.nn.functional as F

    path, hf = folder
    theirs = copy.deepcopy(hf.model.layers[0].mlp.router).to(torch.bfloat16)
    ours = zerotrain.load_model(str(path)).model.layers[0].mlp.to(torch.bfloat16)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(7)).bfloat16()
    upstream = torch.randn(64, 2, generator=torch.Generator().manual_seed(8)).bfloat16()
    (their_weights, their_chosen), their_grad = bf16_routing(None, theirs, x, upstream)

    def gaps():
        (weights, chosen), grad = bf16_routing(lambda x: ours.route(x, 1, 64), None, x, upstream)
        assert torch.equal(chosen, their_chosen)
        return weights.dtype, (weights.float() - their_weights.float()).abs().max(), (grad - their_grad).abs().max()

    assert gaps() == (torch.bfloat16, 0.0, 0.0)
    gate = ours.gate  # planted: the router's logits in fp32
    monkeypatch.setattr(gate, "forward", lambda x: F.linear(x, gate.weight, gate.bias).float())
    dtype, weights_gap, grad_gap = gaps()
    assert dtype == torch.float32 and weights_gap > 1e-3 and grad_gap > 1e-3, (weights_gap, grad_gap)


def test_three_steps_of_init_from_start_at_transformers_loss_and_export_what_transformers_loads(folder, one_rank,
                                                                                                tmp_path, monkeypatch):
    from zerotrain.cli.flags import config_from_args
    from zerotrain.cli.main import build_parser
    from zerotrain.hub.export import export_model
    from zerotrain.runtime.run_folder import resolve_paths
    from zerotrain.training.loop import train

    from test_moe import first_row, transformers_loss

    path, hf = folder
    args = build_parser().parse_args(["train", "--init-from", str(path), "--data", "synthetic", "--no-progress",
                                      "--seq-len", str(SEQ - 1), "--out", str(tmp_path / "run"), "--micro-batch", "1",
                                      "--lr", "1e-3", "--steps", "3", "--moe-aux-coef", "0.5"])
    cfg = resolve_paths(config_from_args(args))
    result = train(cfg, one_rank, announce=False)
    assert len(result.records) == 3 and result.records[0]["loss"] != result.records[-1]["loss"]
    # step 1's loss, with the balancing term, is transformers' loss with output_router_logits on the same row
    monkeypatch.setattr(hf, "router_aux_loss_coef", 0.5)
    their_loss, their_aux = transformers_loss(hf, *first_row(cfg))
    first = result.records[0]
    assert abs(first["aux_loss"] - their_aux) <= 1e-5 * their_aux and abs(first["loss"] - their_loss) <= 1e-5 * their_loss
    assert 0.5 * their_aux > 100 * 1e-5 * their_loss  # the balancing term is well above the bound
    model = result.engine.model.eval()
    export_model(model, str(tmp_path / "hf"), "hf", tokenizer_folder=None, eot_id=None)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "hf")).eval()
    assert type(loaded).__name__ == "GptOssForCausalLM"
    ours, theirs = logits(model), logits(loaded)
    assert (ours - theirs).abs().max() < EXACT
    assert (theirs - logits(hf)).abs().max() > CAUGHT  # it trained: the export is not the folder's model
    exported = mapping.model_config_from_hf(json.loads((tmp_path / "hf" / "config.json").read_text()), "config.json")
    assert exported == dataclasses.replace(model.cfg, seq_len=model.cfg.positions, context=0)  # its context kept


def test_lora_on_the_biased_experts_exports_merged_what_the_run_computes_and_unmerged_experts_are_caught(
        folder, one_rank, tmp_path, monkeypatch):
    """gpt-oss's experts (biased, stacked and interleaved in its files) with adapters: the merged export computes
    the run's logits in transformers; the experts' adapters left out of load_model's merge (planted) are caught."""
    from test_moe import lora_export_gaps

    merged, planted = lora_export_gaps(folder[0], tmp_path, one_rank, IDS, monkeypatch, "--seq-len", str(SEQ - 1))
    # the fold's float noise on this model's larger weights and logits: measured 6.5e-5 (planted: 3.1)
    assert merged < 2e-4 and planted > CAUGHT, (merged, planted)


# MXFP4: gpt-oss's released folders store the experts' matrices as blocks and scales, read here by dequantizing.

def mxfp4_pair(shape, generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random MXFP4 blocks (E, rows, G, 16) and scales (E, rows, G) near 2^-3 .. 2^0."""
    blocks = torch.randint(0, 256, shape, dtype=torch.uint8, generator=generator)
    return blocks, torch.randint(124, 128, shape[:-1], dtype=torch.uint8, generator=generator)


def test_dequantizing_mxfp4_is_transformers_bitwise_and_a_nibble_order_swap_is_caught(monkeypatch):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = mxfp4_pair((3, 8, 2, 16), torch.Generator().manual_seed(7))
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(mapping.dequantize_mxfp4(blocks, scales), theirs)
    assert torch.equal(mapping.dequantize_mxfp4(blocks[1], scales[1]), theirs[1])  # one expert's slice, as read
    monkeypatch.setattr(mapping, "FP4_VALUES", mapping.FP4_VALUES[8:] + mapping.FP4_VALUES[:8])  # planted: sign bit
    assert not torch.equal(mapping.dequantize_mxfp4(blocks, scales), theirs)


@pytest.fixture(scope="module")
def mxfp4_folder(folder, tmp_path_factory):
    """The tiny gpt-oss with its experts' matrices stored in MXFP4 (as the released folders are, with their
    quantization_config); the transformers model with the dequantized weights (transformers' own dequantization)."""
    from safetensors.torch import save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    path, hf = folder
    out = tmp_path_factory.mktemp("mxfp4")
    g = torch.Generator().manual_seed(8)
    tensors = {n: t.contiguous() for n, t in hf.state_dict().items()}
    with torch.no_grad():
        for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            E, cols, rows = tensors[name].shape  # (E, in, out): the blocks run along the rows' inputs
            blocks, scales = mxfp4_pair((E, rows, cols // 32, 16), g)
            del tensors[name]
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
            hf.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                         "model.layers.*.mlp.router"]}
    (out / "config.json").write_text(json.dumps(config))
    return out, hf


def test_an_mxfp4_folder_is_read_dequantized_by_load_model_and_init_from(mxfp4_folder):
    path, hf = mxfp4_folder
    theirs = logits(hf)
    for model in (zerotrain.load_model(str(path)), init_from_model(path)):
        assert (logits(model) - theirs).abs().max() < EXACT


@pytest.mark.parametrize("change, said", [
    (lambda t: t.update({"model.layers.0.mlp.experts.down_proj_scales": torch.zeros(4, 64, 2, dtype=torch.uint8)}),
     r"down_proj_blocks \[4, 64, 1, 16\] \(U8\) and _scales \[4, 64, 2\] \(U8\) in model.safetensors are not an MXFP4 "
     r"pair"),
    (lambda t: t.update({"model.layers.1.mlp.experts.gate_up_proj_blocks": torch.zeros(4, 32, 2, 16, dtype=torch.uint8),
                         "model.layers.1.mlp.experts.gate_up_proj_scales": torch.zeros(4, 32, 2, dtype=torch.uint8)}),
     r"gate_up_proj_blocks dequantizes to \[4, 64, 32\] in model.safetensors, the model its config describes needs "
     r"\[4, 64, 64\]$"),
])
def test_an_mxfp4_pair_that_does_not_fit_is_refused_in_one_line_naming_it(mxfp4_folder, tmp_path, change, said):
    from safetensors.torch import load_file, save_file

    from zerotrain.errors import ConfigError
    from zerotrain.hub import init_from

    path, _ = mxfp4_folder
    tensors = load_file(str(path / "model.safetensors"))
    change(tensors)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(ConfigError, match=said):
        init_from.weight_source(str(tmp_path))


def test_another_quantization_is_refused_naming_it():
    config = {**hf_config().to_dict(), "quantization_config": {"quant_method": "bitsandbytes", "load_in_4bit": True}}
    with pytest.raises(zerotrain.errors.CheckpointError, match="^config.json: quantization_config has quant_method "
                                                                "'bitsandbytes'; zerotrain reads unquantized"):
        mapping.model_config_from_hf(config, "config.json")
    config["quantization_config"] = {"quant_method": "mxfp4"}
    assert mapping.model_config_from_hf(config, "config.json").arch == "gpt_oss"


def test_a_model_from_scratch_exports_its_unscaled_rope_which_transformers_would_otherwise_take_as_yarn(
        tmp_path, monkeypatch):
    """GptOssConfig without rope_parameters takes YaRN (factor 32): the export of a model without rope scaling
    writes its rope as rope_parameters of type default."""
    from zerotrain.hub.export import export_model
    from zerotrain.model import build_model

    cfg = dataclasses.replace(our_config(rope_scaling="none"), n_experts=4, experts_per_token=2)
    model = build_model(cfg, seed=0).eval()

    def exported_gap(out) -> float:
        export_model(model, str(out), "hf", tokenizer_folder=None, eot_id=None)
        loaded = transformers.AutoModelForCausalLM.from_pretrained(str(out)).eval()
        return (logits(loaded) - logits(model)).abs().max().item()

    assert exported_gap(tmp_path / "hf") < EXACT
    real = mapping._moe_config  # planted: the rope left to GptOssConfig's default
    monkeypatch.setattr(mapping, "_moe_config", lambda cfg: {k: v for k, v in real(cfg).items()
                                                             if k != "rope_parameters"})
    assert exported_gap(tmp_path / "planted") > CAUGHT


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gpt_oss_activation_bytes_are_counted_to_the_byte_and_the_clamps_omission_is_caught(monkeypatch, precision):
    """The sinks' explicit scores, the router's top-k softmax and the clamped SwiGLU's tensors, packed or not."""
    from test_activation_bytes import measured_bytes, packed_segments, predicted_bytes

    from zerotrain.model import activation_memory, build_model

    cfg = dataclasses.replace(our_config(), n_experts=4, experts_per_token=2, sliding_window=5)
    for segments in (None, packed_segments(2, 16)):
        measured = measured_bytes(build_model(cfg, seed=0), 2, 16, precision, "none", segments)
        kw = dict(precision=precision, documents=segments is not None)
        assert predicted_bytes(cfg, 2, 16, **kw) == measured
        with monkeypatch.context() as m:  # planted: counted as a plain SwiGLU's
            m.setattr(activation_memory, "glu_tensors", lambda cfg: 4)
            assert predicted_bytes(cfg, 2, 16, **kw) < measured


class _LocalSums:
    """A TP group's stand-in in one process: all_reduce leaves each rank's partial sum (added up by the test)."""

    def all_reduce(self, t, purpose=None):
        return t


@pytest.mark.parametrize("layer", [0, 1], ids=["sliding", "full"])
def test_tp_ranks_heads_with_their_sinks_sum_to_the_whole_attention_and_a_wrong_slice_is_caught(pair, monkeypatch,
                                                                                                 layer):
    """Under TP 2 each rank attends with its own heads and their sinks (the plan's slice of self_attn.sinks); the
    ranks' partial outputs (before the row-parallel all-reduce, each with the replicated o_proj bias) add up to the
    whole layer's. This checks the attention's slices alone, in one process (test_moe_tp trains gpt-oss at TP 2)."""
    import copy

    config, theirs, cfg, ours = pair
    whole = llama_module.Llama(cfg)  # n_experts 0: a dense MLP, beside the point here
    whole.model.layers[layer].self_attn.load_state_dict(theirs[layer].state_dict())

    def summed() -> torch.Tensor:
        parts = []
        for rank in range(2):
            model = copy.deepcopy(whole)
            llama_module.parallelize(model, 2, rank, _LocalSums())
            parts.append(our_output(cfg, model.model.layers[layer].self_attn, layer))
        return parts[0] + parts[1] - theirs[layer].o_proj.bias.detach()

    assert (summed() - transformers_output(config, theirs[layer])).abs().max() < EXACT
    real = tensor_parallel.TPSlice.take  # planted: every rank takes the first heads' sinks
    monkeypatch.setattr(tensor_parallel.TPSlice, "take", lambda self, full, rank:
                        real(self, full, 0 if full.dim() == 1 and full.shape[0] == 4 else rank))
    assert (summed() - transformers_output(config, theirs[layer])).abs().max() > CAUGHT
