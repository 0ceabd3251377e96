"""What every benchmark report shares: the machine it ran on, percentiles, and JSON writing."""

from __future__ import annotations

import json
import os
import platform
from datetime import datetime, timezone

import torch

SCHEMA_VERSION = 1


def machine_info() -> dict:
    return {
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def report_header(schema: str) -> dict:
    """The fields every benchmark report starts with: its schema and version, when, and on what machine."""
    return {"schema": schema, "schema_version": SCHEMA_VERSION,
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"), "machine": machine_info()}


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile, q in [0, 100]."""
    if not values:
        return float("nan")
    s = sorted(values)
    k = (len(s) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (k - lo)


def write_json(path: str, obj: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(obj, f, indent=1)


def write_report(out: str, name: str, report: dict, table: str) -> None:
    """<out>/<name>.json and <name>.md, the table printed, and where they went."""
    os.makedirs(out, exist_ok=True)
    write_json(os.path.join(out, f"{name}.json"), report)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(table)
    print(table)
    print(f"wrote {name}.json and {name}.md to {out} ({report['wall_s']:.0f} s)")
