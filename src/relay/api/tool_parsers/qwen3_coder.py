"""Qwen3-Coder XML tool calls, as vLLM's qwen3_coder parser reads them:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

anywhere in the text (a `<function=...>` without its `<tool_call>` wrapper is read too); the
text outside is the content. A parameter's value is raw text (one newline either side
dropped), converted by the tool's JSON schema: a string parameter stays a string, one of
another type is parsed as JSON and stays a string if it does not parse. A value ends at
`</parameter>`, or at the next `<parameter=` or `</function>` when the model left it open.

A call's name is sent when `<function=NAME>` is read, then its arguments one parameter at a
time as each value closes (`{"city": "Paris"`, then `, "days": 3`, then `}`). A block that does
not open with a valid function name is text, tags and all.
"""

from __future__ import annotations

import json
import re
from typing import Any

from relay.api.tool_parsers.events import CallArgs, CallName, Event, first_of, held_back

OPEN_TAG, CLOSE_TAG = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAMETER, PARAMETER_END = "<parameter=", "</parameter>"
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
_NAME_SO_FAR = re.compile(r"[A-Za-z0-9_.:-]{0,64}")
_STRING_TYPES = frozenset({"string", "str", "text"})


class Qwen3CoderParser:
    def __init__(self, schemas: dict[str, Any] | None = None) -> None:
        self._schemas = schemas or {}  # tool name -> its parameters schema
        self._state = "text"  # text | block | name | params | param_name | value | after
        self._held = ""
        self._raw = ""  # the text of a call not yet named, given back as text if it is none
        self._wrapped = False  # the call is inside <tool_call>
        self._name = ""
        self._param = ""
        self._params = 0  # parameters sent for the current call

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._held += text
        while self._step(out):
            pass
        return out

    def _step(self, out: list[Event]) -> bool:
        """Read what is held as far as it is certain; False once more text is needed."""
        return getattr(self, f"_on_{self._state}")(out)

    def _on_text(self, out: list[Event]) -> bool:
        start, tag = first_of(self._held, (OPEN_TAG, FUNCTION))
        if start < 0:
            cut = len(self._held) - held_back(self._held, (OPEN_TAG, FUNCTION))
            if cut:
                out.append(self._held[:cut])
            self._held = self._held[cut:]
            return False
        if start:
            out.append(self._held[:start])
        self._held = self._held[start + len(tag) :]
        self._raw, self._wrapped = tag, tag == OPEN_TAG
        self._state = "block" if tag == OPEN_TAG else "name"
        return True

    def _on_block(self, out: list[Event]) -> bool:
        """After <tool_call>: whitespace, then <function=."""
        head = self._held.lstrip()
        if head.startswith(FUNCTION):
            self._raw += self._held[: len(self._held) - len(head) + len(FUNCTION)]
            self._held, self._state = head[len(FUNCTION) :], "name"
            return True
        if FUNCTION.startswith(head):
            return False
        return self._no_call(out)

    def _on_name(self, out: list[Event]) -> bool:
        end = self._held.find(">")
        name = self._held[:end] if end >= 0 else self._held
        if end < 0:
            return False if _NAME_SO_FAR.fullmatch(name) else self._no_call(out)
        if not _NAME.fullmatch(name):
            return self._no_call(out)
        out.append(CallName(name))
        self._name, self._params, self._raw = name, 0, ""
        self._held, self._state = self._held[end + 1 :], "params"
        return True

    def _no_call(self, out: list[Event]) -> bool:
        """What was taken for the start of a call is text; the rest is read again as text."""
        out.append(self._raw)
        self._raw, self._state = "", "text"
        return True

    def _on_params(self, out: list[Event]) -> bool:
        """Between parameters: the next one, or the end of the function."""
        head = self._held.lstrip()
        for tag, state in ((PARAMETER, "param_name"), (FUNCTION_END, "after"), (CLOSE_TAG, "text")):
            if head.startswith(tag):
                self._held = head[len(tag) :]
                if state == "param_name":
                    self._state = state
                else:  # the function ends (a missing </function> before </tool_call> is forgiven)
                    out.append(CallArgs("}" if self._params else "{}"))
                    self._state = state if self._wrapped else "text"
                return True
        if not head or any(t.startswith(head) for t in (PARAMETER, FUNCTION_END, CLOSE_TAG)):
            self._held = head
            return False
        # Stray text between parameters is dropped, up to the next tag.
        skip = head.find("<", 1)
        self._held = head[skip:] if skip > 0 else ""
        return bool(self._held)

    def _on_param_name(self, out: list[Event]) -> bool:
        end = self._held.find(">")
        if end < 0:
            return False
        self._param, self._held, self._state = (
            self._held[:end].strip(),
            self._held[end + 1 :],
            "value",
        )
        return True

    def _on_value(self, out: list[Event]) -> bool:
        end, tag = first_of(self._held, (PARAMETER_END, PARAMETER, FUNCTION_END))
        if end < 0:
            return False
        self._send_parameter(self._held[:end], out)
        self._held = self._held[end + len(tag) if tag == PARAMETER_END else end :]
        self._state = "params"
        return True

    def _send_parameter(self, raw: str, out: list[Event]) -> None:
        raw = raw[1:] if raw.startswith("\n") else raw
        raw = raw[:-1] if raw.endswith("\n") else raw
        value = _converted(raw, self._param_type(self._param))
        piece = json.dumps(self._param, ensure_ascii=False) + ": "
        piece += json.dumps(value, ensure_ascii=False)
        out.append(CallArgs(("{" if not self._params else ", ") + piece))
        self._params += 1

    def _param_type(self, param: str) -> Any:
        schema = self._schemas.get(self._name)
        props = schema.get("properties") if isinstance(schema, dict) else None
        spec = props.get(param) if isinstance(props, dict) else None
        return spec.get("type") if isinstance(spec, dict) else None

    def _on_after(self, out: list[Event]) -> bool:
        """After </function>: </tool_call>, or another function in the same block."""
        head = self._held.lstrip()
        for tag, state in ((CLOSE_TAG, "text"), (FUNCTION, "name")):
            if head.startswith(tag):
                self._held, self._state, self._raw = head[len(tag) :], state, tag
                return True
        if any(t.startswith(head) for t in (CLOSE_TAG, FUNCTION)):
            return False
        self._state = "text"  # no close tag: what follows is text
        return True

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "text":
            out += [self._held] if self._held else []
        elif self._state in ("block", "name"):
            out.append(self._raw + self._held)
        elif self._state in ("params", "param_name", "value"):  # cut short: close what was sent
            if self._state == "value":
                self._send_parameter(self._held, out)
            out.append(CallArgs("}" if self._params else "{}"))
        self._state, self._held, self._raw = "text", "", ""
        return out


def _converted(raw: str, kind: Any) -> Any:
    """A parameter's raw text as its schema's type asks: a string unless the type is another."""
    kinds = set(kind) if isinstance(kind, list) else {kind}
    if kinds & _STRING_TYPES or None in kinds or not all(isinstance(k, str) for k in kinds):
        return raw
    try:
        return json.loads(raw, parse_constant=_no_constant)
    except ValueError:
        return raw


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")  # NaN and Infinity stay strings


def forced_call_format(tools: list[tuple[str, Any]], named: str | None, parallel: bool) -> dict:
    """The xgrammar structural-tag format a forced call is written in: one block of the named
    function, or (tool_choice "required") one or more blocks of any tool, each parameter's
    value held to its schema (xgrammar's qwen_xml style)."""
    tags = [
        {
            "type": "tag",
            "begin": f"{OPEN_TAG}\n{FUNCTION}{name}>\n",
            "content": {"type": "json_schema", "json_schema": schema, "style": "qwen_xml"},
            "end": f"\n{FUNCTION_END}\n{CLOSE_TAG}",
        }
        for name, schema in tools
        if named is None or name == named
    ]
    if named is not None:
        return tags[0]
    return {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "\n",
        "at_least_one": True,
        "stop_after_first": not parallel,
    }
