"""The GPT: shapes, tied head, GPT-2 names and init, masked summed loss, decay groups."""

import math

import torch

from zerotrain.config import ModelConfig
from zerotrain.model import GPT, build_model, init, is_decayed, summed_token_loss

TINY = ModelConfig(n_layer=2, n_head=4, n_embd=32, seq_len=16, vocab_size=64)


def test_forward_gives_logits_for_every_position():
    model = build_model(TINY, seed=0)
    logits = model(torch.randint(0, 64, (3, 16)))
    assert logits.shape == (3, 16, 64)


def test_lm_head_is_tied_to_token_embedding():
    model = build_model(TINY, seed=0)
    assert model.lm_head.weight is model.transformer.wte.weight
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # one parameter, stored once
    assert "lm_head.weight" in model.state_dict()


def test_parameter_names_map_onto_hugging_face_gpt2():
    model = build_model(TINY, seed=0)
    per_block = {"ln_1.weight", "ln_1.bias", "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight",
                 "attn.c_proj.bias", "ln_2.weight", "ln_2.bias", "mlp.c_fc.weight", "mlp.c_fc.bias",
                 "mlp.c_proj.weight", "mlp.c_proj.bias"}
    expected = {"transformer.wte.weight", "transformer.wpe.weight", "transformer.ln_f.weight", "transformer.ln_f.bias"}
    expected |= {f"transformer.h.{i}.{n}" for i in range(2) for n in per_block}
    assert {n for n, _ in model.named_parameters()} == expected
    # P = V*C + T*C + L*(12*C*C + 13*C) + 2*C
    C, V, T, L = 32, 64, 16, 2
    assert sum(p.numel() for p in model.parameters()) == V * C + T * C + L * (12 * C * C + 13 * C) + 2 * C


def test_same_seed_same_init_and_residual_projections_scaled():
    a, b = build_model(TINY, seed=3), build_model(TINY, seed=3)
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(p, q), n
    big = build_model(ModelConfig(n_layer=8, n_head=4, n_embd=256, seq_len=16, vocab_size=64), seed=0)
    std = big.transformer.h[0].attn.c_proj.weight.std().item()
    assert abs(std - 0.02 / math.sqrt(16)) < 0.001
    assert abs(big.transformer.h[0].attn.c_attn.weight.std().item() - 0.02) < 0.001


def test_summed_loss_ignores_masked_labels():
    logits = torch.randn(2, 4, 10)
    y = torch.tensor([[1, 2, -100, -100], [3, 4, 5, -100]])
    full = torch.nn.functional.cross_entropy(logits.view(-1, 10), y.view(-1), ignore_index=-100, reduction="sum")
    assert torch.allclose(summed_token_loss(logits, y), full)
    # a planted bug, counting padding as label 0, changes the value
    assert not torch.allclose(summed_token_loss(logits, y.clamp(min=0)), full)


def test_decay_on_matrices_and_tied_embedding_only():
    model = GPT(TINY)
    decayed = {n for n, p in model.named_parameters() if is_decayed(n, p)}
    assert "transformer.wte.weight" in decayed and "transformer.h.0.mlp.c_fc.weight" in decayed
    assert "transformer.wpe.weight" not in decayed
    assert not any(n.endswith("bias") or ".ln_" in n for n in decayed)


def other_model(cfg: ModelConfig) -> dict:
    """The model one block deeper and with more positions: every block's parameters come after another wpe."""
    return dict(build_model(ModelConfig(**{**vars(cfg), "n_layer": 3, "seq_len": 64}), 3).named_parameters())


def test_each_parameter_starts_from_its_name_and_its_architectures_rule_alone_and_a_shared_generator_is_caught(
        monkeypatch):
    cfg = ModelConfig(n_layer=2, n_embd=64, n_head=4, vocab_size=256, seq_len=32)
    model, deeper = dict(build_model(cfg, 3).named_parameters()), other_model(cfg)
    # the same name and shape draw the same values, whatever else the model holds; another seed, others
    assert torch.equal(model["transformer.wte.weight"], deeper["transformer.wte.weight"])
    assert torch.equal(model["transformer.h.1.mlp.c_fc.weight"], deeper["transformer.h.1.mlp.c_fc.weight"])
    assert not torch.equal(model["transformer.wte.weight"], build_model(cfg, 4).transformer.wte.weight)
    # and no two parameters of one shape draw the same values (each has its own generator)
    assert not torch.equal(model["transformer.h.0.mlp.c_fc.weight"], model["transformer.h.1.mlp.c_fc.weight"])
    # GPT-2's rule: N(0, 0.02), residual projections N(0, 0.02 / sqrt(2 n_layer)), biases 0, LayerNorm gains 1
    assert abs(model["transformer.h.0.mlp.c_fc.weight"].std().item() - 0.02) < 0.001
    assert abs(model["transformer.h.0.attn.c_proj.weight"].std().item() - 0.02 / math.sqrt(4)) < 0.001
    assert abs(deeper["transformer.h.0.mlp.c_proj.weight"].std().item() - 0.02 / math.sqrt(6)) < 0.001
    assert torch.equal(model["transformer.h.0.ln_1.weight"], torch.ones(64))
    assert not model["transformer.h.0.attn.c_attn.bias"].any() and not model["transformer.ln_f.bias"].any()
    tied = build_model(cfg, 3)
    assert tied.lm_head.weight is tied.transformer.wte.weight  # tied again after the meta device
    # planted: one key for every parameter (its values from the positions alone): two of one shape are equal
    real = init.parameter_key
    monkeypatch.setattr(init, "parameter_key", lambda seed, name: real(seed, ""))
    model = dict(build_model(cfg, 3).named_parameters())
    assert torch.equal(model["transformer.h.0.mlp.c_fc.weight"], model["transformer.h.1.mlp.c_fc.weight"])
