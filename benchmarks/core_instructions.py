"""Machine instructions per admit+release pair of the core, counted by valgrind's callgrind: what
the decision rate follows, and a count that does not vary with the machine's load (two runs of
the same tree give the same figure, whatever else runs).

    PYTHONPATH=<checkout> .venv/bin/python benchmarks/core_instructions.py [--users 10 1000]

The workload is `core_decisions.py --layer core`'s (round robin). Each figure is the difference
between 30,000 and 10,000 pairs, divided by 20,000, so the interpreter's start-up and the set-up
do not count. Needs `valgrind` (Debian's package); about 20 s per figure.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

PAIRS = (10_000, 30_000)
_HERE = Path(__file__).resolve().parent


def _pairs(users: int, pairs: int) -> None:
    sys.path.insert(0, str(_HERE))
    import core_decisions

    core_decisions._run_core_pairs(users, pairs, "round_robin")


def _instructions(users: int, pairs: int) -> int:
    command = [
        "valgrind",
        "--tool=callgrind",
        "--callgrind-out-file=/dev/null",
        sys.executable,
        __file__,
        "--run",
        str(users),
        str(pairs),
    ]
    done = subprocess.run(command, capture_output=True, text=True, env=os.environ, timeout=600)
    found = re.search(r"Collected : (\d+)", done.stderr)
    if done.returncode or found is None:
        raise SystemExit(f"callgrind failed:\n{done.stderr[-2000:]}")
    return int(found.group(1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, nargs="+", default=[10, 1000])
    parser.add_argument("--run", type=int, nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.run:
        _pairs(*args.run)
        return
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind not found: apt-get install valgrind")
    print(f"{'users':>6} {'instructions/pair':>18}")
    for users in args.users:
        low, high = (_instructions(users, pairs) for pairs in PAIRS)
        print(f"{users:6d} {(high - low) / (PAIRS[1] - PAIRS[0]):18,.0f}")


if __name__ == "__main__":
    main()
