"""PNG plots (the `bench` extra: matplotlib, imported inside each function, Agg backend)."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .client import RequestRecord
from .flood import FloodResult

USER_COLOURS = {"power": "#c0504d", "light-1": "#1f77b4", "light-2": "#2ca02c"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_timelines(results: Sequence[FloodResult], out_dir: Path) -> list[Path]:
    """One PNG per variant: a bar per request, pale while waiting, solid while streaming."""
    plt = _pyplot()
    paths = []
    for result in results:
        ordered = sorted(result.records, key=lambda r: (r.started, r.user))
        fig, ax = plt.subplots(figsize=(9, 5))
        # Light users' bars are thicker so two requests stand out among a hundred, but never so
        # thick that they cover their neighbours in a small run.
        light_height = min(2.5, max(0.8, len(ordered) / 40))
        for row, record in enumerate(ordered):
            _timeline_bar(ax, row, record, light_height)
        ax.set_xlabel("seconds since the flood started")
        ax.set_ylabel("request (by send time)")
        ax.set_title(f"{result.variant.label}: wait (pale) then stream (solid)")
        handles = [plt.Rectangle((0, 0), 1, 1, color=colour) for colour in USER_COLOURS.values()]
        ax.legend(handles, list(USER_COLOURS), loc="lower right")
        path = out_dir / f"timeline-{result.variant.name}.png"
        fig.tight_layout()
        fig.savefig(path, dpi=90)
        plt.close(fig)
        paths.append(path)
    return paths


def _timeline_bar(ax: Any, row: int, record: RequestRecord, light_height: float) -> None:
    colour = USER_COLOURS.get(record.user, "#7f7f7f")
    height = light_height if record.group == "light" else 0.8
    first = record.first_token if record.first_token is not None else record.ended
    if first is None:
        return
    ax.barh(
        row, first - record.started, left=record.started, height=height, color=colour, alpha=0.25
    )
    if record.ended is not None and record.first_token is not None:
        ax.barh(row, record.ended - first, left=first, height=height, color=colour)


def plot_ttft_cdfs(results: Sequence[FloodResult], out_dir: Path) -> Path:
    """TTFT CDFs, one panel per variant, a line per user group."""
    plt = _pyplot()
    fig, axes = plt.subplots(
        1, len(results), figsize=(4 * len(results), 3.6), sharex=True, squeeze=False
    )
    for ax, result in zip(axes[0], results, strict=False):
        for group, colour in (("power", USER_COLOURS["power"]), ("light", USER_COLOURS["light-1"])):
            ttfts = sorted(
                r.ttft for r in result.records if r.group == group and r.ttft is not None
            )
            if ttfts:
                fractions = [(i + 1) / len(ttfts) for i in range(len(ttfts))]
                ax.step(
                    ttfts,
                    fractions,
                    where="post",
                    color=colour,
                    label=group,
                    marker="o" if group == "light" else None,
                )
        ax.set_title(result.variant.label, fontsize=9)
        ax.set_xlabel("TTFT (s)")
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("fraction of requests")
    axes[0][0].legend()
    fig.tight_layout()
    path = out_dir / "ttft-cdf.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_bars(title: str, values: Mapping[str, float], ylabel: str, path: Path) -> Path:
    """A plain bar chart (tiers, many users, thresholds)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(list(values), list(values.values()), color="#1f77b4")
    ax.set_title(title)
    ax.set_ylabel(ylabel)
    for label in ax.get_xticklabels():
        label.set_rotation(15)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_speed_change(
    results: Sequence[Any], slow_from_s: float, slow_until_s: float, path: Path
) -> Path:
    """The speed-change scenario: each variant's allowed engine queue (top) and its light users'
    TTFT (bottom) over time; the slow period shaded. `results` are `SpeedChangeResult`s."""
    plt = _pyplot()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for result in results:
        points = [(s.at, s.allowed) for s in result.samples if s.allowed is not None]
        if points:
            top.step(*zip(*points, strict=True), where="post", label=result.variant.label)
        light = sorted(
            (r.started, r.ttft) for r in result.records if r.group == "light" and r.ttft is not None
        )
        if light:
            bottom.plot(*zip(*light, strict=True), ".", markersize=4, label=result.variant.label)
    for ax in (top, bottom):
        ax.axvspan(slow_from_s, slow_until_s, color="#999999", alpha=0.15)
    top.set_ylabel("allowed engine queue")
    top.set_title("waiting_below over time (slow period shaded)")
    top.legend(loc="upper right", fontsize="small")
    bottom.set_ylabel("light users' TTFT (s)")
    bottom.set_xlabel("seconds since the run started (request send time)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_engine_queues(
    results: Sequence[Any], threshold: float | None, title: str, path: Path
) -> Path:
    """Each engine's waiting queue (solid) and running sequences (dotted) over time, one panel
    per variant; `results` are `ReplicaResult`s, `threshold` the tier's `waiting_below`."""
    plt = _pyplot()
    fig, axes = plt.subplots(
        len(results), 1, figsize=(9, 2.6 * len(results)), sharex=True, squeeze=False
    )
    colours = ("#1f77b4", "#c0504d", "#2ca02c", "#7f7f7f")
    for ax, result in zip(axes[:, 0], results, strict=False):
        for engine, colour in zip(result.engines, colours, strict=False):
            if not engine.samples:
                continue
            at = [s.at for s in engine.samples]
            ax.step(at, [s.waiting for s in engine.samples], where="post", color=colour,
                    label=f"{engine.name} waiting")  # fmt: skip
            ax.step(at, [s.running for s in engine.samples], where="post", color=colour,
                    linestyle=":", alpha=0.7, label=f"{engine.name} running")  # fmt: skip
        if threshold is not None:
            ax.axhline(threshold, color="#000000", linewidth=0.8, linestyle="--",
                       label=f"waiting_below {threshold:g}")  # fmt: skip
        ax.set_title(result.variant.label, fontsize=9)
        ax.set_ylabel("requests")
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right", fontsize="x-small")
    axes[-1][0].set_xlabel("seconds since the run started")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_hit_rates(results: Sequence[Any], best: float | None, path: Path) -> Path:
    """Prefix-cache hit rate per variant, overall and per engine, against the best possible."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 3.8))
    width = 0.8 / (1 + max(len(r.engines) for r in results))
    for index, result in enumerate(results):
        bars = [("all engines", result.summary.get("hit_rate"))]
        bars += [(e["name"], e["hit_rate"]) for e in result.summary.get("engines", [])]
        for offset, (name, rate) in enumerate(bars):
            ax.bar(index + offset * width, rate or 0.0, width,
                   color=("#1f77b4", "#9ecae1", "#c6dbef", "#deebf7")[min(offset, 3)],
                   label=name if index == 0 else None)  # fmt: skip
    if best is not None:
        ax.axhline(best, color="#c0504d", linestyle="--", label=f"best possible {best:.2f}")
    ax.set_xticks([i + width * len(results[0].engines) / 2 for i in range(len(results))])
    ax.set_xticklabels([r.variant.label for r in results], fontsize=8)
    ax.set_ylim(0, 1)
    ax.set_ylabel("prefix-cache hit rate (tokens)")
    ax.legend(fontsize="x-small", loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_service_curves(
    times: Sequence[float],
    curves: Mapping[str, Sequence[int]],
    heavy: set[str],
    title: str,
    path: Path,
) -> Path:
    """Cumulative tokens per user over time: the heavy user(s) red, the ten next biggest in
    colour, everybody else thin and grey."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(9, 4.5))
    ranked = sorted(curves, key=lambda user: -curves[user][-1])
    coloured = [user for user in ranked if user not in heavy][:10]
    palette = plt.get_cmap("tab10")
    for user in ranked:
        if user in heavy:
            ax.plot(times, curves[user], color="#c0504d", linewidth=2.2, label=f"{user} (heavy)")
        elif user in coloured:
            colour = palette(coloured.index(user) % 10)
            ax.plot(times, curves[user], color=colour, linewidth=1.2, label=user)
        else:
            ax.plot(times, curves[user], color="#999999", linewidth=0.6, alpha=0.6)
    ax.set_xlabel("seconds since the scenario started")
    ax.set_ylabel("tokens streamed (cumulative)")
    ax.set_title(title)
    ax.legend(loc="upper left", fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def plot_fairness_comparison(
    cells: Sequence[tuple[str, str, Mapping[str, Any]]], path: Path
) -> Path:
    """Per scenario, a bar per target: Jain's index, the service gap over its VTC bound, and the
    light users' TTFT p50 over the heavy user's."""
    plt = _pyplot()
    scenarios = list(dict.fromkeys(scenario for _, scenario, _ in cells))
    targets = list(dict.fromkeys(target for target, _, _ in cells))
    by_cell = {(target, scenario): summary for target, scenario, summary in cells}
    panels: tuple[tuple[str, Callable[[Mapping[str, Any]], float | None]], ...] = (
        ("Jain's index while backlogged (1 = equal)", lambda s: s.get("jain_index")),
        (
            "max service gap / VTC bound (<= 1: within)",
            lambda s: max(0.01, s["max_service_gap_tokens"] / s["vtc_bound_tokens"]),
        ),
        ("light / heavy TTFT p50 (lower: light first)", lambda s: s.get("light_heavy_ttft_ratio")),
    )
    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    width = 0.8 / max(len(targets), 1)
    palette = plt.get_cmap("tab10")
    for ax, (title, value) in zip(axes, panels, strict=True):
        for t, target in enumerate(targets):
            xs, ys = [], []
            for s, scenario in enumerate(scenarios):
                summary = by_cell.get((target, scenario))
                number = value(summary) if summary else None
                x = s + (t - (len(targets) - 1) / 2) * width
                if number is not None:
                    xs.append(x)
                    ys.append(number)
                elif summary:
                    # No value (e.g. never two users backlogged at once): say so, not a gap.
                    ax.text(
                        x,
                        0.02,
                        "n/a",
                        ha="center",
                        va="bottom",
                        fontsize=7,
                        transform=ax.get_xaxis_transform(),
                    )
            ax.bar(xs, ys, width=width, color=palette(t % 10), label=target)
        ax.set_xticks(range(len(scenarios)), scenarios)
        ax.set_title(title, fontsize=9)
        if "bound" in title:
            ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--")
            ax.set_yscale("log")
    axes[0].set_ylim(0, 1.05)
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path
