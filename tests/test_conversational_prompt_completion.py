"""TRL's conversational prompt/completion records ({"prompt": [messages], "completion": [messages]}): tokens and loss
mask equal TRL's SFTTrainer's (its own dataset preparation run on the same records, through ChatML and the real
templates of Qwen3, Llama 3.1, gpt-oss and Gemma 3), prepare and train take them, malformed rows are refused in one
line naming the file and line."""

from __future__ import annotations

import json
import types

import pytest
from conftest import zerotrain_here
from model_folders import CHATML, llama_folder, read_prepared, tokenizer_folder, write_jsonl
from test_chat_templates import FAMILIES, TRL_TEMPLATES, WEATHER, call, family_tokenizer
from test_user_errors import one_line_error

from zerotrain.data import chat as chat_module
from zerotrain.data.jsonl import prepare_jsonl

pytestmark = pytest.mark.timeout(300)

CHATML_RECORDS = [
    {"prompt": [{"role": "user", "content": "Question 3: what is 3 plus 3?"}],
     "completion": [{"role": "assistant", "content": "Answer: 6."}]},
    {"prompt": [{"role": "system", "content": "The assistant answers."}, {"role": "user", "content": "Question 4:"},
                {"role": "assistant", "content": "8"}, {"role": "user", "content": "and 5 plus 5? ünïcödé"}],
     "completion": [{"role": "assistant", "content": "Answer: 10, the user asks 🙂"}]},
]
TOOL_CALL = {"tools": [WEATHER], "prompt": [{"role": "user", "content": "The weather in Paris?"}],
             "completion": [{"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Paris")]}]}
AFTER_THE_TOOL = {"tools": [WEATHER], "prompt": [
    {"role": "user", "content": "The weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Paris")]},
    {"role": "tool", "name": "get_weather", "content": "{\"degrees\": 18}"}],
    "completion": [{"role": "assistant", "reasoning_content": "The tool says 18 degrees.",
                    "content": "18 degrees in Paris."}]}
MULTI_TURN = {"prompt": [{"role": "system", "content": "Answer briefly."},
                         {"role": "user", "content": "What is 1 plus 1?"}, {"role": "assistant", "content": "2"},
                         {"role": "user", "content": "And 2 plus 2?"}],
              "completion": [{"role": "assistant", "content": "4, as 2 and 2 make 4."}]}
REASONING = {**MULTI_TURN, "completion": [{"role": "assistant", "reasoning_content": "Two and two make four.",
                                           "content": "4"}]}
PARTS = {"prompt": [*MULTI_TURN["prompt"][:3],
                    {"role": "user", "content": [{"type": "text", "text": "And 2 plus 2?"}]}],
         "completion": [{"role": "assistant", "content": [{"type": "text", "text": "4, as 2 and 2 make 4."}]}]}
RECORDS = {
    "qwen3": [TOOL_CALL, AFTER_THE_TOOL, REASONING, MULTI_TURN],
    "llama3_1": [TOOL_CALL, MULTI_TURN],
    "gptoss": [REASONING, MULTI_TURN],
    "gemma3": [PARTS, MULTI_TURN],
}


def trl_view(hf, records):
    """TRL's SFTTrainer's tokens and loss mask of each record: its own _prepare_dataset (completion_only_loss, the
    tokenizer's template), on a stream of the records as they are (a table would give each message every key)."""
    import datasets
    from trl import SFTConfig, SFTTrainer

    args = SFTConfig(output_dir="unused", max_length=None, report_to=[], bf16=False, use_cpu=True)
    trainer = types.SimpleNamespace(_tokenizer=hf, chat_template=None, completion_only_loss=True)
    stream = datasets.IterableDataset.from_generator(lambda: iter(json.loads(json.dumps(records))))
    out = SFTTrainer._prepare_dataset(trainer, stream, hf, args, False, None, "train")
    return [(list(r["input_ids"]), [int(label != -100) for label in r["labels"]]) for r in out]


def ours(tmp_path, folder, records, name="out"):
    meta = prepare_jsonl(write_jsonl(tmp_path / f"{name}.jsonl", records), str(tmp_path / name), str(folder), 0.0)
    return [(list(t), list(m)) for t, m in read_prepared(tmp_path / name)], meta


def plant_bugs(monkeypatch, bug: str) -> None:
    """Planted in the product's own rendering: the generation prompt missing from the prompt, or the prompt's last
    message trained (the prompt rendered without it)."""
    prompt_completion = chat_module.ChatTemplate.prompt_completion

    def planted(self, prompt, completion, where, **context):
        alone, whole = prompt_completion(self, prompt, completion, where, **context)
        if bug == "no generation prompt":
            return self._text(prompt, where, **context), whole
        return self.prompt(prompt[:-1], where, **context) if len(prompt) > 1 else "", whole

    monkeypatch.setattr(chat_module.ChatTemplate, "prompt_completion", planted)


def test_chatml_tokens_and_mask_equal_trls_sft_trainer_and_planted_bugs_are_caught(tmp_path, monkeypatch):
    hf = tokenizer_folder(tmp_path / "chatml", template=CHATML, eos="<|im_end|>")
    expected = trl_view(hf, CHATML_RECORDS)
    got, meta = ours(tmp_path, tmp_path / "chatml", CHATML_RECORDS)
    assert got == expected
    assert all(t[-2:] == hf.convert_tokens_to_ids(["<|im_end|>", "Ċ"]) and m[-2:] == [1, 1] for t, m in got)
    assert meta["source"]["chats"] == 2 and meta["source"]["chat_template"] == "prompt and completion"
    assert meta["source"]["template"]["said"].startswith("the model's own chat template (the completion trained")
    for bug in ("no generation prompt", "the prompt's last message trained"):
        with monkeypatch.context() as m:
            plant_bugs(m, bug)
            assert ours(tmp_path, tmp_path / "chatml", CHATML_RECORDS, "planted")[0] != expected, bug


@pytest.mark.skipif(TRL_TEMPLATES is None, reason="TRL's package holds the real templates (the test extra has it)")
@pytest.mark.parametrize("family", list(FAMILIES))
def test_real_templates_tokens_and_mask_equal_trls_sft_trainer_and_planted_bugs_are_caught(
        tmp_path, monkeypatch, family):
    hf = family_tokenizer(tmp_path / family, family)
    records = RECORDS[family]
    expected = trl_view(hf, records)
    got, meta = ours(tmp_path, tmp_path / family, records)
    assert got == expected
    assert meta["source"]["template"]["origin"] == "model"  # the model's own, not TRL's training variant: as TRL
    for bug in ("no generation prompt", "the prompt's last message trained"):
        with monkeypatch.context() as m:
            plant_bugs(m, bug)
            assert ours(tmp_path, tmp_path / family, records, "planted")[0] != expected, (family, bug)


BAD = {
    "completion text after a conversational prompt": (
        {"prompt": [{"role": "user", "content": "hi"}], "completion": "hello"},
        "\"completion\" is 'hello', not a list of {\"role\", \"content\"} messages"),
    "a user message in the completion": (
        {"prompt": [{"role": "user", "content": "hi"}],
         "completion": [{"role": "assistant", "content": "hello"}, {"role": "user", "content": "and?"}]},
        "completion message 1 is the 'user''s: the completion is what the model is trained to write"),
    "a weight in the completion": (
        {"prompt": [{"role": "user", "content": "hi"}],
         "completion": [{"role": "assistant", "content": "hello", "weight": 0}]},
        "completion message 0 has a weight: a prompt/completion record trains its whole completion, as TRL's "
        "SFTTrainer does"),
    "an unknown role in the prompt": (
        {"prompt": [{"role": "bot", "content": "hi"}], "completion": [{"role": "assistant", "content": "hello"}]},
        "message 0 has role 'bot'"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_malformed_conversational_prompt_completion_is_refused_naming_its_line(tmp_path, capfd, case):
    tokenizer_folder(tmp_path / "chatml", template=CHATML, eos="<|im_end|>")
    record, said = BAD[case]
    path = write_jsonl(tmp_path / "data.jsonl", [*CHATML_RECORDS, record])
    line = one_line_error(zerotrain_here(capfd, "prepare", path, str(tmp_path / "out"), "--tokenizer",
                                         str(tmp_path / "chatml"), "--val-fraction", "0"))
    assert f"{path}:3: {said}" in line, line


def test_prepare_and_train_take_conversational_prompt_completions(tmp_path, capfd):
    model = tmp_path / "instruct"
    hf = llama_folder(model, template=CHATML, eos="<|im_end|>")
    path = write_jsonl(tmp_path / "data.jsonl", CHATML_RECORDS)
    r = zerotrain_here(capfd, "prepare", path, str(tmp_path / "out"), "--tokenizer", str(model), "--val-fraction", "0")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "2 chats rendered with the model's own chat template (the completion trained" in r.stdout, r.stdout
    assert [(list(t), list(m)) for t, m in read_prepared(tmp_path / "out")] == trl_view(hf, CHATML_RECORDS)
    r = zerotrain_here(capfd, "train", "--init-from", str(model), "--data", path, "--data-cache",
                       str(tmp_path / "cache"), "--val-fraction", "0", "--steps", "2", "--micro-batch", "2",
                       "--truncate", "--no-progress", "--out", str(tmp_path / "run"))  # a 77-token record, rows of 64
    assert r.returncode == 0, r.stderr[-2000:]
    assert " 2 records, " in r.stdout, r.stdout


def test_a_parquet_table_of_them_prepares_as_the_same_json_lines(tmp_path):
    pyarrow = pytest.importorskip("pyarrow")
    import pyarrow.parquet

    tokenizer_folder(tmp_path / "chatml", template=CHATML, eos="<|im_end|>")
    records = [*CHATML_RECORDS, {**CHATML_RECORDS[0], "prompt": [{"role": "user", "content": "3 plus 3?",
                                                                   "name": "ann"}]}]
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), str(tmp_path / "data.parquet"))
    prepare_jsonl(str(tmp_path / "data.parquet"), str(tmp_path / "parquet"), str(tmp_path / "chatml"), 0.0)
    # a table gives every message each key of the column's (a null name here): absent keys, as in JSON Lines
    assert [(list(t), list(m)) for t, m in read_prepared(tmp_path / "parquet")] == \
        ours(tmp_path, tmp_path / "chatml", records)[0]
