"""The I/O plan (training/io_plan.py) at ZeRO-3 start-up from folders that stack their experts, one tensor of every
expert a layer (Mistral 4's gate_up_proj (E, 2F, C) in nn.Linear's layout, Llama 4's (E, C, 2F) multiplied as x @ W,
gpt-oss's (E, C, 2F) with the gate's and up's columns alternating, and its stacked biases): on 2 ranks from
--init-from, every parameter its own bucket (owned ranges cut the experts' rows), each rank reads from the folder the
bytes the plan gives it, exactly (its rows of each expert's part: a strided slice of the stored expert,
init_from.stacked_rows), and reads each safetensors header once, hashing its run of the blocks, as planned.

Planted in the product's own functions, in each family's run, each in its own counter and caught: an expert's slice
of the stacked tensor read whole for each of its parts (as --init-from read them before: Mistral 4 read 2.05x its
plan, Llama 4 1.65x, gpt-oss 2.26x), and model.safetensors' header read again to check the tensors after listing
them (it was read 3 times a rank). One start of 2 ranks runs the six jobs in turn.

Mistral 4's folder, one model.safetensors, also shows the headers' other two reads, exactly: a resume of its run
reads no header of the folder (its checkpoint overwrites every value; the record needs its files, not their tensors:
it listed them, reading the header, 4,792 bytes a rank), and each rank's check of the folder before the run, as
config_from_args makes it under torchrun, hands its source to the start-up (each header was read twice a rank), each
with its planted bug caught. A resume after that check reads each header once a rank, in the check, as the plan
counts under torchrun (resume_headers_torchrun; a plan without it is caught). The same start runs these five jobs
after the six.
"""

import functools
import os

import dist_jobs
import io_plan_jobs as jobs
import pytest
from conftest import tiny_config
from test_gemma import one_thread
from test_gpt_oss import gpt_oss_folder
from test_llama4 import hf_model as llama4_folder
from test_mistral4 import mistral4_model as mistral4_folder

from zerotrain.checkpoint import MODEL_FILE
from zerotrain.checkpoint.stream import bytes_counted
from zerotrain.hub.init_from import adopt, weight_source
from zerotrain.runtime.launch import run_job
from zerotrain.training import io_plan as io_plan_module
from zerotrain.training.io_plan import TOLERANCE, differences, io_plan

pytestmark = pytest.mark.timeout(300)
W = 2
BUCKET_MB = 1e-4  # every parameter its own bucket, cut into W chunks: ranges that cut the experts' rows
FOLDERS = {"mistral4": mistral4_folder, "llama4": llama4_folder, "gpt_oss": gpt_oss_folder}
PLANTS = ("whole expert", "headers read again")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{(family, planted): (config, summary)}: each family's run, and its run with both plants in force; and
{("mistral4", name): ...}: Mistral 4's run resumed, and one after each rank's check, each also planted; and one
resumed after each rank's check."""
    tmp = tmp_path_factory.mktemp("io-plan-experts")
    configs = {}
    for family, build in FOLDERS.items():
        folder = str(tmp / family)
        with one_thread():
            build(folder)
        assert weight_source(folder).experts, family  # its experts are stacked in the files
        for planted in (False, True):
            c = tiny_config(tmp / f"{family}-{'planted' if planted else 'run'}", nproc=W, micro=2, steps=1, zero=3,
                            bucket_mb=BUCKET_MB, seq_len=16, ckpt_every=1)
            c.checkpoint.init_from = folder
            c.model = adopt(c.model, weight_source(folder), {"seq_len"})
            configs[family, planted] = c
    pairs = [(functools.partial(jobs.counted_job, plants=PLANTS if planted else ()), c)
             for (_, planted), c in configs.items()]
    # Mistral 4's run resumed, and started after each rank's check of the folder (torchrun's); each also planted
    for name, plants in (("resumed", ()), ("resumed, planted", ("tensors listed at resume",)),
                         ("checked", ()), ("checked, planted", ("check not handed over",)),
                         ("resumed after a check", ())):
        resumed = name.startswith("resumed")
        c = tiny_config(tmp / f"mistral4-{name.replace(', ', '-')}", nproc=W, micro=2, steps=2 if resumed else 1,
                        zero=3, bucket_mb=BUCKET_MB, seq_len=16, ckpt_every=0 if resumed else 1)
        run = configs["mistral4", False]
        c.checkpoint.init_from, c.model = run.checkpoint.init_from, run.model
        if resumed:
            c.checkpoint.resume = str(tmp / "mistral4-run" / "checkpoints" / "step_00000001")
        configs["mistral4", name] = c
        pairs.append((functools.partial(jobs.counted_job, plants=plants, checked="check" in name), c))
    results = run_job(functools.partial(dist_jobs.in_turn_job, jobs=pairs), pairs[0][1], time_limit=360)
    return {key: (c, summary) for (key, c), summary in zip(configs.items(), results)}


def plan_of(runs, family, planted=False):
    c, summary = runs[family, planted]
    return io_plan(c), summary["per_rank"]


@pytest.mark.parametrize("family", list(FOLDERS))
def test_each_rank_reads_its_rows_of_the_stacked_experts_as_planned_and_reading_an_expert_whole_is_caught(
        runs, family):
    plan, measured = plan_of(runs, family)
    assert differences(plan, measured, phases=("startup", "save")) == []
    assert measured["init_bytes_read"] == [r.startup_read for r in plan.ranks]  # exactly, not within the tolerance
    planted, whole = plan_of(runs, family, planted=True)
    said = [line for line in differences(planted, whole, phases=("startup",)) if "init_bytes_read" in line]
    assert len(said) == W, said  # every rank
    assert min(whole["init_bytes_read"]) > (1 + TOLERANCE) * max(r.startup_read for r in planted.ranks)


@pytest.mark.parametrize("family", list(FOLDERS))
def test_each_rank_reads_each_header_once_as_planned_and_a_second_read_is_caught(runs, family):
    plan, measured = plan_of(runs, family)
    assert all(r.startup_headers for r in plan.ranks)
    assert measured["checkpoint_bytes_read"] == [r.startup_hashed + r.startup_headers for r in plan.ranks]
    planted, again = plan_of(runs, family, planted=True)
    # one header more on every rank: within the tolerance `differences` gives a folder's extras, so counted exactly
    assert [a - (r.startup_hashed + r.startup_headers) for a, r in zip(again["checkpoint_bytes_read"], planted.ranks)] \
        == [r.startup_headers for r in planted.ranks]


def test_a_resume_reads_no_header_of_a_single_file_folder_and_listing_its_tensors_is_caught(runs):
    plan, measured = plan_of(runs, "mistral4", "resumed")
    assert differences(plan, measured, phases=("resume",)) == []
    # exactly: its share of the record's hashing and its shard; the header of model.safetensors is not read
    assert measured["checkpoint_bytes_read"] == [r.startup_hashed + r.resume_read for r in plan.ranks]
    assert measured["init_bytes_read"] == [0] * W
    planted, listed = plan_of(runs, "mistral4", "resumed, planted")
    assert all(r.startup_headers for r in planted.ranks)
    assert [m - (r.startup_hashed + r.resume_read) for m, r in zip(listed["checkpoint_bytes_read"], planted.ranks)] \
        == [r.startup_headers for r in planted.ranks]  # within the tolerance, so counted exactly


def test_a_ranks_check_of_the_folder_hands_its_headers_to_the_start_up_and_a_second_read_is_caught(runs):
    plan, measured = plan_of(runs, "mistral4", "checked")
    assert differences(plan, measured, phases=("startup", "save")) == []
    # the check and the start-up together read each header once, as the plan counts
    assert measured["checkpoint_bytes_read"] == [r.startup_hashed + r.startup_headers for r in plan.ranks]
    planted, again = plan_of(runs, "mistral4", "checked, planted")
    assert [a - (r.startup_hashed + r.startup_headers) for a, r in zip(again["checkpoint_bytes_read"], planted.ranks)] \
        == [r.startup_headers for r in planted.ranks]


def test_a_resume_under_torchrun_reads_each_header_once_in_its_check_as_planned_and_the_plan_without_it_is_caught(
        runs, monkeypatch):
    c, summary = runs["mistral4", "resumed after a check"]
    plan, measured = io_plan(c), summary["per_rank"]
    assert differences(plan, measured, phases=("resume",), torchrun=True) == []
    # exactly: the record's hashing, its shard, and model.safetensors' header, which the rank's check read (4,792
    # bytes) and the resume none
    assert all(r.resume_headers_torchrun == r.startup_headers > 0 for r in plan.ranks)
    assert measured["checkpoint_bytes_read"] == [r.startup_hashed + r.resume_read + r.resume_headers_torchrun
                                                 for r in plan.ranks]
    # planted: the plan before, which counted no header at a resume: each rank's header over it
    monkeypatch.setattr(io_plan_module, "resume_check_headers", lambda cfg, headers: 0)
    planted = io_plan(c)
    assert [m - (r.startup_hashed + r.resume_read + r.resume_headers_torchrun)
            for m, r in zip(measured["checkpoint_bytes_read"], planted.ranks)] == [r.startup_headers for r in plan.ranks]


def test_a_checked_source_is_handed_over_once_unless_its_folder_changed_and_an_unlisted_one_records_the_same(
        tmp_path):
    folder = str(tmp_path / "mistral4")
    with one_thread():
        mistral4_folder(folder)
    with open(os.path.join(folder, MODEL_FILE), "rb") as f:
        header = 8 + int.from_bytes(f.read(8), "little")  # its length and its JSON

    def read_by(**kwargs):
        before = bytes_counted()["checkpoint_bytes_read"]
        source = weight_source(folder, **kwargs)
        return source, bytes_counted()["checkpoint_bytes_read"] - before

    checked, _ = read_by()
    handed, read = read_by(verify=False)
    assert handed is checked and read == 0  # the check's source, its header read once
    assert read_by(verify=False)[1] == header  # handed over once: the next reads it
    checked, _ = read_by()
    os.utime(os.path.join(folder, MODEL_FILE), ns=(1, 1))  # changed since the check: read anew
    changed, read = read_by(verify=False)
    assert changed is not checked and read == header
    unlisted, read = read_by(verify=False, listed=False)
    assert read == 0 and unlisted.record() == checked.record()
