"""What responses, logs, metric labels and the status document call each deployment.

A deployment's key (its api_base) and its metrics URL may carry credentials or a `?token=`: only
the app and the engine get them; everything else gets the public name.
"""

from __future__ import annotations

from collections.abc import Mapping

from ..config import BackendSettings, deployment_names, safe_url


class DeploymentNames:
    """The public name of each configured deployment key and metrics URL (numbered where two
    would look alike, `config.deployment_names`), and every configured URL's redaction."""

    def __init__(self, backends: Mapping[str, BackendSettings]) -> None:
        deployments = [pair for backend in backends.values() for pair in backend.deployments()]
        # Metrics URLs too (named alike, for the `url` labels): a deployment known by its
        # metrics URL has it as its key.
        self._names = deployment_names(
            [key for key, _ in deployments] + [url for _, url in deployments]
        )
        # Every configured URL that shows more than its name, longest first (see `redact`).
        self._redactions = sorted(
            {
                (url, name)
                for backend in backends.values()
                for key, metrics_url in backend.deployments()
                for url, name in (
                    (key, self._names[key]),
                    (metrics_url, self._names[metrics_url]),
                    *((base, self._names[key]) for base in _raw_bases(backend, key)),
                )
                if url != name
            },
            key=lambda pair: -len(pair[0]),
        )

    @property
    def hides_secrets(self) -> bool:
        """Whether some configured URL shows more than its public name."""
        return bool(self._redactions)

    def deployment_name(self, key: str) -> str:
        """A deployment's public name, never its key (which may carry credentials). A key the
        configuration does not know (a leader's differing config) is shown safely."""
        return self._names.get(key) or safe_url(key)

    def redact(self, text: str) -> str:
        """`text` with every configured api_base and metrics URL replaced by its public form."""
        for url, name in self._redactions:
            if url in text:
                text = text.replace(url, name)
        return text


def _raw_bases(backend: BackendSettings, key: str) -> tuple[str, ...]:
    """The api_bases as configured (a trailing "/" and all) whose deployment key is `key`."""
    bases = ((backend.api_base,) if backend.api_base else ()) + backend.api_bases
    return tuple(base for base in bases if base.rstrip("/") == key)
