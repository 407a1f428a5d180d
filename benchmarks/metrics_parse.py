"""What one scrape costs the proxy's event loop: parsing a real vLLM /metrics page.

    .venv/bin/python benchmarks/metrics_parse.py [--repeat 500]

Parses each capture in tests/fixtures (vLLM 0.32, about 600 lines) with the vLLM profile,
as the watcher does every `metrics_poll_ms`, and prints milliseconds per parse and the share of
one core that takes at the default 100 ms poll. For comparison it also times prometheus_client's
parser over the whole page, which is what the watcher did before it kept only the lines that can
hold our samples.
"""

from __future__ import annotations

import argparse
import sys
import timeit
from collections.abc import Callable
from functools import partial
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fair_sched_plugin.engine_metrics.parser import parse_metrics
from fair_sched_plugin.engine_metrics.profiles import VLLM_PROFILE

FIXTURES = Path(__file__).resolve().parents[1] / "tests" / "fixtures"
POLLS_PER_SECOND = 10  # metrics_poll_ms: 100


def _parse_whole_page(text: str) -> list[object]:
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def _ms_per_call(call: Callable[[], object], repeat: int) -> float:
    return timeit.timeit(call, number=repeat) / repeat * 1000


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=500)
    parser.add_argument("--fixtures", type=Path, default=FIXTURES)
    args = parser.parse_args()
    captures = sorted(args.fixtures.glob("*.txt"))
    if not captures:
        sys.exit(f"no captures in {args.fixtures}")
    print(f"{'capture':40} {'lines':>6} {'parse ms':>9} {'core at 10/s':>13} {'whole page ms':>14}")
    for path in captures:
        text = path.read_text(encoding="utf-8")
        ours_ms = _ms_per_call(partial(parse_metrics, text, VLLM_PROFILE, "tiny"), args.repeat)
        whole_ms = _ms_per_call(partial(_parse_whole_page, text), max(1, args.repeat // 10))
        share = ours_ms * POLLS_PER_SECOND / 1000
        print(
            f"{path.name:40} {text.count(chr(10)):>6} {ours_ms:>9.3f} {share:>12.2%} "
            f"{whole_ms:>14.3f}"
        )


if __name__ == "__main__":
    main()
