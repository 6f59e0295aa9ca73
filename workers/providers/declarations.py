"""Tool declarations as adapters need them: flat function declarations with a JSON-schema parameters object."""

from __future__ import annotations

from typing import Any


def function_declarations(tools: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Flat `{name, description, parameters...}` declarations, whether sent flat or grouped Gemini-style.

    A Gemini `Tool` (`{"functionDeclarations": [...]}`) contributes its declarations; a flat
    declaration is kept as it is. Other tool kinds (e.g. `googleSearch`) have no function to declare.
    """
    flat: list[dict[str, Any]] = []
    for tool in tools:
        grouped = tool.get("functionDeclarations", tool.get("function_declarations"))
        if isinstance(grouped, list):
            flat.extend(d for d in grouped if isinstance(d, dict))
        elif "name" in tool:
            flat.append(tool)
    return flat


def parameters_schema(declaration: dict[str, Any]) -> dict[str, Any] | None:
    """The JSON schema of a declaration's parameters (`parametersJsonSchema` or `parameters`)."""
    for key in ("parametersJsonSchema", "parameters_json_schema", "parameters"):
        schema = declaration.get(key)
        if isinstance(schema, dict):
            return schema
    return None
