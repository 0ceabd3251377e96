"""model/activation_memory.py's predicted activation bytes equal what autograd saves on CPU, to the byte, and a
planted omission is caught in every configuration: packed records (their document mask) and the KV-head repeat too.

The measurement is training.activations.saved_for_backward over `summed_token_loss(model(x), y)`, as the
training loop runs it; bf16 is the model cast to bf16, as the engine's bf16 parameters make it.
"""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
import torch
from test_checkpoint import spawn

from zerotrain.config import PRESETS, ModelConfig
from zerotrain.model import activation_memory as memory
from zerotrain.model import attention, build_model, parallelize, summed_token_loss
from zerotrain.model.activation_memory import activation_bytes
from zerotrain.model.loss import head_loss
from zerotrain.training.activations import saved_for_backward
from zerotrain.training.preference import sequence_logps

CONFIGS = {"gpt2": ModelConfig(**PRESETS["tiny"]), "llama": ModelConfig(**PRESETS["llama-tiny"])}  # llama: GQA 4/2
SHAPES = [(2, 16), (3, 13)]  # (micro_batch, seq_len): a second, odd shape so B and T enter separately
# The planted omission per --activation-checkpointing: a term of what that configuration keeps (a recomputed block
# saves no attention output, so forgetting it there would be no mistake).
OMITTED = {"none": "attention_output", "blocks": "block_input", "full": "block_input"}


def measured_bytes(model, micro_batch: int, seq_len: int, precision: str, recompute: str,
                   segments: torch.Tensor | None = None, loss=summed_token_loss) -> int:
    if precision == "bf16":
        model.to(torch.bfloat16)
    model.recompute_blocks = recompute in ("blocks", "full")
    ids = torch.randint(0, model.cfg.vocab_size, (micro_batch, seq_len + 1), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1].clone(), ids[:, 1:].clone()  # separate storages, as the data sources make them
    saved, _ = saved_for_backward(lambda: head_loss(model, x, y, loss, recompute == "full", segments),
                                  model.parameters())
    return saved


def packed_segments(micro_batch: int, seq_len: int) -> torch.Tensor:
    """Records of 5 tokens back to back in every row (the last one shorter)."""
    return (torch.arange(seq_len) // 5).expand(micro_batch, seq_len).contiguous()


def predicted_bytes(cfg: ModelConfig, micro_batch: int, seq_len: int, omitted: str | None = None, **kw) -> int:
    """activation_bytes' total; with `omitted`, planted: that term of the formula counts nothing."""
    if omitted is None:
        return activation_bytes(cfg, micro_batch, seq_len, **kw)["total"]
    with mock.patch.object(memory, omitted, lambda s: 0):
        return activation_bytes(cfg, micro_batch, seq_len, **kw)["total"]


@pytest.mark.parametrize("micro_batch,seq_len", SHAPES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "blocks", "full"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_predicted_activation_bytes_equal_what_autograd_saves_and_an_omission_is_caught(arch, recompute, precision,
                                                                                        micro_batch, seq_len):
    cfg = CONFIGS[arch]
    measured = measured_bytes(build_model(cfg, seed=0), micro_batch, seq_len, precision, recompute)
    kw = dict(precision=precision, recompute=recompute)
    assert predicted_bytes(cfg, micro_batch, seq_len, **kw) == measured
    assert predicted_bytes(cfg, micro_batch, seq_len, OMITTED[recompute], **kw) < measured


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "blocks", "full"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_dpo_sequence_logps_saved_bytes_equal_the_plan_and_the_sft_count_or_a_forgotten_lse_is_caught(arch, recompute,
                                                                                                       precision):
    """DPO's head keeps its input, each token's log-sum-exp and the targets (vocab.token_logps), not the summed
    loss's gradients: the plan counts them with objective "dpo" (the SFT count is off for it)."""
    cfg = CONFIGS[arch]
    measured = measured_bytes(build_model(cfg, seed=0), 4, 16, precision, recompute, loss=sequence_logps)
    kw = dict(precision=precision, recompute=recompute, objective="dpo")
    assert predicted_bytes(cfg, 4, 16, **kw) == measured
    assert predicted_bytes(cfg, 4, 16, OMITTED[recompute] if recompute == "full" else "token_logps", **kw) < measured
    if recompute != "full":  # under full recompute neither loss keeps anything beyond the final norm's output
        assert predicted_bytes(cfg, 4, 16, precision=precision, recompute=recompute) != measured


def test_a_narrow_mlp_and_four_blocks_are_counted_to_the_byte():
    cfg = dataclasses.replace(CONFIGS["gpt2"], n_layer=4, intermediate_size=32)  # ffn = width, not 4 x width
    measured = measured_bytes(build_model(cfg, seed=0), 2, 16, "fp32", "none")
    assert predicted_bytes(cfg, 2, 16) == measured
    assert predicted_bytes(cfg, 2, 16, "gelu_mlp") < measured


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "blocks", "full"])
@pytest.mark.parametrize("arch", ["gpt2", "llama"])
def test_packed_records_document_mask_and_positions_are_counted_to_the_byte_and_a_missing_mask_is_caught(
        arch, recompute, precision):
    cfg = CONFIGS[arch]
    measured = measured_bytes(build_model(cfg, seed=0), 2, 16, precision, recompute, packed_segments(2, 16))
    kw = dict(precision=precision, recompute=recompute, documents=True)
    assert predicted_bytes(cfg, 2, 16, **kw) == measured
    assert predicted_bytes(cfg, 2, 16, "document_mask", **kw) < measured
    # The mask (B T T a on CPU) and, for records, positions per row: more than the same batch unpacked.
    assert measured >= predicted_bytes(cfg, 2, 16, precision=precision, recompute=recompute) + 2 * 16 * 16 * 2


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("packed", [False, True])
def test_kv_heads_repeated_for_sdpa_are_counted_to_the_byte_and_counting_them_at_kv_heads_is_caught(
        packed, precision, monkeypatch):
    """The repeat runs on CUDA (fp32, or a mask); selected here on CPU, where it runs the same code."""
    cfg = CONFIGS["llama"]
    monkeypatch.setattr(attention, "repeats_kv_heads", lambda *a, **k: True)
    segments = packed_segments(2, 16) if packed else None
    measured = measured_bytes(build_model(cfg, seed=0), 2, 16, precision, "none", segments)
    kw = dict(precision=precision, documents=packed)
    assert predicted_bytes(cfg, 2, 16, **kw) == measured
    at_kv_heads = lambda s: s.BT * (s.heads + 2 * s.kv_heads) * s.head_dim * s.act  # noqa: E731
    with mock.patch.object(memory, "attention_inputs", at_kv_heads):  # planted: the copies forgotten
        assert activation_bytes(cfg, 2, 16, **kw)["total"] < measured
    # On CUDA in fp32 the plan counts them without being told.
    monkeypatch.undo()
    assert (activation_bytes(cfg, 2, 16, device="cuda")["total"]
            == activation_bytes(cfg, 2, 16)["total"] + cfg.n_layer * 2 * 2 * 16 * (cfg.n_head - cfg.kv_heads)
            * cfg.head_dim * 4)


def tp_bytes_job(rank, comm, tmp_path):
    """Each TP rank's measured bytes for each architecture and precision, at micro-batch 2, seq_len 16.

    Blocks kept whole only: a recomputed block keeps its whole input, which TP does not split (and the first
    checkpoint costs each fresh process seconds of imports).
    """
    out = {}
    for arch, cfg in CONFIGS.items():
        for precision in ("fp32", "bf16"):
            model = build_model(cfg, seed=0)
            parallelize(model, 2, rank, comm)
            out[f"{arch} {precision}"] = measured_bytes(model, 2, 16, precision, "none")
    return out


def test_predicted_activation_bytes_under_tp2_equal_each_ranks_measurement_and_an_omission_is_caught(tmp_path):
    codes, results = spawn(tp_bytes_job, 2, tmp_path, timeout=90)
    assert codes == [0, 0] and all(r is not None and "error" not in r for r in results), results
    for measured in results:
        assert len(measured) == 4
        for case, saved in measured.items():
            arch, precision = case.split()
            assert predicted_bytes(CONFIGS[arch], 2, 16, tp=2, precision=precision) == saved, case
            assert predicted_bytes(CONFIGS[arch], 2, 16, "attention_output", tp=2, precision=precision) < saved
            # Split heads and MLP: less than a whole model's bytes, more than half (norms, head, loss are whole).
            whole = activation_bytes(CONFIGS[arch], 2, 16, precision=precision)["total"]
            assert 0.5 * whole < saved < whole


def test_impossible_settings_are_refused_with_the_value():
    with pytest.raises(ValueError, match="tp 3 does not divide the n_head"):
        activation_bytes(CONFIGS["gpt2"], 2, 16, tp=3)
    with pytest.raises(ValueError, match="'fp16'"):
        activation_bytes(CONFIGS["gpt2"], 2, 16, precision="fp16")


# Qwen3.5's shape of tests/test_qwen35.py: Gated DeltaNet (2 key heads of 8 serving 4 value heads of 12, 4 taps)
# and gated attention layers (every second one), dense or a mixture of experts with a shared expert.
QWEN35 = dict(vocab_size=300, n_embd=64, n_layer=4, n_head=4, n_kv_head=2, head_width=16, full_attention_interval=2,
              linear_conv_kernel=4, linear_key_width=8, linear_value_width=12, linear_key_heads=2,
              linear_value_heads=4, intermediate_size=96, seq_len=150, tie_embeddings=False)
QWEN35_CONFIGS = {"qwen3_5": ModelConfig(arch="qwen3_5", **QWEN35),
                  "qwen3_5_moe": ModelConfig(arch="qwen3_5_moe", n_experts=4, experts_per_token=2, expert_width=32,
                                             shared_expert_width=40, **QWEN35)}
# The planted omissions: a layer kind's own terms (the linear layers' as if they were attention, the attention's
# output gate) counting nothing.
QWEN35_OMITTED = {"linear layers": ("gated_delta_net", lambda s, cfg, documents=False, tp=1: 0),
                  "output gate": ("gated_attention", lambda s: memory.gemma_qk_norms(s) + memory.attention(s))}


class _OneRankOfTwo:
    """A TP group's collectives as one rank sees their shapes: the sums are left as they are (bytes, not values)."""

    def all_reduce(self, tensor, *args, **kwargs):
        return tensor


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", list(QWEN35_CONFIGS))
def test_a_qwen35_tp2_rank_saves_what_the_plan_counts_and_whole_linear_heads_are_caught(family, precision):
    """One TP rank of 2 (its half of the key and value heads, of the attention's heads and the MLP's width), one
    micro-batch of three chunks of the delta rule. Planted: the linear layers counted with every head (TP 1's)."""
    from zerotrain.model import qwen35

    cfg = QWEN35_CONFIGS[family]
    model = build_model(cfg, seed=0)
    qwen35.parallelize(model, 2, 0, _OneRankOfTwo())
    measured = measured_bytes(model, 1, 150, precision, "none")
    assert activation_bytes(cfg, 1, 150, precision=precision, tp=2)["total"] == measured
    real = memory.gated_delta_net
    with mock.patch.object(memory, "gated_delta_net", lambda s, cfg, documents=False, tp=1: real(s, cfg, documents)):
        assert activation_bytes(cfg, 1, 150, precision=precision, tp=2)["total"] > measured


@pytest.mark.parametrize("omitted", list(QWEN35_OMITTED))
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("micro_batch,seq_len", [(2, 16), (1, 150)])  # one chunk of the delta rule, and three
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "blocks"])
@pytest.mark.parametrize("family", list(QWEN35_CONFIGS))
def test_qwen35_linear_and_gated_attention_layers_are_counted_to_the_byte_and_an_omission_is_caught(
        family, recompute, precision, micro_batch, seq_len, packed, omitted):
    cfg = QWEN35_CONFIGS[family]
    segments = (torch.arange(seq_len) // 7).expand(micro_batch, seq_len).contiguous() if packed else None
    measured = measured_bytes(build_model(cfg, seed=0), micro_batch, seq_len, precision, recompute, segments)
    kw = dict(precision=precision, recompute=recompute, documents=packed)
    assert activation_bytes(cfg, micro_batch, seq_len, **kw)["total"] == measured
    if recompute == "none":  # a recomputed block keeps its input alone, whatever its layers
        with mock.patch.object(memory, *QWEN35_OMITTED[omitted]):
            assert activation_bytes(cfg, micro_batch, seq_len, **kw)["total"] < measured


def hf_config_of(config) -> ModelConfig:
    """zerotrain's ModelConfig of a transformers config, as --init-from reads its config.json."""
    from zerotrain.hub import mapping

    return mapping.model_config_from_hf(config.to_dict(), "config.json")


def latent_configs() -> dict[str, ModelConfig]:
    """tests/test_deepseek.py's and test_mistral4.py's tiny models: a dense layer and two MoE layers, values (12)
    narrower than q and k (24), with a query rank and without; Mistral 4's softmax router and query scale."""
    import transformers
    from test_deepseek import SIZES as DEEPSEEK_SIZES
    from test_mistral4 import SIZES as MISTRAL4_SIZES

    return {"deepseek_v3": hf_config_of(transformers.DeepseekV3Config(**DEEPSEEK_SIZES)),
            "deepseek_v3 q_proj": hf_config_of(transformers.DeepseekV3Config(**{**DEEPSEEK_SIZES,
                                                                                "q_lora_rank": None})),
            "mistral4": hf_config_of(transformers.Mistral4Config(**MISTRAL4_SIZES))}


def _kv_latent_output_forgotten(s, cfg, device, tp=1):
    """Planted: the KV latent norm's output (kv_b_proj's input, BT r a) left out."""
    return REAL_LATENT_ATTENTION(s, cfg, device, tp) - s.BT * cfg.kv_lora_rank * s.act


def _query_scale_cast_forgotten(s, cfg, device, tp=1):
    """Planted: Mistral 4's per-layer bf16 cast of its query scale left out (in fp32 its one storage, left out)."""
    return REAL_LATENT_ATTENTION(s, cfg, device, tp) - (s.position_rows * s.T * s.act if s.act != 4 else 0)


REAL_LATENT_ATTENTION = memory.latent_attention
LATENT_OMITTED = {
    "KV latent's norm output": ("latent_attention", _kv_latent_output_forgotten),
    "math kernel taken as fused": ("math_attention", lambda cfg, device: False),
    "group-limited router": ("group_limited_router", lambda s, cfg: 0),
}


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("micro_batch,seq_len", SHAPES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "blocks", "full"])
@pytest.mark.parametrize("family", ["deepseek_v3", "deepseek_v3 q_proj", "mistral4"])
def test_latent_attention_layers_are_counted_to_the_byte_and_a_forgotten_latent_norm_or_router_is_caught(
        family, recompute, precision, micro_batch, seq_len, packed):
    """DeepSeek-V3's and Mistral 4's blocks (latent attention, the dense first layer, group-routed experts with
    shared experts, Mistral 4's query scale): the plan equals what autograd saves. Planted in the plan's own terms:
    the KV latent's norm output forgotten, the CPU math kernel's fp32 q, k, v and probabilities counted as the fused
    kernels' list, the router's tensors forgotten; with Mistral 4's query scale's cast forgotten too in bf16."""
    cfg = latent_configs()[family]
    segments = packed_segments(micro_batch, seq_len) if packed else None
    measured = measured_bytes(build_model(cfg, seed=0), micro_batch, seq_len, precision, recompute, segments)
    kw = dict(precision=precision, recompute=recompute, documents=packed)
    assert activation_bytes(cfg, micro_batch, seq_len, **kw)["total"] == measured
    if recompute != "none":  # a recomputed block keeps its input alone, whatever its layers
        return
    planted = dict(LATENT_OMITTED)
    if family == "mistral4" and precision == "bf16":
        planted["query scale's cast"] = ("latent_attention", _query_scale_cast_forgotten)
    for what, (name, bug) in planted.items():
        with mock.patch.object(memory, name, bug):
            assert activation_bytes(cfg, micro_batch, seq_len, **kw)["total"] != measured, what


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("family", ["deepseek_v3", "mistral4"])
def test_a_latent_attention_tp2_rank_saves_what_the_plan_counts_and_unjoined_latents_are_caught(family, precision):
    """One TP rank of 2 (its half of the heads, of the MLPs' and experts' widths): the replicated latents joined for
    the heads (mla.to_heads) are one storage. Planted: counted as at TP 1, each norm's output on its own."""
    from zerotrain.model import deepseek

    cfg = latent_configs()[family]
    model = build_model(cfg, seed=0)
    deepseek.parallelize(model, 2, 0, _OneRankOfTwo())
    measured = measured_bytes(model, 2, 16, precision, "none")
    assert activation_bytes(cfg, 2, 16, precision=precision, tp=2)["total"] == measured
    at_tp1 = lambda s, cfg, device, tp=1: REAL_LATENT_ATTENTION(s, cfg, device)  # noqa: E731
    with mock.patch.object(memory, "latent_attention", at_tp1):
        assert activation_bytes(cfg, 2, 16, precision=precision, tp=2)["total"] != measured


def llama4_config() -> ModelConfig:
    """tests/test_llama4.py's tiny model: six layers (every third without rotary, every second MoE with a shared
    expert), chunks of 16 positions, the q/k L2 norms and the temperature tuning."""
    from test_llama4 import hf_config

    return hf_config_of(hf_config())


REAL_LLAMA4_ATTENTION = memory.llama4_attention


def _l2_norm_input_forgotten(s, cfg, layer):
    """Planted: the L2 norms' fp32 copies of q and k (their inputs) left out."""
    real = REAL_LLAMA4_ATTENTION(s, cfg, layer)
    return real - s.BT * (s.heads + s.kv_heads) * s.head_dim * 4 if cfg.rotary(layer) else real


LLAMA4_OMITTED = {
    "L2 norm's fp32 input": ("llama4_attention", _l2_norm_input_forgotten),
    "temperature": ("llama4_attention", lambda s, cfg, layer: REAL_LLAMA4_ATTENTION(s, cfg, layer)
                    - (0 if cfg.rotary(layer) else s.position_rows * s.T * 4)),
    "chunked mask": ("llama4_masks", lambda s, cfg, recompute: memory.document_mask(s)),
}


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("micro_batch,seq_len", [(2, 16), (3, 13), (1, 40)])  # within a chunk of 16, and across
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "blocks", "full"])
def test_llama4_layers_are_counted_to_the_byte_and_a_forgotten_l2_norm_copy_temperature_or_chunk_mask_is_caught(
        recompute, precision, micro_batch, seq_len, packed):
    """Llama 4's rotary layers (the interleaved rotary's fp32 tables, the L2 norms in fp32, the chunked mask) and
    layers without rotary (the temperature), dense and MoE (the sigmoid scores on the experts' input, the ungated
    shared expert): the plan equals what autograd saves. Planted in the plan's own terms: the L2 norms' fp32 copies,
    the temperature or (packed, or recomputed across chunks) the chunked mask left out."""
    cfg = llama4_config()
    segments = packed_segments(micro_batch, seq_len) if packed else None
    measured = measured_bytes(build_model(cfg, seed=0), micro_batch, seq_len, precision, recompute, segments)
    kw = dict(precision=precision, recompute=recompute, documents=packed)
    assert activation_bytes(cfg, micro_batch, seq_len, **kw)["total"] == measured
    for what, (name, bug) in LLAMA4_OMITTED.items():
        if recompute != "none" and name == "llama4_attention":
            continue  # a recomputed block keeps its input alone, whatever its layers
        if name == "llama4_masks" and not (packed or recompute != "none" and seq_len > cfg.attention_chunk):
            continue  # no chunked mask kept: within one chunk SDPA's causal mask is exact
        with mock.patch.object(memory, name, bug):
            assert activation_bytes(cfg, micro_batch, seq_len, **kw)["total"] != measured, what


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_llama4_tp2_rank_saves_what_the_plan_counts_and_whole_experts_are_caught(precision):
    """One TP rank of 2 (its heads, its share of the MLPs', experts' and shared expert's widths). Planted: the
    experts counted at their whole width (TP 1's)."""
    from zerotrain.model import llama4

    cfg = llama4_config()
    model = build_model(cfg, seed=0)
    llama4.parallelize(model, 2, 0, _OneRankOfTwo())
    measured = measured_bytes(model, 2, 16, precision, "none")
    assert activation_bytes(cfg, 2, 16, precision=precision, tp=2)["total"] == measured
    real = memory.experts
    with mock.patch.object(memory, "experts", lambda s, cfg, tp=1: real(s, cfg)):
        assert activation_bytes(cfg, 2, 16, precision=precision, tp=2)["total"] != measured


def gemma4_config(moe: bool = False, global_kv_heads: int = 1) -> ModelConfig:
    """tests/test_gemma4.py's tiny model: sliding (heads of 16, 2 KV heads) and global layers (heads of 32, one KV
    head, keys as values), the last two sharing earlier layers' KV with a doubled MLP, per-layer inputs of 8, a window
    of 8; `moe`: with the MoE block on every layer (4 experts of width 32, top-2), test_gemma4_moe's."""
    from test_gemma4 import hf_config

    return hf_config_of(hf_config(moe=moe, global_kv_heads=global_kv_heads))


REAL_GEMMA4_BLOCK = memory.gemma4_block
GEMMA4_OMITTED = {
    # the global layers counted at the sliding layers' head width and KV heads
    "global heads' own shape": ("gemma4_block", lambda s, cfg, layer: REAL_GEMMA4_BLOCK(
        s, dataclasses.replace(cfg, global_head_width=cfg.head_dim, global_kv_heads=cfg.kv_heads), layer)),
    # the shared-KV layers counted as computing their own k and v
    "shared KV": ("gemma4_block", lambda s, cfg, layer: REAL_GEMMA4_BLOCK(
        s, dataclasses.replace(cfg, kv_shared_layers=0), layer)),
    "v's norm": ("gemma4_norm", lambda s, rows, width, gain=True: REAL_GEMMA4_NORM(s, rows, width, gain) if gain
                 else 0),
    "per-layer inputs": ("gemma4_embedding", lambda s, cfg, recompute: 0),
}
REAL_GEMMA4_NORM = memory.gemma4_norm
REAL_GEMMA4_MOE = memory.gemma4_moe
GEMMA4_MOE_OMITTED = {
    # the plan before: the MoE families' experts in place of the MLP
    "experts in place of the MLP": ("gemma4_moe", lambda s, cfg, tp=1: memory.experts(s, cfg, tp)
                                    - memory.swiglu_mlp(s)),
    # the experts' input norm and the two output norms forgotten
    "the block's three norms": ("gemma4_moe", lambda s, cfg, tp=1: REAL_GEMMA4_MOE(s, cfg, tp)
                                - 3 * REAL_GEMMA4_NORM(s, s.BT, s.C)),
}


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("micro_batch,seq_len", SHAPES)
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("recompute", ["none", "blocks", "full"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_gemma4_layers_are_counted_to_the_byte_and_global_heads_shared_kv_or_per_layer_inputs_forgotten_are_caught(
        moe, recompute, precision, micro_batch, seq_len, packed):
    """Gemma 4's blocks (q/k/v norms, the global layers' own head shapes and keys as values, the shared KV, the
    doubled MLPs, the per-layer inputs, the post-norms; the MoE block beside the MLP) and its two rotary tables: the
    plan equals what autograd saves. Planted in the plan's own terms: the global layers at the sliding layers' shape,
    the shared-KV layers as if they had their own keys, v's norm left out, the per-layer inputs left out; with the MoE
    block, its layers counted as the MoE families' (experts in place of the MLP: the plan before, 648,192 bytes short
    of 2,330,880 in fp32 at 2 x 16 tokens), or its three norms left out."""
    cfg = gemma4_config(moe)
    segments = packed_segments(micro_batch, seq_len) if packed else None
    measured = measured_bytes(build_model(cfg, seed=0), micro_batch, seq_len, precision, recompute, segments)
    kw = dict(precision=precision, recompute=recompute, documents=packed)
    assert activation_bytes(cfg, micro_batch, seq_len, **kw)["total"] == measured
    for what, (name, bug) in {**GEMMA4_OMITTED, **(GEMMA4_MOE_OMITTED if moe else {})}.items():
        if recompute != "none" and name != "gemma4_embedding":
            continue  # a recomputed block keeps its input alone, whatever its layers
        with mock.patch.object(memory, name, bug):
            assert activation_bytes(cfg, micro_batch, seq_len, **kw)["total"] != measured, what


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe"])
def test_a_gemma4_tp2_rank_saves_what_the_plan_counts_and_whole_kv_heads_are_caught(moe, precision, packed):
    """One TP rank of 2 (test_gemma4_tp's model: two global KV heads, so that --tp 2 divides both kinds'): its half
    of each kind's heads and KV heads, of the MLPs' and the experts' widths; the vocabulary split, so the replicated
    per-layer table keeps the ids beside the rank's own. Planted: each layer's KV heads counted whole (TP 1's, as the
    plan did: 1,215,008 bytes planned against 1,159,968 saved in fp32, dense; the per-layer table's ids were not
    counted either)."""
    from zerotrain.model import gemma4

    cfg = gemma4_config(moe, global_kv_heads=2)
    model = build_model(cfg, seed=0)
    gemma4.parallelize(model, 2, 0, _OneRankOfTwo())
    segments = packed_segments(2, 16) if packed else None
    measured = measured_bytes(model, 2, 16, precision, "none", segments)
    kw = dict(precision=precision, tp=2, documents=packed)
    assert activation_bytes(cfg, 2, 16, **kw)["total"] == measured
    whole_kv_heads = lambda s, cfg, layer: REAL_GEMMA4_BLOCK(  # noqa: E731
        s, dataclasses.replace(cfg, n_head=s.heads), layer)
    with mock.patch.object(memory, "gemma4_block", whole_kv_heads):
        assert activation_bytes(cfg, 2, 16, **kw)["total"] > measured


def ep_configs() -> dict[str, ModelConfig]:
    """A tiny model of each MoE family, each with 4 experts or more, an even number (--ep 2 splits them): the Qwen3-MoE
    preset and, as test_moe.py makes them, Qwen2-MoE (a shared expert, a dense layer), OLMoE and Mixtral; gpt-oss
    (its biased experts, sinks and window) as test_gpt_oss.py's, GLM-4.5 (top-3 of 8) as test_glm45.py's;
    Qwen3.5-MoE, DeepSeek-V3, Mistral 4, Llama 4 and Gemma 4 as the tests above."""
    import transformers
    from test_glm45 import SIZES as GLM45_SIZES
    from test_gpt_oss import our_config as our_gpt_oss_config

    base = ModelConfig(**PRESETS["qwen3-moe-tiny"])
    return {"qwen3_moe": base,
            "qwen2_moe": dataclasses.replace(base, arch="qwen2_moe", norm_topk_prob=False, shared_expert_width=24,
                                             mlp_only_layers="1"),
            "olmoe": dataclasses.replace(base, arch="olmoe", norm_topk_prob=False),
            "mixtral": dataclasses.replace(base, arch="mixtral"),
            "gpt_oss": dataclasses.replace(our_gpt_oss_config(), n_experts=4, experts_per_token=2, sliding_window=5),
            "qwen3_5_moe": QWEN35_CONFIGS["qwen3_5_moe"],
            **{family: cfg for family, cfg in latent_configs().items() if family != "deepseek_v3 q_proj"},
            "glm4_moe": hf_config_of(transformers.Glm4MoeConfig(**GLM45_SIZES)),
            "llama4": llama4_config(), "gemma4": gemma4_config(moe=True)}


def ep_bytes_job(rank, comm, tmp_path, configs):
    """Each EP rank's measured bytes of each model with its block of half the experts, the rows exchanged with the
    other rank (parallel/experts.ExpertExchange), at micro-batch 2, seq_len 16, in each precision."""
    from zerotrain.model.moe import moe_layers
    from zerotrain.parallel.experts import ExpertExchange, keep_expert_block

    out = {}
    for family, cfg in configs.items():
        for precision in ("fp32", "bf16"):
            model = build_model(cfg, seed=0)
            keep_expert_block(model, 2, rank)
            for layer in moe_layers(model):
                layer.exchange = ExpertExchange(comm, layer.n_experts)
            out[f"{family} {precision}"] = measured_bytes(model, 2, 16, precision, "none")
    return out


def test_every_moe_family_at_ep2_saves_the_plans_rows_at_the_mean_rank_and_forgotten_exchange_indices_are_caught(
        tmp_path):
    """The rows an EP rank's experts get depend on the routing (dropless): the plan counts the mean rank's, N k, so
    the two ranks' bytes sum to twice the plan, the exchange's own two int64 indices of the rows received
    (expert_major_order and its inverse, expert_exchange: 2 N k 8 bytes a MoE layer) included. Planted: those
    indices forgotten (the plan before: 1,024 bytes short a MoE layer and rank at 2 x 16 tokens, top-2), and for
    Gemma 4 its experts counted in place of the MLP."""
    configs = ep_configs()
    codes, results = spawn(ep_bytes_job, 2, tmp_path, configs, timeout=180)
    assert codes == [0, 0] and all(r is not None and "error" not in r for r in results), results
    assert len(results[0]) == 2 * len(configs)
    for case in results[0]:
        family, precision = case.split()
        cfg, measured = configs[family], sum(r[case] for r in results)
        assert 2 * activation_bytes(cfg, 2, 16, precision=precision, ep=2)["total"] == measured, case
        with mock.patch.object(memory, "expert_exchange", lambda s, cfg: 0):
            forgotten = 2 * activation_bytes(cfg, 2, 16, precision=precision, ep=2)["total"]
        moe_layers = sum(map(cfg.has_experts, range(cfg.n_layer)))
        assert measured - forgotten == 2 * moe_layers * 2 * 2 * 16 * cfg.experts_per_token * 8, case
        if family == "gemma4":
            with mock.patch.object(memory, *GEMMA4_MOE_OMITTED["experts in place of the MLP"]):
                assert 2 * activation_bytes(cfg, 2, 16, precision=precision, ep=2)["total"] < measured, case


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_gemma4_under_selective_recompute_keeps_what_blocks_does_and_the_plan_says_so(precision):
    """Gemma 4's decoder recomputes each block whole under --activation-checkpointing selective (run_block is handed
    True): the plan counts that, and a Llama's selective rows (what the policy would keep) are off."""
    cfg = gemma4_config()
    model = build_model(cfg, seed=0)
    if precision == "bf16":
        model.to(torch.bfloat16)
    model.recompute_blocks = "selective"  # as training/loop.py sets it
    ids = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    x, y = ids[:, :-1].clone(), ids[:, 1:].clone()
    measured, _ = saved_for_backward(lambda: head_loss(model, x, y, summed_token_loss, False, None),
                                     model.parameters())
    assert activation_bytes(cfg, 2, 16, precision=precision, recompute="selective")["total"] == measured
    assert measured == measured_bytes(build_model(cfg, seed=0), 2, 16, precision, "blocks")
    with mock.patch.object(memory, "GEMMA4", ()):  # planted: counted as a Llama's selective block
        assert activation_bytes(cfg, 2, 16, precision=precision, recompute="selective")["total"] != measured


def test_the_plan_at_cp2_ep2_counts_the_exchange_indices_of_a_ranks_own_tokens_and_whole_rows_are_caught(
        monkeypatch):
    """Under --cp 2 --ep 2 each rank routes its T / 2 tokens of every row through the exchange: the plan's activations
    are those of B x T / 2 tokens at --ep 2, the indices of N k = B T / 2 x k rows included. Planted: the --cp rows
    (parallel/context.py) planned without --ep, which counted the indices of whole rows (512 bytes more a MoE layer
    here, B 2 x T 16 x top-2)."""
    from test_plan import config_of

    from zerotrain.parallel import context
    from zerotrain.training import memory_plan as plan_module

    cfg = config_of("--preset", "qwen3-moe-tiny", "--nproc", "4", "--cp", "2", "--ep", "2", "--data", "synthetic",
                    "--micro-batch", "2")
    rank = activation_bytes(cfg.model, 2, cfg.model.seq_len // 2, ep=2)["total"]
    assert plan_module.memory_plan(cfg).rows["activations"] == rank
    real = context.activation_bytes
    monkeypatch.setattr(context, "activation_bytes", lambda *a, ep=1, **kw: real(*a, **kw))
    assert plan_module.memory_plan(cfg).rows["activations"] == rank + cfg.model.n_layer * 2 * 2 * 8 * 2 * 8
