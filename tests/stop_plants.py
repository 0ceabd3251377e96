"""Planted bugs the DPO stop drills run in the ranks (test_dpo_stops.py).

A rank is a fork of the ranks' server (runtime/rank_start.py), which imports its modules afresh: a bug planted in
the launcher's interpreter never reaches it. A drill whose launcher must be a process of its own (a signal to its
group) adds this module to rank_start.PRELOAD and names the plant in ZEROTRAIN_TEST_PLANT; the server imports it,
and every rank forked from it runs the product with that one function replaced. A drill run in the test's own
process plants it in the rank's job instead (the *_job functions, for run_job).
"""

from __future__ import annotations

import os
from unittest import mock

from zerotrain.runtime import stop
from zerotrain.training import loop, preference

PLANT = os.environ.get("ZEROTRAIN_TEST_PLANT", "")


def _pass_in_the_start_up() -> None:
    """DPO's reference pass as part of the rank's start-up, as it was: a signal in it ends the rank at once."""
    real = preference.Preference.prepare

    def prepare(self, *args, **kwargs):
        request = stop.stop_request()
        request.stepping = False
        try:
            return real(self, *args, **kwargs)
        finally:
            request.stepping = True

    preference.Preference.prepare = prepare


def _reference_written_in_place():
    """The reference written over the file it replaces, as the resume's copy was (shutil.copyfile)."""
    def in_place(path, data, *, durable=True, halfway=None):
        with open(path, "wb") as f:
            f.write(data[: len(data) // 2])
            f.flush()
            if halfway is not None:
                halfway()
            f.write(data[len(data) // 2 :])

    return in_place


if PLANT == "pass_in_the_start_up":
    _pass_in_the_start_up()
elif PLANT == "reference_written_in_place":
    preference.write_atomic = _reference_written_in_place()


def reference_written_in_place_job(cfg, comm):
    """`zerotrain train` in a rank whose reference is written in place."""
    with mock.patch.object(preference, "write_atomic", _reference_written_in_place()):
        return loop.train_job(cfg, comm)
