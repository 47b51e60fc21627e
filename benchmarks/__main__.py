"""``python -m benchmarks [--quick] [--json PATH] [--only SUITE ...]``: run, print a table.

Exit status 0 whatever the figures: targets are reported, not enforced, because a
shared machine's noise is not a regression. ``--strict`` exits 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from importlib import import_module

from ._harness import Row, table

SUITES = ("hashing", "construction", "reuse", "overhead", "memory", "binding", "wire", "frontend", "affinity")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="smaller media and fewer repeats (CI smoke)")
    parser.add_argument("--only", nargs="+", choices=SUITES, help="run only these suites")
    parser.add_argument("--json", metavar="PATH", help="also write the rows and the machine as JSON")
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target is missed")
    args = parser.parse_args(argv)
    rows: list[Row] = []
    started = time.perf_counter()
    for suite in args.only or SUITES:
        begun = time.perf_counter()
        rows += import_module(f"benchmarks.{suite}").run(args.quick)
        print(f"[{suite}: {time.perf_counter() - begun:.1f} s]", file=sys.stderr, flush=True)
    print(table(rows))
    elapsed = time.perf_counter() - started
    missed = [r for r in rows if r.met is False]
    print(f"\n{len(rows)} figures in {elapsed:.0f} s; targets missed: {len(missed)}")
    if args.json:
        machine = {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "processor": platform.processor(),
            "quick": args.quick,
            "seconds": round(elapsed, 1),
        }
        with open(args.json, "w") as out:
            json.dump({"machine": machine, "rows": [r.as_dict() for r in rows]}, out, indent=1)
    return 1 if args.strict and missed else 0


if __name__ == "__main__":
    sys.exit(main())
