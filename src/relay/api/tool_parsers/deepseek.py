"""DeepSeek tool calls: text, then a block of calls between `<｜tool▁calls▁begin｜>` and
`<｜tool▁calls▁end｜>`, each call in one of two forms, both read by either parser name:

- DeepSeek-V3 / R1 (`deepseek_v3`): `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the
  arguments in a fenced block, "\\n```json\\n{...}\\n```", then `<｜tool▁call▁end｜>`;
- DeepSeek-V3.1 (`deepseek_v31`): `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>`.

The two names differ only in the form a forced call is written in (relay.api.tool_parsers.
forced_call_format). A call's name is sent once it is read (V3: at the fence, V3.1: at the
separator), then its arguments object as it streams. A block that does not open with a call is
text, markers and all. The markers are special tokens: requests read in these formats keep
special tokens in the text.
"""

from __future__ import annotations

from typing import Any

import regex

from relay.api.tool_parsers.events import CallName, Event, first_of, partial_suffix
from relay.api.tool_parsers.json_call import JsonCallReader

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
_NAME = regex.compile(r"[A-Za-z0-9_.:-]{1,64}")
# V3 / R1: after the separator, the name, then (usually) a ```json fence, up to the '{'.
_V3_HEAD = regex.compile(
    r"\s*([A-Za-z0-9_.:-]{1,64})[ \t]*\r?\n?[ \t]*(?:```(?:json)?[ \t]*\r?\n)?\s*\{"
)


class DeepSeekParser:
    def __init__(self) -> None:
        self._state = "text"  # text | calls | head | after_sep | v3_name | args | tail | content
        self._held = ""
        self._raw = ""  # the block's text since its last call, text again if no call follows
        self._head = ""  # the text between the call's begin marker and the separator
        self._calls = 0  # calls in the current block
        self._call: JsonCallReader | None = None

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._held += text
        while getattr(self, f"_on_{self._state}")(out):
            pass
        return out

    def _take(self, n: int) -> None:
        """n characters of the held text are read as part of the block."""
        self._raw += self._held[:n]
        self._held = self._held[n:]

    def _on_text(self, out: list[Event]) -> bool:
        start = self._held.find(CALLS_BEGIN)
        if start < 0:
            cut = len(self._held) - partial_suffix(self._held, CALLS_BEGIN)
            if cut:
                out.append(self._held[:cut])
            self._held = self._held[cut:]
            return False
        if start:
            out.append(self._held[:start])
        self._held, self._raw = self._held[start:], ""
        self._take(len(CALLS_BEGIN))
        self._state, self._calls = "calls", 0
        return True

    def _on_calls(self, out: list[Event]) -> bool:
        """In the block, between calls: the next call, or the block's end."""
        head = self._held.lstrip()
        for tag, state in ((CALL_BEGIN, "head"), (CALLS_END, "text")):
            if head.startswith(tag):
                self._take(len(self._held) - len(head) + len(tag))
                self._state, self._head = state, ""
                return True
        if CALL_BEGIN.startswith(head) or CALLS_END.startswith(head):
            return False
        return self._no_call(out)

    def _no_call(self, out: list[Event]) -> bool:
        """Not a call where one was expected: the block's text since its last call and what
        follows are text (after a call, just what follows)."""
        if not self._calls:
            out.append(self._raw)
        self._raw, self._state = "", "content" if self._calls else "text"
        return True

    def _on_head(self, out: list[Event]) -> bool:
        """Up to the separator: "function" (V3 / R1) or the call's name (V3.1)."""
        end = self._held.find(SEP)
        so_far = self._held[: len(self._held) - partial_suffix(self._held, SEP) if end < 0 else end]
        if len(so_far) > 64 or not _NAME.fullmatch(so_far or "x", partial=True):
            return self._no_call(out)
        if end < 0:
            return False
        self._head = so_far
        self._take(end + len(SEP))
        self._state = "after_sep"
        return True

    def _on_after_sep(self, out: list[Event]) -> bool:
        head = self._held.lstrip()
        if not head:
            return False
        if head[0] == "{" or self._head != "function":  # V3.1: the head was the name
            if not _NAME.fullmatch(self._head):
                return self._no_call(out)
            return self._named(self._head, out)
        self._state = "v3_name"
        return True

    def _on_v3_name(self, out: list[Event]) -> bool:
        m = _V3_HEAD.match(self._held, partial=True)
        if m is None:
            return self._no_call(out)
        if m.partial:
            return False
        self._take(m.end() - 1)  # up to the '{'
        return self._named(m.group(1), out)

    def _named(self, name: str, out: list[Event]) -> bool:
        out.append(CallName(name))
        self._calls += 1
        self._raw, self._state = "", "args"
        self._call = JsonCallReader()
        self._call.start_at_arguments()
        return True

    def _on_args(self, out: list[Event]) -> bool:
        call, text = self._call, self._held
        self._held = ""
        out += call.feed(text)
        if not call.done:
            return False
        self._call, self._held, self._state = None, call.rest, "tail"
        return True

    def _on_tail(self, out: list[Event]) -> bool:
        """After the arguments (V3: the closing fence) up to the call's end marker."""
        end, tag = first_of(self._held, (CALL_END, CALLS_END))
        if end < 0:
            self._held = self._held[len(self._held) - _held_back(self._held) :]
            return False
        self._held = self._held[end + len(tag) :]
        self._state = "calls" if tag == CALL_END else "text"
        return True

    def _on_content(self, out: list[Event]) -> bool:
        if self._held:
            out.append(self._held)
        self._held = ""
        return False

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._call is not None:
            self._call.finish()
            self._call = None
        elif self._state in ("calls", "head", "after_sep", "v3_name") and not self._calls:
            out.append(self._raw + self._held)
        elif self._state == "text" and self._held:
            out.append(self._held)
        self._state, self._held, self._raw = "text", "", ""
        return out


def _held_back(text: str) -> int:
    return max(partial_suffix(text, CALL_END), partial_suffix(text, CALLS_END))


def forced_call_format(
    tools: list[tuple[str, Any]], named: str | None, parallel: bool, v31: bool = False
) -> dict:
    """The xgrammar structural-tag format a forced call is written in: a block of one call (the
    named function's) or, for tool_choice "required", of one or more calls of any tool, in the
    V3 / R1 form (v31: the V3.1 form), the arguments held to their schema."""
    tags = [
        {
            "type": "tag",
            "begin": f"{CALL_BEGIN}{name}{SEP}"
            if v31
            else f"{CALL_BEGIN}function{SEP}{name}\n```json\n",
            "content": {"type": "json_schema", "json_schema": schema},
            "end": CALL_END if v31 else f"\n```{CALL_END}",
        }
        for name, schema in tools
        if named is None or name == named
    ]
    calls = {
        "type": "tags_with_separator",
        "tags": tags,
        "separator": "" if v31 else "\n",
        "at_least_one": True,
        "stop_after_first": named is not None or not parallel,
    }
    return {"type": "tag", "begin": CALLS_BEGIN, "content": calls, "end": CALLS_END}


def forced_call_format_v31(tools: list[tuple[str, Any]], named: str | None, parallel: bool) -> dict:
    return forced_call_format(tools, named, parallel, v31=True)
