"""What one scrape of a real vLLM's /metrics costs the engine.

vLLM renders its Prometheus page in its API server process, the one that also takes requests in
and streams tokens out. Starts the CPU build the real-vLLM stage uses (the cached virtualenv and
tiny model; `scripts/vllm_env.sh` makes them), leaves it idle, and measures the CPU time of the
engine's processes over `--seconds` without scrapes and at each scrape rate of `--rates`, for the
whole page and for the page filtered to the series the gate reads (`metrics_filter`, the
default: `/metrics/?name[]=...`), then prints milliseconds of engine CPU per second and per
scrape. Prints, asserts nothing.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/vllm_scrape_cost.py [--rates 10 4 2] [--seconds 10]
"""

from __future__ import annotations

import argparse
import os
import time

import httpx

from fair_sched_plugin.engine_metrics.profiles import VLLM_PROFILE, filtered_metrics_url
from fair_sched_plugin.lab.harness import vllm_stage
from fair_sched_plugin.lab.loadtest.processes import group_cpu_seconds


def _measure(
    client: httpx.Client, url: str, group: int, rate: float, seconds: float, page: str
) -> None:
    used_before, started, scrapes, size = group_cpu_seconds(group), time.monotonic(), 0, 0
    while time.monotonic() - started < seconds:
        if rate:
            size = len(client.get(url).content)
            scrapes += 1
            time.sleep(1 / rate)
        else:
            time.sleep(0.5)
    used_ms = 1000 * (group_cpu_seconds(group) - used_before)
    per_scrape = f"{used_ms / scrapes:5.1f} ms per scrape (idle share included)" if scrapes else ""
    what = page if rate else "idle"
    size_note = f", page {size} bytes" if scrapes else ""
    print(
        f"{what:8s} {rate:4g} scrapes/s: engine CPU {used_ms / seconds:5.0f} ms/s "
        f"{per_scrape}{size_note}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", type=float, nargs="+", default=[10.0, 4.0, 2.0])
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    cache = vllm_stage.cache_dir()
    python = cache / f"vllm-venv-{vllm_stage.VLLM_VERSION}" / "bin" / "python"
    models = [path for path in cache.glob("tiny-llama-*") if (path / ".complete").exists()]
    if not python.exists() or not models:
        raise SystemExit(
            f"no vLLM virtualenv or tiny model under {cache}: run the real-vLLM stage once"
        )
    scratch = cache / "vllm-run"
    scratch.mkdir(parents=True, exist_ok=True)
    engine = vllm_stage.start_engine(python, models[0], scratch, "priority")
    try:
        group = os.getpgid(engine.process.pid)
        with httpx.Client() as client:
            filtered = filtered_metrics_url(engine.metrics_url, VLLM_PROFILE)
            assert filtered is not None
            client.get(engine.metrics_url)
            _measure(client, engine.metrics_url, group, 0.0, args.seconds, "idle")
            for rate in args.rates:
                for page, url in (("whole", engine.metrics_url), ("filtered", filtered)):
                    _measure(client, url, group, rate, args.seconds, page)
    finally:
        engine.stop()


if __name__ == "__main__":
    main()
