"""Throughput a user can read: the FLOPs formula against torch's count, the peak MFU is measured against, the figures
in the step records, the progress line and summary.json, W&B's offline run, and --profile-steps' traces."""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import json
import os
import statistics
import struct
import sys
import tempfile

import pytest
import torch
from conftest import zerotrain_here
from test_user_errors import one_line_error
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from zerotrain.cli.flags import config_from_args
from zerotrain.cli.main import build_parser
from zerotrain.config import PRESETS, Config, LoraConfig, ModelConfig, notes
from zerotrain.model import build_model, summed_token_loss
from zerotrain.model.loss import head_loss
from zerotrain.model.lora import add_adapters
from zerotrain.training import throughput
from zerotrain.training.metrics import Metrics, read_step_records

pytestmark = pytest.mark.timeout(240)

TINY = ["--preset", "tiny", "--data", "synthetic", "--micro-batch", "2", "--threads", "1", "--no-progress"]


def counted_flops(m: ModelConfig, batch: int = 2, recompute: bool = False, lora: LoraConfig | None = None) -> int:
    """What torch's FlopCounterMode counts in one forward and backward of the model (SDPA's math kernel: the CPU's
    fused one has no FLOP formula in the counter); with `lora`, of the model with its adapters and a frozen base."""
    model = build_model(m, 0)
    if lora is not None:
        add_adapters(model, lora, seed=0)
    model.recompute_blocks = recompute
    idx = torch.randint(0, m.vocab_size, (batch, m.seq_len), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        head_loss(model, idx, idx, summed_token_loss, False).backward()
    return counter.get_total_flops()


# Qwen3's heads are wider than n_embd / n_head (12 x 4 = 48 against 32): the attention widths are the heads', not d.
SHAPES = {"tiny": PRESETS["tiny"], "llama-tiny": PRESETS["llama-tiny"],
          "qwen3": {**PRESETS["llama-tiny"], "arch": "qwen3", "head_width": 12}}


@pytest.mark.parametrize("preset", list(SHAPES))
def test_model_flops_per_token_equals_torchs_count_and_a_planted_mistake_is_caught(preset, monkeypatch):
    m = ModelConfig(**{**SHAPES[preset], "seq_len": 24})  # T != d: the attention term's T and d are told apart
    tokens = 2 * m.seq_len
    assert throughput.model_flops_per_token(m) * tokens == counted_flops(m)

    # planted in the product's formula: Llama's SwiGLU counted as two matrices like GPT-2's MLP; GPT-2's tied head
    # left out as if it were only the embedding; Qwen3's projections as wide as d
    honest = throughput.matmul_params

    def mistaken(c: ModelConfig) -> int:
        if c.head_width:
            return honest(dataclasses.replace(c, head_width=0))
        if c.llama_family:
            return honest(c) - c.n_layer * c.n_embd * c.ffn_width
        return honest(c) - c.vocab_size * c.n_embd

    monkeypatch.setattr(throughput, "matmul_params", mistaken)
    assert throughput.model_flops_per_token(m) * tokens != counted_flops(m)


# Mixtures of experts: qwen3-moe-tiny (4 experts of width 32, top-2), and a Qwen2-MoE with a shared expert and a
# dense first layer (--mlp-only-layers 0: an MLP of intermediate_size)
MOE_SHAPES = {"qwen3-moe-tiny": PRESETS["qwen3-moe-tiny"],
              "qwen2_moe": {**PRESETS["qwen3-moe-tiny"], "arch": "qwen2_moe", "n_layer": 3, "n_experts": 8,
                            "shared_expert_width": 48, "mlp_only_layers": "0", "norm_topk_prob": False}}


def hand_count(name: str) -> int:
    """The FLOPs per token of MOE_SHAPES[name] at seq_len 24, counted by hand: 6 N + 12 L T a."""
    d, q, kv, T, V = 32, 4 * 8, 2 * 8, 24, 64
    attention = d * (q + 2 * kv) + q * d  # 3,072 per layer
    router, top2 = d * 4, 2 * 3 * d * 32  # qwen3-moe-tiny: 128 + 6,144: 2 of its 4 experts
    if name == "qwen3-moe-tiny":
        n = 2 * (attention + router + top2) + V * d  # 20,736
        return 6 * n + 12 * 2 * T * q
    dense = 3 * d * 64  # layer 0: intermediate_size 64
    moe = d * 8 + top2 + 3 * d * 48 + d  # router of 8, 2 experts, the shared expert and its gate
    n = 3 * attention + dense + 2 * moe + V * d
    return 6 * n + 12 * 3 * T * q


@pytest.mark.parametrize("preset", list(MOE_SHAPES))
def test_a_mixture_of_experts_counts_its_active_experts_and_counting_every_expert_is_caught(preset, monkeypatch):
    m = ModelConfig(**{**MOE_SHAPES[preset], "seq_len": 24})
    tokens = 2 * m.seq_len
    assert throughput.model_flops_per_token(m) == hand_count(preset)
    assert throughput.model_flops_per_token(m) * tokens == counted_flops(m)  # torch's count of the expert loop
    # planted in the product's count: every expert's weights, as if each token went through all of them (an MFU
    # inflated n_experts / top-k times over the MLP)
    honest = throughput.mlp_active_params
    monkeypatch.setattr(throughput, "mlp_active_params", lambda c, layer: honest(
        dataclasses.replace(c, experts_per_token=c.n_experts), layer))
    assert throughput.model_flops_per_token(m) > hand_count(preset)


# Targets that leave the first block's q, k or v (or its whole attention) without a gradient: what autograd skips there
LORA_TARGETS = [("tiny", "all"), ("tiny", "c_fc"), ("llama-tiny", "all"), ("llama-tiny", "k_proj,down_proj"),
                ("llama-tiny", "up_proj"), ("qwen3", "q_proj,v_proj")]
# A mixture of experts: `all` adapts the attention (and a dense layer's MLP and the shared expert), not the routed
# experts; `experts` adapts each of them, a token going through its top-k; alone, the dense first layer of the
# Qwen2-MoE computes no backward at all
MOE_LORA_TARGETS = [("qwen3-moe-tiny", "all"), ("qwen3-moe-tiny", "q_proj,k_proj,v_proj,o_proj,experts"),
                    ("qwen3-moe-tiny", "k_proj,experts"), ("qwen2_moe", "all"), ("qwen2_moe", "experts"),
                    ("qwen2_moe", "v_proj,down_proj,experts")]


def lora_flops_counted_as_trained(c: ModelConfig, lo: LoraConfig) -> int:
    """Planted in place of lora_flops_per_token: the frozen base's weight gradients counted, as a full run's (the MFU
    a LoRA run reported before)."""
    return 6 * throughput.matmul_params(c) + 6 * lo.rank * sum(
        i + o for layer in range(c.n_layer) for _, i, o in throughput.adapted_shapes(c, lo, layer))


@pytest.mark.parametrize("preset, targets", LORA_TARGETS + MOE_LORA_TARGETS)
def test_a_lora_runs_flops_are_what_it_computes_and_counting_its_frozen_base_as_trained_is_caught(preset, targets,
                                                                                                   monkeypatch):
    m = ModelConfig(**{**{**SHAPES, **MOE_SHAPES}[preset], "seq_len": 24})
    lora, tokens = LoraConfig(rank=4, alpha=8.0, targets=targets), 2 * m.seq_len
    assert throughput.model_flops_per_token(m, lora) * tokens == counted_flops(m, lora=lora)
    assert throughput.model_flops_per_token(m, lora) < throughput.model_flops_per_token(m)
    monkeypatch.setattr(throughput, "lora_flops_per_token", lora_flops_counted_as_trained)  # planted
    assert throughput.model_flops_per_token(m, lora) * tokens != counted_flops(m, lora=lora)


@pytest.mark.parametrize("preset, targets", MOE_LORA_TARGETS)
def test_a_moe_lora_runs_adapters_are_those_a_token_goes_through_and_a_dense_mlps_count_is_caught(preset, targets,
                                                                                                  monkeypatch):
    """The count before: every MLP's adapters as a dense MLP's of intermediate_size, the routed experts as none."""
    m = ModelConfig(**{**MOE_SHAPES[preset], "seq_len": 24})
    lora, tokens = LoraConfig(rank=4, alpha=8.0, targets=targets), 2 * m.seq_len
    honest = throughput.adapted_shapes
    monkeypatch.setattr(throughput, "adapted_shapes",
                        lambda c, lo, layer: honest(dataclasses.replace(c, n_experts=0), lo, layer))  # planted
    assert throughput.model_flops_per_token(m, lora) * tokens != counted_flops(m, lora=lora)


def test_the_recompute_of_activation_checkpointing_is_not_counted():
    """The blocks' recompute runs (most of) their forward again: torch counts it, the model's FLOPs (and MFU) do not."""
    m = ModelConfig(**PRESETS["tiny"])
    tokens = 2 * m.seq_len
    assert counted_flops(m, recompute=True) > throughput.model_flops_per_token(m) * tokens == counted_flops(m)


def test_cuda_peaks_come_from_the_table_by_device_name_at_the_runs_precision_and_peak_flops_overrides(monkeypatch):
    cfg = Config()
    cuda = torch.device("cuda", 0)

    def peak(name: str, precision: str = "fp32") -> float | None:
        monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
        cfg.parallel.precision = precision
        return throughput.peak_flops(cfg, cuda).flops

    # a name that contains another device's is that device, not the shorter one
    assert peak("NVIDIA A100-SXM4-80GB", "bf16") == 312e12 and peak("NVIDIA A10G", "bf16") == 125e12
    assert peak("NVIDIA H100 80GB HBM3", "bf16") == 989.4e12 and peak("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak("NVIDIA L40S", "bf16") == 362.05e12 and peak("NVIDIA L4", "bf16") == 121e12
    assert peak("NVIDIA H200") == 66.9e12  # fp32 matmuls at PyTorch's default precision ("highest": no TF32)
    monkeypatch.setattr(torch, "get_float32_matmul_precision", lambda: "high")
    assert peak("NVIDIA H200") == 494.7e12
    assert peak("NVIDIA Quantum 9000") is None
    assert "--peak-flops" in throughput.peak_flops(cfg, cuda).source  # the way to give it
    cfg.logging.peak_flops = 2.5e14
    assert peak("NVIDIA H200") == 2.5e14


def quiet_timings(monkeypatch, rates=(2.0e9, 2.2e9, 2.1e9), others=(0, 0, 0, 0)) -> list:
    """time_matmul replaced by fixed figures (no timing luck): each call's FLOP/s and the other processes' runnable
    threads seen; the load average 0 on 16 cores. The calls are counted in the list returned."""
    calls = []

    def timed(shape, dtype):
        calls.append(shape)
        return list(rates), list(others)

    monkeypatch.setattr(throughput, "time_matmul", timed)
    monkeypatch.setattr(os, "getloadavg", lambda: (0.0, 0.0, 0.0))
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    return calls


def test_the_cpu_peak_is_timed_once_and_cached_by_machine_threads_and_shape_but_not_under_load(tmp_path, monkeypatch):
    shape = (64, 32, 128)
    calls = quiet_timings(monkeypatch)
    first = throughput.cpu_peak(shape, torch.float32, cache=str(tmp_path))
    assert first.flops == 2.2e9 and "measured now, cached" in first.source  # the best of the timings
    again = throughput.cpu_peak(shape, torch.float32, cache=str(tmp_path))
    assert again.flops == first.flops and "measured before" in again.source and len(calls) == 1
    # another thread count is another key: timed anew
    monkeypatch.setattr(torch, "get_num_threads", lambda: 7)
    throughput.cpu_peak(shape, torch.float32, cache=str(tmp_path))
    assert len(calls) == 2
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)

    # a busy machine: timed, said, and not kept
    monkeypatch.setattr(os, "getloadavg", lambda: (64.0, 0.0, 0.0))
    busy = throughput.cpu_peak((8, 8, 8), torch.float32, cache=str(tmp_path))
    assert "not cached (load average 64.0" in busy.source
    assert len(json.load(open(tmp_path / throughput.PEAK_CACHE))) == 2
    # forget: the cached figure is dropped and timed again (what a step above the peak asks)
    quiet_timings(monkeypatch, rates=(3e9,))
    retimed = first.remeasure()
    assert retimed.flops == 3e9 and "measured now, cached" in retimed.source
    assert throughput.cpu_peak(shape, torch.float32, cache=str(tmp_path)).flops == 3e9


def test_a_peak_timed_on_a_busy_machine_is_not_cached_and_a_planted_check_that_misses_it_is_caught(
        tmp_path, monkeypatch):
    reason = throughput.busy_reason
    assert reason([2e9, 2.1e9], [0, 1], load=0.5, cores=2, threads=1) is None  # one other thread: a core is free
    assert reason([2e9, 2.1e9], [0, 2], load=0.5, cores=2, threads=1) == \
        "2 runnable thread(s) of other processes beside this rank's 1 on 2 cores"
    assert reason([2e9, 2.1e9], [0, 0], load=2.5, cores=2, threads=1) == "load average 2.5 on 2 cores"
    assert reason([1e9, 2.1e9], [0, 0], load=0.5, cores=2, threads=1) == \
        "its timings spread 2.1x: other work took the cores"
    assert reason([1e9, 2.1e9], [0, 0], load=0.5, cores=16, threads=8) == "its timings spread 2.1x: other work took " \
                                                                          "the cores"
    # the rank's own threads need cores too: 8 threads beside 9 others' on 16 cores is busy
    assert "beside this rank's 8 on 16" in reason([2e9], [9], load=0.5, cores=16, threads=8)

    def cached(rates, others) -> bool:
        quiet_timings(monkeypatch, rates, others)  # 16 cores
        path = tmp_path / throughput.PEAK_CACHE
        if path.exists():
            path.unlink()
        throughput.cpu_peak((8, 8, 8), torch.float32, cache=str(tmp_path))
        return path.exists()

    assert cached([2e9, 2.1e9], [0, 0, 0]) and not cached([2e9, 2.1e9], [0, 20, 0])
    assert not cached([0.5e9, 2.1e9], [0, 0, 0])
    monkeypatch.setattr(throughput, "busy_reason", lambda *a: None)  # planted: the busy machine goes unnoticed
    assert cached([2e9, 2.1e9], [0, 20, 0])


def test_an_mfu_above_1_is_never_reported_a_measured_peak_is_timed_again_else_said_unreliable():
    cfg = Config()
    said = []

    def step(meter, flops_per_s: float) -> dict:
        # one rank, one position per step: FLOP/s = flops_per_token / step_s
        return meter.of_step(meter.flops_per_token / flops_per_s, 1, 1)

    # a measured peak too low for a step: timed again (its cached figure dropped), and the new figure used
    low = throughput.Peak(1e9, "CPU matmul: measured before", remeasure=lambda: throughput.Peak(4e9, "measured now"))
    meter = throughput.Throughput(cfg, 1, low, say=said.append)
    assert step(meter, 0.5e9)["mfu"] == pytest.approx(0.5)
    assert step(meter, 2e9)["mfu"] == pytest.approx(0.5) and meter.peak.flops == 4e9
    assert len(said) == 1 and "timed again: 4.00 GFLOP/s" in said[0]
    # timed again and still beaten: no MFU from then on, said once
    said.clear()
    still_low = throughput.Peak(1e9, "CPU matmul", remeasure=lambda: throughput.Peak(1.5e9, "measured now"))
    meter = throughput.Throughput(cfg, 1, still_low, say=said.append)
    assert "mfu" not in step(meter, 2e9) and "mfu" not in step(meter, 0.1e9)
    assert len(said) == 1 and "the peak is unreliable, so no MFU is reported" in said[0]
    assert "unreliable" in meter.state()["peak_source"]
    # a table's or --peak-flops' figure is not timed: unreliable at once
    said.clear()
    meter = throughput.Throughput(cfg, 1, throughput.Peak(1e9, "--peak-flops"), say=said.append)
    figures = [step(meter, f) for f in (0.9e9, 1.1e9, 0.9e9)]
    assert figures[0]["mfu"] == pytest.approx(0.9) and all("mfu" not in f for f in figures[1:])
    assert len(said) == 1 and "--peak-flops F" in said[0]


@contextlib.contextmanager
def captured_output():
    """What this process prints and what the ranks write to its descriptors 1 and 2: {"out": ..., "err": ...}."""
    files = [tempfile.TemporaryFile(mode="w+", buffering=1) for _ in range(2)]
    sys.stdout.flush()
    sys.stderr.flush()
    saved = [os.dup(1), os.dup(2)]
    for fd, f in zip((1, 2), files):
        os.dup2(f.fileno(), fd)
    texts = {}
    try:
        with contextlib.redirect_stdout(files[0]), contextlib.redirect_stderr(files[1]):
            yield texts
    finally:
        for fd, copy in zip((1, 2), saved):
            os.dup2(copy, fd)
            os.close(copy)
        for name, f in zip(("out", "err"), files):
            f.seek(0)
            texts[name] = f.read()
            f.close()


def run_train(*argv: str) -> tuple[int, dict]:
    from zerotrain.cli.main import main
    from zerotrain.runtime.run_folder import release_run_folders

    with captured_output() as texts:
        try:
            code = main(["train", *argv])
        finally:
            release_run_folders()
    return code, texts


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """4 steps of the tiny GPT on 2 ranks, steps 2 and 3 traced: (run folder, what it printed)."""
    out = tmp_path_factory.mktemp("two-ranks")
    code, printed = run_train(*TINY, "--nproc", "2", "--steps", "4", "--profile-steps", "2:3", "--out", str(out))
    assert code == 0, printed["err"][-2000:]
    return out, printed


def test_step_records_and_summary_hold_tokens_per_s_flops_mfu_and_peak_memory_per_rank(two_ranks):
    out, printed = two_ranks
    records = read_step_records(str(out / "metrics.jsonl"))
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert r["tokens_per_s_per_rank"] > 0 and r["flops_per_s_per_rank"] > 0 and 0 < r["mfu"] < 1, r
        assert r["tokens_per_s_per_rank"] == pytest.approx(r["tokens_per_s"] / 2)
        assert r["peak_host_bytes"] > 0
    summary = json.load(open(out / "summary.json"))
    figures = summary["throughput"]
    for key in ("tokens_per_s_per_rank", "flops_per_s_per_rank", "mfu"):
        assert figures[key] == statistics.median(r[key] for r in records)
    assert 0 < figures["mfu"] < 1 and figures["peak_flops"] > 0
    for r in records:  # the figures are the stated formula over the stated peak
        flops = figures["flops_per_token"] * r["batch_tokens"] / 2 / (r["step_ms"] / 1000)
        assert r["flops_per_s_per_rank"] == pytest.approx(flops) and \
            r["mfu"] == pytest.approx(flops / figures["peak_flops"])
    assert figures["flops_per_token"] == throughput.model_flops_per_token(ModelConfig(**PRESETS["tiny"]))
    assert len(summary["per_rank"]["peak_rss_bytes"]) == 2 and min(summary["per_rank"]["peak_rss_bytes"]) > 0
    # the start line says what MFU is measured against, the summary line what the median step did
    assert f"MFU against {throughput.flop_rate(figures['peak_flops'])} per rank (CPU float32 matmul 32x32x128, " \
           "1 thread: measured " in printed["out"]
    assert f"MFU {figures['mfu']:.3g}" in printed["out"].splitlines()[-1]


def test_profile_steps_writes_a_loadable_chrome_trace_per_rank_of_those_steps(two_ranks):
    out, _ = two_ranks
    traces = sorted(os.listdir(out / "profile"))
    assert traces == ["steps000002-000003-rank00000.json", "steps000002-000003-rank00001.json"]
    for name in traces:
        events = json.load(open(out / "profile" / name))["traceEvents"]
        steps = {e["name"] for e in events if e.get("name", "").startswith("step ")}
        assert steps == {"step 2", "step 3"}, steps
        assert any(e.get("name", "").startswith("aten::mm") for e in events)  # the steps' compute is in it


def test_the_progress_line_shows_mfu(tmp_path, capfd):
    metrics = Metrics(str(tmp_path / "m.jsonl"), active=True, progress=True, start=0, total=2)
    metrics.log(dict(step=1, loss=4.0, tokens_per_s=1000.0, mfu=0.4321))
    metrics.close()
    assert "mfu=0.432" in capfd.readouterr().err


def wandb_records(folder: str) -> list:
    """The records of the offline W&B run `folder` (<out>/wandb/offline-run-*), read from its transaction log (the LevelDB log format:
    32 KiB blocks of records, each a 7-byte header (checksum, length, type: full, first, middle, last) and its bytes,
    after a 7-byte file header) as W&B's own protobuf records."""
    from wandb.proto import wandb_internal_pb2

    [path] = glob.glob(os.path.join(folder, "run-*.wandb"))
    data = open(path, "rb").read()
    assert data[:4] == b":W&B"
    block, pos, pending, records = 32768, 7, b"", []
    while pos + 7 <= len(data):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        length, kind = struct.unpack("<HB", data[pos + 4:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a full record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            records.append(record)
            pending = b""
    return records


def items(update) -> dict:
    return {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in update}


def test_wandb_offline_run_holds_the_runs_losses_config_and_summary_and_a_resume_continues_it(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    out = tmp_path / "run"
    argv = [*TINY, "--nproc", "1", "--wandb", "zerotrain-test", "--out", str(out), "--ckpt-every", "2"]
    code, printed = run_train(*argv, "--steps", "2")
    assert code == 0, printed["err"][-2000:]
    assert "W&B run run of project zerotrain-test: offline in " in printed["out"]
    code, printed = run_train(*argv, "--steps", "3", "--resume", "auto")
    assert code == 0, printed["err"][-2000:]

    first, resumed = sorted(glob.glob(str(out / "wandb" / "offline-run-*")))
    assert first.split("-")[-1] == resumed.split("-")[-1]  # one W&B run: the resume continues the first's id
    steps = read_step_records(str(out / "metrics.jsonl"))
    history = [items(r.history.item) for folder in (first, resumed) for r in wandb_records(folder)
               if r.WhichOneof("record_type") == "history"]
    assert [(h["step"], h["loss"], h["mfu"]) for h in history] == [(r["step"], r["loss"], r["mfu"]) for r in steps]

    records = wandb_records(resumed)
    [run] = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    assert run.project == "zerotrain-test" and run.display_name == "run"
    config = items(run.config.update)
    given = config_from_args(build_parser().parse_args(["train", *argv, "--steps", "3"])).to_dict()
    for section in ("model", "data", "optim", "parallel", "loop", "guard"):
        assert config[section] == given[section], section
    assert config["logging"]["wandb"] == "zerotrain-test"
    summary = json.load(open(out / "summary.json"))
    logged = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            logged.update(items(r.summary.update))
    assert logged["last_loss"] == summary["last_loss"] and logged["throughput"] == summary["throughput"]


def test_bad_peak_flops_and_profile_steps_and_wandb_without_its_package_are_one_line_errors(tmp_path, capfd,
                                                                                            monkeypatch):
    base = ["train", *TINY, "--steps", "4", "--out", str(tmp_path / "run")]
    cases = [(["--peak-flops", "-1"], "--peak-flops must be >= 0, got -1.0"),
             (["--peak-flops", "fast"], "argument --peak-flops: invalid float value: 'fast'"),
             (["--profile-steps", "3:2"], "--profile-steps must be A:B, the first and last step to trace "
                                          "(1 <= A <= B), got '3:2'"),
             (["--profile-steps", "0:2"], "got '0:2'"), (["--profile-steps", "3"], "got '3'")]
    for argv, message in cases:
        r = zerotrain_here(capfd, *base, *argv)
        assert message in one_line_error(r), (argv, r.stderr)
    # a trace past the last step is said before the run, not refused (the steps may come from --epochs)
    cfg = Config()
    cfg.loop.steps, cfg.logging.profile_steps = 4, "3:9"
    assert "--profile-steps 3:9 ends after the last step, 4: the trace ends with the run" in notes(cfg)
    import importlib.util

    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else found(name, *a))
    r = zerotrain_here(capfd, *base, "--wandb", "my-project")
    assert one_line_error(r) == ("zerotrain: error: --wandb my-project needs the wandb package: "
                                 "pip install 'zerotrain[wandb]'")


def test_wandb_online_without_a_login_is_a_one_line_error_before_any_step(tmp_path, capfd, monkeypatch):
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name in ("HOME", "WANDB_CONFIG_DIR", "NETRC"):  # no stored login either
        monkeypatch.setenv(name, str(tmp_path / "home"))
    out = tmp_path / "run"
    r = zerotrain_here(capfd, "train", *TINY, "--nproc", "1", "--steps", "2", "--out", str(out), "--wandb", "proj")
    assert one_line_error(r).startswith("zerotrain: error: --wandb proj: W&B cannot log (No API key configured")
    assert "run 'wandb login', or set WANDB_MODE=offline" in r.stderr
    assert not read_step_records(str(out / "metrics.jsonl"))


# Qwen3.5's shape of tests/test_qwen35.py: Gated DeltaNet layers (2 key heads of 8, 4 value heads of 12, 4 taps)
# beside gated attention (every second layer), dense or a mixture of experts with a shared expert.
QWEN35 = dict(vocab_size=300, n_embd=64, n_layer=4, n_head=4, n_kv_head=2, head_width=16, full_attention_interval=2,
              linear_conv_kernel=4, linear_key_width=8, linear_value_width=12, linear_key_heads=2,
              linear_value_heads=4, intermediate_size=96, tie_embeddings=False)
QWEN35_SHAPES = {"qwen3_5": dict(arch="qwen3_5", **QWEN35),
                 "qwen3_5_moe": dict(arch="qwen3_5_moe", n_experts=4, experts_per_token=2, expert_width=32,
                                     shared_expert_width=40, **QWEN35)}


def counted_matmul_flops(m: ModelConfig, batch: int = 2) -> int:
    """FlopCounterMode's matmuls (mm, bmm) of one forward and backward: its convolution backward's formula counts a
    depthwise convolution as a dense one (81x its forward on the tiny shape), so the convolution is left out."""
    model = build_model(m, 0)
    idx = torch.randint(0, m.vocab_size, (batch, m.seq_len), generator=torch.Generator().manual_seed(0))
    counter = FlopCounterMode(display=False)
    with counter, sdpa_kernel(SDPBackend.MATH):
        head_loss(model, idx, idx, summed_token_loss, False).backward()
    return sum(v for op, v in counter.get_flop_counts()["Global"].items() if str(op) in ("aten.mm", "aten.bmm"))


@pytest.mark.parametrize("seq_len", [24, 128])  # one chunk of the delta rule (padded), and two
@pytest.mark.parametrize("family", list(QWEN35_SHAPES))
def test_qwen35_flops_count_its_linear_attention_layers_and_counting_them_as_attention_is_caught(family, seq_len,
                                                                                                monkeypatch):
    m = ModelConfig(**QWEN35_SHAPES[family], seq_len=seq_len)
    tokens = 2 * m.seq_len
    linear = sum(m.linear_attention(layer) for layer in range(m.n_layer))
    convolution = linear * (2 * 2 * 8 + 4 * 12) * 4  # W K taps a layer, 6 FLOPs a token each: not counted below
    assert throughput.model_flops_per_token(m) * tokens - 6 * convolution * tokens == counted_matmul_flops(m)
    # planted: the linear layers' delta rule counted as attention's scores (12 T a a token), as before
    monkeypatch.setattr(throughput, "delta_rule_flops", lambda c: 12 * c.seq_len ** 2 * c.n_head * c.head_dim)
    assert throughput.model_flops_per_token(m) * tokens - 6 * convolution * tokens != counted_matmul_flops(m)
