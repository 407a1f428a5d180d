"""Validation errors as one message per bad key path, with "did you mean" for a typo'd key."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

# Unknown keys are named in errors only when they look like a setting's name.
SAFE_KEY = re.compile(r"^[a-z_][a-z0-9_]{0,63}$")


def _format_location(location: tuple[int | str, ...]) -> str:
    path = "fair_sched"
    for part in location:
        path += f"[{part}]" if isinstance(part, int) else f".{part}"
    return path


def _annotations_at(annotation: Any, part: int | str) -> list[Any]:
    """What `part` of a location reaches inside a value of type `annotation`."""
    found: list[Any] = []
    for kind in _alternatives(annotation):
        origin = get_origin(kind)
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            if part in kind.model_fields:
                found.append(kind.model_fields[str(part)].annotation)
        elif origin in (tuple, list) and isinstance(part, int):
            found.extend(arg for arg in get_args(kind) if arg is not Ellipsis)
        elif origin in (dict, Mapping) and isinstance(part, str):
            found.append(get_args(kind)[-1])
    # Pydantic names the member of a union it tried (`...waiting_below.AutoWaitingBelow.auto`).
    members = [kind for kind in _alternatives(annotation) if getattr(kind, "__name__", "") == part]
    return found or members


def _alternatives(annotation: Any) -> list[Any]:
    """`annotation` without `Annotated`, `X | None` split into its members."""
    if get_origin(annotation) is Annotated:
        return _alternatives(get_args(annotation)[0])
    if get_origin(annotation) in (Union, UnionType):
        return [kind for member in get_args(annotation) for kind in _alternatives(member)]
    return [annotation]


def nearest_key(root: type[BaseModel], location: tuple[int | str, ...]) -> str | None:
    """The known key closest to the unknown one at the end of `location` inside a `root`
    (a typo's fix)."""
    annotations: list[Any] = [root]
    for part in location[:-1]:
        annotations = [found for kind in annotations for found in _annotations_at(kind, part)]
    known = {
        name
        for annotation in annotations
        for kind in _alternatives(annotation)
        if isinstance(kind, type) and issubclass(kind, BaseModel)
        for name in kind.model_fields
    }
    matches = difflib.get_close_matches(str(location[-1]), sorted(known), n=1)
    return matches[0] if matches else None


def format_errors(error: ValidationError, root: type[BaseModel]) -> str:
    """Every error of validating a `root`, one line each: its key path and what is wrong."""
    lines = []
    for detail in error.errors(include_url=False):
        location = tuple(
            part
            for part in detail["loc"]
            if not (isinstance(part, str) and part.startswith("function-"))
        )
        message = detail["msg"].removeprefix("Value error, ")
        kind = detail["type"]
        if kind == "extra_forbidden":
            message = "unknown key"
            nearest = nearest_key(root, location) if SAFE_KEY.match(str(location[-1])) else None
            if nearest is not None:
                message += f", did you mean {nearest}?"
        bad_value = detail.get("input")
        # Only numbers and booleans are echoed: any string may be a key pasted in the wrong
        # place (a name, a URL with a password, a tier), and a config error ends up in logs.
        show_value = kind != "extra_forbidden" and isinstance(bad_value, (int, float))
        if show_value and "(got " not in message:
            message += f" (got {bad_value!r})"
        if kind == "extra_forbidden" and location and not SAFE_KEY.match(str(location[-1])):
            location = (*location[:-1], "<a key not shown>")
        where = _format_location(location)
        # Cross-field checks raise "sub.path: message" from the model; fold the path in.
        nested = re.match(r"^([A-Za-z_][\w.\[\]]*): (.*)$", message, re.DOTALL)
        if nested and kind == "value_error":
            where, message = f"{where}.{nested.group(1)}", nested.group(2)
        lines.append(f"{where}: {message}")
    return "invalid fair_sched settings:\n  " + "\n  ".join(lines)
