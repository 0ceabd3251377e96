"""The `zerotrain` command line: the parser, dispatch to a command, and one-line errors with exit code 2."""

from __future__ import annotations

import argparse
import os
import sys

from zerotrain import __version__
from zerotrain.errors import ConfigError

from .flags import Parser


DESCRIPTION = ("Train GPT language models data- and tensor-parallel on torch.distributed with a ZeRO optimizer (stages 1-3), "
               "exact resume and correctness invariants checked on every run. Start with `zerotrain demo`; "
               "`zerotrain COMMAND --help` shows a command's flags and defaults.")


def build_parser() -> argparse.ArgumentParser:
    from zerotrain import bench

    from .commands import demo, equivalence, plan, plot, prepare, sample, train
    from .commands import eval as evaluate  # the module's name shadows the builtin
    from .commands import export_model as export
    from .commands import verify_checkpoint as verify

    parser = Parser(prog="zerotrain", description=DESCRIPTION)
    parser.add_argument("--version", action="version", version=f"zerotrain {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=Parser)
    train.add_parser(sub)
    demo.add_parser(sub)
    bench.add_parser(sub)
    equivalence.add_parser(sub)
    plan.add_parser(sub)
    verify.add_parser(sub)
    prepare.add_parser(sub)
    sample.add_parser(sub)
    evaluate.add_parser(sub)
    export.add_parser(sub)
    plot.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    from zerotrain.runtime.console import console_outlives_its_reader
    from zerotrain.runtime.launch import in_torchrun

    with console_outlives_its_reader():  # `zerotrain ... | tee log` and Ctrl-C: tee goes first
        code = _run(argv)
    if in_torchrun():
        # A rank ends like a spawned one, without interpreter teardown: gloo's worker threads can
        # still hold tensors after destroy_process_group, and tearing those down at exit aborts.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _run(argv: list[str] | None) -> int:
    from zerotrain.errors import ZeroTrainError
    from zerotrain.runtime.launch import Interrupted, JobFailed, in_torchrun, say_under_torchrun

    try:
        args = build_parser().parse_args(argv)
        return args.func(args)
    except ConfigError as e:
        if in_torchrun():  # every rank finds it: rank 0 says it at once, the others only if torchrun lets them be
            say_under_torchrun(e, int(os.environ["RANK"]))
        print(f"zerotrain: error: {e}", file=sys.stderr)
        return 2
    except (JobFailed, ZeroTrainError) as e:  # a zerotrain error outside the ranks (e.g. no checkpoint verifies)
        print(f"zerotrain: FAILED: {e}", file=sys.stderr)
        return 1
    except Interrupted as e:
        print(f"zerotrain: {e}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("zerotrain: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
