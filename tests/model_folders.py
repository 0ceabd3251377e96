"""Tiny model and tokenizer folders built locally: a Llama-style BPE (post-processor `<s> $A`), ChatML templates with
and without `{% generation %}` markers, saved by transformers as a downloaded instruct model has them."""

from __future__ import annotations

import json
import os

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

TEXTS = [f"Question {i}: what is {i} plus {i}? Answer: {2 * i}. The user asks and the assistant answers." for i in
         range(300)]
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>", "<|end_header_id|>",
            "<|eot_id|>"]  # ids 0..7
BOS, EOS, IM_START, IM_END = 1, 2, 3, 4
VOCAB = 400
CHATML_MARKED = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] != 'assistant' %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% else %}{{ '<|im_start|>assistant\n' }}{% generation %}{{ message['content'] + '<|im_end|>' }}"
    "{% endgeneration %}{{ '\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
CHATML = CHATML_MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")
LLAMA3_MARKED = (  # Llama 3's layout: a header per message, the turn ended by <|eot_id|>, no newline between turns
    "{{- bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
LLAMA3 = LLAMA3_MARKED.replace("{% generation %}", "").replace("{% endgeneration %}", "")


def bpe(bos: bool = True) -> Tokenizer:
    """A byte-level BPE of VOCAB ids with SPECIALS first; with `bos`, a Llama's post-processor (`<s> $A`)."""
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIALS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(TEXTS, trainer=trainer)
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A", pair="<s> $A <s> $B",
                                                                 special_tokens=[("<s>", BOS)])
    return tokenizer


def tokenizer_folder(folder, *, template: str | None = None, eos: str = "</s>", bos: bool = True):
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja) as transformers saves them; the transformers
    tokenizer."""
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=bpe(bos), bos_token="<s>", eos_token=eos,
                                              unk_token="<unk>")
    if template is not None:
        hf.chat_template = template
    hf.save_pretrained(str(folder))
    return hf


def llama_folder(folder, **tokenizer):
    """A tiny random Llama of VOCAB ids with the tokenizer folder's files beside its weights."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      bos_token_id=BOS, eos_token_id=EOS)
    transformers.LlamaForCausalLM(config).save_pretrained(str(folder))
    return tokenizer_folder(folder, **tokenizer)


def write_jsonl(path, records) -> str:
    with open(path, "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def read_prepared(folder, split: str = "train"):
    """[(tokens, mask)] of each record of a prepared folder's split, by its record index."""
    from zerotrain.data.tokenfiles import open_token_file

    file = open_token_file(os.path.join(str(folder), f"{split}.bin"))
    offsets = np.fromfile(os.path.join(str(folder), f"{split}.records"), dtype="<u8").astype(int)
    return [(np.asarray(file.tokens[a:b], dtype=int), np.asarray(file.mask[a:b], dtype=int))
            for a, b in zip(offsets[:-1], offsets[1:])]


def read_weights(folder) -> dict:
    """A model folder's weights as zerotrain reads them: {name: tensor} by hub/init_from.py, --init-from's path."""
    from zerotrain.hub import init_from
    from zerotrain.model import build_model

    source = init_from.weight_source(str(folder))
    model = build_model(source.model, 0)
    init_from.load_local(model, source, {}, 0)
    return {n: p.detach() for n, p in model.named_parameters()}


# Tiny random models of each Llama-family member zerotrain builds, fp32, with what sets each member apart: Llama 3.1's
# rope scaling (its original context below the positions, so that the scaling changes the logits), Qwen2's q/k/v
# biases and a tied head, Qwen3's q/k norms with heads wider than hidden / heads, Mistral's window shorter than the
# positions, Phi-3's fused projections (and a window). Weights drawn at std 0.2 (biases and norm gains moved off 0
# and 1 as much), so that a dropped piece moves the logits well beyond 1e-4.
FAMILY_SIZES = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, max_position_embeddings=32, rms_norm_eps=1e-6, initializer_range=0.2,
                    rope_theta=500.0)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8}
WINDOW = 5


def family_config(family: str, **changes):
    """The transformers config of the tiny `family` model (llama3 is Llama with Llama 3.1's rope scaling)."""
    sizes = {**FAMILY_SIZES, **changes}
    if family in ("llama", "llama3"):
        return transformers.LlamaConfig(**sizes, **({"rope_scaling": LLAMA3_ROPE} if family == "llama3" else {}))
    if family == "qwen2":
        return transformers.Qwen2Config(**{"tie_word_embeddings": True, **sizes})
    if family == "qwen3":
        return transformers.Qwen3Config(**{"head_dim": 12, **sizes})
    if family == "mistral":
        return transformers.MistralConfig(**{"sliding_window": WINDOW, **sizes})
    if family == "phi3":  # q, k and v in one qkv_proj, gate and up in one gate_up_proj; a window too
        return transformers.Phi3Config(**{"sliding_window": WINDOW, "pad_token_id": 0, "bos_token_id": 1,
                                          "eos_token_id": 2, **sizes})
    raise ValueError(f"no tiny model of family {family!r}")


def family_folder(folder, family: str, **changes):
    """A tiny random model of `family` saved by transformers in `folder` (safetensors, config.json); the model, in
    eval mode."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(family_config(family, **changes), attn_implementation="sdpa")
    with torch.no_grad():  # transformers starts biases at 0 and norm gains at 1: a dropped one would change nothing
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(folder))
    return model.eval()


# Tiny random mixtures of experts, one per family zerotrain builds, hidden 64, with what sets each apart: Qwen3-MoE's
# renormalised top-2 of 8 experts with per-head q/k norms (its second layer dense: mlp_only_layers), Qwen2-MoE's shared
# expert behind its sigmoid gate (top-2 of 4, not renormalised) and q/k/v biases, Mixtral's top-2 of 4 within a window
# shorter than the sequence, OLMoE's q/k norms over the whole projections (top-2 of 8).
MOE_SIZES = {**FAMILY_SIZES, "hidden_size": 64}
MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "olmoe")


def moe_config(family: str, **changes):
    """The transformers config of the tiny `family` mixture of experts."""
    sizes = {**MOE_SIZES, **changes}
    if family == "qwen3_moe":
        return transformers.Qwen3MoeConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                              "norm_topk_prob": True, "head_dim": 24,
                                              "mlp_only_layers": [1], **sizes})
    if family == "qwen2_moe":
        return transformers.Qwen2MoeConfig(**{"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                                              "shared_expert_intermediate_size": 40, "tie_word_embeddings": True,
                                              **sizes})
    if family == "mixtral":
        return transformers.MixtralConfig(**{"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": WINDOW,
                                             **sizes})
    if family == "olmoe":
        return transformers.OlmoeConfig(**{"num_experts": 8, "num_experts_per_tok": 2, "eos_token_id": 2,
                                           "pad_token_id": 0, **sizes})
    raise ValueError(f"no tiny mixture of experts of family {family!r}")


def moe_folder(folder, family: str, **changes):
    """A tiny random `family` mixture of experts saved by transformers in `folder`; the model, in eval mode."""
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(family, **changes), attn_implementation="sdpa")
    with torch.no_grad():  # biases and norm gains moved off 0 and 1, as family_folder's
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(torch.randn_like(p) * 0.2)
    model.save_pretrained(str(folder))
    return model.eval()
