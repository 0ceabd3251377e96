"""Fine-tuning keeps the model whole: an --init-from model's tokenizer configuration and context travel through the
checkpoints to the export; `sample` stops where transformers' generate stops, and speaks the model's chat template
(fine-tuning's optimizer defaults: test_finetune_defaults.py).

Every model is built here with transformers (random weights, a BPE trained on a line of text, a ChatML template):
nothing is downloaded. A random model rarely ends its text, so each folder's head is given a point to stop at: the
row of the end-of-text token (and of the end-of-turn token) is set just above the row of the token greedy decoding
draws fourth, which it then draws there instead.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch
import transformers  # a test dependency (pyproject's [test] extra): missing, the module fails to import, loudly
from conftest import zerotrain_here
from test_api import run_cli
from safetensors import safe_open
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from zerotrain import checkpoint, load_model
from zerotrain.cli.commands import export_model as export_command
from zerotrain.cli.commands import sample as sample_command
from zerotrain.config import ModelConfig
from zerotrain.model import generate as generate_module

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
TEXT = "hello world, how are you? I am fine thanks. The quick brown fox jumps over the lazy dog. " * 20
EOT, IM_START, IM_END = 0, 1, 2  # the BPE's special tokens, in this order
CONTEXT = {"llama": 2048, "gpt2": 32}  # the source models' context lengths
PLAIN, MESSAGE = "the quick", "hello"
CHAT = [{"role": "user", "content": "How are you?"}, {"role": "assistant", "content": "fine"},
        {"role": "user", "content": "and the fox?"}]


def model_folder(folder, arch: str) -> str:
    """A tiny random Hugging Face model with a ChatML template saved in `folder`: Llama (untied head, context 2048,
    eos <|endoftext|> as Qwen's base models have it) or GPT-2 (context 32)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainer=trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|endoftext|>",
                                                eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    fast.save_pretrained(str(folder))
    torch.manual_seed(0)
    V = tok.get_vocab_size()
    if arch == "llama":
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(
            vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=CONTEXT["llama"], bos_token_id=EOT, eos_token_id=EOT,
            pad_token_id=EOT, initializer_range=0.2))
        head = model.lm_head.weight
        with torch.no_grad():  # a point to stop at: the end-of-turn token, then the end of text, drawn fourth
            for stop, ids in ((IM_END, chat_ids(fast, MESSAGE)), (EOT, fast(PLAIN)["input_ids"])):
                head[stop] = 1.02 * head[argmax_run(model, ids, 4)[3]]
    else:
        model = transformers.GPT2LMHeadModel(transformers.GPT2Config(
            vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=CONTEXT["gpt2"], bos_token_id=EOT,
            eos_token_id=EOT, initializer_range=0.2))
    model.save_pretrained(str(folder))
    return str(folder)


def chat_ids(tokenizer, message: str) -> list[int]:
    return tokenizer.apply_chat_template([{"role": "user", "content": message}], add_generation_prompt=True,
                                         tokenize=True, return_dict=True)["input_ids"]


def argmax_run(model, ids: list[int], n: int) -> list[int]:
    """The n most likely next tokens, one after the other, with no stop."""
    out = []
    with torch.no_grad():
        for _ in range(n):
            out.append(int(model(torch.tensor([ids + out])).logits[0, -1].argmax()))
    return out


def greedy(model, ids: list[int], n: int = 12, **eos) -> list[int]:
    """transformers' greedy continuation of `ids`: n tokens, or up to and including the first end of sequence
    (generation_config.json's, or eos_token_id given)."""
    with torch.no_grad():
        out = model.eval().generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, pad_token_id=EOT,
                                    **eos)[0, len(ids):].tolist()
    return out


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{arch: (source folder, run folder)}: each source fine-tuned 2 steps on one rank on a shorter window than its
    context: the Llama at --seq-len 64 (its context is 2048), the GPT-2 at 16 (its learned position table has 32)."""
    root = tmp_path_factory.mktemp("finetune")
    found = {}
    for arch, window in (("llama", ["--seq-len", "64"]), ("gpt2", ["--seq-len", "16"])):
        source = model_folder(root / arch, arch)
        run = str(root / f"{arch}-run")
        assert run_cli(["train", "--init-from", source, "--data", "synthetic", *window, "--steps", "2", "--lr",
                        "2e-5", "--micro-batch", "2", "--ckpt-every", "2", "--no-progress", "--out", run]) == 0
        found[arch] = (source, run)
    return found


def step_folder(run: str) -> str:
    return os.path.join(run, "checkpoints", "step_00000002")


def read_json(folder: str, name: str):
    with open(os.path.join(folder, name)) as f:
        return json.load(f)


def test_the_checkpoint_keeps_the_models_tokenizer_configuration_and_verify_catches_a_changed_template(runs):
    source, run = runs["llama"]
    folder = step_folder(run)
    manifest = checkpoint.read_manifest(folder)
    kept = ["chat_template.jinja", "generation_config.json", "tokenizer_config.json"]  # what transformers 5 saves
    assert manifest["tokenizer"]["files"] == kept and manifest["tokenizer"]["file"] == "tokenizer.json"
    assert manifest["tokenizer"]["context_length"] == 2048 and manifest["tokenizer"]["eos_token_id"] == EOT
    listed = {f["name"]: f for f in manifest["files"]}
    for name in kept + ["tokenizer.json"]:
        data = open(os.path.join(folder, name), "rb").read()
        assert data == open(os.path.join(source, name), "rb").read(), name  # byte for byte, as the model has it
        assert listed[name]["bytes"] == len(data)
    checkpoint.verify_or_raise(folder)
    with open(os.path.join(folder, "chat_template.jinja"), "r+b") as f:  # planted: the template changed after the save
        f.seek(len(CHATML) // 2)
        f.write(b"#")
    with pytest.raises(checkpoint.CheckpointError, match="chat_template.jinja: sha256"):
        checkpoint.verify_or_raise(folder)
    os.remove(os.path.join(folder, "chat_template.jinja"))
    with pytest.raises(checkpoint.CheckpointError, match="chat_template.jinja: is missing"):
        checkpoint.verify_or_raise(folder)
    with open(os.path.join(source, "chat_template.jinja"), "rb") as src, \
            open(os.path.join(folder, "chat_template.jinja"), "wb") as dst:  # put back for the tests after this one
        dst.write(src.read())
    checkpoint.verify_or_raise(folder)


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_the_export_renders_the_sources_chat_and_keeps_its_context_and_a_training_window_export_is_caught(
        runs, arch, tmp_path, monkeypatch):
    source, run = runs[arch]
    out = str(tmp_path / "hf")
    assert run_cli(["export", run, out, "--format", "hf"]) == 0
    config = read_json(out, "config.json")
    assert config["max_position_embeddings" if arch == "llama" else "n_positions"] == CONTEXT[arch]
    assert (config["bos_token_id"], config["eos_token_id"], config.get("pad_token_id")) == \
        (EOT, EOT, EOT if arch == "llama" else None)
    assert read_json(out, "tokenizer_config.json") == read_json(source, "tokenizer_config.json")
    assert read_json(out, "generation_config.json")["eos_token_id"] == EOT
    assert read_json(out, "special_tokens_map.json")["eos_token"] == "<|endoftext|>"
    theirs, ours = transformers.AutoTokenizer.from_pretrained(source), transformers.AutoTokenizer.from_pretrained(out)
    for prompt in (False, True):
        assert ours.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt) == \
            theirs.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=prompt)
    assert chat_ids(ours, MESSAGE) == chat_ids(theirs, MESSAGE)
    assert (ours.bos_token, ours.eos_token, ours.pad_token, ours.model_max_length) == \
        (theirs.bos_token, theirs.eos_token, theirs.pad_token, theirs.model_max_length)
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert loaded.config.max_position_embeddings == CONTEXT[arch]
    import zerotrain  # zerotrain's loader takes inputs up to the context too, from the checkpoint and the export
    assert zerotrain.load_model(run).cfg.positions == zerotrain.load_model(out).cfg.positions == CONTEXT[arch]
    own = str(tmp_path / "zerotrain")  # zerotrain's own format keeps the context and the template too
    assert run_cli(["export", run, own, "--format", "safetensors"]) == 0
    assert ModelConfig(**read_json(own, "config.json")["model"]).positions == CONTEXT[arch]
    assert read_json(own, "tokenizer_config.json") == read_json(source, "tokenizer_config.json")
    # planted: what the checkpoint kept of the source's tokenizer left unread: the export writes zerotrain's own files
    monkeypatch.setattr(export_command, "model_facts", lambda folder: {})
    monkeypatch.setattr("zerotrain.hub.export.config_files", lambda folder: {})
    wrong = str(tmp_path / "wrong")
    assert run_cli(["export", run, wrong, "--format", "hf"]) == 0
    assert transformers.AutoTokenizer.from_pretrained(wrong).chat_template is None
    # planted: the model's positions taken to be the training window: a Llama exports the window as its context; a
    # GPT-2's position table, longer than the window, no longer fits the model
    monkeypatch.setattr(ModelConfig, "positions", property(lambda self: self.seq_len))
    window = str(tmp_path / "window")
    if arch == "llama":
        assert run_cli(["export", run, window, "--format", "hf"]) == 0
        assert read_json(window, "config.json")["max_position_embeddings"] == 64
    else:
        assert run_cli(["export", run, window, "--format", "hf"]) == 1


def test_a_gpt2_trains_on_a_shorter_window_keeping_its_position_table_and_a_longer_one_is_refused(runs, tmp_path,
                                                                                                  capfd):
    source, run = runs["gpt2"]
    model = checkpoint.read_manifest(step_folder(run))["config"]["model"]
    assert (model["seq_len"], model["context"]) == (16, CONTEXT["gpt2"])
    kept = load_model(run).transformer.wpe.weight
    with safe_open(os.path.join(source, "model.safetensors"), "pt") as f:
        table = f.get_tensor("transformer.wpe.weight")
    assert kept.shape == table.shape and torch.equal(kept[16:], table[16:])  # the rows past the window: untrained
    r = zerotrain_here(capfd, "train", "--init-from", source, "--data", "synthetic", "--seq-len", "64", "--out",
                       str(tmp_path / "long"))
    assert r.returncode == 2 and r.stderr.strip() == (
        f"zerotrain: error: --seq-len 64 contradicts --init-from {source}, whose model has seq_len = 32: leave it "
        "out, the model's comes with it")


def hf_export(run: str, out: str):
    assert run_cli(["export", run, out, "--format", "hf"]) == 0
    return transformers.AutoModelForCausalLM.from_pretrained(out), transformers.AutoTokenizer.from_pretrained(out)


def sample(capsys, run: str, *flags) -> str:
    capsys.readouterr()
    assert run_cli(["sample", run, "--temperature", "0", "--max-new-tokens", "12", "--threads", "1", *flags]) == 0
    return capsys.readouterr().out[:-1]  # print's newline


def test_sample_stops_at_the_end_of_text_as_transformers_generate_does_and_a_sampler_that_runs_on_is_caught(
        runs, tmp_path, capsys, monkeypatch):
    _, run = runs["llama"]
    model, tokenizer = hf_export(run, str(tmp_path / "hf"))
    ids = tokenizer(PLAIN)["input_ids"]
    theirs = greedy(model, ids)  # generation_config.json's eos: it stops after the first <|endoftext|>
    assert theirs[-1] == EOT and EOT not in theirs[:-1] and 1 < len(theirs) < 12
    import zerotrain
    ours = generate_module.generate(zerotrain.load_model(run), torch.tensor([ids]), 12, temperature=0,
                                    stop_ids=[EOT])[0].tolist()
    assert ours == theirs  # the same tokens, up to and including the end of text
    assert sample(capsys, run, "--prompt", PLAIN) == tokenizer.decode(theirs[:-1])
    assert sample(capsys, str(tmp_path / "hf"), "--prompt", PLAIN) == tokenizer.decode(theirs[:-1])  # the export too
    ran_on = sample(capsys, run, "--prompt", PLAIN, "--ignore-eos")
    assert ran_on.startswith(tokenizer.decode(theirs)) and len(ran_on) > len(tokenizer.decode(theirs))
    # planted: the sampler no longer cuts a row at its stop token
    monkeypatch.setattr(sample_command, "until_stop", lambda ids, stops: (ids, False))
    assert sample(capsys, run, "--prompt", PLAIN) != tokenizer.decode(theirs[:-1])


def test_batched_rows_end_each_at_their_own_stop_and_draw_as_they_would_alone():
    torch.manual_seed(0)
    from zerotrain.config import ModelConfig
    from zerotrain.model import GPT

    model = GPT(ModelConfig(vocab_size=64)).eval()
    prompts = torch.tensor([[1, 2], [3, 4], [5, 6]])
    free = generate_module.generate(model, prompts, 12, temperature=0)
    stop = int(free[1, 2])  # row 1 draws it third; whatever the other rows draw
    stopped = generate_module.generate(model, prompts, 12, temperature=0, stop_ids=[stop])
    for row, full in zip(stopped.tolist(), free.tolist()):
        kept, ended = generate_module.until_stop(row, [stop])
        cut, _ = generate_module.until_stop(full, [stop])
        assert kept == cut  # each row's tokens to its own stop are those it draws alone
        assert all(t == stop for t in row[len(kept):]) if ended else kept == full[: len(row)]
    assert stopped.shape[1] <= 12 and stopped.shape[1] == max(len(generate_module.until_stop(r, [stop])[0])
                                                              for r in free.tolist())


def test_sample_chat_renders_the_template_and_ends_at_the_end_of_turn_and_a_missed_end_of_turn_is_caught(
        runs, tmp_path, capsys, monkeypatch):
    _, run = runs["llama"]
    model, tokenizer = hf_export(run, str(tmp_path / "hf"))
    ids = chat_ids(tokenizer, MESSAGE)
    assert tokenizer.decode(ids) == f"<|im_start|>user\n{MESSAGE}<|im_end|>\n<|im_start|>assistant\n"
    theirs = greedy(model, ids, eos_token_id=[EOT, IM_END])  # a server stops at the template's end of turn too
    assert theirs[-1] == IM_END and EOT not in theirs and 1 < len(theirs) < 12
    assert sample(capsys, run, "--chat", MESSAGE) == tokenizer.decode(theirs[:-1])
    # planted: the end of turn not read from the template, only the model's end of text stops the reply
    monkeypatch.setattr(sample_command, "end_of_turn", lambda tokenizer: None)
    assert sample(capsys, run, "--chat", MESSAGE) != tokenizer.decode(theirs[:-1])
    monkeypatch.setitem(sys.modules, "transformers", None)  # not installed: one line naming the extra
    capsys.readouterr()
    assert run_cli(["sample", run, "--chat", MESSAGE]) == 2
    assert capsys.readouterr().err.strip().endswith("pip install 'zerotrain[chat]'")


def test_sample_chat_without_a_template_is_refused_in_one_line(tmp_path, capsys):
    from test_api import train_checkpoint

    run = train_checkpoint(str(tmp_path / "bytes"), steps=1)
    assert run_cli(["sample", run, "--chat", "hi"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "has no chat template" in err and "--prompt" in err


END_OF_TURN = {  # a template, and the special token it ends an assistant's turn with (None: it writes none)
    "chatml": (CHATML, "<|im_end|>"),
    "llama3": ("{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
               "{{ m['content'] }}<|eot_id|>{% endfor %}", "<|eot_id|>"),
    "zephyr": ("{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}", "</s>"),
    "gemma": ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
              "{{ m['content'] }}<end_of_turn>\n{% endfor %}", "<end_of_turn>"),
    "plain": ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}", None),
}


@pytest.mark.parametrize("name", sorted(END_OF_TURN))
def test_the_end_of_turn_is_the_first_special_token_the_template_writes_after_a_reply(name, tmp_path):
    from zerotrain.hub.chat_prompt import chat_tokenizer, end_of_turn

    template, expected = END_OF_TURN[name]
    specials = ["<|begin_of_text|>", "</s>", "<|im_start|>", "<|im_end|>", "<|start_header_id|>",
                "<|end_header_id|>", "<|eot_id|>", "<start_of_turn>", "<end_of_turn>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT], trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|begin_of_text|>", eos_token="</s>")
    fast.chat_template = template
    fast.save_pretrained(str(tmp_path))
    found = end_of_turn(chat_tokenizer(str(tmp_path)))
    assert found == (None if expected is None else tok.token_to_id(expected))
