"""Rewrite the flag table in docs/reference.md from the declarations in zerotrain/config.py.

Run it after adding or changing a setting: the table between the two markers is replaced by
`zerotrain.cli.flags.reference_table()`, everything else in the file is left as it is.

    python scripts/regen_reference.py            # rewrite docs/reference.md in place
    python scripts/regen_reference.py --check    # exit 1 if the table is not the declarations' (CI)
"""

from __future__ import annotations

import argparse
import os
import sys

REFERENCE = os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "docs", "reference.md"))
BEGIN = "<!-- flag table: written by scripts/regen_reference.py from the declarations in src/zerotrain/config.py -->"
END = "<!-- end of flag table -->"


def with_table(text: str, table: str) -> str:
    """`text` with whatever stands between the markers replaced by `table`; ValueError if the markers are not there
    once each, in order."""
    if text.count(BEGIN) != 1 or text.count(END) != 1 or text.index(BEGIN) > text.index(END):
        raise ValueError(f"the flag table's markers are missing or out of order; they are:\n{BEGIN}\n{END}")
    head, rest = text.split(BEGIN, 1)
    _, tail = rest.split(END, 1)
    return f"{head}{BEGIN}\n{table}\n{END}{tail}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("path", nargs="?", default=REFERENCE,
                        help="the reference to rewrite (default docs/reference.md)")
    parser.add_argument("--check", action="store_true", help="change nothing; exit 1 if the table is out of date")
    args = parser.parse_args(argv)
    from zerotrain.cli.flags import reference_table
    from zerotrain.durable import write_atomic

    with open(args.path) as f:
        text = f.read()
    try:
        current = with_table(text, reference_table())
    except ValueError as e:
        print(f"{args.path}: {e}", file=sys.stderr)
        return 2
    if current == text:
        print(f"{args.path}: the flag table is current")
        return 0
    if args.check:
        print(f"{args.path}: the flag table differs from the declarations: run scripts/regen_reference.py",
              file=sys.stderr)
        return 1
    write_atomic(args.path, current, durable=False)
    print(f"{args.path}: flag table rewritten")
    return 0


if __name__ == "__main__":
    sys.exit(main())
