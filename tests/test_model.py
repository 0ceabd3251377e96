"""The GPT: shapes, tied head, GPT-2 names and init, masked summed loss, decay groups."""

import math

import torch

from zerotrain.config import ModelConfig
from zerotrain.model import GPT, build_model, is_decayed, summed_token_loss

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
