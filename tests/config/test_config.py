"""Settings are validated once, with messages that name the key path and the bad value."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from fair_sched_plugin.config import default_metrics_url, load_settings, parse_settings
from fair_sched_plugin.errors import ConfigError

BAD_CONFIGS: list[tuple[str, Any, str]] = [
    ("not a mapping", ["tiers"], "fair_sched: must be a mapping"),
    ("unknown top-level key", {"fairnes": "round_robin"}, "fair_sched.fairnes: unknown key"),
    ("unknown policy", {"fairness": "lottery"}, "fair_sched.fairness: Input should be"),
    (
        "negative threshold",
        {"tiers": [{"name": "a", "waiting_below": -1}]},
        "fair_sched.tiers[0].waiting_below",
    ),
    (
        "negative threshold, its value named",
        {"tiers": [{"name": "a", "waiting_below": -1}]},
        "(got -1)",
    ),
    (
        "tpot not a number",
        {"tiers": [{"name": "a", "tpot_below_ms": "fast"}]},
        "fair_sched.tiers[0].tpot_below_ms",
    ),
    (
        "kv usage above 1",
        {"tiers": [{"name": "a", "kv_usage_below": 1.5}]},
        "fair_sched.tiers[0].kv_usage_below",
    ),
    (
        "fairness window not positive",
        {"observability": {"fairness_window_s": 0}},
        "fair_sched.observability.fairness_window_s",
    ),
    ("no tiers", {"tiers": []}, "fair_sched.tiers: needs at least one tier"),
    ("duplicate tiers", {"tiers": [{"name": "a"}, {"name": "a"}]}, "duplicate tier names ['a']"),
    ("bad tier name", {"tiers": [{"name": "has space"}]}, "fair_sched.tiers[0].name"),
    (
        "unknown default tier",
        {"default_tier": "gold"},
        "fair_sched.default_tier: unknown tier; tiers are ['batch', 'interactive']",
    ),
    (
        "principal with unknown tier",
        {"principals": [{"name": "a", "keys": ["k"], "tier": "gold"}]},
        "fair_sched.principals[0].tier: unknown tier; tiers are",
    ),
    (
        "principal without keys or match",
        {"principals": [{"name": "a"}]},
        "fair_sched.principals[0]: needs `keys` or `match`",
    ),
    (
        "malformed sha256 key",
        {"principals": [{"name": "a", "keys": ["sha256:abc"]}]},
        "fair_sched.principals[0].keys",
    ),
    (
        "a key owned twice",
        {"principals": [{"name": "a", "keys": ["k1"]}, {"name": "b", "keys": ["k1"]}]},
        "fair_sched.principals[1].keys: a key is also listed for principal 'a'",
    ),
    (
        "weight zero",
        {"principals": [{"name": "a", "keys": ["k"], "weight": 0}]},
        "fair_sched.principals[0].weight",
    ),
    ("empty match", {"principals": [{"name": "a", "match": {}}]}, "fair_sched.principals[0].match"),
    (
        "bad metrics url",
        {"backends": {"m": {"metrics_url": "ftp://x"}}},
        "fair_sched.backends.m.metrics_url: must be an http(s) URL",
    ),
    ("unknown engine", {"backends": {"m": {"engine": "triton"}}}, "fair_sched.backends.m.engine"),
    (
        "engine queue in user order without priority scheduling",
        {"backends": {"m": {"fair_engine_queue": True}}},
        "fair_sched.backends.m.fair_engine_queue: needs priority_scheduling: true",
    ),
    (
        "engine queue in user order on TGI",
        {
            "backends": {
                "m": {"engine": "tgi", "priority_scheduling": True, "fair_engine_queue": True}
            }
        },
        "fair_sched.backends.m.fair_engine_queue: needs priority_scheduling: true on a vllm or sglang",
    ),
    (
        "metrics urls do not pair with api_bases",
        {
            "backends": {
                "m": {
                    "api_bases": ["http://a:8000/v1", "http://b:8000/v1"],
                    "metrics_url": "http://a:8000/metrics",
                }
            }
        },
        "fair_sched.backends.m.metrics_urls: 1 metrics URLs for 2 api_bases",
    ),
    (
        "load bound not above 1",
        {"backends": {"m": {"placement": {"load_bound": 1}}}},
        "fair_sched.backends.m.placement.load_bound",
    ),
    (
        "unknown metric signal",
        {"backends": {"m": {"metric_names": {"queue": "x"}}}},
        "fair_sched.backends.m.metric_names",
    ),
    ("queue cap zero", {"queue": {"max_per_user": 0}}, "fair_sched.queue.max_per_user"),
    ("queue typo", {"queue": {"max_per_usr": 3}}, "fair_sched.queue.max_per_usr: unknown key"),
    ("poll too fast", {"metrics_poll_ms": 1}, "fair_sched.metrics_poll_ms"),
    ("bad state url", {"state": "postgres://x"}, "fair_sched.state: must be memory://"),
    ("bad identity source", {"identity": {"source": "cookie"}}, "fair_sched.identity.source"),
    # Values that used to be accepted and silently broke a bound.
    (
        "weight too small",
        {"principals": [{"name": "a", "keys": ["k"], "weight": 1e-300}]},
        "fair_sched.principals[0].weight: Input should be greater than or equal to 0.001",
    ),
    ("infinite wait", {"queue": {"max_wait_s": float("inf")}}, "fair_sched.queue.max_wait_s"),
    ("nan wait", {"queue": {"max_wait_s": float("nan")}}, "fair_sched.queue.max_wait_s"),
    ("scrape timeout too short", {"metrics_timeout_ms": 0.001}, "fair_sched.metrics_timeout_ms"),
    ("infinite lease", {"max_lease_s": float("inf")}, "fair_sched.max_lease_s"),
    ("lease zero", {"max_lease_s": 0}, "fair_sched.max_lease_s: Input should be greater than 0"),
    ("send timeout zero", {"send_timeout_s": 0}, "fair_sched.send_timeout_s"),
    (
        "admin key from an unset variable",
        {"observability": {"admin_key": "os.environ/FAIR_SCHED_TEST_UNSET_VARIABLE"}},
        "fair_sched.observability.admin_key: the environment variable "
        "FAIR_SCHED_TEST_UNSET_VARIABLE is not set",
    ),
    (
        "backend key from an unset variable",
        {"backends": {"m": {"api_key": "os.environ/FAIR_SCHED_TEST_UNSET_VARIABLE"}}},
        "fair_sched.backends.m.api_key: the environment variable",
    ),
]


@pytest.mark.parametrize(
    ("case", "section", "expected"), BAD_CONFIGS, ids=[c[0] for c in BAD_CONFIGS]
)
def test_bad_config_names_the_key_path(case: str, section: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings(section)
    assert expected in str(caught.value)


@pytest.mark.parametrize(
    "section",
    [
        {"default_tier": "sk-live-pasted-by-mistake"},
        {"principals": [{"name": "a", "keys": ["k"], "tier": "sk-live-pasted-by-mistake"}]},
        {"principals": [{"name": "a", "keys": ["k"], "sk-live-pasted-by-mistake": 1}]},
        {"tiers": [{"name": "i", "waiting_below": {"auto": {"sk-live-pasted-by-mistake": 1}}}]},
        {"principals": [{"name": "sk-live-pasted by mistake", "keys": ["k"]}]},
        {"backends": {"m": {"api_base": "sk-live-pasted-by-mistake"}}},
        {"backends": {"m": {"engine": "sk-live-pasted-by-mistake"}}},
        {"observability": {"admin_key": 123, "user_labels": "sk-live-pasted-by-mistake"}},
        {"state": "sk-live-pasted-by-mistake"},
    ],
)
def test_a_key_pasted_in_the_wrong_place_is_not_echoed(section: Any) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings(section)
    assert "sk-live" not in str(caught.value)
    assert "fair_sched." in str(caught.value)


def test_admin_key_from_a_set_variable_is_accepted(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FAIR_SCHED_TEST_ADMIN", "s3cret")
    settings = parse_settings({"observability": {"admin_key": "os.environ/FAIR_SCHED_TEST_ADMIN"}})
    assert settings.observability.resolved_admin_key() == "s3cret"
    assert "s3cret" not in repr(settings)


def test_keys_are_never_echoed_in_errors() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings({"principals": [{"name": "a", "keys": ["sha256:not-hex-secret-value"]}]})
    assert "secret" not in str(caught.value)


def test_defaults_match_the_design() -> None:
    settings = parse_settings({})
    assert [tier.name for tier in settings.tiers] == ["interactive", "batch"]
    assert settings.tiers[0].waiting_below == 3 and settings.tiers[1].waiting_below == 1
    assert settings.fairness == "round_robin"
    assert settings.metrics_poll_ms == 100
    assert settings.effective_metrics_timeout_ms == 1000
    assert settings.effective_stale_after_ms == 2000
    assert settings.identity.source == "auth"


def test_design_example_parses(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(
        """
model_list: []
fair_sched:
  tiers:
    - {name: interactive, waiting_below: 3, tpot_below_ms: 150, vllm_priority: 0}
    - {name: batch, waiting_below: 1, vllm_priority: 10}
  default_tier: interactive
  fairness: round_robin
  principals:
    - {name: alice, keys: ["sk-alice-1"], tier: interactive, weight: 1}
    - {name: ci-bot, keys: ["sha256:9f2c5e0a6f3d0f0b7c1f2e3d4c5b6a79881726354453627180f9e8d7c6b5a4f3"], tier: batch}
    - {name: chat-ui, match: {team_id: chat}, tier: interactive, weight: 2}
  backends:
    llama-70b: {metrics_url: "http://vllm-a:8000/metrics", engine: vllm, priority_scheduling: true}
  queue: {max_per_user: 1000, max_total: 100000, max_wait_s: 600}
  metrics_poll_ms: 100
"""
    )
    settings = load_settings(path)
    assert settings.principals[2].match is not None
    assert settings.backends["llama-70b"].priority_scheduling


def test_litellm_config_without_section_gets_defaults(tmp_path: Path) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("model_list: []\nlitellm_settings: {}\n")
    assert load_settings(path) == parse_settings({})


def test_environment_variable_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "fair.yaml"
    path.write_text("fairness: tokens\n")
    monkeypatch.setenv("FAIR_SCHED_CONFIG", str(path))
    assert load_settings().fairness == "tokens"


def test_unreadable_and_invalid_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        load_settings(tmp_path / "missing.yaml")
    broken = tmp_path / "broken.yaml"
    broken.write_text("fair_sched: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_settings(broken)


@pytest.mark.parametrize(
    ("api_base", "expected"),
    [
        ("http://vllm:8000/v1", "http://vllm:8000/metrics"),
        ("http://vllm:8000/v1/", "http://vllm:8000/metrics"),
        ("https://host/prefix/v1", "https://host/prefix/metrics"),
        ("http://127.0.0.1:9000", "http://127.0.0.1:9000/metrics"),
    ],
)
def test_metrics_url_defaults_from_api_base(api_base: str, expected: str) -> None:
    assert default_metrics_url(api_base) == expected


def test_api_bases_are_deployments_with_derived_metrics_urls() -> None:
    backend = load_settings(
        {"backends": {"m": {"api_base": "http://a:8000/v1/", "api_bases": ["http://b:8000/v1"]}}}
    ).backends["m"]
    assert backend.deployments() == (
        ("http://a:8000/v1", "http://a:8000/metrics"),
        ("http://b:8000/v1", "http://b:8000/metrics"),
    )
    assert backend.placement.prefix_affinity and backend.placement.load_bound == 1.25


def test_metrics_urls_pair_with_api_bases_by_position() -> None:
    backend = load_settings(
        {
            "backends": {
                "m": {
                    "api_bases": ["http://a:8000/v1", "http://b:8000/v1"],
                    "metrics_urls": ["http://a:9090/metrics", "http://b:9090/metrics"],
                }
            }
        }
    ).backends["m"]
    assert backend.deployments() == (
        ("http://a:8000/v1", "http://a:9090/metrics"),
        ("http://b:8000/v1", "http://b:9090/metrics"),
    )


def test_metrics_urls_without_api_base_are_deployments_keyed_by_themselves() -> None:
    urls = ["http://a:8000/metrics", "http://b:8000/metrics"]
    backend = load_settings({"backends": {"m": {"metrics_urls": urls}}}).backends["m"]
    assert backend.deployments() == tuple((url, url) for url in urls)


def test_deployment_names_hide_credentials_and_tell_look_alikes_apart() -> None:
    """A deployment's public name is its key without credentials, query or fragment; two keys
    that would look alike are numbered in the order given (every replica's config order)."""
    from fair_sched_plugin.config import deployment_names

    names = deployment_names(
        [
            "http://a:pw1@h:8000/v1?token=t1",
            "http://b:pw2@h:8000/v1?token=t2",
            "http://other:8000/v1",
            "http://other:8000/v1",
        ]
    )
    assert names == {
        "http://a:pw1@h:8000/v1?token=t1": "http://h:8000/v1#1",
        "http://b:pw2@h:8000/v1?token=t2": "http://h:8000/v1#2",
        "http://other:8000/v1": "http://other:8000/v1",
    }


@pytest.mark.parametrize(
    ("section", "expected"),
    [
        (
            {"principals": [{"name": "a", "keys": ["k"]}, {"name": "b", "key": ["k"]}]},
            "fair_sched.principals[1].key: unknown key, did you mean keys?",
        ),
        (
            {"metrics_pol_ms": 100},
            "fair_sched.metrics_pol_ms: unknown key, did you mean metrics_poll_ms?",
        ),
        (
            {"tiers": [{"name": "i", "waiting_bellow": 3}]},
            "fair_sched.tiers[0].waiting_bellow: unknown key, did you mean waiting_below?",
        ),
        (
            {"backends": {"m": {"placement": {"prefix_afinity": True}}}},
            "fair_sched.backends.m.placement.prefix_afinity: unknown key, did you mean "
            "prefix_affinity?",
        ),
        (
            {"queue": {"max_per_usr": 3}},
            "fair_sched.queue.max_per_usr: unknown key, did you mean max_per_user?",
        ),
        (
            {"tiers": [{"name": "i", "tpot_below_ms": 100, "waiting_below": {"auto": {"mn": 1}}}]},
            "fair_sched.tiers[0].waiting_below.auto.mn: unknown key, did you mean min?",
        ),
    ],
)
def test_an_unknown_key_names_the_nearest_known_one(section: Any, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings(section)
    assert expected in str(caught.value).splitlines()[1]


def test_an_unknown_key_like_no_known_one_gets_no_suggestion() -> None:
    with pytest.raises(ConfigError) as caught:
        parse_settings({"observability": {"zzzz": 1}})
    assert str(caught.value).splitlines()[1].strip() == "fair_sched.observability.zzzz: unknown key"
