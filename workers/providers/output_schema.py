"""The launch's output schema on the wire: native structured output where the server takes it, else text.

An adapter sends a request's `output_schema` in its API's native form (Chat Completions'
`response_format`, Gemini's `responseJsonSchema`), so the model is constrained to (or at least told)
the schema before it answers, rather than guessing it from the feedback after a wrong answer. Some
servers refuse native mode (a Chat Completions server without `json_schema` support, a Gemini model
that does not combine function calling with a JSON response): `generate_with_schema` then sends the
same request with the schema stated as text in its system instruction, and remembers the model for
the life of the process, so later steps go straight to text. The schema check after the answer
(`workers/history/structured.py`) still applies either way.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from typing import Any, Final

from workers.errors import ProviderError
from workers.providers import ModelRequest, ModelResponse

log = logging.getLogger("forkq.provider")

# what a server answers for a parameter it does not support: the request as sent is invalid
REFUSAL_STATUSES: Final = frozenset({400, 422})


def schema_note(schema: dict[str, Any]) -> str:
    """The instruction that states the output schema in the request, for servers without native mode."""
    text = json.dumps(schema, ensure_ascii=False, sort_keys=True)
    return (
        "When you give your final answer (a reply without tool calls), reply with only a JSON value that "
        f"matches this JSON schema, and nothing else:\n{text}"
    )


class SchemaModes:
    """The models of one provider that refused a native output schema in this process; thread-safe."""

    def __init__(self) -> None:
        self._refused: set[str] = set()
        self._lock = threading.Lock()

    def native(self, request: ModelRequest) -> bool:
        """Whether `request` carries a schema to send natively (it has one, and its model never refused)."""
        if request.output_schema is None:
            return False
        with self._lock:
            return request.model not in self._refused

    def refuse(self, model: str) -> None:
        """Send `model` its schema as text from now on."""
        with self._lock:
            self._refused.add(model)


def generate_with_schema(
    request: ModelRequest, modes: SchemaModes, send: Callable[[bool], ModelResponse], *, provider: str, model: str
) -> ModelResponse:
    """`send(native)` for `request`: native structured output first if `modes` allows it; on a refusal
    (HTTP 400 or 422), the same request again with the schema as text, remembered when that succeeds.

    Raises:
        ProviderError: the call failed (a refusal that the text form does not cure raises the text form's error).
    """
    native = modes.native(request)
    try:
        return send(native)
    except ProviderError as exc:
        if not native or exc.status not in REFUSAL_STATUSES:
            raise
        refusal = exc
    response = send(False)  # raises its own error when the refusal was about something else
    modes.refuse(model)
    log.warning(
        "%s model %r refused the output schema in native mode (%s); it is stated in the request from now on",
        provider,
        model,
        refusal,
    )
    return response
