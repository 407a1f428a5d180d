"""The docs say what the code does: status codes of refusals, configuration defaults, log lines."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

import fair_sched_plugin
from fair_sched_plugin import errors
from fair_sched_plugin.config import FairSchedSettings
from fair_sched_plugin.request.responses import CLIENT_CLOSED_STATUS, error

ROOT = Path(__file__).resolve().parents[1]
DOCS = [*sorted((ROOT / "docs").glob("*.md")), ROOT / "README.md"]
PACKAGE = Path(fair_sched_plugin.__file__).parent


def _source_calls() -> Iterator[ast.Call]:
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                yield node


def _rejections() -> Iterator[type[errors.Rejected]]:
    pending: list[type[errors.Rejected]] = [errors.Rejected]
    while pending:
        cls = pending.pop()
        pending.extend(cls.__subclasses__())
        yield cls


def statuses_by_code() -> dict[str, set[int]]:
    """Every error `code` the package answers with, and its statuses: the refusals in
    `errors.py`, and the `error(status, ..., code=...)` answers written out in the adapters."""
    table: dict[str, set[int]] = {"client_disconnected": {CLIENT_CLOSED_STATUS}}
    for cls in _rejections():
        if cls is not errors.Rejected:
            table.setdefault(cls.code or cls.reason, set()).add(cls.status_code)
    for call in _source_calls():
        name = (
            call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        )
        codes = [kw.value for kw in call.keywords if kw.arg == "code"]
        if (
            name == "error"
            and call.args
            and isinstance(call.args[0], ast.Constant)
            and isinstance(call.args[0].value, int)
            and codes
            and isinstance(codes[0], ast.Constant)
            and isinstance(codes[0].value, str)
        ):
            table.setdefault(codes[0].value, set()).add(call.args[0].value)
    return table


def test_every_status_and_code_named_in_the_docs_is_what_the_code_answers() -> None:
    table = statuses_by_code()
    wrong = []
    for path in DOCS:
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
            for status, code in re.findall(r"\b([1-5]\d\d) `([a-z_]+)`", line):
                if int(status) not in table.get(code, ()):
                    wrong.append(
                        f"{path.name}:{number}: {status} `{code}` (code: {table.get(code)})"
                    )
    assert not wrong


def test_the_refusal_table_of_waiting_clients_matches_the_responses() -> None:
    text = (ROOT / "docs" / "waiting-clients.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| [^|]+ \| (\d{3}) \| `(\w+)` \| `(\w+)` \|$", text, re.MULTILINE)
    assert len(rows) == 5
    table = statuses_by_code()
    for status, kind, code in rows:
        assert int(status) in table[code], (status, code)
        assert error(int(status), "", code=code).body["error"]["type"] == kind


def test_the_exception_tree_in_errors_docstring_names_each_status() -> None:
    documented: dict[str, int] = {}
    name = None
    for line in (errors.__doc__ or "").splitlines():
        if found := re.search(r"[├└]── (\w+)", line):
            name = found.group(1)
        if (status := re.search(r"-> \(?HTTP (\d{3})", line)) and name:
            documented[name] = int(status.group(1))
    actual = {cls.__name__: cls.status_code for cls in _rejections() if cls is not errors.Rejected}
    actual["ClientDisconnected"] = CLIENT_CLOSED_STATUS
    assert documented == actual


# ----------------------------------------------------------------------------- defaults


def _models(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [model for arg in get_args(annotation) for model in _models(arg)]


def _field_default(path: str) -> Any:
    """The default of the setting at a documented path (`backends.<model>.placement.load_bound`,
    `tiers[].name`); KeyError where the path names no field."""
    models: list[type[BaseModel]] = [FairSchedSettings]
    parts = path.split(".")
    for position, part in enumerate(parts):
        if part == "<model>":
            continue  # a dict's key: its value's model is already in `models`
        name = part.removesuffix("[]")
        found = [model for model in models if name in model.model_fields]
        if len(found) != 1:
            raise KeyError(path)
        (model,) = found
        field = model.model_fields[name]
        if position == len(parts) - 1:
            if field.default_factory is not None:
                return field.default_factory()  # type: ignore[call-arg]
            return None if field.default is PydanticUndefined else field.default
        annotation = field.annotation
        if get_origin(annotation) is dict:
            annotation = get_args(annotation)[1]
        models = _models(annotation)
    raise KeyError(path)


_NOT_A_VALUE = object()


def _documented_value(cell: str) -> Any:
    """A default cell of the configuration table as a value, or `_NOT_A_VALUE` where it is prose
    (`max(1000, 5 x poll)`, `the first tier`) or names another key."""
    cell = cell.strip()
    if cell == "none":
        return None
    if cell in ("true", "false"):
        return cell == "true"
    if re.fullmatch(r"-?\d+(\.\d+)?", cell):
        return float(cell)
    if cell in ("`[]`", "`{}`"):
        return "empty"
    if (word := re.fullmatch(r"`([^`\s]+)`", cell)) and word.group(1) not in (
        FairSchedSettings.model_fields
    ):
        return word.group(1)
    return _NOT_A_VALUE


def configuration_defaults() -> list[tuple[str, Any]]:
    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    rows = re.findall(r"^\| `([^`]+)` \| ([^|]*) \|", text, re.MULTILINE)
    return [
        (key, value) for key, cell in rows if (value := _documented_value(cell)) is not _NOT_A_VALUE
    ]


def test_the_configuration_table_documents_enough_plain_defaults_to_check() -> None:
    assert len(configuration_defaults()) >= 40


@pytest.mark.parametrize(("key", "documented"), configuration_defaults())
def test_a_documented_default_is_the_config_models_default(key: str, documented: Any) -> None:
    default = _field_default(key)
    if documented == "empty":
        assert default is not None and len(default) == 0
    elif isinstance(documented, bool) or documented is None:
        assert default is documented
    elif isinstance(documented, float):
        assert not isinstance(default, bool) and float(default) == documented
    else:
        assert default == documented


def test_defaults_named_in_prose_are_the_config_models_defaults() -> None:
    """`arrival_grace_ms` (default 300 ms): wherever a doc gives a setting's default in passing."""
    wrong = []
    for path in DOCS:
        text = path.read_text(encoding="utf-8")
        for key, value in re.findall(r"`([\w.<>\[\]]+)` \(default (\d+(?:\.\d+)?)", text):
            try:
                default = _field_default(key if "." in key else _path_of(key))
            except KeyError:
                continue  # not a setting (`stream_options.include_usage` of a request)
            if float(default) != float(value):
                wrong.append(f"{path.name}: {key} default {value} (code: {default})")
    assert not wrong


def _path_of(name: str) -> str:
    for path in ("", "backends.<model>.", "tiers[].", "queue.", "observability."):
        try:
            _field_default(path + name)
        except KeyError:
            continue
        return path + name
    raise KeyError(name)


# ----------------------------------------------------------------------------- log lines

_LEVELS = {"debug": "DEBUG", "info": "INFO", "warning": "WARNING", "error": "ERROR"}
# What a value in a log line may look like: a name or number without spaces, a quoted repr.
_PLACEHOLDERS = {"s": r"\S+", "r": r"'.*'", "d": r"-?\d+", "f": r"-?[\d.]+"}


def log_formats() -> list[tuple[str | None, re.Pattern[str]]]:
    """(level or None for `logger.log`, the message's format as a pattern) of each log call."""
    formats = []
    for call in _source_calls():
        func = call.func
        if not (
            isinstance(func, ast.Attribute)
            and isinstance(func.value, ast.Name)
            and func.value.id == "logger"
        ):
            continue
        args = call.args[1:] if func.attr == "log" else call.args
        if not args or not isinstance(args[0], ast.Constant) or not isinstance(args[0].value, str):
            continue
        pattern, previous = "", ""
        for piece in filter(None, re.split(r"(%[-.\d]*[srdf])", args[0].value)):
            if not piece.startswith("%"):
                pattern += re.escape(piece)
            elif previous.startswith("%"):
                pattern += ".*"  # `retry_after=%s%s`: an optional tail (and N more not logged)
            else:
                pattern += _PLACEHOLDERS[piece[-1]]
            previous = piece
        formats.append((_LEVELS.get(func.attr), re.compile(pattern + "$")))
    return formats


def test_the_log_lines_in_the_operations_doc_are_ones_the_code_writes() -> None:
    text = (ROOT / "docs" / "operations.md").read_text(encoding="utf-8")
    block = text.split("## Log lines", 1)[1].split("```", 2)[1]
    lines = [line for line in block.splitlines() if line.strip()]
    assert len(lines) >= 5
    formats = log_formats()
    for line in lines:
        level, message = line.split(maxsplit=1)
        assert any(
            pattern.match(message) and found in (None, level) for found, pattern in formats
        ), line


def test_the_example_files_the_docs_name_are_shipped() -> None:
    named = {
        name
        for path in DOCS
        for name in re.findall(r"\bexamples/[\w.-]+\.\w+", path.read_text(encoding="utf-8"))
    }
    assert "examples/fair_sched.yaml" in named
    assert not [name for name in sorted(named) if not (ROOT / name).is_file()]
