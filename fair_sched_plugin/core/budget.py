"""Spending budgets per principal: money or tokens per fixed window, on an injected clock.

Pure bookkeeping (no I/O). The service asks `verdict()` at admission and, over budget, demotes
the request to the named tier or rejects it until the window ends; it reports what a request
actually spent with `spend()` when its lease ends.

A window starts with the first spend after the previous one ended and lasts `window_s` (a
rolling "per day" from the first request, not a calendar day: the clock is monotonic).
Memory is one entry per principal that has a budget rule, i.e. bounded by the configuration.
`snapshot()` / `restore()` carry the whole state as a small JSON-able mapping with times
relative to now, so another process (with another monotonic clock) can take it over.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal, NamedTuple

from .clock import Clock

BudgetUnit = Literal["usd", "tokens"]
BudgetAction = Literal["demote", "reject"]


class BudgetRule(NamedTuple):
    limit: float
    unit: BudgetUnit
    window_s: float
    action: BudgetAction
    demote_to: str | None = None


class BudgetVerdict(NamedTuple):
    over: bool
    spent: float
    remaining: float
    resets_in_s: float  # until the current window ends (a full window when none is open)
    rule: BudgetRule


class _Window:
    __slots__ = ("spent", "started_at")

    def __init__(self, started_at: float, spent: float) -> None:
        self.started_at = started_at
        self.spent = spent


class BudgetBook:
    def __init__(self, rules: Mapping[str, BudgetRule], *, clock: Clock) -> None:
        for principal, rule in rules.items():
            if rule.limit < 0 or rule.window_s <= 0:
                raise ValueError(f"budget of {principal!r}: limit >= 0 and window_s > 0")
            if rule.action == "demote" and not rule.demote_to:
                raise ValueError(f"budget of {principal!r}: action demote needs demote_to")
        self._rules = dict(rules)
        self._clock = clock
        self._windows: dict[str, _Window] = {}

    def rule(self, principal: str) -> BudgetRule | None:
        return self._rules.get(principal)

    def principals(self) -> list[str]:
        """The principals that have a budget rule."""
        return list(self._rules)

    def verdict(self, principal: str) -> BudgetVerdict | None:
        """Where `principal` stands now; None without a budget."""
        rule = self._rules.get(principal)
        if rule is None:
            return None
        window = self._current(principal, rule)
        if window is None:
            return BudgetVerdict(False, 0.0, rule.limit, rule.window_s, rule)
        resets_in = window.started_at + rule.window_s - self._clock.now()
        return BudgetVerdict(
            window.spent >= rule.limit,
            window.spent,
            max(0.0, rule.limit - window.spent),
            resets_in,
            rule,
        )

    def spend(self, principal: str, *, usd: float = 0.0, tokens: int = 0) -> None:
        """Count what a request spent (in the rule's unit; the other is ignored)."""
        rule = self._rules.get(principal)
        if rule is None:
            return
        amount = usd if rule.unit == "usd" else float(tokens)
        if amount <= 0:
            return
        window = self._current(principal, rule)
        if window is None:
            window = self._windows[principal] = _Window(self._clock.now(), 0.0)
        window.spent += amount

    def snapshot(self) -> dict[str, dict[str, float]]:
        """Every open window: `{principal: {"spent": x, "resets_in_s": y}}`."""
        result = {}
        for principal in list(self._windows):
            verdict = self.verdict(principal)
            if verdict is not None and principal in self._windows:
                result[principal] = {"spent": verdict.spent, "resets_in_s": verdict.resets_in_s}
        return result

    def restore(self, snapshot: object, *, replace: bool = False) -> None:
        """Take over windows from a snapshot (principals without a rule here are skipped);
        `replace`: the snapshot is the whole truth, windows it lacks are dropped.

        The snapshot usually comes from another process (through Redis), so it is checked
        first: `ValueError` for anything `snapshot()` would not have produced, and then
        nothing has changed.
        """
        windows = _parse_snapshot(snapshot)
        now = self._clock.now()
        if replace:
            self._windows.clear()
        for principal, (spent, resets_in_s) in windows.items():
            rule = self._rules.get(principal)
            if rule is None:
                continue
            resets_in = min(resets_in_s, rule.window_s)
            if resets_in <= 0:
                continue
            started_at = now + resets_in - rule.window_s
            self._windows[principal] = _Window(started_at, spent)

    def longest_window_s(self) -> float:
        """The longest budget window (0.0 without budgets): how long a snapshot stays useful."""
        return max((rule.window_s for rule in self._rules.values()), default=0.0)

    def _current(self, principal: str, rule: BudgetRule) -> _Window | None:
        window = self._windows.get(principal)
        if window is not None and self._clock.now() >= window.started_at + rule.window_s:
            del self._windows[principal]
            return None
        return window


def _parse_snapshot(snapshot: object) -> dict[str, tuple[float, float]]:
    """`{principal: (spent, resets_in_s)}` from a `snapshot()`-shaped mapping, or ValueError."""
    if not isinstance(snapshot, Mapping):
        raise ValueError(f"a budget snapshot is a mapping, not {type(snapshot).__name__}")
    windows = {}
    for principal, entry in snapshot.items():
        if not isinstance(principal, str) or not isinstance(entry, Mapping):
            raise ValueError(f"budget snapshot entry {principal!r}: not a principal's window")
        numbers = []
        for field in ("spent", "resets_in_s"):
            value = entry.get(field)
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise ValueError(f"budget snapshot entry {principal!r}: {field} is {value!r}")
            # Compared before any conversion: an integer too large for a float fails here.
            if not -1e300 < value < 1e300 or (field == "spent" and value < 0):
                raise ValueError(f"budget snapshot entry {principal!r}: {field} is {value!r}")
            numbers.append(float(value))
        windows[principal] = (numbers[0], numbers[1])
    return windows
