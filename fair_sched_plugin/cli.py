"""The `fair-sched` command: `emulate`, `proxy`, `demo`, `bench`."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def build_parser() -> argparse.ArgumentParser:
    from .emulator.server import add_emulate_parser

    parser = argparse.ArgumentParser(
        prog="fair-sched",
        description="Fair, backpressure-aware request scheduling for self-hosted LLM engines.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    add_emulate_parser(subparsers)
    try:
        from .proxy import add_proxy_parser
    except ImportError:  # pragma: no cover - the proxy module is part of the package
        pass
    else:
        add_proxy_parser(subparsers)
    try:
        from .demo import add_demo_parsers
    except ImportError:  # pragma: no cover
        pass
    else:
        add_demo_parsers(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result: int = args.handler(args)
    return result


if __name__ == "__main__":
    sys.exit(main())
