"""Every message that crosses a process boundary. Plain dataclasses; `ipc.codec` packs them.

A request:   http -GenerateReq-> tokenizer -TokenizedReq-> scheduler
                                 tokenizer -DetokenizeSpec-> detokenizer
A step:      scheduler -BatchInput-> every runner rank; rank 0 -BatchOutput-> scheduler
Its outputs: scheduler -OutputBatch-> detokenizer -OutputBatch-> http (RequestOutput records)
Ending it:   http -AbortRequest-> scheduler (client gone);
             detokenizer -StopGenerating-> scheduler (a stop string ended its output)
Also:        tokenizer -OutputBatch-> http (a request refused before it ran), ControlCall and
             ControlReply between http and scheduler, TokenizeCall http -> tokenizer answered
             by a ControlReply (/tokenize, /detokenize), a Heartbeat around the pipeline, Ready;
             NodeMsg between the launchers of a multi-node server (launch/multinode.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from relay.outputs import RequestOutput
from relay.sampling_params import SamplingParams
from relay.text.tokenize_query import TokenizeQuery


@dataclass
class GenerateReq:
    """http -> tokenizer: one API request; `rids` holds one id per choice (OpenAI `n`), or per
    input of an embeddings request (`inputs`: a text or token ids each, in rids' order)."""

    rids: list[str]
    params: SamplingParams
    text: str | None = None
    input_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # chat: rendered with the tokenizer's template
    chat_kwargs: dict[str, Any] = field(default_factory=dict)
    priority: int = 0
    arrival_time: float = 0.0  # time.time() at the http server
    inputs: list[str | list[int]] | None = None


@dataclass
class TokenizedReq:
    """tokenizer -> scheduler."""

    rid: str
    input_ids: list[int]
    params: SamplingParams
    priority: int = 0
    arrival_time: float = 0.0


@dataclass
class OutputBatch:
    """What requests produced: scheduler -> detokenizer (tokens), detokenizer -> http (text
    too), tokenizer -> http (refusals)."""

    outputs: list[RequestOutput]


@dataclass
class AbortRequest:
    """http -> scheduler: end a request early (its client left, or /abort_request)."""

    rid: str
    sent_at: float = 0.0  # time.time() at http: an abort never drops a later request of the same id


@dataclass
class StopGenerating:
    """detokenizer -> scheduler: a stop string ended this request's output (its client was
    told); free it without a word back."""

    rid: str
    matched: str | None  # None: detokenizing it failed


@dataclass
class ControlCall:
    """http -> scheduler: `get_info` | `flush_cache`, answered by the ControlReply with the same id."""

    call_id: int
    kind: str


@dataclass
class TokenizeCall:
    """http -> tokenizer: /tokenize or /detokenize; answered by the ControlReply with the same id
    (data: {"tokens", "token_strs"?} or {"prompt"}; when not ok, {"message", "param", "status"})."""

    call_id: int
    query: TokenizeQuery


@dataclass
class ControlReply:
    call_id: int
    ok: bool
    data: dict[str, Any] = field(default_factory=dict)


@dataclass
class Ready:
    """child -> launcher: started and ready (with what the launcher needs to know), or failed."""

    name: str
    ok: bool = True
    info: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


@dataclass
class Heartbeat:
    """http -> tokenizer -> scheduler -> detokenizer -> http: every loop on the path is turning.
    The scheduler stamps step_age, how long its current model step has been running (0: none)."""

    seq: int
    step_age: float = 0.0


@dataclass
class NodeMsg:
    """Between node 0's launcher and another node's (`--nnodes`, over TCP): `hello` (started),
    `beat` (alive, both ways, every second), `ready` (its ranks are up; info per rank),
    `down` (it is stopping because of `detail`), `bye` (a clean shutdown)."""

    node: int  # the sender's --node-rank
    kind: str
    detail: str = ""
    info: dict[str, Any] = field(default_factory=dict)
