"""Which provider serves which model, the per-kind cache, and API keys that stay out of sight."""

from __future__ import annotations

import threading
from typing import Any

import pytest

from broker_config.settings import Settings
from workers.errors import ConfigurationError
from workers.history.messages import Content, Part
from workers.providers import ModelRequest, ModelResponse
from workers.providers.gemini import GeminiProvider
from workers.providers.openai_compat import OpenAICompatProvider
from workers.providers.routing import ProviderRouter, make_provider, provider_kind, provider_problems
from workers.providers.scripted import ScriptedProvider
from workers.service.runner import WorkerRuntime

KEY_VARS = ("FORKQ_OPENAI_API_KEY", "OPENAI_API_KEY", "FORKQ_GEMINI_API_KEY", "GEMINI_API_KEY")


@pytest.fixture(autouse=True)
def no_keys(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in (*KEY_VARS, "FORKQ_PROVIDER", "FORKQ_PROVIDER_ROUTES"):
        monkeypatch.delenv(name, raising=False)


def test_the_first_matching_glob_wins_in_insertion_order(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FORKQ_PROVIDER", "openai")
    monkeypatch.setenv("FORKQ_PROVIDER_ROUTES", '{"gemini-2.5-*": "gemini", "gemini-*": "scripted", "qwen*": "openai"}')
    settings = Settings()

    assert list(settings.provider_routes) == ["gemini-2.5-*", "gemini-*", "qwen*"]
    assert provider_kind(settings, "gemini-2.5-pro") == "gemini"
    assert provider_kind(settings, "gemini-1.5-flash") == "scripted"
    assert provider_kind(settings, "qwen3-coder-plus") == "openai"
    assert provider_kind(settings, "Gemini-2.5-pro") == "openai"  # globs are case-sensitive
    assert provider_kind(settings, "gpt-4.1") == "openai"  # no match: FORKQ_PROVIDER
    assert provider_kind(settings, None) == "openai"


def test_no_model_gets_the_scripted_provider_unless_a_setting_names_it():
    # Given no FORKQ_PROVIDER: no model has a provider, and the error names the variable and its choices
    with pytest.raises(ConfigurationError, match=r"FORKQ_PROVIDER is unset; set FORKQ_PROVIDER to one of scripted, "):
        make_provider(Settings(), "gemini-2.5-pro")
    # a route serves only the models it names
    routed = Settings(provider_routes={"gpt-*": "openai"})
    with pytest.raises(ConfigurationError, match="model 'local-7b' matches no FORKQ_PROVIDER_ROUTES glob"):
        provider_kind(routed, "local-7b")

    # Then the scripted provider runs where FORKQ_PROVIDER or a route names it, and only there
    assert isinstance(make_provider(Settings(provider="scripted"), "gemini-2.5-pro"), ScriptedProvider)
    assert isinstance(make_provider(Settings(provider_routes={"fake-*": "scripted"}), "fake-1"), ScriptedProvider)


def test_the_worker_start_up_check_wants_a_named_provider_with_its_key():
    [problem] = provider_problems(Settings())
    assert "no model provider is configured: set FORKQ_PROVIDER to one of scripted, openai, gemini" in problem
    assert "FORKQ_PROVIDER_ROUTES" in problem

    assert provider_problems(Settings(provider="scripted")) == []
    assert provider_problems(Settings(provider_routes={"fake-*": "scripted"})) == []
    assert provider_problems(Settings(provider="openai", openai_api_key="sk-o")) == []
    missing = provider_problems(Settings(provider="openai", provider_routes={"gemini-*": "gemini"}))
    assert [p.split(";")[0] for p in missing] == [
        "the gemini provider is configured but has no API key",
        "the openai provider is configured but has no API key",
    ]
    assert "FORKQ_GEMINI_API_KEY (or GEMINI_API_KEY)" in missing[0]
    assert "FORKQ_OPENAI_API_KEY (or OPENAI_API_KEY)" in missing[1]


def test_a_bad_route_is_rejected_by_settings(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FORKQ_PROVIDER_ROUTES", '{"gpt-*": "anthropic"}')

    with pytest.raises(ValueError, match="provider_routes"):
        Settings()


def test_make_provider_builds_each_adapter_from_settings():
    settings = Settings(
        provider_routes={"gpt-*": "openai", "gemini-*": "gemini"},
        openai_api_key="sk-o",
        gemini_api_key="g-k",
        openai_base_url="http://127.0.0.1:9/v1",
        gemini_base_url="http://127.0.0.1:9/",
    )

    openai_provider = make_provider(settings, "gpt-4.1")
    gemini_provider = make_provider(settings, "gemini-2.5-pro")
    try:
        assert isinstance(openai_provider, OpenAICompatProvider)
        assert isinstance(gemini_provider, GeminiProvider)
        assert openai_provider.retry.max_attempts == settings.provider_max_attempts == 5
    finally:
        openai_provider.close()
        gemini_provider.close()


@pytest.mark.parametrize(
    ("fallback", "primary", "field"),
    [
        ("OPENAI_API_KEY", "FORKQ_OPENAI_API_KEY", "openai_api_key"),
        ("GEMINI_API_KEY", "FORKQ_GEMINI_API_KEY", "gemini_api_key"),
    ],
)
def test_keys_fall_back_to_the_provider_variable_and_never_show(monkeypatch, fallback, primary, field):
    monkeypatch.setenv(fallback, "fallback-secret-1")
    assert getattr(Settings(), field).get_secret_value() == "fallback-secret-1"

    monkeypatch.setenv(primary, "primary-secret-2")
    settings = Settings()

    assert getattr(settings, field).get_secret_value() == "primary-secret-2"
    for text in (repr(settings), str(settings), settings.model_dump_json()):
        assert "secret" not in text


@pytest.mark.parametrize("kind", ["openai", "gemini"])
def test_a_missing_key_is_a_configuration_error_naming_both_variables(kind: str):
    settings = Settings(provider=kind)

    with pytest.raises(ConfigurationError, match=rf"FORKQ_{kind.upper()}_API_KEY \(or {kind.upper()}_API_KEY\)"):
        make_provider(settings, "any-model")


class Recording:
    """A provider that answers with its own name."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.models: list[str | None] = []

    def generate(self, request: ModelRequest) -> ModelResponse:
        self.models.append(request.model)
        return ModelResponse(content=Content(role="model", parts=[Part(text=self.name)]))


def request(model: str | None) -> ModelRequest:
    return ModelRequest(fork_id="f", step=0, model=model, system_instruction=None, tools=[], messages=[])


def test_the_router_dispatches_by_model_and_builds_one_provider_per_kind():
    built: list[str] = []
    lock = threading.Lock()

    def build(settings: Settings, kind: Any) -> Recording:
        with lock:
            built.append(kind)
        return Recording(kind)

    routes = {"gpt-*": "openai", "gemini-*": "gemini"}
    router = ProviderRouter(Settings(provider="scripted", provider_routes=routes), build=build)
    models = ["gpt-4.1", "gemini-2.5-pro", "other", None] * 8
    answers: dict[int, str] = {}

    def call(i: int, model: str | None) -> None:
        answers[i] = router.generate(request(model)).content.parts[0].text or ""

    threads = [threading.Thread(target=call, args=(i, m)) for i, m in enumerate(models)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sorted(built) == ["gemini", "openai", "scripted"]
    assert [answers[i] for i in range(4)] == ["openai", "gemini", "scripted", "scripted"]
    assert router.provider_for("gpt-x") is router.provider_for("gpt-y")


def test_the_first_request_builds_every_named_provider_before_it_goes_out():
    # Given a router whose settings name three providers, one of which cannot be built yet
    built: list[str] = []

    def build(settings: Settings, kind: Any) -> Recording:
        if kind == "gemini":
            raise ConfigurationError("the gemini provider has no API key", field="gemini_api_key")
        built.append(kind)
        return Recording(kind)

    routes = {"gpt-*": "openai", "gemini-*": "gemini"}
    router = ProviderRouter(Settings(provider="scripted", provider_routes=routes), build=build)

    # When the first request arrives
    answer = router.generate(request("other")).content.parts[0].text

    # Then its own provider and the other buildable ones were built (their SDKs imported before any request
    # runs), and the one that failed is left to its own first use, which raises why
    assert (answer, built) == ("scripted", ["scripted", "openai"])
    with pytest.raises(ConfigurationError, match="no API key"):
        router.provider_for("gemini-2.5-pro")


def test_closing_the_router_closes_the_providers_that_hold_pools():
    closed: list[str] = []

    class Closable(Recording):
        def close(self) -> None:
            closed.append(self.name)

    router = ProviderRouter(Settings(provider="scripted"), build=lambda settings, kind: Closable(kind))
    router.generate(request("m"))
    router.close()

    assert closed == ["scripted"]


def test_the_worker_runtime_provider_is_a_router_to_the_configured_provider():
    runtime = WorkerRuntime(Settings(provider="scripted"))

    assert isinstance(runtime.provider, ProviderRouter)
    response = runtime.provider.generate(request("gemini-2.5-pro").model_copy(update={"directive": "d"}))
    assert "[scripted provider]" in (response.content.parts[0].text or "")
