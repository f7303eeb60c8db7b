"""Structured output and tool calls of the OpenAI API, as request fields -> a `Grammar`.

Structured output (one of these per request; two are refused by name):
  * `response_format`: ``{"type": "text"}`` (no constraint), ``{"type": "json_object"}`` (any JSON
    object), ``{"type": "json_schema", "json_schema": {"name", "schema", "strict"?, "description"?}}``
    (the schema enforced whatever `strict` says: a constraint is always strict here);
  * vLLM's extensions by its names: `guided_json` (a schema, object or JSON text), `guided_regex`,
    `guided_choice` (a list of strings), `guided_grammar` (llguidance's Lark), and the newer
    `structured_outputs` object with one of `json`, `regex`, `choice`, `grammar`.

Tool calls (chat only; `tools`, `tool_choice`, `parallel_tool_calls`): the functions are described
to the model in a system message (the served models' chat templates have no tool format), and a
call is a JSON object ``{"name": <function>, "arguments": {...}}`` (a JSON list of them for
parallel calls; `TOOL_FORMAT`). `tool_choice` "required" or a named function constrains the answer
to that format by a grammar built from the functions' parameter schemas, so the arguments always
validate; "auto" leaves the model free and an answer that is such a call (and nothing else)
becomes `tool_calls` (as vLLM's tool parsers do); "none" sends no tools. Assistant messages with
`tool_calls` and `tool` messages come back in the same format (`render_tool_messages`).
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from relayinfer.protocol.messages import Grammar
from relayinfer.protocol.model.grammar import choice_grammar, grammar_text, json_schema_grammar
from relayinfer.protocol.validate import FieldError

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "structured_outputs")
STRUCTURED_KEYS = {"json": "guided_json", "regex": "guided_regex", "choice": "guided_choice",
                   "grammar": "guided_grammar"}
MAX_TOOLS = 128
FUNCTION_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")  # OpenAI's function name rule (tools, tool_calls)

TOOL_FORMAT = (
    "You can call functions. To call one, answer with only a JSON object of the form "
    '{"name": <function name>, "arguments": <an object of its parameters>}%s, and nothing else. '
    "Otherwise answer normally. The functions (JSON Schema of their parameters):\n%s")
PARALLEL_NOTE = " (to call several at once, a JSON list of such objects)"


def _schema(v: Any, field: str) -> dict | bool:
    """A JSON schema given as an object (or boolean) or as JSON text."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except ValueError as e:
            raise FieldError(field, "a JSON schema (an object, or its JSON text)", f"{v[:80]!r}: {e}") from None
    if not isinstance(v, (dict, bool)):
        raise FieldError(field, "a JSON schema (an object, or its JSON text)", v)
    return v


def _guided(field: str, v: Any) -> Grammar:
    if field == "guided_json":
        return json_schema_grammar(_schema(v, field))
    if field == "guided_choice":
        return choice_grammar(v, field)
    if not isinstance(v, str) or not v:
        raise FieldError(field, "a non-empty string", v)
    return Grammar("regex" if field == "guided_regex" else "lark", v)


def _known_keys(v: dict, keys: tuple[str, ...], field: str) -> None:
    """Raises FieldError naming the first key of `v` outside `keys` (never silently ignored)."""
    extra = sorted(k for k in v if k not in keys)
    if extra:
        raise FieldError(f"{field}.{extra[0]}", f"left out (the keys here are {', '.join(keys)})", v[extra[0]])


def _response_format(rf: Any) -> Grammar | None:
    if not isinstance(rf, dict) or rf.get("type") not in ("text", "json_object", "json_schema"):
        raise FieldError("response_format", "an object whose type is 'text', 'json_object' or 'json_schema'", rf)
    _known_keys(rf, ("type", "json_schema") if rf["type"] == "json_schema" else ("type",), "response_format")
    if rf["type"] == "text":
        return None
    if rf["type"] == "json_object":
        return json_schema_grammar({"type": "object"})
    js = rf.get("json_schema")
    if not isinstance(js, dict) or "schema" not in js:
        raise FieldError("response_format.json_schema", "an object with 'name' and 'schema'", js)
    _known_keys(js, ("name", "schema", "strict", "description"), "response_format.json_schema")
    if not isinstance(js.get("name"), str) or not FUNCTION_NAME.fullmatch(js["name"]):
        raise FieldError("response_format.json_schema.name", "a name of 1-64 letters, digits, '_' or '-'",
                         js.get("name"))
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise FieldError("response_format.json_schema.strict", "a boolean", js["strict"])
    return json_schema_grammar(_schema(js["schema"], "response_format.json_schema.schema"))


def parse_structured(body: dict) -> tuple[Grammar | None, str | None]:
    """The request's structured-output constraint and the field that set it ((None, None): none).

    Raises:
        FieldError: a malformed value, two constraints in one request (the second named), or a
            grammar that does not compile (llguidance's message, the field named).
    """
    found: list[tuple[str, Grammar | None]] = []
    if body.get("response_format") is not None:
        g = _response_format(body["response_format"])
        if g is not None:
            found.append(("response_format", g))
    for field in GUIDED_FIELDS[:-1]:
        if body.get(field) is not None:
            found.append((field, _guided(field, body[field])))
    so = body.get("structured_outputs")
    if so is not None:
        keys = [k for k in so if so[k] is not None] if isinstance(so, dict) else None
        if not keys or len(keys) != 1 or keys[0] not in STRUCTURED_KEYS:
            raise FieldError("structured_outputs", f"an object with one of {', '.join(STRUCTURED_KEYS)}", so)
        found.append((f"structured_outputs.{keys[0]}", _guided(STRUCTURED_KEYS[keys[0]], so[keys[0]])))
    if len(found) > 1:
        raise FieldError(found[1][0], f"left out: {found[0][0]} already constrains the answer "
                         "(one structured-output field per request)", "given")
    if not found:
        return None, None
    field, g = found[0]
    grammar_text(g, field)  # GrammarError (a FieldError) naming the field
    return g, field


@dataclass(frozen=True)
class Tools:
    """The request's functions. `functions`: ({"name", "description", "parameters"}, ...);
    `choice`: 'auto', 'required' or a function name; `parallel`: parallel_tool_calls."""

    functions: tuple[dict, ...]
    choice: str
    parallel: bool

    def names(self) -> set[str]:
        return {f["name"] for f in self.functions}

    def _valid(self, name: str, arguments: dict) -> bool:
        """Whether `arguments` validate under function `name`'s parameters (jsonschema): a call
        the grammar did not force is checked before it becomes `tool_calls`."""
        import jsonschema

        params = next(f["parameters"] for f in self.functions if f["name"] == name)
        if params is None:
            return True
        try:
            jsonschema.validate(arguments, params)
        except jsonschema.ValidationError:
            return False
        except jsonschema.SchemaError:  # a schema llguidance takes and jsonschema does not: trust neither
            return False
        return True

    def system_text(self) -> str:
        """The system message that describes the functions and `TOOL_FORMAT`."""
        spec = json.dumps([{k: f[k] for k in ("name", "description", "parameters") if f.get(k) is not None}
                           for f in self.functions], separators=(",", ":"))
        return TOOL_FORMAT % (PARALLEL_NOTE if self.parallel else "", spec)

    def grammar(self) -> Grammar | None:
        """The constraint of `choice` (None for 'auto'): a call of one of the functions (the named
        one), or with `parallel` a non-empty JSON list of calls."""
        if self.choice == "auto":
            return None
        funcs = [f for f in self.functions if self.choice == "required" or f["name"] == self.choice]
        calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                                   "arguments": f.get("parameters") or {"type": "object"}},
                  "required": ["name", "arguments"], "additionalProperties": False} for f in funcs]
        one = calls[0] if len(calls) == 1 else {"anyOf": calls}
        return json_schema_grammar({"type": "array", "items": one, "minItems": 1} if self.parallel else one)

    def calls(self, text: str) -> list[dict] | None:
        """`text` as OpenAI `tool_calls` ([{"id", "type": "function", "function": {"name",
        "arguments": JSON text}}]) when it is a call (or a list of calls) of known functions in
        `TOOL_FORMAT` and nothing else; None otherwise (the text is the answer)."""
        try:
            v = json.loads(text)
        except ValueError:
            return None
        if isinstance(v, list) and not self.parallel:
            return None  # a list of calls where at most one is asked for: the text stays the answer
        items = v if isinstance(v, list) and v else [v]
        out = []
        for c in items:
            if not (isinstance(c, dict) and set(c) <= {"name", "arguments"} and c.get("name") in self.names()
                    and isinstance(c.get("arguments", {}), dict) and self._valid(c["name"], c.get("arguments", {}))):
                return None
            out.append({"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                        "function": {"name": c["name"], "arguments": json.dumps(c.get("arguments", {}))}})
        return out


def parse_tools(body: dict) -> Tools | None:
    """`tools`, `tool_choice` and `parallel_tool_calls` of a chat body (None: no tools, or
    tool_choice 'none').

    Raises:
        FieldError: a malformed tool (the entry named), a duplicate or bad function name, a
            tool_choice that names no given function, or tool_choice without tools.
    """
    tools, choice = body.get("tools"), body.get("tool_choice")
    parallel = body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise FieldError("parallel_tool_calls", "a boolean", parallel)
    if tools is None:
        if choice not in (None, "none"):
            raise FieldError("tool_choice", "left out (or 'none') without tools", choice)
        return None
    if not isinstance(tools, list) or not 0 < len(tools) <= MAX_TOOLS:
        raise FieldError("tools", f"a list of 1 to {MAX_TOOLS} tools", tools)
    funcs, seen = [], set()
    for i, t in enumerate(tools):
        p = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise FieldError(p, "{'type': 'function', 'function': {...}}", t)
        _known_keys(t, ("type", "function"), p)
        f = t["function"]
        _known_keys(f, ("name", "description", "parameters", "strict"), f"{p}.function")
        if f.get("strict") is not None and not isinstance(f["strict"], bool):
            raise FieldError(f"{p}.function.strict", "a boolean", f["strict"])
        name = f.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise FieldError(f"{p}.function.name", "a name of 1-64 letters, digits, '_' or '-'", name)
        if name in seen:
            raise FieldError(f"{p}.function.name", "unique among the tools", name)
        seen.add(name)
        if f.get("description") is not None and not isinstance(f["description"], str):
            raise FieldError(f"{p}.function.description", "a string", f["description"])
        params = f.get("parameters")
        if params is not None:
            params = _schema(params, f"{p}.function.parameters")
            if not isinstance(params, dict) or params.get("type", "object") != "object":
                raise FieldError(f"{p}.function.parameters", "a JSON schema of an object (type 'object': the "
                                 "arguments are named)", params)
            grammar_text(json_schema_grammar(params), f"{p}.function.parameters")
        funcs.append({"name": name, "description": f.get("description"), "parameters": params})
    if choice is None or choice in ("auto", "required", "none"):
        choice = choice or "auto"
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        choice = choice["function"].get("name")
        if not isinstance(choice, str) or choice not in seen:
            raise FieldError("tool_choice.function.name", f"one of the tools' names ({', '.join(sorted(seen))})",
                             choice)
    else:
        raise FieldError("tool_choice", "'none', 'auto', 'required' or {'type': 'function', 'function': "
                         "{'name': ...}}", choice)
    if choice == "none":
        return None
    return Tools(tuple(funcs), choice, True if parallel is None else parallel)


def render_tool_messages(messages: list[dict], raw: list) -> list[dict]:
    """`messages` (parsed, one per `raw` entry) with the tool parts of the conversation as text:
    an assistant message's `tool_calls` become its content in `TOOL_FORMAT`, and a `tool` message
    (`tool_call_id`, content) a user message "Result of <function> (<id>): <content>" (the served
    models' templates know only system, user and assistant).

    Raises:
        FieldError: a tool message whose `tool_call_id` names no call of an earlier assistant message.
    """
    names: dict[str, str] = {}
    out = []
    for i, (m, r) in enumerate(zip(messages, raw)):
        calls = r.get("tool_calls") if isinstance(r, dict) else None
        if m["role"] == "assistant" and calls:
            items = []
            for c in calls:
                f = c["function"]
                names[c.get("id", "")] = f["name"]
                items.append({"name": f["name"], "arguments": json.loads(f["arguments"] or "{}")})
            text = json.dumps(items[0] if len(items) == 1 else items)
            out.append({"role": "assistant", "content": (m["content"] + "\n" if m["content"] else "") + text})
        elif m["role"] == "tool":
            cid = r.get("tool_call_id")
            if cid not in names:
                raise FieldError(f"messages[{i}].tool_call_id", "the id of a tool call of an earlier assistant "
                                 "message", cid)
            out.append({"role": "user", "content": f"Result of {names[cid]} ({cid}): {m['content']}"})
        else:
            out.append(m)
    return out
