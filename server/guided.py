"""Structured output and tools, from the request's fields to what the engine and the view need.

response_format / guided_* / structured_outputs  ->  StructuredOutput (at most one ask)
tools + tool_choice                                ->  ToolPlan: how the prompt shows the
    tools, the parser that reads calls back, and for "required" or a named function
    the grammar that makes the call valid JSON matching its parameters (as vLLM does)
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from engine.structured import GrammarError, StructuredOutput
from server.errors import invalid
from server.tool_parsers import PARSERS, JsonParser, ToolParser, hermes_messages, template_renders_tools


def structured_output(body: Any) -> tuple[StructuredOutput | None, str | None]:
    """The request's structured output and the field that asked for it; 400 for more than one."""
    asks: list[tuple[str, StructuredOutput]] = []
    param = "response_format"
    try:
        rf = body.response_format
        if rf is not None and rf.type == "json_object":
            asks.append(("response_format", StructuredOutput.json_object()))
        elif rf is not None and rf.type == "json_schema":
            if rf.json_schema is None or rf.json_schema.schema_ is None:
                raise invalid(
                    "'response_format.json_schema.schema' is required when 'type' is 'json_schema'",
                    param="response_format.json_schema",
                )
            asks.append(("response_format", StructuredOutput.json_schema(rf.json_schema.schema_)))
        so = body.structured_outputs
        fields = [
            ("guided_json", body.guided_json),
            ("guided_regex", body.guided_regex),
            ("guided_choice", body.guided_choice),
            ("guided_grammar", body.guided_grammar),
        ]
        if so is not None:
            fields += [
                ("structured_outputs.json", so.json_),
                ("structured_outputs.regex", so.regex),
                ("structured_outputs.choice", so.choice),
                ("structured_outputs.grammar", so.grammar),
            ]
            if so.json_object:
                asks.append(("structured_outputs.json_object", StructuredOutput.json_object()))
        for param, value in fields:
            if value is None:
                continue
            kind = param.rsplit("_", 1)[-1].rsplit(".", 1)[-1]
            if kind == "json":
                asks.append((param, StructuredOutput.json_schema(_schema(value, param))))
            else:
                asks.append((param, getattr(StructuredOutput, kind)(value)))
    except GrammarError as exc:
        raise invalid(f"Invalid '{param}': {exc}", param=param) from None
    if len(asks) > 1:
        raise invalid(
            f"Only one structured output may be asked for, got {', '.join(p for p, _ in asks)}", param=asks[1][0]
        )
    return asks[0][1] if asks else None, asks[0][0] if asks else None


def _schema(value: Any, param: str) -> dict | bool:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            raise invalid(f"'{param}' is not valid JSON", param=param) from None
    if not isinstance(value, (dict, bool)):
        raise invalid(f"'{param}' must be a JSON schema (an object)", param=param)
    return value


async def compile_or_400(engine: Any, spec: StructuredOutput | None, param: str | None) -> None:
    """Compile the grammar before the request is admitted, so a bad one is a 400 naming its field."""
    if spec is None:
        return
    try:
        await engine.compile_grammar(spec)
    except GrammarError as exc:
        raise invalid(f"Invalid '{param}': {exc}", param=param, code="invalid_grammar") from None


# --------------------------------------------------------------------------- tools
@dataclass
class ToolPlan:
    parser: ToolParser
    structured: StructuredOutput | None  # forced calls: the grammar of the call's JSON
    max_calls: int | None  # 1 when parallel_tool_calls is false


MAX_FORCED_CALLS = 16  # tool_choice "required": a small model otherwise calls again and again, to max_tokens


def plan_tools(body: Any, parser_name: str) -> ToolPlan | None:
    """None when no tool can be called (no tools, or tool_choice "none")."""
    tools, choice = body.tools or [], body.tool_choice
    if choice is not None and choice != "none" and not tools:
        raise invalid("'tool_choice' needs 'tools'", param="tool_choice")
    if not tools or choice == "none":
        return None
    max_calls = 1 if body.parallel_tool_calls is False else None
    by_name = {t.function.name: t.function for t in tools}
    if len(by_name) != len(tools):
        raise invalid("'tools' has two functions with the same name", param="tools")
    if choice is None or choice == "auto":
        return ToolPlan(PARSERS[parser_name](), None, max_calls)
    if choice == "required":
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "parameters": _parameters(f)},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, f in by_name.items()
        ]
        schema = {
            "type": "array",
            "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
            "minItems": 1,
            "maxItems": max_calls or MAX_FORCED_CALLS,
        }
        return ToolPlan(JsonParser(), _spec(schema), max_calls)
    name = choice.function.name
    if name not in by_name:
        raise invalid(f"'tool_choice' names function '{name}', which is not in 'tools'", param="tool_choice")
    return ToolPlan(JsonParser(name), _spec(_parameters(by_name[name])), 1)


def _parameters(function: Any) -> dict:
    """A function's parameters as the grammar of its arguments: objects that do not say whether
    they take undeclared keys take none (a model otherwise adds keys the tool does not have)."""
    return _closed(function.parameters if function.parameters is not None else {"type": "object", "properties": {}})


def _closed(schema: Any) -> Any:
    if not isinstance(schema, dict):
        return schema
    out = dict(schema)
    if isinstance(out.get("properties"), dict):
        out["properties"] = {name: _closed(sub) for name, sub in out["properties"].items()}
        out.setdefault("additionalProperties", False)
    if isinstance(out.get("items"), dict):
        out["items"] = _closed(out["items"])
    return out


def _spec(schema: dict) -> StructuredOutput:
    try:
        return StructuredOutput.json_schema(schema)
    except GrammarError as exc:
        raise invalid(str(exc), param="tools") from None


def chat_messages(body: Any, tokenizer: Any) -> tuple[list[dict], list[dict] | None]:
    """(messages, tools) to render, for a chat or a /tokenize request: the model's own template shows the tools when it can;
    otherwise tools, past calls and results are written as text in the Hermes format."""
    messages = body.template_messages()
    active = body.tools and getattr(body, "tool_choice", None) != "none"
    tools = [t.model_dump(exclude_none=True) for t in body.tools] if active else None
    has_tool_turns = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
    if template_renders_tools(getattr(tokenizer, "chat_template", None)):
        return messages, tools
    if tools or has_tool_turns:
        return hermes_messages(messages, tools or []), None
    return messages, None
