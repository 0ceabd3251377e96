"""Chat records: the model folder's chat template, the loss on the assistant's turns only, equal to transformers'
assistant mask; templates without generation markers by growing prefixes, or refused; bad records named by line."""

from __future__ import annotations

import json

import pytest
from conftest import zerotrain_here
from model_folders import BOS, CHATML, CHATML_MARKED, IM_END, LLAMA3, LLAMA3_MARKED, llama_folder, read_prepared, \
    tokenizer_folder, write_jsonl
from test_user_errors import one_line_error

from zerotrain.data import chat as chat_module

pytestmark = pytest.mark.timeout(300)

CHATS = [
    [{"role": "user", "content": "Question 3: what is 3 plus 3?"}, {"role": "assistant", "content": "Answer: 6."}],
    [{"role": "system", "content": "The assistant answers."}, {"role": "user", "content": "Question 4:"},
     {"role": "assistant", "content": "8"}, {"role": "user", "content": "and 5 plus 5? ünïcödé"},
     {"role": "assistant", "content": "Answer: 10, the user asks 🙂"}],
    [{"role": "user", "content": "what is 1 plus 1?"}, {"role": "assistant", "content": ""},
     {"role": "user", "content": "again"}, {"role": "assistant", "content": "2\n"}],
]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tokenizer folders with ChatML, end of turn <|im_end|> as eos: marked, unmarked, and marked without a BOS
    post-processor; the transformers tokenizer of each."""
    root = tmp_path_factory.mktemp("chat")
    return {name: (root / name, tokenizer_folder(root / name, template=template, eos="<|im_end|>", bos=bos))
            for name, template, bos in [("marked", CHATML_MARKED, True), ("plain", CHATML, True),
                                        ("marked-no-bos", CHATML_MARKED, False)]}


def prepare(capfd, jsonl, out, tokenizer):
    return zerotrain_here(capfd, "prepare", str(jsonl), str(out), "--tokenizer", str(tokenizer), "--val-fraction", "0")


def ours(capfd, tmp_path, folder, name="out"):
    jsonl = write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS])
    r = prepare(capfd, jsonl, tmp_path / name, folder)
    assert r.returncode == 0, r.stderr
    return [(list(t), list(m)) for t, m in read_prepared(tmp_path / name)]


def transformers_view(hf):
    out = []
    for messages in CHATS:
        enc = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        out.append((list(enc["input_ids"]), list(enc["assistant_masks"])))
    return out


@pytest.mark.parametrize("name", ["marked", "marked-no-bos"])
def test_tokens_and_mask_equal_transformers_assistant_mask_and_a_planted_cut_turn_end_is_caught(
        folders, tmp_path, capfd, monkeypatch, name):
    folder, hf = folders[name]
    expected = transformers_view(hf)
    got = ours(capfd, tmp_path, folder)
    assert got == expected
    assert all(t[0] == BOS and t.count(BOS) == 1 for t, _ in got)  # the template's bos_token, not doubled
    assert all(m[len(t) - 1 - t[::-1].index(IM_END)] for t, m in got)  # the last turn's end (an assistant's) is trained
    render = chat_module.ChatTemplate.render

    def without_end_of_turn(self, messages, where):  # planted: each assistant span stops before its <|im_end|>
        text, spans = render(self, messages, where)
        return text, [(a, max(a, b - len("<|im_end|>"))) for a, b in spans]

    monkeypatch.setattr(chat_module.ChatTemplate, "render", without_end_of_turn)
    assert ours(capfd, tmp_path, folder, "planted") != expected


@pytest.mark.parametrize("layout", ["chatml", "llama3"])
def test_a_template_without_markers_gives_the_markers_mask_and_a_planted_trained_header_is_caught(
        folders, tmp_path, capfd, monkeypatch, layout):
    if layout == "chatml":
        marked_folder, plain_folder = folders["marked"][0], folders["plain"][0]
    else:
        marked_folder, plain_folder = tmp_path / "llama3-marked", tmp_path / "llama3"
        tokenizer_folder(marked_folder, template=LLAMA3_MARKED, eos="<|eot_id|>")
        tokenizer_folder(plain_folder, template=LLAMA3, eos="<|eot_id|>")
    marked = ours(capfd, tmp_path, marked_folder, "marked")
    assert ours(capfd, tmp_path, plain_folder, "plain") == marked
    assert json.load(open(tmp_path / "plain" / "meta.json"))["source"]["chat_template"] == "growing prefixes"
    text = chat_module.ChatTemplate._text

    def no_generation_prompt(self, messages, where, add_generation_prompt=False):  # planted: the header is trained
        return text(self, messages, where)

    monkeypatch.setattr(chat_module.ChatTemplate, "_text", no_generation_prompt)
    assert ours(capfd, tmp_path, plain_folder, "planted") != marked


def test_a_template_that_rewrites_earlier_turns_is_refused_naming_the_record(tmp_path, capfd):
    # the last assistant turn is written plainly, earlier ones with a mark: a longer conversation changes its prefix
    rewriting = CHATML.replace("message['content'] + '<|im_end|>' }}", "(message['content'] if loop.last else "
                                                                       "'(earlier) ' + message['content']) + "
                                                                       "'<|im_end|>' }}")
    tokenizer_folder(tmp_path / "rewrites", template=rewriting, eos="<|im_end|>")
    write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[0]}, {"messages": CHATS[1]}])
    line = one_line_error(prepare(capfd, tmp_path / "chats.jsonl", tmp_path / "out", tmp_path / "rewrites"))
    assert f"{tmp_path / 'chats.jsonl'}:2: the chat template of {tmp_path / 'rewrites'} does not render" in line
    assert "{% generation %}" in line


BAD = {
    "no assistant turn": ({"messages": [{"role": "user", "content": "hi"}]}, "no assistant message"),
    "unknown role": ({"messages": [{"role": "bot", "content": "x"}, {"role": "assistant", "content": "y"}]},
                     "message 0 has role 'bot'; a role is one of system, user, assistant, tool"),
    "content not text": ({"messages": [{"role": "user", "content": ["x"]}, {"role": "assistant", "content": "y"}]},
                         "message 0 (user) has content part 0 'x', not a text part"),
    "an image part": ({"messages": [{"role": "user", "content": [{"type": "image", "url": "x.png"}]},
                                    {"role": "assistant", "content": "y"}]},
                      "message 0 (user) has content part 0 a 'image' part: zerotrain trains on text"),
    "content a number": ({"messages": [{"role": "user", "content": 3}, {"role": "assistant", "content": "y"}]},
                         "message 0 (user) has content 3, not a string or a list of text parts"),
    "a key not read": ({"messages": [{"role": "user", "content": "x"},
                                     {"role": "assistant", "content": "y", "loss": False}]},
                       "message 1 (assistant) has the key 'loss', which zerotrain does not read (a message's keys: "
                       "role, content, reasoning_content, thinking, reasoning, tool_calls, tool_call_id, name, "
                       "weight)"),
    "a weight other than 0 or 1": ({"messages": [{"role": "user", "content": "x"},
                                                 {"role": "assistant", "content": "y", "weight": 0.5}]},
                                   "message 1 (assistant) has weight 0.5: a turn's weight is 0 (context, not trained) "
                                   "or 1"),
    "every assistant turn of weight 0": ({"messages": [{"role": "user", "content": "x"},
                                                       {"role": "assistant", "content": "y", "weight": 0}]},
                                         "every assistant message has weight 0"),
    "messages not a list": ({"messages": "hello"}, "\"messages\" is 'hello', not a list"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_a_bad_chat_record_is_named_by_its_line(folders, tmp_path, capfd, case):
    record, said = BAD[case]
    write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[0]}, {"messages": CHATS[1]}, record])
    line = one_line_error(prepare(capfd, tmp_path / "chats.jsonl", tmp_path / "out", folders["marked"][0]))
    assert f"{tmp_path / 'chats.jsonl'}:3: {said}" in line, line


def test_chats_without_a_chat_template_and_bad_chats_given_to_train_are_refused_in_one_line(tmp_path, capfd):
    tokenizer_folder(tmp_path / "base")  # no chat template
    write_jsonl(tmp_path / "chats.jsonl", [{"messages": CHATS[0]}])
    line = one_line_error(prepare(capfd, tmp_path / "chats.jsonl", tmp_path / "out", tmp_path / "base"))
    assert f"{tmp_path / 'chats.jsonl'}:1: a chat record, and {tmp_path / 'base'} has no chat template" in line
    model = tmp_path / "instruct"
    llama_folder(model, template=CHATML, eos="<|im_end|>")
    write_jsonl(tmp_path / "bad.jsonl", [{"messages": CHATS[0]}, {"messages": [{"role": "user", "content": "hi"}]}])
    cache = tmp_path / "cache"
    line = one_line_error(zerotrain_here(capfd, "train", "--init-from", str(model), "--data",
                                         str(tmp_path / "bad.jsonl"), "--data-cache", str(cache), "--steps", "1",
                                         "--no-progress", "--out", str(tmp_path / "run")))
    assert f"{tmp_path / 'bad.jsonl'}:2: no assistant message" in line
    assert not (tmp_path / "run").exists() and not [p for p in cache.iterdir() if p.is_dir()]  # nothing half-made


def test_train_on_chats_prepares_them_with_the_models_template_and_trains_only_the_assistant(tmp_path, capfd):
    model = tmp_path / "instruct"
    hf = llama_folder(model, template=CHATML_MARKED, eos="<|im_end|>")
    write_jsonl(tmp_path / "chats.jsonl", [{"messages": m} for m in CHATS])
    cache = tmp_path / "cache"
    r = zerotrain_here(capfd, "train", "--init-from", str(model), "--data", str(tmp_path / "chats.jsonl"),
                       "--data-cache", str(cache), "--val-fraction", "0", "--steps", "2", "--micro-batch", "2",
                       "--truncate", "--no-progress", "--out", str(tmp_path / "run"))  # a 77-token chat, rows of 64
    assert r.returncode == 0, r.stderr[-2000:]
    (folder,) = [p for p in cache.iterdir() if p.is_dir()]
    assert json.load(open(folder / "meta.json"))["source"]["chats"] == len(CHATS)
    assert [(list(t), list(m)) for t, m in read_prepared(folder)] == transformers_view(hf)
    assert "(train): " in r.stdout and " 3 records, " in r.stdout  # the start line counts them


# CHATS[1] with its first assistant turn ("8") kept as context: axolotl's "weight": 0
WEIGHTED = [dict(m, weight=0) if k == 2 else m for k, m in enumerate(CHATS[1])]
SHAREGPT_SPEAKERS = {"system": "system", "user": "human", "assistant": "gpt"}


def runs_of_ones(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s: a trained turn each in a ChatML chat."""
    edges = [0, *mask, 0]
    starts = [j for j in range(len(mask)) if edges[j + 1] and not edges[j]]
    return [(s, next(e for e in range(s, len(mask) + 1) if not edges[e + 1])) for s in starts]


@pytest.mark.parametrize("name", ["marked", "plain"])
def test_a_turn_of_weight_0_is_context_in_messages_and_sharegpt_alike_and_a_planted_ignored_weight_is_caught(
        folders, tmp_path, capfd, monkeypatch, name):
    folder = folders[name][0]
    ids, full = transformers_view(folders["marked"][1])[1]  # the unweighted chat, as transformers masks it
    first, last = runs_of_ones(full)  # both assistant turns
    expected = [0 if first[0] <= j < first[1] else v for j, v in enumerate(full)]  # the first turn untrained
    sharegpt = {"conversations": [{"from": SHAREGPT_SPEAKERS[m["role"]], "value": m["content"],
                                   **({"weight": m["weight"]} if "weight" in m else {})} for m in WEIGHTED]}

    def prepared(records, out):
        r = prepare(capfd, write_jsonl(tmp_path / f"{out}.jsonl", records), tmp_path / out, folder)
        assert r.returncode == 0, r.stderr
        return [(list(t), list(m)) for t, m in read_prepared(tmp_path / out)]

    assert prepared([{"messages": WEIGHTED}], "messages") == [(ids, expected)]
    assert prepared([sharegpt], "sharegpt") == [(ids, expected)]
    assert runs_of_ones(expected) == [last]
    monkeypatch.setattr(chat_module, "is_trained", lambda message: True)  # planted: the weight read and ignored
    assert prepared([sharegpt], "planted") == [(ids, full)] != [(ids, expected)]
