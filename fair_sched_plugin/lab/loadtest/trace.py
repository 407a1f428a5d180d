"""Traces: one request a line (JSONL), parsed with errors that name the line, and synthetic ones.

A line is a JSON object::

    {"t": 0.25, "user": "u7", "prompt_tokens": 120, "max_tokens": 64, "tier": "batch"}

``t`` (or ``arrival_s``) is the arrival time in seconds from the start; ``user`` any string (an
anonymised id is enough); the prompt is ``prompt`` (text, sent as is) or ``prompt_tokens`` (that
many filler tokens, roughly); ``max_tokens`` the output tokens asked for; ``tier`` is optional,
and so are ``prefix`` with ``prefix_tokens`` (a shared system prompt of that length, the same text
for every request naming the same prefix: what a prefix cache can reuse).

:func:`make_trace` writes the bench's shapes as traces (flood, zipf, tiers, prefix, burst), so a
scenario and a replayed day of traffic go through the same driver.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import zlib
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

SHAPES = ("flood", "zipf", "tiers", "prefix", "burst")
# Bounds where values enter: a trace line asking for more is a mistake, not a workload.
MAX_TOKENS_LIMIT = 1_000_000
MAX_PROMPT_TOKENS = 1_000_000
MAX_ARRIVAL_S = 7 * 24 * 3600.0
MAX_NAME_CHARS = 200
_FIELDS = {"t", "arrival_s", "user", "prompt", "prompt_tokens", "max_tokens", "tier", "prefix"}
_FIELDS |= {"prefix_tokens"}


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message names the file and the line."""


@dataclass(frozen=True)
class TraceRequest:
    """One request of a trace."""

    at_s: float
    user: str
    max_tokens: int
    prompt_tokens: int = 0
    prompt: str | None = None
    tier: str | None = None
    prefix: str | None = None
    prefix_tokens: int = 0

    def to_json(self) -> dict[str, Any]:
        line: dict[str, Any] = {"t": round(self.at_s, 6), "user": self.user}
        if self.prompt is not None:
            line["prompt"] = self.prompt
        else:
            line["prompt_tokens"] = self.prompt_tokens
        line["max_tokens"] = self.max_tokens
        if self.tier is not None:
            line["tier"] = self.tier
        if self.prefix is not None:
            line["prefix"] = self.prefix
            line["prefix_tokens"] = self.prefix_tokens
        return line


def _number(line: dict[str, Any], key: str, low: float, high: float, where: str) -> float:
    value = line[key]
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TraceError(f"{where}: '{key}' must be a number, got {value!r}")
    if not low <= value <= high:
        raise TraceError(f"{where}: '{key}' must be between {low:g} and {high:g}, got {value!r}")
    return float(value)


def _integer(line: dict[str, Any], key: str, low: int, high: int, where: str) -> int:
    value = line[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise TraceError(f"{where}: '{key}' must be an integer, got {value!r}")
    if not low <= value <= high:
        raise TraceError(f"{where}: '{key}' must be between {low} and {high}, got {value!r}")
    return value


def _name(line: dict[str, Any], key: str, where: str) -> str | None:
    value = line.get(key)
    if value is None:
        return None
    if not isinstance(value, str) or not value or len(value) > MAX_NAME_CHARS:
        raise TraceError(f"{where}: '{key}' must be a string of 1-{MAX_NAME_CHARS} characters")
    return value


def parse_line(text: str, where: str) -> TraceRequest:
    """One trace line; `where` ("FILE:LINE") starts every error message."""
    try:
        line = json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not JSON ({exc.msg})") from None
    except (ValueError, RecursionError):
        # An integer past Python's digit limit, or nesting past the recursion limit.
        raise TraceError(f"{where}: not JSON (a number too long, or nested too deeply)") from None
    if not isinstance(line, dict):
        raise TraceError(f"{where}: a line must be a JSON object, got {type(line).__name__}")
    unknown = sorted(set(line) - _FIELDS)
    if unknown:
        raise TraceError(f"{where}: unknown field(s) {unknown}; known: {sorted(_FIELDS)}")
    time_key = "arrival_s" if "arrival_s" in line else "t"
    for key in (time_key, "user", "max_tokens"):
        if key not in line:
            raise TraceError(f"{where}: missing '{key}'" + (" (or 'arrival_s')" * (key == "t")))
    if ("prompt" in line) == ("prompt_tokens" in line):
        raise TraceError(f"{where}: give exactly one of 'prompt' (text) and 'prompt_tokens'")
    prompt = line.get("prompt")
    if prompt is not None and not isinstance(prompt, str):
        raise TraceError(f"{where}: 'prompt' must be a string")
    user = _name(line, "user", where)
    assert user is not None
    prefix = _name(line, "prefix", where)
    if (prefix is None) != ("prefix_tokens" not in line):
        raise TraceError(f"{where}: 'prefix' and 'prefix_tokens' come together")
    return TraceRequest(
        at_s=_number(line, time_key, 0.0, MAX_ARRIVAL_S, where),
        user=user,
        max_tokens=_integer(line, "max_tokens", 1, MAX_TOKENS_LIMIT, where),
        prompt_tokens=(
            _integer(line, "prompt_tokens", 0, MAX_PROMPT_TOKENS, where) if prompt is None else 0
        ),
        prompt=prompt,
        tier=_name(line, "tier", where),
        prefix=prefix,
        prefix_tokens=(
            _integer(line, "prefix_tokens", 1, MAX_PROMPT_TOKENS, where) if prefix else 0
        ),
    )


def parse_trace(lines: Iterable[str], source: str = "trace") -> list[TraceRequest]:
    """Every non-blank line (``#`` starts a comment line), sorted by arrival (stable)."""
    requests = []
    for number, text in enumerate(lines, start=1):
        stripped = text.strip()
        if stripped and not stripped.startswith("#"):
            requests.append(parse_line(stripped, f"{source}:{number}"))
    if not requests:
        raise TraceError(f"{source}: no requests")
    return sorted(requests, key=lambda request: request.at_s)


def read_trace(path: str | Path) -> list[TraceRequest]:
    with Path(path).open(encoding="utf-8") as file:
        return parse_trace(file, str(path))


def write_trace(requests: Sequence[TraceRequest], path: str | Path) -> Path:
    path = Path(path)
    with path.open("w", encoding="utf-8") as file:
        for request in requests:
            file.write(json.dumps(request.to_json()) + "\n")
    return path


# ----------------------------------------------------------------------------- synthetic


@dataclass(frozen=True)
class TraceShape:
    """How big a synthetic trace is. `users` counts every user, the heavy one (`u0`) included."""

    shape: str = "zipf"
    requests: int = 200
    users: int = 10
    max_tokens: int = 64
    prompt_tokens: int = 64
    duration_s: float = 20.0
    zipf_s: float = 1.1
    # tiers: the first `batch_users` users are batch, the rest interactive.
    batch_users: int = 1
    # prefix: each user's shared system prompt.
    prefix_tokens: int = 1500
    # burst: the quiet time before everybody sends at once.
    idle_s: float = 5.0
    seed: int = 7

    def __post_init__(self) -> None:
        if self.shape not in SHAPES:
            raise ValueError(f"shape must be one of {SHAPES}, got {self.shape!r}")
        if self.requests < 1 or self.users < 1 or self.max_tokens < 1:
            raise ValueError("requests, users and max_tokens must be >= 1")
        if self.shape in ("flood", "tiers") and self.users < 2:
            raise ValueError(f"the {self.shape} shape needs at least 2 users")
        if not self.duration_s >= 0 or not self.idle_s >= 0:
            raise ValueError("duration_s and idle_s must be >= 0")


def _user(index: int) -> str:
    return f"u{index}"


def _flood(shape: TraceShape, rng: random.Random) -> list[TraceRequest]:
    # The heavy user sends most requests at once; the light users spread theirs over the time
    # the flood needs, one at a time, starting a second in (as the demo's flood).
    light_users = shape.users - 1
    light_each = max(1, shape.requests // (10 * light_users))
    heavy = max(1, shape.requests - light_each * light_users)
    out = [TraceRequest(0.0, _user(0), shape.max_tokens, shape.prompt_tokens) for _ in range(heavy)]
    span = max(shape.duration_s - 1.0, 0.0)
    for user in range(1, shape.users):
        for k in range(light_each):
            at = 1.0 + span * (k + rng.random() * 0.5) / light_each
            out.append(TraceRequest(at, _user(user), shape.max_tokens, shape.prompt_tokens))
    return out


def _zipf(shape: TraceShape, rng: random.Random) -> list[TraceRequest]:
    # User i's share of requests ∝ 1/(i+1)^s, arrivals uniform over the duration (Poisson-like),
    # lengths mixed so that request-fair and token-fair differ.
    weights = [1 / (rank + 1) ** shape.zipf_s for rank in range(shape.users)]
    owners = rng.choices(range(shape.users), weights=weights, k=shape.requests)
    lengths = (max(1, shape.max_tokens // 4), max(1, shape.max_tokens // 2), shape.max_tokens)
    return [
        TraceRequest(
            rng.uniform(0, shape.duration_s),
            _user(owner),
            rng.choice(lengths),
            shape.prompt_tokens,
        )
        for owner in owners
    ]


def _tiers(shape: TraceShape, rng: random.Random) -> list[TraceRequest]:
    # Batch users send 70% of the requests at once; interactive users come and go.
    batch_requests = max(1, int(shape.requests * 0.7))
    batch_users = min(max(1, shape.batch_users), shape.users - 1)
    out = [
        TraceRequest(
            0.0, _user(i % batch_users), shape.max_tokens, shape.prompt_tokens, tier="batch"
        )
        for i in range(batch_requests)
    ]
    interactive = range(batch_users, shape.users)
    rest = shape.requests - batch_requests
    for i in range(rest):
        at = 1.0 + max(shape.duration_s - 1.0, 0.0) * (i + rng.random()) / max(rest, 1)
        user = _user(interactive[i % len(interactive)])
        out.append(
            TraceRequest(at, user, shape.max_tokens, shape.prompt_tokens, tier="interactive")
        )
    return out


def _prefix(shape: TraceShape, rng: random.Random) -> list[TraceRequest]:
    # Every user has its own long system prompt and asks short questions, all at about once.
    return [
        TraceRequest(
            rng.uniform(0, min(shape.duration_s, 1.0)),
            _user(i % shape.users),
            shape.max_tokens,
            shape.prompt_tokens,
            prefix=f"system-{i % shape.users}",
            prefix_tokens=shape.prefix_tokens,
        )
        for i in range(shape.requests)
    ]


def _burst(shape: TraceShape, rng: random.Random) -> list[TraceRequest]:
    # One request per user (a warm, quiet engine), `idle_s` of nothing, then everybody at once:
    # the heavy user with half of the rest, the others sharing the other half.
    out = [
        TraceRequest(0.0, _user(user), shape.max_tokens, shape.prompt_tokens)
        for user in range(min(shape.users, shape.requests))
    ]
    left = shape.requests - len(out)
    heavy = left // 2 if shape.users > 1 else left
    owners = [0] * heavy + [1 + i % max(shape.users - 1, 1) for i in range(left - heavy)]
    for owner in owners:
        at = shape.idle_s + rng.random() * 0.2
        out.append(TraceRequest(at, _user(owner), shape.max_tokens, shape.prompt_tokens))
    return out


_MAKERS = {"flood": _flood, "zipf": _zipf, "tiers": _tiers, "prefix": _prefix, "burst": _burst}


def make_trace(shape: TraceShape) -> list[TraceRequest]:
    """A synthetic trace of `shape.requests` requests (seeded: the same shape, the same trace)."""
    made = _MAKERS[shape.shape](shape, random.Random(shape.seed))
    # Microseconds, as written to a file: a trace read back is the trace made.
    requests = [dataclasses.replace(r, at_s=round(r.at_s, 6)) for r in made]
    return sorted(requests, key=lambda request: request.at_s)


# ----------------------------------------------------------------------------- prompts

_WORDS: tuple[str, ...] = (
    "river",
    "stone",
    "lamp",
    "orbit",
    "cedar",
    "violet",
    "harbor",
    "signal",
    "meadow",
)
_WORDS += ("copper", "lantern", "quiet", "summit", "ember", "glacier", "willow", "compass")


def filler_text(tokens: int, seed: str) -> str:
    """About `tokens` tokens of words (one word ≈ one token for common tokenizers, and four
    characters each for the emulator's estimate), the same for the same seed."""
    rng = random.Random(zlib.crc32(seed.encode("utf-8")))
    return " ".join(rng.choice(_WORDS)[:4].ljust(3, "a") for _ in range(max(tokens, 0)))


def prompt_messages(request: TraceRequest, index: int) -> list[dict[str, str]]:
    """The chat messages a trace request is sent with; `index` keeps prompts distinct."""
    if request.prompt is not None:
        question = request.prompt
    else:
        question = f"Request {index}: " + filler_text(request.prompt_tokens, f"q{index}")
    messages = [{"role": "user", "content": question}]
    if request.prefix is not None:
        system = filler_text(request.prefix_tokens, request.prefix)
        messages.insert(0, {"role": "system", "content": system})
    return messages


# ----------------------------------------------------------------------------- CLI


def add_make_trace_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Register ``fair-sched make-trace``."""
    parser = subparsers.add_parser(
        "make-trace",
        help="write a synthetic JSONL trace (flood, zipf, tiers, prefix, burst) for bench --trace",
    )
    parser.add_argument("--shape", choices=SHAPES, default="zipf")
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--users", type=int, default=10, help="users, the heavy one (u0) included")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--duration", type=float, default=20.0, help="seconds of arrivals")
    parser.add_argument("--zipf-s", type=float, default=1.1)
    parser.add_argument("--prefix-tokens", type=int, default=1500)
    parser.add_argument("--idle", type=float, default=5.0, help="burst: quiet seconds first")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--out", required=True, help="the JSONL file to write")
    parser.set_defaults(handler=run_make_trace)


def run_make_trace(args: argparse.Namespace) -> int:
    try:
        shape = TraceShape(
            shape=args.shape,
            requests=args.requests,
            users=args.users,
            max_tokens=args.max_tokens,
            prompt_tokens=args.prompt_tokens,
            duration_s=args.duration,
            zipf_s=args.zipf_s,
            prefix_tokens=args.prefix_tokens,
            idle_s=args.idle,
            seed=args.seed,
        )
    except ValueError as exc:
        print(f"fair-sched make-trace: {exc}")
        return 2
    trace = make_trace(shape)
    write_trace(trace, args.out)
    users = len({request.user for request in trace})
    print(f"wrote {args.out}: {len(trace)} requests from {users} users, {shape.shape} shape")
    return 0


__all__ = [
    "SHAPES",
    "TraceError",
    "TraceRequest",
    "TraceShape",
    "add_make_trace_parser",
    "make_trace",
    "parse_trace",
    "prompt_messages",
    "read_trace",
    "write_trace",
]
