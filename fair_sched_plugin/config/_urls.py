"""Deployment URLs: their keys, their public names (no credentials) and their metrics URLs."""

from __future__ import annotations

from collections.abc import Iterable
from urllib.parse import urlsplit, urlunsplit


def check_http_url(value: str) -> None:
    parts = urlsplit(value)
    if parts.scheme not in {"http", "https"} or not parts.netloc:
        raise ValueError("must be an http(s) URL")  # not echoed: it may carry a password


def deployment_key(api_base: str) -> str:
    """The key of the deployment at `api_base` (a lease's `deployment`): the api_base without a
    trailing "/". Every adapter maps its deployments to keys with this one function."""
    return api_base.rstrip("/")


def safe_url(url: str) -> str:
    """A URL without credentials, query or fragment (fit for a label, a log or a status page)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    try:
        port = parts.port
    except ValueError:  # a port out of range: nothing of it is shown
        port = None
    netloc = f"{host}:{port}" if port else host
    return urlunsplit((parts.scheme, netloc, parts.path, "", ""))


def deployment_names(keys: Iterable[str]) -> dict[str, str]:
    """Each deployment key's public name: what responses, the status document, metric labels
    and logs call it, since the key (an api_base) may carry a password or a `?token=`.

    The name is the key as `safe_url` shows it (`http://user:pw@h:8000/v1?token=t` ->
    `http://h:8000/v1`); keys that would share a name are told apart by `#1`, `#2`, ... in the
    order given (the configuration's, so every replica names them alike)."""
    unique = list(dict.fromkeys(keys))
    by_name: dict[str, list[str]] = {}
    for key in unique:
        by_name.setdefault(safe_url(key), []).append(key)
    names = {}
    for name, same in by_name.items():
        for number, key in enumerate(same, start=1):
            names[key] = name if len(same) == 1 else f"{name}#{number}"
    return names


def default_metrics_url(api_base: str) -> str:
    """`http://host:8000/v1` -> `http://host:8000/metrics` (LiteLLM's `api_base` to /metrics)."""
    parts = urlsplit(api_base.rstrip("/"))
    path = parts.path
    if path.endswith("/v1"):
        path = path[: -len("/v1")]
    return urlunsplit((parts.scheme, parts.netloc, path.rstrip("/") + "/metrics", "", ""))
