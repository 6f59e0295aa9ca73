"""The one reader of the environment: `Settings`, every `FORKQ_*` variable with its default, and `load_settings`."""

from __future__ import annotations

import fnmatch
import re
from pathlib import Path
from typing import Annotated, Any, Final, Literal
from urllib.parse import urlsplit

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict, SettingsError

from workers.errors import ConfigurationError

REDIS_SCHEMES = ("redis", "rediss", "unix", "sentinel")
# no `sentinel+ssl`: kombu would read it as transport `sentinel` with the host `ssl://…`
BROKER_SCHEMES = ("redis", "rediss", "redis+socket", "sentinel")
SENTINEL_SCHEME = "sentinel"
TOKEN_HASH_PREFIX: Final = "sha256:"  # a FORKQ_API_TOKENS entry that is the SHA-256 of a token, not the token
DEFAULT_TENANT: Final = "default"  # the tenant of a token entry without one, and of trusted in-process launchers
TENANT_PATTERN: Final = r"^[a-z0-9][a-z0-9_-]{0,62}$"
TENANT_RE: Final = re.compile(TENANT_PATTERN)
TENANT_RULE: Final = "1-63 lowercase letters, digits, '_' and '-', starting with a letter or digit"
LIMIT_KEYS: Final = ("concurrency", "rpm", "tpm")  # what a FORKQ_MODEL_LIMITS entry may bound
LIMIT_EXAMPLE: Final = '{"gpt-*": {"concurrency": 50, "rpm": 500, "tpm": 200000}}'


class ModelLimit(BaseModel):
    """One FORKQ_MODEL_LIMITS entry: what every worker together may send one model (None: no bound)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    concurrency: int | None = None  # calls in flight at once
    rpm: int | None = None  # calls admitted in any 60 s
    tpm: int | None = None  # tokens (estimated, then as reported) in any 60 s


class Settings(BaseSettings):
    """forkq's configuration, read from `FORKQ_*` environment variables (see README)."""

    model_config = SettingsConfigDict(env_prefix="FORKQ_", extra="ignore", frozen=True, hide_input_in_errors=True)

    redis_url: str = Field("redis://127.0.0.1:6379/0", description="Redis holding records, state and events.")
    broker_url: str | None = Field(None, description="Celery broker; defaults to the Redis URL.")
    namespace: str = Field("forkq", pattern=r"^[A-Za-z0-9_.-]+$", description="Prefix of every forkq key.")
    queue: str = Field("forks", pattern=r"^[A-Za-z0-9_.-]+$", description="Celery queue of fork jobs.")
    inline_seed_max_bytes: int = Field(
        16 * 1024, ge=0, description="Seeds up to this size travel inside the job; larger ones are read from Redis."
    )
    chunk_cache_mb: int = Field(
        16, ge=0, description="Seed and context chunks a worker process keeps decoded, in MB of chunk bytes (0: none)."
    )
    record_ttl_s: int = Field(7 * 24 * 3600, gt=0, description="Retention of a fork's records after launch.")
    session_tombstone_s: int = Field(
        600,
        gt=0,
        le=30 * 24 * 3600,
        description="How long launches into a cancelled session are refused after `forkq cancel --session`.",
    )
    # no default: a worker that silently answered with the scripted (fake) model would report fake successes
    provider: Literal["scripted", "openai", "gemini"] | None = Field(
        None, description="Default model provider; unset, a worker serves only the models FORKQ_PROVIDER_ROUTES names."
    )
    script: Path | None = Field(None, description="JSON script of the scripted provider.")
    provider_routes: dict[str, Literal["scripted", "openai", "gemini"]] = Field(
        default_factory=dict,
        description='JSON object of model-name glob → provider, e.g. {"gemini-*": "gemini"}; first match wins.',
    )
    # a token budget counts a cached input token at this weight (`workers.loop.budget`): as the provider bills it
    cached_input_weights: dict[str, Annotated[float, Field(ge=0, le=1)]] = Field(
        default_factory=dict,
        description="JSON object of model-name glob → weight of a cached input token in budgets, 0 to 1, e.g. "
        '{"gpt-5*": 0.1}; first match wins, else the provider\'s default (openai 0.5, gemini 0.25)',
    )
    openai_base_url: str = Field(
        "https://api.openai.com/v1", description="Chat Completions endpoint (OpenAI, DashScope, vLLM, Ollama, ...)."
    )
    # AliasChoices: the FORKQ_ name wins, the provider's conventional name is the fallback; both read here only
    openai_api_key: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices("FORKQ_OPENAI_API_KEY", "OPENAI_API_KEY"),
        description="API key of the OpenAI-compatible endpoint (else OPENAI_API_KEY).",
    )
    gemini_base_url: str = Field(
        "https://generativelanguage.googleapis.com/", description="Gemini API endpoint (the Developer API)."
    )
    gemini_api_key: SecretStr | None = Field(
        None,
        validation_alias=AliasChoices("FORKQ_GEMINI_API_KEY", "GEMINI_API_KEY"),
        description="Gemini API key (else GEMINI_API_KEY).",
    )
    # on by default: sibling forks of one parent then hit one provider cache; off for a server refusing the parameter
    prompt_cache_key: bool = Field(
        True, description="Send the parent session as `prompt_cache_key` with OpenAI-compatible requests."
    )
    provider_timeout_s: float = Field(120.0, gt=0, description="Timeout of one model call (one attempt).")
    provider_max_attempts: int = Field(5, ge=1, description="Attempts per model call, retries on 429/5xx included.")
    provider_retry_base_s: float = Field(1.0, ge=0, description="First retry delay; doubles per retry, jittered.")
    provider_retry_max_s: float = Field(60.0, ge=0, description="Longest backoff delay (a longer Retry-After wins).")
    worker_pool: Literal["threads", "prefork", "solo"] = Field("threads", description="Celery pool of `forkq worker`.")
    worker_concurrency: int = Field(32, gt=0, description="Forks one worker process runs at once.")
    max_turns: int = Field(200, gt=0, description="Model calls a fork may make before it is stopped.")
    max_wall_s: float = Field(
        3600.0, gt=0, description="Wall-clock limit of a fork from its first start (a launch may set a lower one)."
    )
    max_subagent_depth: int = Field(
        3, ge=1, description="Deepest nesting of regular subagents (a top-level session's subagent is depth 1)."
    )
    # launchers and workers read the same folder: a nested subagent's type resolves as a top-level one does
    agents_dir: Path | None = Field(
        None, description="Folder of subagent definitions (*.md with front matter); they override the built-ins."
    )
    tool_timeout_s: float = Field(
        300.0,
        gt=0,
        le=86400,  # finite: `inf` or a huge value would let a stuck handler hold its thread for good
        allow_inf_nan=False,
        description="Time limit of one tool call (run_shell_command: its own timeout_s); never past max_wall_s.",
    )
    schema_retries: int = Field(
        2, ge=0, description="Times a final answer that fails the launch's output schema goes back to the model."
    )
    visibility_timeout_s: int = Field(3600, gt=0, description="Broker redelivery timeout of unacked jobs.")
    lease_ttl_s: float = Field(15.0, gt=0, description="A fork whose worker is silent this long is revived.")
    heartbeat_s: float = Field(5.0, gt=0, description="How often a worker renews the leases of its forks.")
    heartbeat_file: Path = Field(
        Path("/tmp/forkq-worker.heartbeat"),
        description="File a worker rewrites every FORKQ_HEARTBEAT_S from its consumer loop (`forkq check --worker`).",
    )
    metrics_port: int | None = Field(
        None, ge=1, le=65535, description="Port of the Prometheus `/metrics` of `forkq worker` and `forkq sweep`."
    )
    sweep_s: float = Field(2.0, gt=0, description="How often the sweeper looks for expired leases.")
    presence_check_s: float = Field(
        0.1,
        ge=0,
        description="How often the sweeper looks for workers whose Redis connection is gone (0: only expired leases).",
    )
    presence_grace_s: float = Field(
        0.75,
        gt=0,
        description="How long a worker's connection must stay gone before its forks are revived without their leases.",
    )
    max_attempts: int = Field(3, ge=1, description="Runs a fork gets before a lost worker fails it (worker_lost).")
    # model admission (docs/capacity.md): cluster-wide limits per model, shared fairly across parent sessions
    model_limits: dict[str, ModelLimit] = Field(
        default_factory=dict,
        description='JSON object of model-name glob → {"concurrency": N, "rpm": N, "tpm": N} (any of them); '
        "the first matching glob bounds each model, across every worker.",
    )
    session_weights: dict[str, float] = Field(
        default_factory=dict,
        description="JSON object of parent session id → its share of a short model capacity (default 1).",
    )
    sentinel_master: str = Field(
        "mymaster", pattern=r"^[A-Za-z0-9_.-]+$", description="Master name that sentinel:// URLs ask Sentinel for."
    )
    sentinel_password: SecretStr | None = Field(
        None, description="Password of the Sentinel nodes themselves (the Redis password stays in the URL)."
    )
    # a secret: never printed, and `forkq serve` refuses to start without one (unless on loopback, on purpose)
    api_tokens: SecretStr | None = Field(
        None,
        description="Bearer tokens `forkq serve` accepts, comma-separated; an entry `sha256:<hex>` is a token's hash.",
    )
    api_admin_tokens: SecretStr | None = Field(
        None,
        description="Bearer tokens of operators, comma-separated (or `sha256:<hex>`): they see every tenant's forks.",
    )
    tenant: str = Field(
        DEFAULT_TENANT,
        pattern=TENANT_PATTERN,
        description="The tenant of the forks this process launches through ForkClient and the CLI (trusted).",
    )
    api_max_body_bytes: int = Field(
        32 * 1024 * 1024,
        gt=0,
        description="Largest request body `forkq serve` reads, checked on the compressed and the decompressed size.",
    )
    api_idempotency_ttl_s: int = Field(
        24 * 3600, gt=0, description="How long `forkq serve` remembers an Idempotency-Key and the fork it launched."
    )
    api_redis_connections: int = Field(
        2000,
        gt=0,
        description="Redis connections one `forkq serve` process opens at most for reads; each open event stream or "
        "waiting long poll holds one.",
    )
    api_keepalive_s: float = Field(
        15.0,
        gt=0,
        le=300,
        allow_inf_nan=False,
        description="Seconds between keep-alive comments of an idle event stream (below proxies' idle timeouts).",
    )

    # a fork's files: a snapshot travels with the fork (stored content-addressed in Redis); `shared` acts in place
    workspace: Literal["snapshot", "shared"] = Field(
        "snapshot", description="Default workspace of a launch: `snapshot` (the fork's own copy) or `shared` (in place)"
    )
    workspace_max_bytes: int = Field(
        256 * 1024 * 1024, gt=0, description="Largest tree a snapshot workspace may hold, in bytes (else refused)."
    )
    workspace_max_files: int = Field(
        50_000, gt=0, description="Most files a snapshot workspace may hold (else refused)."
    )
    workspace_cache_mb: int = Field(
        1024, ge=0, description="Disk a worker's cache of workspace files may use, in MiB (oldest use goes first)"
    )
    workspace_dir: Path | None = Field(
        None, description="Folder of a worker's workspaces and their cache (default: a forkq folder in the temp dir)."
    )
    # without it a remote parent can point a `shared` fork's tools at any folder a worker can reach
    shared_roots: str | None = Field(
        None,
        description="Folders a `shared` workspace's cwd must lie under, comma-separated (advised with `forkq serve`)",
    )
    sandbox: Literal["on", "off"] = Field(
        "on", description="`off`: snapshot forks' tools run unconfined (only where the worker cannot sandbox them)."
    )

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, value: str) -> str:
        scheme = urlsplit(value).scheme
        if scheme not in REDIS_SCHEMES:
            raise ValueError(
                f"FORKQ_REDIS_URL {_redact(value)!r} has scheme {scheme!r}; "
                "use redis://, rediss://, unix:// or sentinel://"
            )
        _check_sentinel_list("FORKQ_REDIS_URL", value)
        return value

    @field_validator("broker_url")
    @classmethod
    def _broker_scheme(cls, value: str | None) -> str | None:
        if value is None:
            return value
        if urlsplit(value.split(";")[0]).scheme not in BROKER_SCHEMES:
            raise ValueError(
                f"FORKQ_BROKER_URL {_redact(value)!r} is not a Redis broker URL; use one of "
                + ", ".join(f"{s}://" for s in BROKER_SCHEMES)
            )
        _check_sentinel_list("FORKQ_BROKER_URL", value)
        return value

    @field_validator("api_tokens")
    @classmethod
    def _token_hashes(cls, value: SecretStr | None) -> SecretStr | None:
        tenant_tokens(value)  # raises naming the entry's position and the fix
        return value

    @field_validator("api_admin_tokens")
    @classmethod
    def _admin_token_hashes(cls, value: SecretStr | None) -> SecretStr | None:
        for entry in api_token_entries(value):
            _check_token(entry, "FORKQ_API_ADMIN_TOKENS")
        return value

    @field_validator("model_limits", mode="before")
    @classmethod
    def _model_limits(cls, value: Any) -> Any:
        return check_model_limits(value)

    @field_validator("session_weights", mode="before")
    @classmethod
    def _session_weights(cls, value: Any) -> Any:
        if not isinstance(value, dict):
            return value  # pydantic says what it expected
        for session, weight in value.items():
            # bounded: a session's turns advance by 1/weight, which a weight near 0 would make infinite
            if isinstance(weight, bool) or not isinstance(weight, int | float) or not 0.001 <= weight <= 1000:
                raise ValueError(
                    f"session {session!r} has weight {weight!r}; a weight is a number from 0.001 to 1000 (its share "
                    'of a short model capacity; default 1), e.g. {"s-important": 3}'
                )
        return value

    @model_validator(mode="after")
    def _script_exists(self) -> Settings:
        if self.script is not None and not self.script.is_file():
            raise ValueError(f"FORKQ_SCRIPT {str(self.script)!r} is not a file; point it at a scripted-provider JSON")
        return self

    @model_validator(mode="after")
    def _heartbeat_fits_lease(self) -> Settings:
        if self.heartbeat_s * 2 > self.lease_ttl_s:
            raise ValueError(
                f"FORKQ_HEARTBEAT_S={self.heartbeat_s} must be at most half of FORKQ_LEASE_TTL_S={self.lease_ttl_s}, "
                "so one missed heartbeat does not lose a live worker's forks"
            )
        return self

    @property
    def broker_uses_sentinel(self) -> bool:
        """Whether the broker is found through Redis Sentinel (a sentinel:// URL list)."""
        return is_sentinel_url(self.effective_broker_url)

    @property
    def effective_broker_url(self) -> str:
        """The broker URL: FORKQ_BROKER_URL, else the Redis URL in kombu's form."""
        if self.broker_url is not None:
            return self.broker_url
        parts = urlsplit(self.redis_url)
        if parts.scheme == "unix":  # kombu spells a unix socket redis+socket://
            query = f"?{parts.query}" if parts.query else ""
            return f"redis+socket://{parts.path}{query}"
        return self.redis_url


def check_model_limits(value: Any) -> Any:
    """FORKQ_MODEL_LIMITS as given, once every glob maps to an object of positive whole limits.

    Raises:
        ValueError: naming the glob, the key and the fix (pydantic would name only a path).
    """
    if not isinstance(value, dict):
        return value  # pydantic says what it expected (a JSON object)
    for glob, limits in value.items():
        if not isinstance(limits, dict):
            raise ValueError(f"glob {glob!r} maps to {limits!r}; give it an object of limits, e.g. {LIMIT_EXAMPLE}")
        for key, limit in limits.items():
            if key not in LIMIT_KEYS:
                raise ValueError(
                    f"glob {glob!r} has the unknown key {key!r}; a limit is one of {', '.join(LIMIT_KEYS)}, "
                    f"e.g. {LIMIT_EXAMPLE}"
                )
            if isinstance(limit, bool) or not isinstance(limit, int) or limit <= 0:
                raise ValueError(
                    f"glob {glob!r} has {key}={limit!r}; each limit is a positive whole number (leave a key out "
                    f"for no bound), e.g. {LIMIT_EXAMPLE}"
                )
    return value


def model_limit(settings: Settings, model: str | None) -> ModelLimit | None:
    """The limits of `model`: the first FORKQ_MODEL_LIMITS glob it matches, in the object's order (None: unbounded)."""
    if model:
        for glob, limit in settings.model_limits.items():
            if fnmatch.fnmatchcase(model, glob):
                return limit
    return None


def api_token_entries(tokens: SecretStr | None) -> list[str]:
    """The entries of FORKQ_API_TOKENS: comma-separated, surrounding spaces and empty entries dropped."""
    if tokens is None:
        return []
    return [entry.strip() for entry in tokens.get_secret_value().split(",") if entry.strip()]


def tenant_tokens(tokens: SecretStr | None) -> list[tuple[str, str]]:
    """(tenant, token or `sha256:<hex>`) of each FORKQ_API_TOKENS entry: `TENANT=TOKEN`, or a bare token of the
    tenant `default`. The tenant is what comes before the entry's first `=`; a token that holds `=` itself
    (base64) is written with its tenant: `default=TOKEN`.

    Raises:
        ValueError: an entry's tenant is not a tenant name, its token is empty, or its hash is not 64 hex digits;
            the message names the entry by position (never its token).
    """
    pairs: list[tuple[str, str]] = []
    for position, entry in enumerate(api_token_entries(tokens), start=1):
        tenant, separator, token = entry.partition("=")
        if not separator:
            tenant, token = DEFAULT_TENANT, entry
        elif not TENANT_RE.fullmatch(tenant) or not token or token.startswith("="):
            # `abc==` is a base64 token, not the tenant `abc` with the token `=`: refused, never misread
            problem = "its token is empty" if TENANT_RE.fullmatch(tenant) else "what comes before '=' is not a tenant"
            if token.startswith("="):
                problem = "it looks like a token ending in '=' (base64), not TENANT=TOKEN"
            raise ValueError(
                f"entry {position} of FORKQ_API_TOKENS is not TENANT=TOKEN: {problem} (a tenant is {TENANT_RULE}); "
                "a token that holds '=' is written with its tenant: default=TOKEN"
            )
        _check_token(token, f"entry {position} of FORKQ_API_TOKENS")
        if any(token == seen for _, seen in pairs):
            raise ValueError(
                f"entry {position} of FORKQ_API_TOKENS repeats the token of an earlier entry: a token belongs to one "
                "tenant; give each tenant its own token"
            )
        pairs.append((tenant, token))
    return pairs


def _check_token(token: str, where: str) -> None:
    digest = token.removeprefix(TOKEN_HASH_PREFIX)
    if token.startswith(TOKEN_HASH_PREFIX) and not re.fullmatch(r"[0-9a-fA-F]{64}", digest):
        raise ValueError(
            f"{where}: an entry {TOKEN_HASH_PREFIX}... must hold the 64 hex digits of a token's SHA-256 "
            f"(got {len(digest)} characters); compute it with `printf %s TOKEN | sha256sum`"
        )


def load_settings(**overrides: Any) -> Settings:
    """The environment's settings (`overrides` win over it), for every entry point that reads them.

    Raises:
        ConfigurationError: a FORKQ_* variable is invalid; the message starts with its name (`.field`)
            and says what to set.
    """
    try:
        return Settings(**overrides)
    except ValidationError as exc:
        raise settings_error(exc) from exc
    except SettingsError as exc:  # a JSON setting (FORKQ_MODEL_LIMITS, ...) that is not JSON at all
        raise json_setting_error(exc) from exc


def json_setting_error(exc: SettingsError) -> ConfigurationError:
    """The `ConfigurationError` for a JSON setting pydantic-settings could not parse, naming the variable."""
    found = re.search(r'field "(\w+)"', str(exc))
    field = found.group(1) if found else ""
    name = f"FORKQ_{field.upper()}" if field else "a FORKQ_* variable"
    info = Settings.model_fields.get(field)
    what = f" ({info.description.rstrip('.')})" if info is not None and info.description else ""
    cause = exc.__cause__ or exc
    return ConfigurationError(
        f"{name}: not valid JSON ({cause}); set it to JSON{what}, or unset it for its default", field=name, cause=exc
    )


def settings_error(exc: ValidationError) -> ConfigurationError:
    """The `ConfigurationError` for `Settings`' first validation error, naming the variable and the fix."""
    first = exc.errors()[0]
    message = str(first.get("ctx", {}).get("error", first["msg"]))
    if not first["loc"]:  # a check across settings: its message names the variables and the fix
        return ConfigurationError(message, cause=exc)
    field, *inside = (str(part) for part in first["loc"])
    name = field if field.isupper() else f"FORKQ_{field.upper()}"  # an alias (OPENAI_API_KEY) is a name already
    where = f" (at {'.'.join(inside)})" if inside else ""
    info = Settings.model_fields.get(field)
    what = f" ({info.description.rstrip('.')})" if info is not None and info.description else ""
    fix = f"set it to a valid value{what}, or unset it for its default"
    return ConfigurationError(f"{name}: {message}{where}; {fix}", field=name, cause=exc)


def is_sentinel_url(url: str) -> bool:
    """Whether `url` names Redis Sentinel nodes (`sentinel://h1:26379;sentinel://h2:26379`)."""
    return urlsplit(url.split(";", maxsplit=1)[0]).scheme == SENTINEL_SCHEME


def sentinel_nodes(url: str) -> list[tuple[str, int]]:
    """The (host, port) of every Sentinel node in a `;`-separated sentinel:// URL list (port 26379 by default)."""
    return [(parts.hostname or "", parts.port or 26379) for parts in map(urlsplit, url.split(";"))]


def _check_sentinel_list(name: str, value: str) -> None:
    """A `;`-separated URL list is Sentinel's only, and each of its URLs names a host."""
    urls = value.split(";")
    if len(urls) == 1 and not is_sentinel_url(value):
        return
    for url in urls:
        parts = urlsplit(url)
        if parts.scheme != SENTINEL_SCHEME or not parts.hostname:
            raise ValueError(
                f"{name} {_redact(value)!r}: {_redact(url)!r} is not a sentinel://[:password@]host:port URL; "
                "list Sentinel nodes as sentinel://:pw@host1:26379;sentinel://:pw@host2:26379"
            )


def _redact(url: str) -> str:
    """The URL (or `;`-separated URL list) with any password replaced by `***`, for messages and logs."""
    if ";" in url:
        return ";".join(_redact(part) for part in url.split(";"))
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return parts._replace(netloc=netloc).geturl()


def redact_url(url: str) -> str:
    """Public form of `_redact`: never print a Redis password."""
    return _redact(url)
