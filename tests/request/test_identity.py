"""Identity comes from authentication; client-set fields are trusted only when configured."""

from __future__ import annotations

import hashlib

from fair_sched_plugin.config import parse_settings
from fair_sched_plugin.request.identity import Credentials, PrincipalDirectory, key_fingerprint

HASHED = "sha256:" + hashlib.sha256(b"sk-bot-secret").hexdigest()
SETTINGS = {
    "principals": [
        {"name": "alice", "keys": ["sk-alice-1"], "tier": "interactive", "weight": 2},
        {"name": "ci-bot", "keys": [HASHED], "tier": "batch"},
        {"name": "chat-ui", "match": {"team_id": "chat"}, "weight": 3},
    ]
}


def directory(**overrides: object) -> PrincipalDirectory:
    return PrincipalDirectory(parse_settings({**SETTINGS, **overrides}))


def test_plain_and_hashed_keys_resolve_to_their_principal() -> None:
    alice = directory().resolve(Credentials(api_key="sk-alice-1"))
    assert (alice.name, alice.tier, alice.weight, alice.known) == ("alice", "interactive", 2, True)
    bot = directory().resolve(Credentials(api_key="sk-bot-secret"))
    assert (bot.name, bot.tier) == ("ci-bot", "batch")


def test_litellm_identity_matches_principals() -> None:
    chat = directory().resolve(Credentials(team_id="chat", user_id="u1"))
    assert (chat.name, chat.weight) == ("chat-ui", 3)


def test_unknown_caller_gets_default_tier_and_own_queue_named_without_the_key() -> None:
    stranger = directory().resolve(Credentials(api_key="sk-unknown-123"))
    assert stranger.tier == "interactive" and not stranger.known
    assert stranger.name == key_fingerprint("sk-unknown-123")
    assert "sk-unknown-123" not in stranger.name
    other = directory().resolve(Credentials(api_key="sk-unknown-456"))
    assert other.name != stranger.name


def test_client_claims_are_ignored_by_default() -> None:
    claimed = directory().resolve(Credentials(api_key="sk-unknown-123", claimed_user="alice"))
    assert claimed.name != "alice"


def test_claims_are_trusted_when_configured() -> None:
    trusting = directory(identity={"source": "header"})
    assert trusting.resolve(Credentials(claimed_user="alice")).name == "alice"
    assert trusting.resolve(Credentials(claimed_user="bob")).name == "user:bob"


def test_key_beats_litellm_match() -> None:
    resolved = directory().resolve(Credentials(api_key="sk-alice-1", team_id="chat"))
    assert resolved.name == "alice"
