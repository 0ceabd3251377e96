"""Per-step metrics: a progress line on rank 0 and one JSON object per step in a JSONL file."""

from __future__ import annotations

import json
import os
import sys

from tqdm import tqdm


class Metrics:
    """Rank 0 writes; other ranks hold a no-op instance so the loop needs no rank checks."""

    def __init__(self, path: str, *, active: bool, progress: bool, start: int, total: int):
        self.active = active
        self.file = None
        self.bar = None
        if not active:
            return
        if path:
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
            kept = _records_up_to(path, start) if start else []
            self.file = open(path, "w")
            for record in kept:  # a resumed run rewrites the steps after its checkpoint
                self.file.write(json.dumps(record) + "\n")
        if progress:
            self.bar = tqdm(total=total, initial=start, desc="train", unit="step", file=sys.stderr,
                            dynamic_ncols=True, leave=True)

    def log(self, record: dict) -> None:
        if not self.active:
            return
        if self.file:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        if self.bar:
            self.bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", refresh=False)
            self.bar.update(1)

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.file:
            self.file.close()


def _records_up_to(path: str, step: int) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        records = [json.loads(line) for line in f if line.strip()]
    return [r for r in records if r.get("step", 0) <= step]
