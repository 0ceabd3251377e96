"""`zerotrain bench model`: the report's schema and table (figures are measured, never asserted)."""

import argparse
import json

import pytest

from zerotrain import bench


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bench_model_writes_its_json_report_and_markdown_table(tmp_path, capsys, arch):
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "out"
    args = parser.parse_args(["bench", "model", "--arch", arch, "--quick", "--repeats", "1", "--out", str(out)])
    assert args.func(args) == 0
    report = json.loads((out / "bench-model.json").read_text())
    assert report["schema"] == "zerotrain.bench.model" and report["arch"] == arch
    assert report["logits_max_abs_diff"] < 1e-4  # the two models hold the same weights: the timing compares like
    for key in ("train_step_s", "generation_s"):
        assert set(report[key]) == {"zerotrain", "transformers"} and all(v > 0 for v in report[key].values())
    assert set(report["met"]) == {"train", "generation"}
    table = (out / "bench-model.md").read_text()
    assert table.startswith(f"# bench model: {arch} (quick)") and len(table.strip().splitlines()) == 6
    assert "wrote bench-model.json and bench-model.md" in capsys.readouterr().out


def test_bench_model_lora_reports_zerotrain_lora_full_fine_tuning_and_peft_side_by_side(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "out"
    args = parser.parse_args(["bench", "model", "--lora", "--layers", "1", "--seq-len", "16", "--repeats", "1",
                              "--out", str(out)])
    assert args.func(args) == 0
    report = json.loads((out / "bench-model-lora.json").read_text())
    assert report["schema"] == "zerotrain.bench.model.lora" and report["lora_rank"] == 16
    assert report["logits_max_abs_diff"] < 1e-4  # the same base and adapters: the timing compares like with like
    runs = {"zerotrain LoRA", "peft LoRA", "zerotrain full"}
    assert set(report["train_step_s"]) == runs and all(v > 0 for v in report["train_step_s"].values())
    mem = report["memory_bytes"]
    # LoRA's AdamW state is the adapters' moments (8 bytes each); full fine-tuning's every parameter's
    lora, peft = mem["zerotrain LoRA"]["optimizer_state"], mem["peft LoRA"]["optimizer_state"]
    assert lora == 8 * report["adapter_params"] == peft
    assert mem["zerotrain full"]["optimizer_state"] == 8 * report["params"]
    table = (out / "bench-model-lora.md").read_text()
    assert table.startswith("# bench model --lora: smollm-135m shape, 1 of its 30 blocks")


def test_bench_model_moe_reports_zerotrains_expert_paths_and_transformers_side_by_side(tmp_path):
    parser = argparse.ArgumentParser()
    bench.add_parser(parser.add_subparsers(dest="command"))
    out = tmp_path / "out"
    args = parser.parse_args(["bench", "model", "--arch", "qwen3_moe", "--quick", "--repeats", "1", "--out", str(out)])
    assert args.func(args) == 0
    report = json.loads((out / "bench-model-moe.json").read_text())
    assert report["schema"] == "zerotrain.bench.model.moe" and report["model"]["n_experts"] == 8
    # the same weights in every run, zerotrain's grouped path too: the timing compares like with like
    assert max(report["logits_max_abs_diff"].values()) < 1e-4
    runs = {"zerotrain loop", "transformers eager", "transformers grouped_mm"} | (
        {"zerotrain grouped"} if report["grouped_mm"] else set())
    assert set(report["train_step_s"]) == runs and all(v > 0 for v in report["train_step_s"].values())
    tokens = report["batch"] * report["seq_len"]
    assert all(report["tokens_per_s"][k] == tokens / v for k, v in report["train_step_s"].items())
    mem = report["memory_bytes"]
    # the same parameters, stored per expert (zerotrain) or stacked (transformers): the same bytes, AdamW's 8 each
    assert {m["parameters"] for m in mem.values()} == {4 * report["params"]}
    assert {m["optimizer_state"] for m in mem.values()} == {8 * report["params"]}
    table = (out / "bench-model-moe.md").read_text()
    assert table.startswith("# bench model: qwen3_moe (quick)") and len(table.strip().splitlines()) == 6 + len(runs)
