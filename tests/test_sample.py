"""Generation: the KV cache computes what full recomputation does, past the context too; `zerotrain sample`, its
chats rendered as training rendered them."""

import json

import pytest
import torch
from test_api import run_cli, train_checkpoint

import zerotrain
from zerotrain.config import ModelConfig
from zerotrain.model.generate import generate, next_token, window_start
from zerotrain.model import GPT, KVCache


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A tiny GPT trained on the Zen of Python as bytes (see test_api.train_checkpoint): its run folder."""
    return train_checkpoint(str(tmp_path_factory.mktemp("run")))


def drop_last_position(monkeypatch):
    """Planted bug: each layer attends over every cached position but the newest."""
    append = KVCache.append

    def lossy(self, layer, k, v):
        keys, values = append(self, layer, k, v)
        return keys[:, :, :-1], values[:, :, :-1]

    monkeypatch.setattr(KVCache, "append", lossy)


def test_cached_logits_equal_a_full_forward_and_a_cache_that_drops_the_last_position_is_caught(run, monkeypatch):
    model = zerotrain.load_model(run)
    idx = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))

    def incremental(chunk=True):  # a prefill of 5, a chunk of 3 (the masked path), then one token at a time
        cache = KVCache(model.cfg, 2)
        with torch.no_grad():
            parts = [model(idx[:, :5], cache), model(idx[:, 5:8], cache)] if chunk else [model(idx[:, :8], cache)]
            parts += [model(idx[:, t : t + 1], cache) for t in range(8, 16)]
        assert cache.length == 16
        return torch.cat(parts, dim=1)

    with torch.no_grad():
        full = model(idx)
    torch.testing.assert_close(incremental(), full, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="exceed seq_len 16"):
        model(torch.zeros(2, 17, dtype=torch.long), KVCache(model.cfg, 2))
    drop_last_position(monkeypatch)
    assert (incremental(chunk=False) - full).abs().max() > 1e-3


def test_greedy_is_identical_with_and_without_the_cache_past_the_context_and_a_lossy_cache_is_caught(run, monkeypatch):
    model = zerotrain.load_model(run)
    prompts = torch.tensor([list(b"Bea"), list(b"Now"), list(b"Fla")])
    with_cache = generate(model, prompts, 40, temperature=0)  # 40 tokens: the seq-16 window jumps 7 times
    without = generate(model, prompts, 40, temperature=0, kv_cache=False)
    assert with_cache.shape == (3, 40)
    assert torch.equal(with_cache, without)
    assert len(set(with_cache[0].tolist())) > 1  # not a degenerate repetition of one token
    # before the first jump, both equal the plain greedy loop over the whole sequence
    seq = prompts.clone()
    for _ in range(16 - 3):
        seq = torch.cat([seq, model(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(with_cache[:, :13], seq[:, 3:])
    drop_last_position(monkeypatch)
    assert not torch.equal(generate(model, prompts, 40, temperature=0), without)


def test_the_cache_computes_each_position_once_between_window_jumps(run):
    model = zerotrain.load_model(run)
    fed = []
    handle = model.register_forward_pre_hook(lambda m, args: fed.append(args[0].shape[1]))
    try:
        generate(model, torch.tensor([[1, 2, 3]]), 40, temperature=0)
        cached, fed[:] = list(fed), []
        generate(model, torch.tensor([[1, 2, 3]]), 40, temperature=0, kv_cache=False)
        full = list(fed)
    finally:
        handle.remove()
    # seq 16, keep 12: the prompt, one position per token, and a refill of the 12 kept whenever the window
    # overflows: at sequence lengths 17, 22, 27, 32, 37, 42 (12 kept + 4 new fill it, the 5th jumps)
    assert cached == [3] + [1] * 13 + ([12] + [1] * 4) * 5 + [12]
    assert len(cached) == 40  # one forward per generated token but the last (its logits are not needed)
    assert all(n <= 16 for n in full) and sum(full) > 3 * sum(cached)


def test_the_window_never_exceeds_the_context_and_keeps_its_last_tokens():
    seq_len, keep, start = 16, 12, 0
    for n in range(1, 200):
        new = window_start(start, n, seq_len, keep)
        assert 1 <= n - new <= seq_len
        assert new == start or n - new == keep  # unchanged, or jumped to keep the last `keep`
        start = new
    with pytest.raises(ValueError, match="keep must be in"):
        generate(GPT(ModelConfig()), torch.tensor([[1]]), 2, keep=0)


def test_top_k_1_is_greedy_and_ids_past_the_tokenizer_vocabulary_are_never_drawn():
    logits = torch.randn(64, 50, generator=torch.Generator().manual_seed(0))
    g = torch.Generator().manual_seed(1)
    assert torch.equal(next_token(logits, 2.0, 1, g), logits.argmax(-1))
    assert torch.equal(next_token(logits, 0.0, None, g), logits.argmax(-1))
    logits[:, 40:] += 100.0  # the model's favourites lie past the tokenizer's 40 ids
    assert next_token(logits, 1.0, None, g, vocab_limit=40).max() < 40


def test_sample_prints_only_the_text_and_the_same_seed_gives_the_same_text(run, capsys):
    def sample(*flags):
        assert run_cli(["sample", run, "--prompt", "hi", "--max-new-tokens", "40", *flags]) == 0
        return capsys.readouterr()

    first, again, other = sample("--seed", "1"), sample("--seed", "1"), sample("--seed", "2")
    assert first.out == again.out and first.out != other.out
    assert "tokens/s" in first.err and "tokens/s" not in first.out
    greedy, greedy_full = sample("--temperature", "0"), sample("--temperature", "0", "--no-kv-cache")
    assert greedy.out == greedy_full.out and "no KV cache" in greedy_full.err
    two = sample("--seed", "1", "--num-samples", "2", "--top-k", "10")
    assert two.out.count("\n---\n") == 1


def test_a_prompt_outside_the_models_vocabulary_is_refused_in_one_line(tmp_path, capsys):
    small = train_checkpoint(str(tmp_path / "v64"), synthetic_vocab=64, steps=1)
    assert run_cli(["sample", small, "--prompt", "hello"]) == 2
    assert "token id 111, outside this model's vocabulary of 64" in capsys.readouterr().err
    assert run_cli(["sample", small, "--max-new-tokens", "5"]) == 0  # no prompt: starts from end-of-text (id 0)


# ---------------------------------------------------------------- sample --chat: the context training gave the model
CHAT_TURNS = [{"role": "system", "content": "The assistant answers."},
              {"role": "user", "content": "Question 3: what is 3 plus 3?"}]


@pytest.fixture(scope="module")
def instruct(tmp_path_factory):
    """A tiny random Llama whose tokenizer puts a BOS before a text (`<s> $A`) and whose ChatML template writes none:
    the folder, and training's rendering of CHAT_TURNS + an assistant reply (ids, mask) from encode_chunk, what
    `prepare` and `train` write for a chat record."""
    from model_folders import CHATML, llama_folder

    from zerotrain.data.chat import ChatTemplate
    from zerotrain.data.jsonl import encode_chunk, record_tokenizer

    folder = tmp_path_factory.mktemp("instruct")
    llama_folder(folder, template=CHATML.replace("{{ bos_token }}", ""), eos="<|im_end|>")
    tok = record_tokenizer(str(folder))
    record = ("chat", [*CHAT_TURNS, {"role": "assistant", "content": "Answer: 6."}], {}, "chats.jsonl:1")
    [(ids, mask)], _ = encode_chunk([record], tok, ChatTemplate.of(tok, "chats.jsonl:1"))
    return str(folder), ids, mask


def fed_prompts(monkeypatch, capsys, *argv) -> list[tuple[list[int], float]]:
    """The prompt ids `zerotrain sample ARGV` feeds the model and the temperature it samples at, per call."""
    from zerotrain.cli.commands import sample as sample_command

    seen, real = [], sample_command.generate

    def recording(model, prompt, *args, **kwargs):
        seen.append((prompt[0].tolist(), kwargs["temperature"]))
        return real(model, prompt, *args, **kwargs)

    monkeypatch.setattr(sample_command, "generate", recording)
    capsys.readouterr()
    assert run_cli(["sample", *argv, "--max-new-tokens", "4", "--threads", "1"]) == 0, capsys.readouterr().err
    monkeypatch.setattr(sample_command, "generate", real)
    return seen


def test_sample_chat_feeds_the_context_training_rendered_with_its_bos_and_a_missing_bos_is_caught(
        instruct, tmp_path, monkeypatch, capsys):
    from model_folders import BOS

    from zerotrain.data import jsonl

    folder, ids, mask = instruct
    trained_prompt = ids[: list(mask).index(1)]  # what the first trained token was predicted from
    assert trained_prompt[0] == BOS and trained_prompt.count(BOS) == 1  # training's BOS: the template wrote none
    args = ["--chat", CHAT_TURNS[1]["content"], "--system", CHAT_TURNS[0]["content"]]
    [(fed, temperature)] = fed_prompts(monkeypatch, capsys, folder, *args)
    assert fed == trained_prompt and temperature == 0.0
    assert CHAT_TURNS[0]["content"] in zerotrain.load_tokenizer(folder).decode(fed)  # --system is rendered
    # the same conversation from a file, as a training record's messages
    (tmp_path / "chat.json").write_text(json.dumps({"messages": CHAT_TURNS}))
    assert fed_prompts(monkeypatch, capsys, folder, "--messages", str(tmp_path / "chat.json"))[0][0] == trained_prompt
    # without --system the system turn is gone, and the rest is training's rendering of the user turn alone
    [(alone, _)] = fed_prompts(monkeypatch, capsys, folder, "--chat", CHAT_TURNS[1]["content"])
    assert CHAT_TURNS[0]["content"] not in zerotrain.load_tokenizer(folder).decode(alone) and alone[0] == BOS
    # planted: the BOS rule skipped on sample's path (what transformers' apply_chat_template does)
    monkeypatch.setattr(jsonl, "missing_bos", lambda ids, prefix: [])
    [(planted, _)] = fed_prompts(monkeypatch, capsys, folder, *args)
    assert planted != trained_prompt and planted == trained_prompt[1:]


def test_sample_chat_is_greedy_by_default_and_samples_when_given_a_temperature(instruct, monkeypatch, capsys):
    folder, _, _ = instruct

    def reply(*flags) -> str:
        capsys.readouterr()
        assert run_cli(["sample", folder, "--chat", "what is 1 plus 1?", "--max-new-tokens", "12", "--ignore-eos",
                        "--threads", "1", *flags]) == 0
        return capsys.readouterr().out

    assert reply("--seed", "1") == reply("--seed", "2") == reply("--temperature", "0", "--seed", "3")
    drawn = {reply("--temperature", "1", "--seed", str(s)) for s in range(3)}
    assert len(drawn) > 1  # an explicit temperature draws: the seeds differ


@pytest.mark.parametrize("content, said", [
    ("[]", "expected a list of"),
    ('[{"role": "user"}]', "message 0 is {'role': 'user'}, not an object with"),
    ('[{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]', "the last message is the "
                                                                                    "assistant's"),
    ("{", "not JSON"),
])
def test_a_bad_messages_file_is_refused_in_one_line_naming_it(instruct, tmp_path, capsys, content, said):
    folder, _, _ = instruct
    (tmp_path / "m.json").write_text(content)
    assert run_cli(["sample", folder, "--messages", str(tmp_path / "m.json")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--messages {tmp_path / 'm.json'}: {said}" in err, err
    assert run_cli(["sample", folder, "--prompt", "hi", "--system", "x"]) == 2
    assert "--system goes with --chat" in capsys.readouterr().err


def test_sample_sizes_the_kv_cache_to_the_prompt_and_new_tokens_and_a_cache_too_short_is_caught(run, monkeypatch, capsys):
    """A 20-token prompt to Llama-3.1-8B preallocated its whole context (32 GiB); the cache holds prompt + new tokens."""
    from zerotrain.model import generate as generation

    made = []

    class Recorded(KVCache):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            made.append(self)

    monkeypatch.setattr(generation, "KVCache", Recorded)
    assert run_cli(["sample", run, "--prompt", "hi", "--max-new-tokens", "5", "--temperature", "0"]) == 0
    cached = capsys.readouterr().out
    model = zerotrain.load_model(run)
    assert model.cfg.positions == 16 and [c.keys.shape[3] for c in made] == [2 + 5]  # "hi": 2 byte tokens
    assert run_cli(["sample", run, "--prompt", "hi", "--max-new-tokens", "5", "--temperature", "0",
                    "--no-kv-cache"]) == 0
    assert capsys.readouterr().out == cached
    made.clear()
    generate(model, torch.tensor([[1, 2, 3]]), 40, temperature=0)  # past the context: the whole context, no more
    assert [c.keys.shape[3] for c in made] == [16]
    # planted: a cache sized to the prompt alone; the first new token does not fit
    monkeypatch.setattr(generation, "cache_positions", lambda prompt, new, seq_len: prompt)
    with pytest.raises(ValueError, match="the KV cache holds 3 positions; 4 do not fit"):
        generate(model, torch.tensor([[1, 2, 3]]), 5, temperature=0)


def test_sample_messages_writes_a_records_tools_calls_and_results_as_the_models_template_does_and_dropped_tools_are_caught(
        tmp_path, monkeypatch, capsys):
    """A tool-calling conversation is sampled with its tools, its assistant's tool call and the tool's result, rendered
    by the model's own template as transformers renders it for generation (Qwen3's real template, from TRL's package):
    the prompt fed to the model is apply_chat_template's, tools and all. It was refused: a tool call is no "content"
    string, and a record's tools were dropped."""
    from model_folders import llama_folder
    from test_chat_templates import TOOL_CHAT, trl_template

    from zerotrain.cli.commands import sample as sample_command

    folder = tmp_path / "qwen3-like"
    hf = llama_folder(folder, template=trl_template("qwen3.jinja"), eos="<|im_end|>", bos=False)
    so_far = {"tools": TOOL_CHAT["tools"], "messages": TOOL_CHAT["messages"][:-1]}  # ends with the tool's result
    theirs = hf.apply_chat_template(so_far["messages"], tools=so_far["tools"], add_generation_prompt=True,
                                    tokenize=False)
    assert "get_weather" in theirs and "The weather in a city" in theirs and '"degrees": 18' in theirs
    (tmp_path / "so-far.json").write_text(json.dumps(so_far))
    [(fed, _)] = fed_prompts(monkeypatch, capsys, str(folder), "--messages", str(tmp_path / "so-far.json"))
    assert fed == hf(theirs, add_special_tokens=False)["input_ids"]
    # planted: the record's tools dropped on sample's path (what sample did before)
    real = sample_command.conversation
    monkeypatch.setattr(sample_command, "conversation", lambda args: (real(args)[0], {}))
    [(planted, _)] = fed_prompts(monkeypatch, capsys, str(folder), "--messages", str(tmp_path / "so-far.json"))
    assert planted != fed and "The weather in a city" not in hf.decode(planted)
