"""Settings: FORKQ_* variables, defaults, URL validation with messages naming the variable, and real URLs."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.worker import WorkController
from pydantic import ValidationError

from broker_config.settings import (
    ModelLimit,
    Settings,
    is_sentinel_url,
    load_settings,
    model_limit,
    redact_url,
    sentinel_nodes,
)
from workers.app import make_app
from workers.client import ForkClient
from workers.demo.redis_server import RedisServer
from workers.errors import ConfigurationError
from workers.records.fork import Status

FORK = {"description": "d", "prompt": "Summarise the session.", "subagent_type": "fork", "fork_turns": "1"}


def configuration_error(**env: str) -> ConfigurationError:
    """The ConfigurationError `load_settings()` raises under these FORKQ_* variables."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        with pytest.raises(ConfigurationError) as caught:
            load_settings()
    return caught.value


def error_of(**env: str) -> str:
    """The text of the ValidationError `Settings()` raises under these FORKQ_* variables."""
    with pytest.MonkeyPatch.context() as patch:
        for name, value in env.items():
            patch.setenv(name, value)
        with pytest.raises(ValidationError) as caught:
            Settings()
    return str(caught.value)


def test_the_defaults_are_those_of_the_readme() -> None:
    settings = Settings()

    assert settings.redis_url == "redis://127.0.0.1:6379/0"
    assert settings.broker_url is None
    assert settings.effective_broker_url == settings.redis_url
    assert (settings.namespace, settings.queue, settings.provider, settings.script) == ("forkq", "forks", None, None)
    assert settings.inline_seed_max_bytes > 0
    assert settings.record_ttl_s > 0


def test_every_setting_is_read_from_its_forkq_variable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    script = tmp_path / "script.json"
    script.write_text('{"steps": []}')
    env = {
        "FORKQ_REDIS_URL": "rediss://:pw@redis.internal:6380/2",
        "FORKQ_BROKER_URL": "redis://broker.internal:6379/1",
        "FORKQ_NAMESPACE": "team-a",
        "FORKQ_QUEUE": "forks-high",
        "FORKQ_INLINE_SEED_MAX_BYTES": "0",
        "FORKQ_RECORD_TTL_S": "60",
        "FORKQ_SCRIPT": str(script),
        "FORKQ_WORKER_CONCURRENCY": "7",
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    settings = Settings()

    assert settings.redis_url == env["FORKQ_REDIS_URL"]
    assert settings.effective_broker_url == env["FORKQ_BROKER_URL"]
    assert (settings.namespace, settings.queue) == ("team-a", "forks-high")
    assert (settings.inline_seed_max_bytes, settings.record_ttl_s, settings.worker_concurrency) == (0, 60, 7)
    assert settings.script == script


def test_the_prompt_cache_key_is_on_by_default_and_forkq_prompt_cache_key_turns_it_off(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert Settings().prompt_cache_key is True

    monkeypatch.setenv("FORKQ_PROMPT_CACHE_KEY", "false")

    assert Settings().prompt_cache_key is False


def test_arguments_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKQ_QUEUE", "from-env")

    assert Settings(queue="from-code").queue == "from-code"


def test_a_unix_socket_url_becomes_kombus_redis_socket_url() -> None:
    settings = Settings(redis_url="unix:///run/redis/redis.sock?db=3")

    assert settings.effective_broker_url == "redis+socket:///run/redis/redis.sock?db=3"


@pytest.mark.parametrize("url", ["http://localhost:6379/0", "localhost:6379", "redis+socket:///tmp/r.sock", ""])
def test_an_invalid_redis_url_is_refused_naming_the_variable(url: str) -> None:
    message = error_of(FORKQ_REDIS_URL=url)

    assert "FORKQ_REDIS_URL" in message
    assert "use redis://, rediss://, unix:// or sentinel://" in message


@pytest.mark.parametrize("url", ["amqp://guest@localhost//", "http://broker/"])
def test_an_invalid_broker_url_is_refused_naming_the_variable(url: str) -> None:
    message = error_of(FORKQ_BROKER_URL=url)

    assert "FORKQ_BROKER_URL" in message
    assert "is not a Redis broker URL" in message


def test_a_sentinel_url_list_names_the_nodes_and_serves_as_the_broker_too() -> None:
    url = "sentinel://:pw@sentinel-0:26379/0;sentinel://:pw@sentinel-1;sentinel://:pw@10.0.0.7:26380"

    settings = Settings(redis_url=url)

    assert settings.effective_broker_url == url
    assert settings.broker_uses_sentinel
    assert sentinel_nodes(url) == [("sentinel-0", 26379), ("sentinel-1", 26379), ("10.0.0.7", 26380)]
    assert (settings.sentinel_master, settings.sentinel_password) == ("mymaster", None)


def test_the_sentinel_master_and_password_are_read_from_their_forkq_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKQ_BROKER_URL", "sentinel://:pw@s1:26379;sentinel://:pw@s2:26379")
    monkeypatch.setenv("FORKQ_SENTINEL_MASTER", "forkq-primary")
    monkeypatch.setenv("FORKQ_SENTINEL_PASSWORD", "sentinel-pw")

    settings = Settings()

    assert settings.broker_uses_sentinel
    assert not is_sentinel_url(settings.redis_url)
    assert settings.sentinel_master == "forkq-primary"
    assert settings.sentinel_password is not None
    assert settings.sentinel_password.get_secret_value() == "sentinel-pw"
    assert "sentinel-pw" not in repr(settings)


@pytest.mark.parametrize("name", ["FORKQ_REDIS_URL", "FORKQ_BROKER_URL"])
@pytest.mark.parametrize(
    "url",
    [
        "redis://:s3cret-pw@a:6379;redis://:s3cret-pw@b:6379",
        "sentinel://:s3cret-pw@a:26379;redis://:s3cret-pw@b:6379",
        "sentinel://:s3cret-pw@a:26379;sentinel://",
    ],
)
def test_a_url_list_that_is_not_all_sentinel_nodes_is_refused(name: str, url: str) -> None:
    message = error_of(**{name: url})

    assert name in message
    assert "s3cret-pw" not in message


def test_sentinel_over_tls_is_not_a_url_scheme_kombu_reads() -> None:
    assert "is not a Redis broker URL" in error_of(FORKQ_BROKER_URL="sentinel+ssl://s1:26379")


def test_a_sentinel_master_name_is_a_plain_name() -> None:
    assert "should match pattern" in error_of(FORKQ_SENTINEL_MASTER="my master")


@pytest.mark.parametrize(
    ("name", "url"),
    [
        ("FORKQ_REDIS_URL", "http://user:s3cret-pw@host:6379/0"),
        ("FORKQ_BROKER_URL", "amqp://user:s3cret-pw@host//"),
    ],
)
def test_a_refused_url_never_shows_its_password(name: str, url: str) -> None:
    message = error_of(**{name: url})

    assert name in message
    assert "s3cret-pw" not in message


def test_redaction_hides_only_the_password() -> None:
    assert redact_url("rediss://user:pw@host:6380/1") == "rediss://user:***@host:6380/1"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"
    assert redact_url("sentinel://:pw@s1:26379/0;sentinel://:pw@s2") == "sentinel://:***@s1:26379/0;sentinel://:***@s2"


@pytest.mark.parametrize("name", ["FORKQ_NAMESPACE", "FORKQ_QUEUE"])
@pytest.mark.parametrize("value", ["a:b", "a{b}", "a b", ""])
def test_a_namespace_or_queue_that_would_break_key_names_is_refused(name: str, value: str) -> None:
    assert "should match pattern" in error_of(**{name: value})


def test_a_script_that_is_not_a_file_is_refused_naming_the_variable(tmp_path: Path) -> None:
    message = error_of(FORKQ_SCRIPT=str(tmp_path / "missing.json"))

    assert "FORKQ_SCRIPT" in message
    assert "missing.json" in message


@pytest.mark.parametrize(("name", "value"), [("FORKQ_INLINE_SEED_MAX_BYTES", "-1"), ("FORKQ_RECORD_TTL_S", "0")])
def test_negative_sizes_and_empty_retention_are_refused(name: str, value: str) -> None:
    message = error_of(**{name: value})

    # the error names the setting and the bound it broke (a size may be 0, a retention must be more)
    assert name.removeprefix("FORKQ_").lower() in message
    assert "should be greater than" in message


def test_settings_are_frozen() -> None:
    with pytest.raises(ValidationError, match="frozen"):
        Settings().queue = "other"  # type: ignore[misc]


# ── the URLs work against real servers ──────────────────────────────────────────────────────


def run_one_fork(settings: Settings, start: Callable[[Celery], WorkController], parent: dict[str, Any]) -> Status:
    app = make_app(settings)
    try:
        with ForkClient(settings, app=app) as client:
            handle = client.launch(parent, FORK)
            start(app)
            return handle.wait(timeout=15).status
    finally:
        app.close()


@pytest.mark.parametrize("fresh_redis", [{"unix_socket": True}], indirect=True)
def test_a_unix_socket_redis_url_serves_both_the_records_and_the_broker(
    fresh_redis: RedisServer, start_live_worker: Callable[[Celery], WorkController], parent: dict[str, Any]
) -> None:
    settings = Settings(redis_url=fresh_redis.url, namespace="sock", queue="sock-forks", provider="scripted")

    assert settings.redis_url.startswith("unix://")
    assert run_one_fork(settings, start_live_worker, parent) is Status.SUCCEEDED


def test_a_redis_url_with_a_password_serves_both_the_records_and_the_broker(
    fresh_redis: RedisServer, start_live_worker: Callable[[Celery], WorkController], parent: dict[str, Any]
) -> None:
    # Given a Redis that requires a password
    with redis.Redis.from_url(fresh_redis.url) as admin:
        admin.config_set("requirepass", "pa55-word")
    url = f"redis://:pa55-word@127.0.0.1:{fresh_redis.port}/0"
    settings = Settings(redis_url=url, namespace="auth", queue="auth-forks", provider="scripted")

    # Then forks launch and run through it, and the password never reaches the broker URL shown to users
    assert run_one_fork(settings, start_live_worker, parent) is Status.SUCCEEDED
    assert "pa55-word" not in redact_url(settings.effective_broker_url)


@pytest.mark.parametrize("value", ["inf", "nan", "86401", "0"])
def test_a_tool_timeout_that_is_not_a_finite_positive_day_at_most_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, value: str
) -> None:
    monkeypatch.setenv("FORKQ_TOOL_TIMEOUT_S", value)
    with pytest.raises(ValidationError, match="tool_timeout_s"):
        Settings()


# ── load_settings: one message for every entry point ─────────────────────────────────────────


def test_load_settings_names_the_invalid_variable_what_it_is_and_the_fix() -> None:
    error = configuration_error(FORKQ_QUEUE="a:b")

    assert error.field == "FORKQ_QUEUE"
    assert str(error) == (
        "FORKQ_QUEUE: String should match pattern '^[A-Za-z0-9_.-]+$'; set it to a valid value "
        "(Celery queue of fork jobs), or unset it for its default"
    )
    assert isinstance(error.cause, ValidationError)


def test_load_settings_names_the_entry_of_a_mapping_setting_that_is_invalid() -> None:
    error = configuration_error(FORKQ_PROVIDER_ROUTES='{"gemini-*": "bard"}')

    assert error.field == "FORKQ_PROVIDER_ROUTES"
    assert str(error).startswith(
        "FORKQ_PROVIDER_ROUTES: Input should be 'scripted', 'openai' or 'gemini' (at gemini-*); set it to a valid value"
    )


def test_load_settings_keeps_the_message_of_a_check_across_settings_which_names_both() -> None:
    error = configuration_error(FORKQ_HEARTBEAT_S="60")

    assert error.field is None
    assert str(error) == (
        "FORKQ_HEARTBEAT_S=60.0 must be at most half of FORKQ_LEASE_TTL_S=15.0, "
        "so one missed heartbeat does not lose a live worker's forks"
    )


def test_load_settings_overrides_win_over_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORKQ_QUEUE", "from-env")

    assert load_settings(queue="given").queue == "given"
    assert load_settings().queue == "from-env"


def test_model_limits_are_read_as_globs_of_limits_and_the_first_matching_glob_wins(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert model_limit(Settings(), "gpt-5") is None  # unset: no model is admitted
    limits = '{"gpt-4.1*": {"concurrency": 5, "tpm": 1000}, "gpt-*": {"rpm": 60}, "*": {}}'
    monkeypatch.setenv("FORKQ_MODEL_LIMITS", limits)
    monkeypatch.setenv("FORKQ_SESSION_WEIGHTS", '{"s-urgent": 3, "s-slow": 0.5}')

    settings = load_settings()

    assert model_limit(settings, "gpt-4.1-mini") == ModelLimit(concurrency=5, tpm=1000)
    assert model_limit(settings, "gpt-5") == ModelLimit(rpm=60)
    assert model_limit(settings, "gemini-2.5-pro") == ModelLimit()
    assert model_limit(settings, None) is None
    assert settings.session_weights == {"s-urgent": 3, "s-slow": 0.5}


@pytest.mark.parametrize(
    ("value", "named"),
    [
        ('{"gpt-*": {"concurency": 5}}', "glob 'gpt-*' has the unknown key 'concurency'"),
        ('{"gpt-*": {"rpm": -1}}', "glob 'gpt-*' has rpm=-1"),
        ('{"gpt-*": {"tpm": 0}}', "glob 'gpt-*' has tpm=0"),
        ('{"gpt-*": {"concurrency": 2.5}}', "glob 'gpt-*' has concurrency=2.5"),
        ('{"gpt-*": {"concurrency": true}}', "glob 'gpt-*' has concurrency=True"),
        ('{"gpt-*": 5}', "glob 'gpt-*' maps to 5"),
    ],
)
def test_a_bad_model_limit_names_the_glob_the_key_and_the_fix(value: str, named: str) -> None:
    error = configuration_error(FORKQ_MODEL_LIMITS=value)

    assert error.field == "FORKQ_MODEL_LIMITS"
    assert str(error).startswith("FORKQ_MODEL_LIMITS: ") and named in str(error)
    assert (
        "positive whole number" in str(error)
        or "a limit is one of concurrency, rpm, tpm" in str(error)
        or ("object of limits" in str(error))
    )


@pytest.mark.parametrize("weight", ["0", "-1", "5e-324", "1e300", "true", '"3"'])
def test_a_session_weight_must_be_a_number_from_a_thousandth_to_a_thousand(weight: str) -> None:
    error = configuration_error(FORKQ_SESSION_WEIGHTS=f'{{"s-1": {weight}}}')

    assert error.field == "FORKQ_SESSION_WEIGHTS" and "session 's-1' has weight" in str(error)
    assert "a number from 0.001 to 1000" in str(error)


@pytest.mark.parametrize("name", ["FORKQ_MODEL_LIMITS", "FORKQ_SESSION_WEIGHTS", "FORKQ_PROVIDER_ROUTES"])
def test_a_json_setting_that_is_not_json_names_the_variable(name: str) -> None:
    error = configuration_error(**{name: "{gpt-*: 5}"})

    assert error.field == name and str(error).startswith(f"{name}: not valid JSON (")
