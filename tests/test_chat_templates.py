"""Reasoning, tool calls, tool results, tools and multi-turn chats through the real chat templates of Qwen3, Llama 3.1,
gpt-oss and Gemma 3 (TRL's package's copies, as their model repositories ship them): zerotrain's tokens and loss mask
equal transformers' assistant mask under the training template zerotrain chose, and what the template cannot write
is refused naming the record."""

from __future__ import annotations

import json
import os

import pytest
import transformers
from conftest import tiny_config, zerotrain_here
from model_folders import family_folder, read_prepared, write_jsonl
from test_user_errors import one_line_error
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from zerotrain.data import chat as chat_module
from zerotrain.data import jsonl as jsonl_module
from zerotrain.data import templates as templates_module
from zerotrain.data.jsonl import prepare_jsonl
from zerotrain.errors import ConfigError

pytestmark = pytest.mark.timeout(300)

TRL_TEMPLATES = templates_module.trl_folder()
# Each family's special tokens (what its tokenizer knows), its BOS (written by the post-processor and the template) and
# its end of a turn (eos_token).
FAMILIES = {
    "qwen3": (["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>",
               "<tool_response>", "</tool_response>"], None, "<|im_end|>"),
    "llama3_1": (["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
                  "<|eom_id|>", "<|python_tag|>"], "<|begin_of_text|>", "<|eot_id|>"),
    "gptoss": (["<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                "<|return|>", "<|call|>", "<|constrain|>"], None, "<|return|>"),
    "gemma3": (["<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>", "<start_of_image>"], "<bos>", "<eos>"),
}
TEXTS = [f"The weather in city {i} is {i % 40} degrees; the user asks and the assistant answers, thinking first."
         for i in range(200)]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city, in degrees",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def call(name: str, **arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


TOOL_CHAT = {"tools": [WEATHER], "messages": [
    {"role": "user", "content": "The weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Paris")]},
    {"role": "tool", "name": "get_weather", "content": "{\"degrees\": 18}"},
    {"role": "assistant", "reasoning_content": "The tool says 18 degrees.", "content": "18 degrees in Paris."}]}
MULTI_TURN = {"messages": [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "What is 1 plus 1?"},
    {"role": "assistant", "reasoning_content": "One and one make two.", "content": "2"},
    {"role": "user", "content": "And 2 plus 2?"},
    {"role": "assistant", "reasoning_content": "Two and two make four.", "content": "4"}]}
PLAIN_MULTI_TURN = {"messages": [{k: v for k, v in m.items() if k != "reasoning_content"}
                                 for m in MULTI_TURN["messages"]]}
PARTS = {"messages": [  # content as a list of text parts
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": [{"type": "text", "text": "What is 1 plus 1?"}]},
    {"role": "assistant", "content": "2"},
    {"role": "user", "content": "And 2 plus 2?"},
    {"role": "assistant", "content": [{"type": "text", "text": "4, as 2 and 2 make 4."}]}]}
# gpt-oss writes reasoning only on the last turn and a tool call's analysis only without a later final answer: the
# records give it where the template writes it
GPTOSS_TOOL_CHAT = {"tools": [WEATHER], "messages": [
    {"role": "system", "content": "Answer briefly."},
    {"role": "user", "content": "The weather in Paris?"},
    {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Paris")]},
    {"role": "tool", "content": "{\"degrees\": 18}"},
    {"role": "assistant", "reasoning_content": "The tool says 18 degrees.", "content": "18 degrees in Paris."}]}
GPTOSS_MULTI_TURN = {"messages": [*PLAIN_MULTI_TURN["messages"][:-1], MULTI_TURN["messages"][-1]]}
RECORDS = {
    "qwen3": [TOOL_CHAT, MULTI_TURN, PLAIN_MULTI_TURN],
    "llama3_1": [{**TOOL_CHAT, "messages": [{k: v for k, v in m.items() if k != "reasoning_content"}
                                             for m in TOOL_CHAT["messages"]]}, PLAIN_MULTI_TURN],
    "gptoss": [GPTOSS_TOOL_CHAT, GPTOSS_MULTI_TURN, PLAIN_MULTI_TURN],
    "gemma3": [PARTS, PLAIN_MULTI_TURN],
}


def llama3_1_marked(template: str) -> str:
    """Llama 3.1's template with {% generation %} markers where the assistant writes (a content turn's content and
    <|eot_id|>, a tool call's JSON and <|eot_id|>; builtin tools not used here): the oracle of its mask."""
    plain = ("{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
             "'<|eot_id|>' }}")
    call_json = ("""            {{- '{"name": "' + tool_call.name + '", ' }}\n            {{- '"parameters": ' }}\n"""
                 """            {{- tool_call.arguments | tojson }}\n            {{- "}" }}\n        {%- endif %}\n"""
                 """        {%- if builtin_tools is defined %}\n            {#- This means we're in ipython mode #}\n"""
                 """            {{- "<|eom_id|>" }}\n        {%- else %}\n            {{- "<|eot_id|>" }}\n"""
                 """        {%- endif %}""")
    assert plain in template and call_json in template, "TRL's llama3_1.jinja changed: update the markers"
    return template.replace(plain, (
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}{%- if message['role'] == "
        "'assistant' %}{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endgeneration %}"
        "{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}")).replace(call_json, (
        """{%- generation %}{{- '{"name": "' + tool_call.name + '", "parameters": ' + tool_call.arguments | tojson"""
        """ + "}<|eot_id|>" }}{%- endgeneration %}{%- endif %}"""))


def trl_template(name: str) -> str:
    with open(os.path.join(TRL_TEMPLATES, name), encoding="utf-8") as f:
        return f.read()


def family_tokenizer(folder, family: str):
    """A byte-level BPE that knows the family's special tokens, with its BOS post-processor, its bos/eos and its real
    chat template as TRL's package keeps it, saved as transformers saves a model's tokenizer; the transformers
    tokenizer."""
    specials, bos, eos = FAMILIES[family]
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(TEXTS, trainer=trainers.BpeTrainer(
        vocab_size=400, special_tokens=specials, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if bos:
        tokenizer.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[
            (bos, tokenizer.token_to_id(bos))])
    hf = transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token=eos,
                                              **({"bos_token": bos} if bos else {}))
    hf.chat_template = trl_template(f"{family}.jinja")
    hf.save_pretrained(str(folder))
    return hf


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {family: (root / family, family_tokenizer(root / family, family)) for family in FAMILIES}


def transformers_view(hf, records, template):
    """transformers' tokens and assistant mask of each record under `template`."""
    out = []
    for r in records:
        enc = hf.apply_chat_template(r["messages"], tools=r.get("tools"), chat_template=template, tokenize=True,
                                     return_dict=True, return_assistant_tokens_mask=True)
        out.append((list(enc["input_ids"]), list(enc["assistant_masks"])))
    return out


def ours(tmp_path, folder, records, name="out", chat_template=None):
    path = write_jsonl(tmp_path / f"{name}.jsonl", records)
    meta = prepare_jsonl(path, str(tmp_path / name), str(folder), 0.0, chat_template)
    return [(list(t), list(m)) for t, m in read_prepared(tmp_path / name)], meta["source"]["template"]


def plant_trained_results(monkeypatch) -> None:
    """Planted: the spans of the tool results (and of the user turns: Gemma 3's records have no tool turn) trained on,
    the text unchanged."""
    render = chat_module.ChatTemplate.render

    def trained_results(self, messages, where, **context):
        text, spans = render(self, messages, where, **context)
        results = [(at, at + len(m["content"])) for m in messages if m["role"] in ("tool", "user")
                   if isinstance(m["content"], str) and (at := text.find(m["content"])) >= 0]
        return text, sorted(spans + results)

    monkeypatch.setattr(chat_module.ChatTemplate, "render", trained_results)


def caught(expected, prepare) -> bool:
    """Whether a planted bug shows: the prepared records differ from the oracle's, or preparing them is refused."""
    try:
        return prepare() != expected
    except ConfigError:
        return True


@pytest.mark.skipif(TRL_TEMPLATES is None, reason="TRL's package holds the real templates (the test extra has it)")
@pytest.mark.parametrize("family", ["qwen3", "gptoss", "gemma3"])
def test_tokens_and_mask_equal_transformers_under_trls_training_variant_and_planted_bugs_are_caught(
        families, tmp_path, monkeypatch, family):
    from trl.chat_template_utils import get_training_chat_template

    folder, hf = families[family]
    variant = get_training_chat_template(hf)  # TRL's own choice for this tokenizer: the oracle of ours
    assert variant == trl_template(f"{family}_training.jinja")
    records = RECORDS[family]
    expected = transformers_view(hf, records, variant)
    got, template = ours(tmp_path, folder, records)
    assert got == expected
    assert template["origin"] == "trl" and template["name"] == family
    assert f"the training variant of {family} from TRL" in template["said"]
    assert all(sum(m) for _, m in got)  # every record trains on something
    if family == "qwen3":  # the variant keeps every turn's reasoning: the first answer's is trained on
        assert "One and one make two." in hf.decode([t for t, m in zip(*got[1]) if m])

    check = jsonl_module.check_messages

    def without_reasoning(record, where, **options):  # planted: reasoning_content dropped on the way to the template
        messages, context = check(record, where, **options)
        return [{k: v for k, v in m.items() if k != "reasoning_content"} for m in messages], context

    if family != "gemma3":  # Gemma 3's records hold no reasoning
        monkeypatch.setattr(jsonl_module, "check_messages", without_reasoning)
        assert caught(expected, lambda: ours(tmp_path, folder, records, "dropped")[0])
        monkeypatch.undo()
    plant_trained_results(monkeypatch)
    assert caught(expected, lambda: ours(tmp_path, folder, records, "tool-trained")[0])
    monkeypatch.undo()
    monkeypatch.setattr(templates_module, "training_variant", lambda template: None)  # planted: the model's own
    assert caught(expected, lambda: ours(tmp_path, folder, records, "own")[0])


@pytest.mark.skipif(TRL_TEMPLATES is None, reason="TRL's package holds the real templates (the test extra has it)")
def test_llama3_1_trains_its_own_template_by_growing_prefixes_as_its_marked_copy_and_a_trained_tool_result_is_caught(
        families, tmp_path, monkeypatch):
    folder, hf = families["llama3_1"]
    records = RECORDS["llama3_1"]
    own = hf.chat_template
    assert templates_module.training_variant(own) is None  # TRL keeps no variant of it: it is prefix-preserving
    marked = llama3_1_marked(own)
    expected = transformers_view(hf, records, marked)
    assert [t for t, _ in expected] == [t for t, _ in transformers_view(hf, records, own)]  # the markers add no text
    got, template = ours(tmp_path, folder, records)
    assert got == expected
    assert template["origin"] == "model" and "growing prefixes" in template["said"]
    assert "Environment: ipython" in hf.decode(got[0][0])  # the record's tools reach the template
    (tmp_path / "marked.jinja").write_text(marked)  # the user's file, marked: the same records, the same bytes
    got, template = ours(tmp_path, folder, records, "file", chat_template=str(tmp_path / "marked.jinja"))
    assert got == expected and template["origin"] == "file"

    plant_trained_results(monkeypatch)
    assert caught(expected, lambda: ours(tmp_path, folder, records, "planted")[0])


@pytest.mark.skipif(TRL_TEMPLATES is None, reason="TRL's package holds the real templates (the test extra has it)")
def test_a_value_the_template_cannot_write_is_refused_naming_the_record_and_a_planted_silent_drop_is_caught(
        families, tmp_path, capfd, monkeypatch):
    folder, _ = families["llama3_1"]
    path = write_jsonl(tmp_path / "reasoning.jsonl", [PLAIN_MULTI_TURN, MULTI_TURN])  # Llama 3.1 writes no reasoning
    line = one_line_error(zerotrain_here(capfd, "prepare", path, str(tmp_path / "out"), "--tokenizer", str(folder)))
    assert (f"{path}:2: the chat template of {folder} does not write message 2's reasoning_content ('One and one "
            "make two.'), so the conversation would be trained on without it") in line
    gemma, _ = families["gemma3"]  # Gemma 3 writes no tools and no tool calls
    with pytest.raises(ConfigError, match=r"tools\.jsonl:1: the training variant of gemma3 from TRL refuses this "
                                          r"conversation|tools\.jsonl:1: .* does not write"):
        ours(tmp_path, gemma, [TOOL_CHAT], "tools")
    monkeypatch.setattr(chat_module, "unwritten", lambda *a: None)  # planted: what the template drops goes unseen
    r = zerotrain_here(capfd, "prepare", path, str(tmp_path / "planted"), "--tokenizer", str(folder))
    assert r.returncode == 0


@pytest.mark.skipif(TRL_TEMPLATES is None, reason="TRL's package holds the real templates (the test extra has it)")
def test_qwen3_multi_turn_without_a_training_variant_is_refused_saying_where_one_comes_from(families, tmp_path,
                                                                                            monkeypatch):
    folder, _ = families["qwen3"]
    monkeypatch.setattr(templates_module, "trl_folder", lambda: None)  # TRL not installed
    with pytest.raises(ConfigError, match=r"multi\.jsonl:1: the chat template of .* does not render this conversation "
                                          r"as a growing prefix .* pip install 'zerotrain\[chat\]'"):
        ours(tmp_path, folder, [MULTI_TURN], "multi")


def test_sharegpt_tool_turns_prepare_as_the_same_records_in_openai_shape(families, tmp_path):
    folder, _ = families["qwen3"]
    sharegpt = {"tools": json.dumps([WEATHER["function"]]), "conversations": [
        {"from": "human", "value": "The weather in Paris?"},
        {"from": "function_call", "value": json.dumps({"name": "get_weather", "arguments": {"city": "Paris"}})},
        {"from": "observation", "value": "{\"degrees\": 18}"},
        {"from": "gpt", "value": "18 degrees in Paris."}]}
    openai = {"tools": [WEATHER], "messages": [
        {"role": "user", "content": "The weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call("get_weather", city="Paris")]},
        {"role": "tool", "content": "{\"degrees\": 18}"},
        {"role": "assistant", "content": "18 degrees in Paris."}]}
    assert ours(tmp_path, folder, [sharegpt], "sharegpt") == ours(tmp_path, folder, [openai], "openai")


@pytest.mark.skipif(TRL_TEMPLATES is None, reason="TRL's package holds the real templates (the test extra has it)")
def test_train_on_tool_calls_says_per_source_the_records_trained_tokens_and_the_template(tmp_path, capfd):
    model = tmp_path / "qwen3"
    family_folder(model, "qwen3", vocab_size=400, max_position_embeddings=512)
    family_tokenizer(model, "qwen3")
    data = write_jsonl(tmp_path / "tools.jsonl", [TOOL_CHAT, MULTI_TURN] * 4)
    r = zerotrain_here(capfd, "train", "--init-from", str(model), "--data", data, "--data-cache",
                       str(tmp_path / "cache"), "--val-fraction", "0", "--seq-len", "512", "--truncate", "--steps",
                       "1", "--micro-batch", "2", "--no-progress", "--out", str(tmp_path / "run"),
                       "--threads", "1")  # the tiny model gains nothing from a second thread; busy cores lose much
    assert r.returncode == 0, r.stderr[-2000:]
    start = r.stdout.splitlines()[0]
    assert f"--data {data} (train): " in start and " 8 records, " in start and " trained tokens, " in start
    assert "4 longer than the window (--seq-len 512 + 1 tokens), truncated" in start, start  # the tool chats
    assert "chats rendered with the training variant of qwen3 from TRL" in start, start


def test_tool_chats_in_parquet_prepare_as_in_json_lines_and_documents_the_template_drops_are_refused(families,
                                                                                                   tmp_path):
    import pyarrow
    import pyarrow.parquet

    folder, _ = families["qwen3"]
    records = [TOOL_CHAT, MULTI_TURN, PLAIN_MULTI_TURN]
    # a table gives every message every key of its column (null where a message has none): absent keys, not nulls
    pyarrow.parquet.write_table(pyarrow.Table.from_pylist(records), tmp_path / "tools.parquet")
    meta = prepare_jsonl(str(tmp_path / "tools.parquet"), str(tmp_path / "parquet"), str(folder), 0.0)
    assert meta["train"]["record_count"] == 3
    assert [(list(t), list(m)) for t, m in read_prepared(tmp_path / "parquet")] == ours(tmp_path, folder, records)[0]
    documents = {**PLAIN_MULTI_TURN, "documents": [{"title": "Sums", "text": "1 plus 1 is 2."}]}
    with pytest.raises(ConfigError, match=r"docs\.jsonl:1: the training variant of qwen3 from TRL does not write the "
                                          r"record's document 0 \('1 plus 1 is 2\.'\)"):
        ours(tmp_path, folder, [documents], "docs")


@pytest.mark.skipif(TRL_TEMPLATES is None, reason="TRL's package holds the real templates (the test extra has it)")
def test_train_s_chat_template_prepares_with_the_users_file_into_a_cache_of_its_own(families, tmp_path):
    from zerotrain.data import resolve_data

    folder, hf = families["llama3_1"]
    records = RECORDS["llama3_1"]
    (tmp_path / "marked.jinja").write_text(llama3_1_marked(hf.chat_template))
    cfg = tiny_config(tmp_path)
    cfg.data.source = write_jsonl(tmp_path / "chats.jsonl", records)
    cfg.data.cache_dir, cfg.data.val_fraction, cfg.checkpoint.init_from = str(tmp_path / "cache"), 0.0, str(folder)
    own = resolve_data(cfg).folder
    cfg.data.chat_template = str(tmp_path / "marked.jinja")
    spec = resolve_data(cfg)
    assert spec.folder != own  # the template is part of what the prepared copy is keyed by
    assert spec.chat_template == f"the chat template of --chat-template {tmp_path / 'marked.jinja'}"
    assert [(list(t), list(m)) for t, m in read_prepared(spec.folder)] == transformers_view(
        hf, records, llama3_1_marked(hf.chat_template))
    cfg.data.source = spec.folder  # token files: rendered already
    with pytest.raises(ConfigError, match="renders chat records, and --data .* is not records"):
        resolve_data(cfg)
