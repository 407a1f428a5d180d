"""Who is calling: principals from API keys or from LiteLLM's authenticated identity.

Identity comes from authentication, never from fields the client sets (`user`, metadata, headers)
unless `identity.source` says so explicitly: otherwise any client could claim another user's queue,
or a fresh one per request, and fairness would mean nothing.

Keys are compared as SHA-256 digests: the presented key is hashed, looked up by digest, and the
match confirmed with `hmac.compare_digest`, so timing reveals nothing about stored keys. Raw keys
are never kept beyond the lookup, never logged and never used as names: an unknown caller is
named by a short hash of its key.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from ..config import FairSchedSettings, PrincipalSettings


class Principal(NamedTuple):
    """A resolved caller: the queue it waits in (`name`), its tier and weight."""

    name: str
    tier: str
    weight: float
    known: bool  # configured in `principals`, as opposed to an authenticated stranger


@dataclass(frozen=True)
class Credentials:
    """Everything an integration knows about a request's caller.

    `api_key` is the bearer key as presented; `user_id`, `team_id`, `key_alias` and `key_hash`
    come from LiteLLM's authentication (`UserAPIKeyAuth`). `claimed_user` is what the client says
    (a header or the body's `user`), used only when `identity.source` trusts it.
    """

    api_key: str | None = None
    user_id: str | None = None
    team_id: str | None = None
    key_alias: str | None = None
    key_hash: str | None = None
    claimed_user: str | None = None


def key_digest(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()


def key_fingerprint(key: str) -> str:
    """A short, non-reversible name for a key, safe for logs, metrics and status pages."""
    return "key:" + key_digest(key)[:12]


class PrincipalDirectory:
    """Resolves credentials to principals according to the settings."""

    def __init__(self, settings: FairSchedSettings) -> None:
        self._settings = settings
        self._default_tier = settings.default_tier_name
        self._by_digest: dict[str, tuple[str, PrincipalSettings]] = {}
        self._by_name: dict[str, PrincipalSettings] = {}
        self._matchers: list[PrincipalSettings] = []
        for principal in settings.principals:
            self._by_name[principal.name] = principal
            for key in principal.keys:
                digest = (
                    key.removeprefix("sha256:") if key.startswith("sha256:") else key_digest(key)
                )
                self._by_digest[digest] = (digest, principal)
            if principal.match is not None:
                self._matchers.append(principal)

    @property
    def has_keys(self) -> bool:
        return bool(self._by_digest)

    def principal_for_key(self, api_key: str) -> Principal | None:
        """The configured principal owning this key, or None."""
        digest = key_digest(api_key)
        entry = self._by_digest.get(digest)
        # The lookup is keyed by a digest of the presented key, so its timing says nothing about
        # stored keys; the final comparison is constant-time all the same.
        if entry is None or not hmac.compare_digest(entry[0], digest):
            return None
        return self._principal(entry[1])

    def principal_for_digest(self, hexdigest: str) -> Principal | None:
        """The principal owning a key whose SHA-256 hex digest is given (LiteLLM's key hash)."""
        entry = self._by_digest.get(hexdigest.lower())
        if entry is None or not hmac.compare_digest(entry[0], hexdigest.lower()):
            return None
        return self._principal(entry[1])

    def principal_named(self, name: str) -> Principal | None:
        """A configured principal by name (for identities our own authentication vouched for)."""
        configured = self._by_name.get(name)
        return self._principal(configured) if configured is not None else None

    def resolve(self, credentials: Credentials) -> Principal:
        source = self._settings.identity.source
        if source != "auth" and credentials.claimed_user:
            claimed = credentials.claimed_user.strip()[:128]
            configured = self._by_name.get(claimed)
            if configured is not None:
                return self._principal(configured)
            return Principal(f"user:{claimed}", self._default_tier, 1.0, known=False)
        if credentials.api_key:
            principal = self.principal_for_key(credentials.api_key)
            if principal is not None:
                return principal
        if credentials.key_hash:
            principal = self.principal_for_digest(credentials.key_hash)
            if principal is not None:
                return principal
        matched = self._match(credentials)
        if matched is not None:
            return self._principal(matched)
        return Principal(self._stranger_name(credentials), self._default_tier, 1.0, known=False)

    def _match(self, credentials: Credentials) -> PrincipalSettings | None:
        for principal in self._matchers:
            match = principal.match
            assert match is not None
            wanted: Mapping[str, str | None] = {
                "user_id": match.user_id,
                "team_id": match.team_id,
                "key_alias": match.key_alias,
            }
            if all(
                value is None or getattr(credentials, field) == value
                for field, value in wanted.items()
            ):
                return principal
        return None

    def _principal(self, principal: PrincipalSettings) -> Principal:
        return Principal(
            principal.name, principal.tier or self._default_tier, principal.weight, known=True
        )

    @staticmethod
    def _stranger_name(credentials: Credentials) -> str:
        # Authenticated but not configured: its own queue, named without revealing the key.
        if credentials.user_id:
            return f"user:{credentials.user_id}"
        if credentials.key_alias:
            return f"alias:{credentials.key_alias}"
        if credentials.key_hash:
            return "key:" + credentials.key_hash[:12]
        if credentials.api_key:
            return key_fingerprint(credentials.api_key)
        return "anonymous"
