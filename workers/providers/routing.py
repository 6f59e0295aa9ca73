"""Which provider serves a model: `FORKQ_PROVIDER_ROUTES` globs first, else `FORKQ_PROVIDER`.

`make_provider` builds a provider for one model name; `ProviderRouter` is the worker's provider: it
dispatches each request by `request.model` and keeps one provider per kind (one HTTP connection pool
each) for the life of the worker process that owns it, building every kind the settings name at the
first request (an SDK imported while another one sends can break that request). There is no default
provider: the scripted one runs only where a setting names it, and `provider_problems` is the worker's
start-up check.
"""

from __future__ import annotations

import fnmatch
import logging
import threading
from collections.abc import Callable
from typing import Final, Literal, get_args

from pydantic import SecretStr

from broker_config.settings import Settings
from workers.errors import ConfigurationError
from workers.providers import ModelProvider, ModelRequest, ModelResponse
from workers.providers.retry import Pacer, RetryPolicy
from workers.providers.scripted import ScriptedProvider, load_script

ProviderKind = Literal["scripted", "openai", "gemini"]
PROVIDER_CHOICES: Final = ", ".join(get_args(ProviderKind))
log = logging.getLogger("forkq.provider")
KEYED: Final[dict[str, str]] = {"openai": "OPENAI", "gemini": "GEMINI"}  # kind → its API key's variable infix


def provider_kind(settings: Settings, model_name: str | None) -> ProviderKind:
    """The provider for a model: the first matching glob of `provider_routes` (in order), else `provider`.

    Raises:
        ConfigurationError: no route matches and `FORKQ_PROVIDER` is unset.
    """
    if model_name:
        for pattern, kind in settings.provider_routes.items():
            if fnmatch.fnmatchcase(model_name, pattern):
                return kind
    if settings.provider is None:
        raise ConfigurationError(
            f"model {model_name!r} matches no FORKQ_PROVIDER_ROUTES glob and FORKQ_PROVIDER is unset; "
            f"set FORKQ_PROVIDER to one of {PROVIDER_CHOICES}, or add a route for this model",
            field="FORKQ_PROVIDER",
        )
    return settings.provider


def provider_problems(settings: Settings) -> list[str]:
    """Why a worker with these settings cannot serve forks: no provider named, or a named one without its key."""
    if settings.provider is None and not settings.provider_routes:
        return [
            f"no model provider is configured: set FORKQ_PROVIDER to one of {PROVIDER_CHOICES} "
            "(openai: any OpenAI-compatible server; scripted: the fake model of demos and tests), "
            'or route models with FORKQ_PROVIDER_ROUTES (e.g. {"gpt-*": "openai"})'
        ]
    keys = {"openai": settings.openai_api_key, "gemini": settings.gemini_api_key}
    named = {settings.provider, *settings.provider_routes.values()}
    keyless = sorted(kind for kind, key in keys.items() if kind in named and not (key and key.get_secret_value()))
    return [
        f"the {kind} provider is configured but has no API key; set FORKQ_{KEYED[kind]}_API_KEY "
        f"(or {KEYED[kind]}_API_KEY) in the worker's environment (servers that need no key accept any value)"
        for kind in keyless
    ]


def make_provider(settings: Settings, model_name: str | None) -> ModelProvider:
    """A new provider for `model_name`, configured from `settings`.

    Raises:
        ConfigurationError: the chosen provider's API key is not set, or the scripted provider's script is bad.
    """
    return build_provider(settings, provider_kind(settings, model_name))


def build_provider(settings: Settings, kind: ProviderKind, pacer: Pacer | None = None) -> ModelProvider:
    """A new provider of `kind`, configured from `settings` (imports each SDK only when it is used); its attempts
    wait for `pacer`'s shared cooldowns."""
    policy = RetryPolicy(
        max_attempts=settings.provider_max_attempts,
        base_delay_s=settings.provider_retry_base_s,
        max_delay_s=settings.provider_retry_max_s,
        pacer=pacer,
    )
    if kind == "openai":
        from workers.providers.openai_compat import OpenAICompatProvider  # noqa: PLC0415  (SDK import is slow)

        return OpenAICompatProvider(
            api_key=_key(settings.openai_api_key, "OPENAI"),
            base_url=settings.openai_base_url,
            timeout_s=settings.provider_timeout_s,
            retry=policy,
            prompt_cache_key=settings.prompt_cache_key,
        )
    if kind == "gemini":
        from workers.providers.gemini import GeminiProvider  # noqa: PLC0415  (SDK import is slow)

        return GeminiProvider(
            api_key=_key(settings.gemini_api_key, "GEMINI"),
            base_url=settings.gemini_base_url,
            timeout_s=settings.provider_timeout_s,
            retry=policy,
        )
    return ScriptedProvider(load_script(settings.script) if settings.script else None)


def endpoint_of(settings: Settings, model_name: str | None) -> str:
    """The endpoint (base URL) the provider of `model_name` calls: with the model, a shared cooldown's scope.

    Raises:
        ConfigurationError: no provider serves the model (`provider_kind`).
    """
    kind = provider_kind(settings, model_name)
    return {"openai": settings.openai_base_url, "gemini": settings.gemini_base_url}.get(kind, kind)


def _key(secret: SecretStr | None, provider: str) -> str:
    if secret is None or not secret.get_secret_value():
        raise ConfigurationError(
            f"the {provider.lower()} provider has no API key; set FORKQ_{provider}_API_KEY (or {provider}_API_KEY) "
            "in the worker's environment — servers that need no key accept any value, e.g. EMPTY",
            field=f"{provider.lower()}_api_key",
        )
    return secret.get_secret_value()


class ProviderRouter:
    """The worker's `ModelProvider`: routes each request by its model, one cached provider per kind."""

    name = "router"

    def __init__(
        self, settings: Settings, build: Callable[[Settings, ProviderKind], ModelProvider] = build_provider
    ) -> None:
        self.settings = settings
        self._build = build
        self._providers: dict[ProviderKind, ModelProvider] = {}
        self._lock = threading.Lock()  # forks run in threads; build each provider (and pool) once

    def provider_for(self, model_name: str | None) -> ModelProvider:
        """The cached provider `model_name` routes to, built on first use (with the others the settings name)."""
        kind = provider_kind(self.settings, model_name)
        with self._lock:
            provider = self._providers.get(kind)
            if provider is None:
                first = not self._providers
                provider = self._providers[kind] = self._build(self.settings, kind)
                if first:
                    self._build_others()
            return provider

    def _build_others(self) -> None:
        """Build every other provider the settings name, before the first request goes out.

        An SDK imports its HTTP stack when its provider is first built, and the openai client looks up the
        `httpx` module in `sys.modules` on every request: built in one fork's thread while another thread's
        request is under way, google-genai's import of `httpx` let that request read a half-imported module
        (AttributeError). Built here, under the lock every request passes first, no request overlaps an import.
        A kind that cannot be built now is left for its own first use, which raises why.
        """
        named = {self.settings.provider, *self.settings.provider_routes.values()}
        for kind in sorted(k for k in named if k is not None and k not in self._providers):
            try:
                self._providers[kind] = self._build(self.settings, kind)
            except (ConfigurationError, ImportError) as exc:
                log.debug("provider %s not built ahead of its first use: %s", kind, exc)

    def generate(self, request: ModelRequest) -> ModelResponse:
        """Send `request` to the provider of its model."""
        return self.provider_for(request.model).generate(request)

    def close(self) -> None:
        """Close every provider built so far that holds a connection pool."""
        with self._lock:
            providers, self._providers = list(self._providers.values()), {}
        for provider in providers:
            close = getattr(provider, "close", None)
            if callable(close):
                close()
