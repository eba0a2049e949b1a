"""One msgpack codec for every message type. Never pickle: decoding only builds the
dataclasses listed here, so a peer cannot make us run code."""

from __future__ import annotations

import dataclasses
import operator
from typing import Any

import msgpack

from ipc import messages as m
from relay.config import EngineConfig
from relay.outputs import PromptLogprobs, RequestOutput
from relay.sampling_params import SamplingParams
from relay.step import (
    BatchInput,
    BatchOutput,
    EmbedChunk,
    EmbedSpan,
    PromptLogprobChunk,
    PromptLogprobSpan,
    SamplingSpec,
)
from relay.text.detokenizer import DetokenizeSpec
from relay.text.tokenize_query import TokenizeQuery

# The order fixes each type's ext code. Every process of a server runs the same code, so
# codes only have to agree within one version.
WIRE_TYPES: list[type] = [
    SamplingParams,
    SamplingSpec,
    BatchInput,
    BatchOutput,
    EngineConfig,
    RequestOutput,
    DetokenizeSpec,
    m.GenerateReq,
    m.TokenizedReq,
    m.OutputBatch,
    m.AbortRequest,
    m.StopGenerating,
    m.ControlCall,
    m.ControlReply,
    m.Ready,
    m.Heartbeat,
    m.NodeMsg,
    TokenizeQuery,
    m.TokenizeCall,
    PromptLogprobSpan,
    PromptLogprobChunk,
    PromptLogprobs,
    EmbedSpan,
    EmbedChunk,
]


def _values_getter(cls: type):
    """obj -> its field values as a tuple, in one C call (attrgetter of one name returns the value)."""
    names = [f.name for f in dataclasses.fields(cls)]
    get = operator.attrgetter(*names)
    return get if len(names) > 1 else lambda obj: (get(obj),)


_WIRE = {
    cls: (i + 1, _values_getter(cls)) for i, cls in enumerate(WIRE_TYPES)
}  # type -> (ext code, values)
# An OutputBatch (a record per request per step) travels as columns of its records' fields:
# one pack for the batch instead of one per record, ~4x cheaper at 64 requests.
_BATCH_CODE, _RECORD = _WIRE[m.OutputBatch][0], _WIRE[RequestOutput][1]


def _default(obj: Any) -> msgpack.ExtType:
    wire = _WIRE.get(type(obj))
    if wire is None:
        raise TypeError(f"{type(obj).__name__} is not a wire type")
    code, values = wire
    if code == _BATCH_CODE:
        if any(type(r) is not RequestOutput for r in obj.outputs):
            raise TypeError("an OutputBatch holds RequestOutput records only")
        columns = list(zip(*map(_RECORD, obj.outputs)))
        # default: a record's PromptLogprobs (only such a value calls it)
        return msgpack.ExtType(code, msgpack.packb(columns, default=_default, use_bin_type=True))
    return msgpack.ExtType(code, msgpack.packb(values(obj), default=_default, use_bin_type=True))


def _ext_hook(code: int, data: bytes) -> Any:
    if not 1 <= code <= len(WIRE_TYPES):
        raise ValueError(f"unknown wire type code {code}")
    values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    if code == _BATCH_CODE:
        return m.OutputBatch([RequestOutput(*row) for row in zip(*values)])
    return WIRE_TYPES[code - 1](*values)


def encode(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
