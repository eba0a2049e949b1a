"""gpt-oss's harmony format: the output is a run of messages, each a header and a body,

    <|channel|>analysis<|message|>Let me look.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

(the chat template's generation prompt writes the first `<|start|>assistant`, so the output
begins at a `<|channel|>`; a header may also name its recipient before the channel,
` to=functions.NAME<|channel|>commentary json`). The analysis channel is reasoning
(`reasoning_content`, sent as Thought events); a message to `functions.NAME` is a call of NAME
with the body as its arguments (streamed as they come); the final channel, and commentary to no
one, are content. A body ends at `<|end|>`, `<|call|>`, `<|return|>`, the next `<|start|>` or
the end of the output (`<|call|>` and `<|return|>` are stop tokens and seldom reach the text).

Output that does not begin like a header (a model not writing harmony) is content up to the
next message; a header that runs past HEADER_LIMIT characters without `<|message|>` is content.
Every marker is a special token: requests read in this format keep special tokens in the text.
"""

from __future__ import annotations

import re
from typing import Any

from relay.api.text_trim import Trim
from relay.api.tool_parsers.events import CallArgs, CallName, Event, Thought, first_of, held_back

START, CHANNEL, MESSAGE = "<|start|>", "<|channel|>", "<|message|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
BODY_ENDS = (END, CALL, RETURN, START)
HEADER_LIMIT = 256
_HEADER_OPENINGS = (START, CHANNEL, "to=")
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z_]+)")
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
FUNCTIONS = "functions."


class HarmonyParser:
    def __init__(self, calls: bool = True) -> None:
        self._calls = calls  # False (no tools): a message to a function is content
        self._state = "header"  # header | body
        self._held = ""
        self._route = "content"  # the body's: content | reasoning | call
        self._args: Trim | None = None  # a call's arguments, stripped as they stream
        self._sent_args = False

    def feed(self, text: str) -> list[Event]:
        out: list[Event] = []
        self._held += text
        while getattr(self, f"_on_{self._state}")(out):
            pass
        return out

    def _on_header(self, out: list[Event]) -> bool:
        head = self._held.lstrip()
        if not head:
            return False
        if not any(head.startswith(o) or o.startswith(head) for o in _HEADER_OPENINGS):
            return self._body("content", out)  # no header: text up to the next message
        # The header ends at <|message|>; a body end, or no <|message|> in time, says it is none.
        end, tag = first_of(head[: HEADER_LIMIT + len(MESSAGE)], (MESSAGE, *BODY_ENDS[:3]))
        if tag == MESSAGE:
            header, self._held = head[:end], head[end + len(MESSAGE) :]
            return self._open(header, out)
        if end >= 0 or len(head) >= HEADER_LIMIT + len(MESSAGE):
            return self._body("content", out)
        return False

    def _open(self, header: str, out: list[Event]) -> bool:
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        to = recipient.group(1) if recipient else ""
        if to.startswith(FUNCTIONS) and len(to) > len(FUNCTIONS) and self._calls:
            out.append(CallName(to[len(FUNCTIONS) :]))
            self._args, self._sent_args = Trim(), False
            return self._body("call", out)
        if channel is not None and channel.group(1) == "analysis" and not to:
            return self._body("reasoning", out)
        return self._body("content", out)

    def _body(self, route: str, out: list[Event]) -> bool:
        self._route, self._state = route, "body"
        return True

    def _on_body(self, out: list[Event]) -> bool:
        end, tag = first_of(self._held, BODY_ENDS)
        if end < 0:
            cut = len(self._held) - held_back(self._held, BODY_ENDS)
            self._send(self._held[:cut], out)
            self._held = self._held[cut:]
            return False
        self._send(self._held[:end], out)
        self._close(out)
        self._held = self._held[end if tag == START else end + len(tag) :]
        self._state = "header"
        return True

    def _send(self, text: str, out: list[Event]) -> None:
        if not text:
            return
        if self._route == "call":
            if piece := self._args.push(text):
                out.append(CallArgs(piece))
                self._sent_args = True
        elif self._route == "reasoning":
            out.append(Thought(text))
        else:
            out.append(text)

    def _close(self, out: list[Event]) -> None:
        if self._route == "call" and not self._sent_args:
            out.append(CallArgs("{}"))  # a call with no arguments takes an empty object
        self._args, self._route = None, "content"

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "body":
            self._send(self._held, out)
            self._close(out)
        # An unfinished header at the end is dropped: it says nothing yet.
        self._state, self._held = "header", ""
        return out


def forced_call_format(tools: list[tuple[str, Any]], named: str | None, parallel: bool) -> dict:
    """The xgrammar structural-tag format a forced call is written in: optionally an analysis
    message first (free reasoning), then one message to the named function (or, for
    tool_choice "required", to any tool), its arguments held to its schema. A harmony call ends
    the turn (`<|call|>` stops the model), so there is one call whatever parallel says."""
    calls = [
        {
            "type": "tag",
            "begin": f"{CHANNEL}commentary to={FUNCTIONS}{name} <|constrain|>json{MESSAGE}",
            "content": {"type": "json_schema", "json_schema": schema},
            "end": CALL,
        }
        for name, schema in tools
        if named is None or name == named
    ]
    call = calls[0] if len(calls) == 1 else {"type": "or", "elements": calls}
    analysis = {
        "type": "tag",
        "begin": f"{CHANNEL}analysis{MESSAGE}",
        "content": {"type": "any_text"},
        "end": f"{END}{START}assistant",
    }
    return {"type": "sequence", "elements": [{"type": "optional", "content": analysis}, call]}
