"""Mixtures (--data A:0.75 --data B:0.25): each step's rows drawn among the sources in proportion to their weights,
by (seed, data step) alone; each source read on from where the steps before left it, so the split over ranks and a
resume (at the same or another global batch) change nothing; the tokens each source gave in every step record and in
summary.json."""

from __future__ import annotations

import copy
import functools
import json
import os
import shutil
from unittest import mock

import numpy as np
import pytest
import torch
from conftest import tiny_config
from test_epochs import global_rows, row_records
from test_packing import make_records, write_records

from zerotrain import checkpoint
from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser, main
from zerotrain.config import Config, data_sources, merge
from zerotrain.data import MixtureSource, make_source, mixture
from zerotrain.runtime.launch import run_job
from zerotrain.training.loop import train
from zerotrain.training.metrics import Metrics


def record_folder(path, n=60, seed=0):
    """A JSON Lines record folder (bytes) with a validation split: the training records again."""
    folder = write_records(path, make_records(n, seed))
    for ext in ("bin", "mask", "records"):
        shutil.copy(folder / f"train.{ext}", folder / f"val.{ext}")
    return folder


def mixture_config(tmp_path, folder, *, world=1, micro=8, accum=1, steps=4, seed=0):
    cfg = tiny_config(tmp_path / "run", nproc=world, micro=micro, accum=accum, steps=steps, seed=seed,
                      data=f"{folder}:0.75\nsynthetic:0.25")
    cfg.model.vocab_size, cfg.model.seq_len = 256, 32
    return cfg


def shares(source: MixtureSource, steps: int) -> np.ndarray:
    rows = sum(source.counts(s) for s in range(steps))
    return rows / rows.sum()


def test_paths_with_colons_stay_whole_and_weights_split_on_the_last_colon():
    assert data_sources("a.jsonl") == [("a.jsonl", None)]
    assert data_sources("a.jsonl:0.7\nb:c/d.jsonl:3") == [("a.jsonl", 0.7), ("b:c/d.jsonl", 3.0)]
    assert data_sources("C:/data/x.jsonl") == [("C:/data/x.jsonl", None)]  # what follows is no number
    assert data_sources("runs:12:0.5") == [("runs:12", 0.5)]  # a path ending in :NUMBER, given with a weight
    parser = build_parser()  # --data again without weights: the last wins, as before mixtures
    assert parser.parse_args(["train", "--data", "a", "--data", "b"]).data == "b"
    assert parser.parse_args(["train", "--data", "a:1", "--data", "b:3"]).data == "a:1\nb:3"
    from_toml = Config()  # TOML: a list, held as the flags given several times hold it
    merge(from_toml, {"data": {"data": ["a.jsonl:0.7", "b.jsonl:0.3"]}}, origin="test")
    assert data_sources(from_toml.data.source) == [("a.jsonl", 0.7), ("b.jsonl", 0.3)]


def test_rows_follow_the_weights_and_the_split_over_ranks_changes_no_step(tmp_path):
    folder = record_folder(tmp_path / "d")
    source = make_source(mixture_config(tmp_path, folder))
    assert isinstance(source, MixtureSource) and source.names == [str(folder), "synthetic"]
    odd = make_source(mixture_config(tmp_path, folder, micro=6))  # 4.5 and 1.5 rows a step: drawn
    assert all(odd.counts(s).sum() == 6 and odd.counts(s)[1] in (1, 2) for s in range(200))
    got = shares(odd, 200)
    assert np.abs(got - [0.75, 0.25]).max() < 0.03, got
    # the records source is read as one stream, row after row: step s reads on from the rows steps 0..s-1 took
    rows = [source.plan(s)[1][source.plan(s)[0] == 0] for s in range(20)]
    assert np.array_equal(np.concatenate(rows), np.arange(sum(len(r) for r in rows)))
    # the same rows however ranks, micro-batches and accumulation split the step
    for step in (0, 7):
        want = global_rows(source, step, 1, 8, 1)
        for world, micro, accum in [(2, 2, 2), (4, 1, 2)]:
            got_rows = global_rows(source, step, world, micro, accum)
            assert all(torch.equal(a, b) for a, b in zip(want, got_rows)), (world, micro, accum)


def plans(cfg, steps):
    source = make_source(cfg)
    return [np.concatenate(source.plan(s)) for s in range(steps)]


def test_the_split_depends_only_on_seed_and_step_and_an_unseeded_draw_is_caught(tmp_path, monkeypatch):
    folder = record_folder(tmp_path / "d")
    cfg = mixture_config(tmp_path, folder, micro=6)  # 4.5 and 1.5 rows a step: the counts are drawn too
    first, again = plans(cfg, 5), plans(cfg, 5)
    assert all(np.array_equal(a, b) for a, b in zip(first, again))
    other_seed = plans(mixture_config(tmp_path, folder, micro=6, seed=1), 5)
    assert not all(np.array_equal(a, b) for a, b in zip(first, other_seed))
    # planted: the split's uniforms, then the placement of the rows, drawn from torch's global generator
    with monkeypatch.context() as m:
        m.setattr(mixture, "step_uniforms", lambda seed, steps: torch.rand(len(steps), dtype=torch.float64).numpy())
        planted, planted_again = plans(cfg, 5), plans(cfg, 5)
        assert not all(np.array_equal(a, b) for a, b in zip(planted, planted_again))
    monkeypatch.setattr(mixture, "step_generator",
                        lambda seed, step: np.random.default_rng(int(torch.randint(2**31, ()))))
    planted, planted_again = plans(cfg, 5), plans(cfg, 5)
    assert not all(np.array_equal(a, b) for a, b in zip(planted, planted_again))


def test_a_resume_at_another_global_batch_reads_each_source_on_and_a_forgotten_position_is_caught(tmp_path,
                                                                                                  monkeypatch):
    folder = record_folder(tmp_path / "d")
    cfg = mixture_config(tmp_path, folder)
    run = make_source(cfg)
    at = 10
    resumed = make_source(cfg)
    resumed.continue_layout([[0, 8]], at)
    assert all(np.array_equal(np.concatenate(run.plan(s)), np.concatenate(resumed.plan(s))) for s in range(at, 14))
    small = copy.deepcopy(cfg)
    small.loop.micro_batch = 6
    resized = make_source(small)
    resized.continue_layout([[0, 8]], at)
    before = run.rows_before(at)
    assert np.array_equal(resized.rows_before(at), before)  # each source reads on where the run stopped
    assert all(resized.counts(s).sum() == 6 for s in range(at, at + 5))
    records = resized.plan(at)[1][resized.plan(at)[0] == 0]
    assert np.array_equal(records, before[0] + np.arange(len(records)))
    # planted: the resumed run forgets the rows the steps before it took, and reads each source from its start
    monkeypatch.setattr(MixtureSource, "rows_before", lambda self, step: np.zeros(len(self.names), dtype=np.int64))
    forgetful = make_source(small)
    forgetful.continue_layout([[0, 8]], at)
    assert not np.array_equal(forgetful.plan(at)[1][forgetful.plan(at)[0] == 0], records)


def resume_job(cfg, comm, *, resume_at: int) -> dict:
    """An uninterrupted run saving at `resume_at`; a fresh run resumed from that checkpoint; and, planted, a resume
    whose sources start over from their first rows. Rank 0's summary is summary.json's figures."""
    def outcome(result):
        return {"losses": [r["loss"] for r in result.records], "digests": result.digests,
                "records": result.records, "summary": result.report.get("summary")}

    first = outcome(train(cfg, comm))
    resumed = copy.deepcopy(cfg)
    resumed.checkpoint.resume = os.path.join(cfg.checkpoint.dir, checkpoint.step_name(resume_at))
    resumed.checkpoint.every, resumed.checkpoint.final_save, resumed.logging.metrics = 0, False, ""
    again = outcome(train(resumed, comm))
    with mock.patch.object(MixtureSource, "rows_before",
                           lambda self, step: np.zeros(len(self.names), dtype=np.int64)):
        forgetful = outcome(train(resumed, comm))
    return {"first": first, "resumed": again, "forgetful": forgetful}


@pytest.mark.timeout(300)
def test_two_ranks_resume_a_mixture_bitwise_with_tokens_and_validation_per_source(tmp_path, capfd):
    folder = record_folder(tmp_path / "d")
    cfg = mixture_config(tmp_path, folder, world=2, micro=2, accum=2, steps=4)
    cfg.checkpoint.every, cfg.loop.eval_every, cfg.loop.eval_batches = 2, 2, 1
    out = run_job(functools.partial(resume_job, resume_at=2), cfg, time_limit=120)
    printed = capfd.readouterr().out
    # `zerotrain eval` of the run's last checkpoint: each source's validation loss, the one training reported at
    # that step, and the mixture's by its weights
    assert main(["eval", os.path.join(cfg.checkpoint.dir, checkpoint.step_name(4)), "--batches", "1"]) == 0
    lines = capfd.readouterr().out.splitlines()
    evaluated_at_4 = next(r for r in out["first"]["records"] if r["step"] == 4 and "val_loss" in r)
    for line, name in zip(lines, (str(folder), "synthetic")):
        assert f"sequences of {name}, validation split" in line, lines
        assert float(line.split()[1]) == pytest.approx(evaluated_at_4["source_val_loss"][name], rel=1e-5)
    assert lines[2].startswith("val_loss ") and "the mixture" in lines[2] and len(lines) == 3, lines
    assert float(lines[2].split()[1]) == pytest.approx(evaluated_at_4["val_loss"], rel=1e-5)
    assert f"data a mixture of 2 sources, rows drawn per step: 0.75 of --data {folder} (train)" in printed
    first, resumed, forgetful = out["first"], out["resumed"], out["forgetful"]
    assert resumed["losses"] == first["losses"][2:] and resumed["digests"] == first["digests"]
    assert forgetful["losses"] != first["losses"][2:] and forgetful["digests"] != first["digests"]
    source = make_source(cfg)
    for r in first["records"]:
        assert r["source_tokens"] == source.source_tokens(r["step"] - 1)
        assert sum(r["source_tokens"].values()) == r["tokens"] and r["source_epochs"] == {str(folder): 1}
    evaluated = [r for r in first["records"] if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [2, 4]
    for r in evaluated:  # the validation loss is the sources' own, weighed as the mixture weighs them
        losses = r["source_val_loss"]
        assert set(losses) == {str(folder), "synthetic"}
        assert r["val_loss"] == pytest.approx(0.75 * losses[str(folder)] + 0.25 * losses["synthetic"])
    assert first["summary"]["source_tokens"] == {name: sum(r["source_tokens"][name] for r in first["records"])
                                        for name in (str(folder), "synthetic")}


def test_a_bad_weight_or_sources_of_different_vocabularies_are_one_line_exit_2(tmp_path, capsys):
    raw = []  # nanoGPT's token files state no vocabulary: the model's is the largest id + 1 over all of them
    for name, top in [("x", 40), ("y", 90)]:
        (tmp_path / name).mkdir()
        np.arange(top + 1, dtype=np.uint16).tofile(tmp_path / name / "train.bin")
        raw.append(str(tmp_path / name))
    cfg = config_from_args(build_parser().parse_args(["train", "--data", f"{raw[0]}:1", "--data", f"{raw[1]}:1"]),
                           environment=False)
    assert cfg.model.vocab_size == 91
    capsys.readouterr()
    a, b = record_folder(tmp_path / "a"), record_folder(tmp_path / "b")
    (a / "meta.json").write_text(json.dumps({"vocab_size": 256}))
    (b / "meta.json").write_text(json.dumps({"vocab_size": 300}))
    for argv, says in [(["--data", f"{a}:0.7", "--data", f"{b}:-0.3"], f"--data {b}:-0.3: the weight '-0.3' is not "
                                                                        "a positive number"),
                       (["--data", f"{a}:0", "--data", f"{b}:1"], f"--data {a}:0: the weight '0' is not a positive"),
                       (["--data", f"{a}:0.7", "--data", str(b)], f"--data {b}: a mixture of several --data needs a "
                                                                  "weight on each"),
                       (["--data", f"{a}:0.7", "--data", f"{a}:0.3"], f"--data {a} is named twice in the mixture"),
                       (["--data", f"{a}:0.7", "--data", f"{b}:0.3"], f"--data {b}: a vocabulary of 300 ids, --data "
                                                                      f"{a}'s a vocabulary of 256 ids")]:
        assert main(["train", "--steps", "1", *argv]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and says in err, err


def test_sources_with_two_tokenizers_of_one_size_are_one_line_exit_2(tmp_path, capsys, monkeypatch):
    """Two token folders whose tokenizer.json files have the same size and end-of-text id but give ids other tokens
    (two ids swapped): a mixture of them would train on ids that mean different things. Planted: comparing only the
    tokenizers' kind, size and end-of-text id lets it through."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from zerotrain.data import resolve

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(["the sum of two and three is five"] * 20, trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    folders = []
    for name in ("one", "swapped"):
        state = json.loads(tokenizer.to_str())
        if name == "swapped":
            vocab = state["model"]["vocab"]
            a, b = sorted(vocab, key=vocab.get)[100:102]
            vocab[a], vocab[b] = vocab[b], vocab[a]
        (tmp_path / name).mkdir()
        (tmp_path / name / "tokenizer.json").write_text(json.dumps(state))
        np.arange(200, dtype=np.uint16).tofile(tmp_path / name / "train.bin")
        (tmp_path / name / "meta.json").write_text(json.dumps({"vocab_size": tokenizer.get_vocab_size()}))
        folders.append(str(tmp_path / name))
    argv = ["train", "--steps", "1", "--data", f"{folders[0]}:0.5", "--data", f"{folders[1]}:0.5"]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"--data {folders[1]}: " in err, err
    monkeypatch.setattr(resolve, "read_tokenizer_file", lambda path: tokenizer)  # planted: the files not compared
    assert config_from_args(build_parser().parse_args(argv), environment=False).model.vocab_size == \
        tokenizer.get_vocab_size()


def test_tensorboard_and_wandb_get_each_sources_figures(tmp_path):
    logged = []

    class Board:
        def add_scalar(self, key, value, step):
            logged.append((key, value, step))

    class Run:
        def log(self, values):
            logged.append(values)

    metrics = Metrics(str(tmp_path / "metrics.jsonl"), active=True, progress=False, start=0, total=1)
    metrics.board, metrics.wandb = Board(), Run()
    metrics.log({"step": 1, "loss": 2.0, "tokens": 7, "source_tokens": {"a": 5, "b": 2},
                 "source_val_loss": {"a": 1.5, "b": 2.5}, "val_loss": 1.75})
    assert {("source_tokens/a", 5, 1), ("source_tokens/b", 2, 1), ("source_val_loss/a", 1.5, 1),
            ("source_val_loss/b", 2.5, 1), ("val_loss", 1.75, 1)} <= set(logged[:-1])
    assert {"source_tokens/a": 5, "source_val_loss/b": 2.5, "tokens": 7}.items() <= logged[-1].items()
    metrics.file.close()
