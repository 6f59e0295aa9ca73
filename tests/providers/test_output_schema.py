"""The output schema's native-or-text choice shared by the adapters (each adapter's wire form is in its own tests)."""

from __future__ import annotations

import json

import pytest

from workers.errors import ProviderError
from workers.history.messages import Content, Part
from workers.providers import ModelRequest, ModelResponse
from workers.providers.output_schema import SchemaModes, generate_with_schema, schema_note

SCHEMA = {"type": "object", "properties": {"b": {"type": "string"}, "a": {"type": "integer"}}, "required": ["a"]}


def request(model: str = "m", output_schema: dict[str, object] | None = SCHEMA) -> ModelRequest:
    return ModelRequest(
        fork_id="f-1", step=0, model=model, system_instruction=None, tools=[], messages=[], output_schema=output_schema
    )


class Server:
    """A `send` for `generate_with_schema`: answers per mode, and records the modes it was asked for."""

    def __init__(self, native_status: int | None = None, text_status: int | None = None) -> None:
        self.native_status, self.text_status = native_status, text_status
        self.modes: list[bool] = []

    def __call__(self, native: bool) -> ModelResponse:
        self.modes.append(native)
        status = self.native_status if native else self.text_status
        if status is not None:
            raise ProviderError(f"HTTP {status}", provider="openai", model="m", status=status, attempts=1)
        return ModelResponse(content=Content(role="model", parts=[Part(text="native" if native else "text")]))


def generate(req: ModelRequest, modes: SchemaModes, server: Server) -> str:
    response = generate_with_schema(req, modes, server, provider="openai", model=req.model or "")
    return response.content.parts[0].text or ""


def test_the_note_states_the_schema_as_canonical_json():
    note = schema_note(SCHEMA)

    assert note.endswith("\n" + json.dumps(SCHEMA, sort_keys=True))
    assert "only a JSON value" in note and "without tool calls" in note


@pytest.mark.parametrize("status", [400, 422])
def test_a_refused_native_schema_is_sent_as_text_and_remembered_for_that_model_only(status: int):
    modes, server = SchemaModes(), Server(native_status=status)

    assert generate(request("m"), modes, server) == "text"
    assert generate(request("m"), modes, server) == "text"
    assert server.modes == [True, False, False]  # one refusal, then text straight away

    other = Server()
    assert generate(request("other-model"), modes, other) == "native"
    assert other.modes == [True]


@pytest.mark.parametrize("status", [401, 404, 429, 503])
def test_failures_that_are_not_refusals_of_the_request_are_not_retried_as_text(status: int):
    modes, server = SchemaModes(), Server(native_status=status)

    with pytest.raises(ProviderError) as caught:
        generate(request(), modes, server)

    assert caught.value.status == status
    assert server.modes == [True]
    assert modes.native(request())


def test_a_400_that_text_does_not_cure_raises_the_text_forms_error_and_is_not_remembered():
    modes, server = SchemaModes(), Server(native_status=400, text_status=413)

    with pytest.raises(ProviderError) as caught:
        generate(request(), modes, server)

    assert caught.value.status == 413
    assert modes.native(request())


def test_a_request_without_a_schema_is_never_native_and_a_refusal_is_not_retried():
    modes, server = SchemaModes(), Server(native_status=400, text_status=400)

    with pytest.raises(ProviderError):
        generate(request(output_schema=None), modes, server)

    assert server.modes == [False]
