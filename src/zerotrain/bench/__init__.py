"""`zerotrain bench`: benchmark commands that report figures (tests assert correctness, never timings)."""

from __future__ import annotations


def add_parser(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: accumulation curve, comparison with PyTorch's strategies, checkpoint "
                                     "speed, tensor vs data parallelism, the model against transformers', memory per "
                                     "rank, bytes per rank by phase, the spike guard over recorded runs")
    benches = p.add_subparsers(dest="bench", required=True, parser_class=type(p))
    from . import accum, ckpt, compare, memory, model, ranks, spikes, tp  # each benchmark lives in its own module with add_parser(subparsers)

    for module in (accum, compare, ckpt, tp, model, memory, ranks, spikes):
        module.add_parser(benches)
