"""The `fair-sched` command: `emulate`, `proxy`, `demo`, `bench`, `make-trace`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from .lab.demo import add_demo_parsers
    from .lab.emulator.server import add_emulate_parser
    from .lab.loadtest.trace import add_make_trace_parser
    from .proxy import add_proxy_parser

    parser = argparse.ArgumentParser(
        prog="fair-sched",
        description="Fair, backpressure-aware request scheduling for self-hosted LLM engines.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_emulate_parser(subparsers)
    add_proxy_parser(subparsers)
    add_demo_parsers(subparsers)
    add_make_trace_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.handler(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
