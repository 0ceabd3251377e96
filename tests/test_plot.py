"""`zerotrain plot`: a run's metrics become a PNG that decodes, with the last record of a replayed step."""

import json

import matplotlib.pyplot as plt
import pytest

from zerotrain.cli.main import main
from zerotrain.training.metrics import read_step_records


def write_metrics(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def test_plot_writes_a_png_that_decodes_and_uses_the_last_record_of_each_step(tmp_path):
    records = [{"step": s, "loss": 4.0 - 0.1 * s, "lr": 1e-3, "tokens_per_s": 1000.0} for s in range(1, 7)]
    records[3]["val_loss"] = 3.9
    records += [{"event": "rollback", "step": 6, "to_step": 4},
                {"step": 5, "loss": 3.0, "lr": 1e-3, "tokens_per_s": 900.0}]  # step 5 again, after the rollback
    write_metrics(tmp_path / "metrics.jsonl", records)
    steps = read_step_records(str(tmp_path / "metrics.jsonl"))
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6] and steps[4]["loss"] == 3.0
    assert main(["plot", str(tmp_path)]) == 0
    image = plt.imread(tmp_path / "metrics.png")
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 300
    assert image.std() > 0  # something was drawn


@pytest.mark.parametrize("content, message", [(None, "no metrics.jsonl there"), ("", "no step records")])
def test_plot_of_a_folder_without_metrics_is_one_line(tmp_path, capsys, content, message):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err
