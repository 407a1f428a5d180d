"""The request body at the HTTP boundary: parsed with its nesting bounded, and the numbers the
scheduler reads from it checked to their ranges where they are read (`InvalidRequest`, a 400,
naming the field), so nothing downstream sees a 400-digit integer or a NaN. Also the one place
that rewrites the body's `priority` for the engine.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, MutableMapping
from typing import Any

from .core import MAX_REQUEST_TOKENS
from .errors import InvalidRequest

# What a request costs when it does not say how many tokens it may generate.
DEFAULT_MAX_TOKENS = 256
# The fields that bound a request's output tokens (the largest present counts, see
# `requested_max_tokens`).
OUTPUT_TOKEN_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
# OpenAI's own limit on `n` (choices generated per request).
MAX_CHOICES = 128
# Deeper request bodies are refused with a 400 before any work (real ones nest < 20 levels).
MAX_BODY_DEPTH = 64


class RequestBody(dict[str, Any]):
    """A request body `parse_request_body` read from JSON with its nesting checked:
    `SchedulingService.admit` does not walk it again."""


def parse_request_body(raw: bytes) -> RequestBody:
    """A request body as a JSON object; `InvalidRequest` (400) for anything else.

    Nesting is bounded before any work is done on the body: a deeply nested one would otherwise
    overflow the JSON decoder's recursion (a 500 with a traceback) or cost time per level.
    """
    try:
        body = json.loads(raw) if raw else None
    except (ValueError, RecursionError):
        raise InvalidRequest("the request body is not valid JSON (or nests too deeply)") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_body_depth(body)
    return RequestBody(body)


_SCALARS = frozenset({str, int, float, bool, type(None)})


def check_body_depth(body: Mapping[str, Any], limit: int = MAX_BODY_DEPTH) -> None:
    """Raise `InvalidRequest` when `body`'s dicts and lists nest deeper than `limit`."""
    stack: list[tuple[Any, int]] = [(body, 1)]
    # An adapter's own request dict (LiteLLM's) may refer to itself: visit each container once.
    seen = {id(body)}
    while stack:
        node, depth = stack.pop()
        if depth > limit:
            raise InvalidRequest(f"the request body nests deeper than {limit} levels")
        # Exact types first: `isinstance(_, Mapping)` is a Python-level ABC check, and a body is
        # mostly plain dicts, lists, strings and numbers.
        kind = type(node)
        children = node if kind is list else node.values() if kind is dict else _children(node)
        for child in children:
            kind = type(child)
            if kind in _SCALARS:
                continue
            if (kind is dict or kind is list or isinstance(child, Mapping)) and id(
                child
            ) not in seen:
                seen.add(id(child))
                stack.append((child, depth + 1))


def _children(node: Any) -> Any:
    return node.values() if isinstance(node, Mapping) else node


def estimate_prompt_tokens(body: Mapping[str, Any]) -> int:
    """A cheap prompt-size estimate (~4 characters a token), good enough for fair ordering."""
    characters = 0
    messages = body.get("messages")
    if type(messages) is list:
        for message in messages:
            if type(message) is dict or isinstance(message, Mapping):
                content = message.get("content")
                if type(content) is str:
                    characters += len(content)
                elif type(content) is list:
                    for part in content:
                        if (type(part) is dict or isinstance(part, Mapping)) and isinstance(
                            part.get("text"), str
                        ):
                            characters += len(part["text"])
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        characters += len(prompt)
    elif isinstance(prompt, list):
        characters += sum(len(item) for item in prompt if isinstance(item, str))
    return max(1, characters // 4)


def request_size(body: Mapping[str, Any]) -> tuple[int, int]:
    """(estimated prompt tokens, most output tokens over every choice): what a ticket costs,
    each field read once (`estimate_prompt_tokens`, `requested_max_tokens` times
    `requested_choices`), with the body's nesting checked first unless `parse_request_body`
    did (`InvalidRequest`)."""
    if type(body) is not RequestBody:
        check_body_depth(body)
    return estimate_prompt_tokens(body), requested_max_tokens(body) * requested_choices(body)


def requested_max_tokens(body: Mapping[str, Any]) -> int:
    """The most output tokens the request may generate, per choice: the largest of the OpenAI
    fields present (chat's `max_completion_tokens` and `max_tokens`, the responses API's
    `max_output_tokens`), else `DEFAULT_MAX_TOKENS`. The largest, not the route's own: each
    route's engine reads a different one (vLLM's chat prefers `max_completion_tokens`, its
    `/v1/completions` reads only `max_tokens`, `/v1/responses` only `max_output_tokens`), and a
    client that adds a field its engine ignores, set to 1, must not be estimated (and charged,
    if it leaves) at 1 while the engine generates the other. Each present field must be a whole
    number in [1, MAX_REQUEST_TOKENS] (`InvalidRequest` naming it): the engine would refuse
    anything else, and an unbounded one must never reach the scheduler's charge."""
    most = 0
    for field in OUTPUT_TOKEN_FIELDS:
        value: Any = body.get(field)
        if value is None:
            continue
        if type(value) is not int or not 1 <= value <= MAX_REQUEST_TOKENS:
            value = bounded_count(body, field, 1, MAX_REQUEST_TOKENS)  # not None: present
        if value > most:
            most = value
    return most or DEFAULT_MAX_TOKENS


def requested_choices(body: Mapping[str, Any]) -> int:
    """How many sequences the engine generates for the request (`n`, `best_of`; 1 if absent),
    each up to `requested_max_tokens`; `InvalidRequest` outside [1, MAX_CHOICES]."""
    n = body.get("n")
    best_of = body.get("best_of")
    if n is None and best_of is None:
        return 1
    n = bounded_count(body, "n", 1, MAX_CHOICES) or 1
    best_of = bounded_count(body, "best_of", 1, MAX_CHOICES) or 1
    return max(n, best_of)


def bounded_count(body: Mapping[str, Any], field: str, low: int, high: int) -> int | None:
    """`body[field]` as a whole number in [low, high]; None where the field is absent or null;
    `InvalidRequest` naming the field for anything else (a string, a list, NaN, 1e400, a
    400-digit integer, a negative count). The value is not echoed: it may be anything."""
    value = body.get(field)
    if value is None:
        return None
    if isinstance(value, float) and value.is_integer() and low <= value <= high:
        return int(value)
    if isinstance(value, int) and not isinstance(value, bool) and low <= value <= high:
        return value
    raise InvalidRequest(f"`{field}` must be a whole number from {low} to {high}", param=field)


def rewrite_priority(
    body: MutableMapping[str, Any], priority: int | None, *, via_extra_body: bool
) -> None:
    """Remove whatever priority the client sent; set ours where the backend supports it.

    LiteLLM forwards `extra_body.priority` as the engine's top-level `priority` (and consumes a
    top-level `priority` itself), so the LiteLLM adapter passes `via_extra_body=True`.
    """
    body.pop("priority", None)
    extra_body = body.get("extra_body")
    if isinstance(extra_body, MutableMapping):
        extra_body.pop("priority", None)
        if not extra_body:
            body.pop("extra_body", None)
    elif extra_body is not None:
        body.pop("extra_body", None)
    if priority is None:
        return
    if via_extra_body:
        extra = body.setdefault("extra_body", {})
        extra["priority"] = priority
    else:
        body["priority"] = priority
