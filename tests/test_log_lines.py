"""Without the progress bar, a line of the step's figures every --log-every steps and at the last."""

from __future__ import annotations

from zerotrain.training.metrics import Metrics


def record(step: int) -> dict:
    return dict(step=step, loss=4.0 - step / 100, lr=1e-3, grad_norm=0.5, tokens_per_s=1234.0)


def lines_of(capsys, *, progress: bool, log_every: int, start: int = 0, total: int = 25) -> list[str]:
    metrics = Metrics("", active=True, progress=progress, start=start, total=total, log_every=log_every)
    for step in range(start + 1, total + 1):
        metrics.log(record(step))
    metrics.close()
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("zerotrain: step ")]


def test_no_progress_logs_a_line_every_n_steps_and_at_the_last(capsys):
    lines = lines_of(capsys, progress=False, log_every=10)
    assert lines == ["zerotrain: step 10/25: loss 3.9000, lr 1.00e-03, grad norm 0.5, 1,234 tokens/s",
                     "zerotrain: step 20/25: loss 3.8000, lr 1.00e-03, grad norm 0.5, 1,234 tokens/s",
                     "zerotrain: step 25/25: loss 3.7500, lr 1.00e-03, grad norm 0.5, 1,234 tokens/s"]
    assert [line.split(":")[1] for line in lines_of(capsys, progress=False, log_every=10, start=12)] == \
        [" step 20/25", " step 25/25"]  # a resumed run logs at the same steps


def test_log_every_0_and_the_progress_bar_print_no_step_lines(capsys):
    assert lines_of(capsys, progress=False, log_every=0) == []
    assert lines_of(capsys, progress=True, log_every=10) == []  # the bar shows the figures
