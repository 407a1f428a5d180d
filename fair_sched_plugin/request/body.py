"""The request body at the HTTP boundary: parsed with its nesting bounded, and the numbers the
scheduler reads from it checked to their ranges where they are read (`InvalidRequest`, a 400,
naming the field), so nothing downstream sees a 400-digit integer or a NaN. Also the one place
that rewrites the body's `priority` for the engine.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, MutableMapping
from typing import Any

from ..core import MAX_REQUEST_TOKENS
from ..errors import BodyTooLarge, InvalidRequest

# What a request costs when it does not say how many tokens it may generate.
DEFAULT_MAX_TOKENS = 256
# The fields that bound a request's output tokens (the largest present counts, see
# `requested_max_tokens`).
OUTPUT_TOKEN_FIELDS = ("max_completion_tokens", "max_tokens", "max_output_tokens")
# OpenAI's own limit on `n` (choices generated per request).
MAX_CHOICES = 128
# The largest request body read (an 8 MiB body is ~2 million tokens of text).
MAX_BODY_BYTES = 8 * 1024 * 1024
# Deeper request bodies are refused with a 400 before any work (real ones nest < 20 levels).
MAX_BODY_DEPTH = 64
# The most objects and arrays one body may hold: each costs a Python object when parsed (a
# 2-byte `{}` about 64 bytes), so an 8 MiB body of them would cost half a GiB. A long agent
# conversation with tools holds a few thousand.
MAX_BODY_CONTAINERS = 100_000
# Per-field element counts, bounded before anything walks them (OpenAI allows 128 tools).
MAX_MESSAGES = 20_000
MAX_CONTENT_PARTS = 2_000
MAX_TOOLS = 1_024
# The list fields a request's element counts are bounded in (`input` is the responses API's).
_MESSAGE_LISTS = ("messages", "input")

_BRACKETS_ONLY = bytes(range(256)).translate(None, b"{}[]")
# A JSON string once escaped backslashes and quotes are gone (see `_outside_strings`).
_PLAIN_STRING = re.compile(rb'"[^"]*"')


class RequestBody(dict[str, Any]):
    """A request body `parse_request_body` read from JSON with its size, nesting and element
    counts checked: nothing walks it again."""


def parse_request_body(raw: bytes, *, max_bytes: int = MAX_BODY_BYTES) -> RequestBody:
    """A request body as a JSON object; `BodyTooLarge` (413) over `max_bytes`,
    `InvalidRequest` (400, naming the limit) for anything else.

    One bounded pass: the size, then the nesting depth and the number of objects and arrays
    read from the bytes before the JSON decoder builds anything (a few C-speed scans), then the
    decoder, then the list lengths the scheduler reads (`check_element_counts`).
    """
    if len(raw) > max_bytes:
        raise BodyTooLarge(f"the request body is larger than {max_bytes} bytes")
    check_body_shape(raw)
    try:
        # UTF-8 only, as JSON over HTTP is (RFC 8259): `json.loads` would also take UTF-16 and
        # UTF-32 bytes, which the forwarded bytes' priority splice cannot extend.
        body = json.loads(raw.decode("utf-8")) if raw else None
    except (ValueError, RecursionError):
        raise InvalidRequest("the request body is not valid UTF-8 JSON") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the request body must be a JSON object")
    check_element_counts(body)
    return RequestBody(body)


def check_body_shape(
    raw: bytes, *, depth: int = MAX_BODY_DEPTH, containers: int = MAX_BODY_CONTAINERS
) -> None:
    """`InvalidRequest` where the JSON text `raw` holds more than `containers` objects and
    arrays or nests them deeper than `depth`, read from its bytes outside its strings.

    For valid JSON the reading is exact; for anything else the decoder refuses it after.
    """
    if raw.count(b"{") + raw.count(b"[") <= depth:
        return  # too few brackets to nest deeper or count more, inside strings or not
    structure = _outside_strings(raw)
    count = structure.count(b"{") + structure.count(b"[")
    if count > containers:
        raise InvalidRequest(f"the request body holds more than {containers} objects and arrays")
    brackets = structure.translate(None, _BRACKETS_ONLY)
    # Each pass removes the innermost level: `depth` passes empty a body that deep. At most
    # 2 * `containers` bytes, so each pass is cheap.
    for _ in range(depth):
        reduced = brackets.replace(b"{}", b"").replace(b"[]", b"")
        if len(reduced) == len(brackets):
            return  # empty, or mismatched brackets: the decoder refuses those
        brackets = reduced
    if brackets:
        raise InvalidRequest(f"the request body nests deeper than {depth} levels")


def _outside_strings(raw: bytes) -> bytes:
    """The JSON text `raw` without its strings. Backslashes appear only in strings' escapes,
    which pair up from the left: removing `\\\\` pairs, then escaped quotes, leaves only the
    quotes that open and close strings."""
    plain = raw.replace(b"\\\\", b"").replace(b'\\"', b"")
    return _PLAIN_STRING.sub(b"", plain)


def check_element_counts(body: Mapping[str, Any]) -> None:
    """`InvalidRequest` naming the field where `messages` (or `input`), a message's `content`
    parts or `tools` is longer than its limit: checked before anything iterates them, on
    every path (an adapter's own parsed body too)."""
    for field in _MESSAGE_LISTS:
        messages = body.get(field)
        if type(messages) is not list:
            continue
        if len(messages) > MAX_MESSAGES:
            raise InvalidRequest(f"`{field}` holds more than {MAX_MESSAGES} items", param=field)
        for message in messages:
            if type(message) is dict or isinstance(message, Mapping):
                content = message.get("content")
                if type(content) is list and len(content) > MAX_CONTENT_PARTS:
                    raise InvalidRequest(
                        f"a message's `content` holds more than {MAX_CONTENT_PARTS} parts",
                        param=field,
                    )
    tools = body.get("tools")
    if type(tools) is list and len(tools) > MAX_TOOLS:
        raise InvalidRequest(f"`tools` holds more than {MAX_TOOLS} items", param="tools")


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
    `requested_choices`), with the lists it iterates bounded first unless `parse_request_body`
    did (`InvalidRequest`). Nothing here recurses, so an adapter's own parsed body (LiteLLM's,
    bounded by its decoder) needs no walk of its nesting."""
    if type(body) is not RequestBody:
        check_element_counts(body)
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
