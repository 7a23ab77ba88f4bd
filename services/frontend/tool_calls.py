"""OpenAI's tool calling on chat completions, request side: the `tools`/`tool_choice`/
`parallel_tool_calls` fields (and the legacy `functions`/`function_call`) checked and reduced to
a ToolPlan, which says what the prompt shows, how the model's text is read back
(services/frontend/tool_parsers/) and, for "required" or a named function, the JSON schema
the output must match (`tool_choice_schema`), enforced as a grammar. Pure functions: no I/O.

Output shape under "required" / a named function: a JSON array of calls,
`[{"name": <one tool's name>, "arguments": <that tool's parameters>}, ...]`, at least one item,
exactly one for a named function or when parallel_tool_calls is false. JSON rather than the
Hermes text form because the grammar backends enforce JSON schemas directly and every call's
arguments then validate against its tool's schema, on any model; a list, so that one shape (and
one parser, JsonToolCallParser) serves one call and several."""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass
from typing import Any

import jsonschema
from jsonschema.validators import validator_for

from vmesh.services.frontend.errors import Code, RequestError

TOOL_CHOICE_MODES = ("none", "auto", "required")
TOOL_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")  # OpenAI's rule for function names
_DEFS = "$defs"


def _invalid(param: str, message: str) -> RequestError:
    return RequestError(Code.INVALID_ARGUMENT, f"{param}: {message}", param)


@dataclass(frozen=True)
class ToolPlan:
    """What a chat request's tool fields ask for. `tools`: OpenAI's list, checked, each
    {"type": "function", "function": {"name", "description"?, "parameters"}}; `choice`: "none",
    "auto", "required", or the name of the one function to call; `parallel`: several calls allowed."""

    tools: tuple[dict[str, Any], ...]
    choice: str
    parallel: bool = True
    # The legacy functions/function_call: a call is answered as OpenAI answered those, the
    # message's one `function_call` and finish_reason "function_call".
    legacy: bool = False

    @property
    def prompt_tools(self) -> list[dict[str, Any]] | None:
        """The tools the prompt shows: none under "none" (the model is not to call any); only the
        named one when a function is named."""
        if self.choice == "none" or not self.tools:
            return None
        if self.choice in TOOL_CHOICE_MODES:
            return list(self.tools)
        return [t for t in self.tools if t["function"]["name"] == self.choice]

    @property
    def forced(self) -> bool:
        """The output must be calls ("required" or a named function): enforced by tool_choice_schema."""
        return bool(self.tools) and self.choice not in ("none", "auto")

    @property
    def parses_calls(self) -> bool:
        return bool(self.tools) and self.choice != "none"


def _function(param: str, function: Any) -> dict[str, Any]:
    if not isinstance(function, dict):
        raise _invalid(param, "must be an object with name, description and parameters")
    name = function.get("name")
    if not isinstance(name, str) or not name:
        raise _invalid(f"{param}.name", "required")
    if not TOOL_NAME.match(name):
        raise _invalid(f"{param}.name", f"{name!r} must be 1 to 64 letters, digits, '_' or '-'")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise _invalid(f"{param}.description", "must be a string")
    parameters = function.get("parameters", {"type": "object", "properties": {}})
    if not isinstance(parameters, dict):
        raise _invalid(f"{param}.parameters", "must be a JSON schema object")
    if parameters.get("type", "object") != "object":
        raise _invalid(f"{param}.parameters", f"must describe an object (type 'object'), not {parameters['type']!r}")
    try:
        validator_for(parameters).check_schema(parameters)
    except jsonschema.SchemaError as exc:
        where = ".".join(str(p) for p in exc.path)
        raise _invalid(f"{param}.parameters" + (f".{where}" if where else ""),
                       f"not a valid JSON schema ({exc.message})") from exc
    checked: dict[str, Any] = {"name": name, "parameters": {"type": "object", **parameters}}
    if description is not None:
        checked["description"] = description
    if "strict" in function:
        checked["strict"] = bool(function["strict"])
    return checked


def check_tools(tools: list[Any] | None, param: str = "tools", legacy: bool = False) -> tuple[dict[str, Any], ...]:
    """OpenAI's tools, checked (`legacy`: the `functions` list, bare function objects)."""
    out: list[dict[str, Any]] = []
    for i, tool in enumerate(tools or ()):
        where = f"{param}[{i}]"
        if legacy:
            function = _function(where, tool)
        else:
            if not isinstance(tool, dict) or tool.get("type", "function") != "function":
                raise _invalid(f"{where}.type", "only 'function' tools are supported by vmesh")
            function = _function(f"{where}.function", tool.get("function"))
        out.append({"type": "function", "function": function})
    names = [t["function"]["name"] for t in out]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise _invalid(f"{param}[{i}].function.name" if not legacy else f"{param}[{i}].name",
                           f"{name!r} is defined twice")
    return tuple(out)


def _choice(param: str, value: Any, names: list[str], legacy: bool) -> str:
    if value is None:
        return "auto" if names else "none"
    if isinstance(value, str):
        modes = ("none", "auto") if legacy else TOOL_CHOICE_MODES
        if value not in modes:
            raise _invalid(param, f"{value!r} is not one of {', '.join(modes)} or a named function")
        if value != "none" and not names:
            raise _invalid(param, f"{value!r} needs {'functions' if legacy else 'tools'}")
        return value
    if not isinstance(value, dict):
        raise _invalid(param, "must be a string or an object naming a function")
    if legacy:
        name = value.get("name")
    else:
        if value.get("type") != "function":
            raise _invalid(f"{param}.type", "must be 'function'")
        name = (value.get("function") or {}).get("name") if isinstance(value.get("function"), dict) else None
    if not isinstance(name, str) or not name:
        raise _invalid(f"{param}.name" if legacy else f"{param}.function.name", "required")
    if name not in names:
        raise _invalid(f"{param}.name" if legacy else f"{param}.function.name",
                       f"{name!r} is not among the {'functions' if legacy else 'tools'}")
    return name


def tool_plan(tools: list[Any] | None, tool_choice: Any, parallel_tool_calls: bool | None,
              functions: list[Any] | None = None, function_call: Any = None) -> ToolPlan:
    """The request's tool fields, checked (a 400 naming the field otherwise). The legacy
    `functions`/`function_call` map onto the same plan, one call at most, as OpenAI had them."""
    if functions is not None or function_call is not None:
        if tools is not None or tool_choice is not None:
            raise _invalid("functions", "use tools/tool_choice or the legacy functions/function_call, not both")
        checked = check_tools(functions, "functions", legacy=True)
        names = [t["function"]["name"] for t in checked]
        return ToolPlan(checked, _choice("function_call", function_call, names, legacy=True), parallel=False,
                        legacy=True)
    checked = check_tools(tools)
    names = [t["function"]["name"] for t in checked]
    return ToolPlan(checked, _choice("tool_choice", tool_choice, names, legacy=False),
                    parallel=parallel_tool_calls is not False)


def _rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with its local references ("#/...") pointing under `base` (a JSON pointer),
    where the schema is moved to: its $defs keep working once it is nested in a larger schema."""
    if isinstance(schema, dict):
        out = {}
        for key, value in schema.items():
            if key == "$ref" and isinstance(value, str) and value.startswith("#"):
                out[key] = base + value[1:]
            else:
                out[key] = _rebase_refs(value, base)
        return out
    if isinstance(schema, list):
        return [_rebase_refs(item, base) for item in schema]
    return schema


def _call_schema(index: int, function: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """One call's object schema, and its parameters placed under the root's $defs (so that the
    parameters' own references resolve wherever the call sits)."""
    key = f"vmesh_tool_{index}"
    # "$id" would move the base that references resolve against; "$schema" only counts at the root
    moved = {k: v for k, v in function["parameters"].items() if k not in ("$id", "$schema")}
    parameters = _rebase_refs(copy.deepcopy(moved), f"#/{_DEFS}/{key}")
    call = {"type": "object", "properties": {"name": {"const": function["name"]},
                                             "arguments": {"$ref": f"#/{_DEFS}/{key}"}},
            "required": ["name", "arguments"], "additionalProperties": False}
    return call, {key: parameters}


def tool_choice_schema(tools: tuple[dict[str, Any], ...] | list[dict[str, Any]], tool_choice: str,
                       parallel_tool_calls: bool = True) -> dict[str, Any] | None:
    """The JSON schema the output must match under `tool_choice` ("required" or a function's
    name; checked tools, as tool_plan returns them): an array of {"name", "arguments"} calls,
    each call's arguments its tool's parameters. "auto" and "none": None (unconstrained)."""
    if tool_choice in ("none", "auto"):
        return None
    chosen = [(i, t["function"]) for i, t in enumerate(tools)
              if tool_choice == "required" or t["function"]["name"] == tool_choice]
    if not chosen:
        raise ValueError(f"tool_choice {tool_choice!r} names no tool")
    calls, defs = [], {}
    for i, function in chosen:
        call, parameters = _call_schema(i, function)
        calls.append(call)
        defs.update(parameters)
    one = tool_choice != "required" or not parallel_tool_calls
    return {"type": "array", "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
            "minItems": 1, **({"maxItems": 1} if one else {}), _DEFS: defs}


def plan_schema(plan: ToolPlan) -> dict[str, Any] | None:
    """tool_choice_schema of a plan: what the frontend hands the grammar compiler, as
    StructuredOutput(kind="json_schema", source=json.dumps(schema))."""
    return tool_choice_schema(plan.tools, plan.choice, plan.parallel) if plan.forced else None


def tools_json(plan: ToolPlan) -> str:
    """The prompt's tools as the chat input carries them (ChatMessages.tools); "" for none."""
    tools = plan.prompt_tools
    return json.dumps(tools, ensure_ascii=False) if tools else ""
