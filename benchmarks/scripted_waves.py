"""The real-vLLM stage's flood as waves, in the scripted engine.

The stage's requests are equal (128 tokens, `ignore_eos`), so vLLM's 8 slots finish together:
traced on the real stage, a wave every 1.1-1.5 s, scrapes coming back 0.3-0.8 s after they were sent
(about three a second), LiteLLM seeing first bytes and ends about half a second late. This runs
100 parked requests through the gate against the harness's `EngineSim` with those
timings, a fixed `waiting_below: 3` against `auto` (2 s TTFT target), and prints when the last
one finished, the engine's mean running sequences while requests were parked, the p95 of
release-to-first-byte, and `auto`'s allowed queue once a second. A wave at a time would finish
in about 100 / 8 x 1.2 s + the way there, 15.3 s. Fake clock: a second of CPU, no sleeps.

    PYTHONPATH=$PWD .venv/bin/python benchmarks/scripted_waves.py
"""

from __future__ import annotations

from fair_sched_plugin.core import BackendGroup, Deployment, MetricsGate, TierLimits
from fair_sched_plugin.lab.harness.engine_sim import URL, EngineSim, mean
from fair_sched_plugin.testing import FakeClock

REQUESTS = 100
# As traced in the shared layout (docs/real-vllm.md, its measured section).
WAVES = {
    "service_s": 1.2,
    "transit_s": 0.3,
    "proxy_delay_s": 0.5,
    "poll_s": 0.35,
    "lag_s": 0.3,
    "finished_counter": True,
}
FIXED = TierLimits("interactive", waiting_below=3)
AUTO = TierLimits("interactive", waiting_below=3, auto_waiting_below=(1, 32), ttft_target_s=2.0)


def run(tier: TierLimits) -> str:
    clock = FakeClock(0.0)
    group = BackendGroup("m", (Deployment(URL, URL),), max_num_seqs=8)
    gate = MetricsGate([group], stale_after_s=5.0, clock=clock)
    sim = EngineSim(gate, clock, **WAVES)  # type: ignore[arg-type]

    def allowed() -> float | None:
        return dict(gate.status()[0].allowed_queue).get(tier.name)

    samples = sim.run(40.0, {tier: REQUESTS}, allowed=allowed)
    done = next(
        (s.at for s in samples if s.at > 1 and not (s.parked or s.waiting or s.running)), None
    )
    running = mean([s.running for s in samples if s.parked])
    first_bytes = sorted(seconds for _, seconds in sim.ttfb.get(tier.name, []))
    p95 = first_bytes[int(0.95 * (len(first_bytes) - 1))]
    every_second = [samples[i].allowed for i in range(0, len(samples), 100)]
    trajectory = " ".join(f"{value:.1f}" for value in every_second[:16] if value is not None)
    name = "auto" if tier.auto_waiting_below else f"fixed {tier.waiting_below:g}"
    finished = "not within 40 s" if done is None else f"{done:5.1f} s"
    line = f"{name:8s} all done {finished}, running while parked {running:.2f} of 8, "
    line += f"release-to-first-byte p95 {p95:.2f} s"
    return line + (f", allowed queue {trajectory}" if trajectory else "")


def main() -> None:
    for tier in (FIXED, AUTO):
        print(run(tier))


if __name__ == "__main__":
    main()
