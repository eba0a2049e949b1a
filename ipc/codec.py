"""One msgpack codec for every message type. Never pickle: decoding only builds the
dataclasses listed here, so a peer cannot make us run code."""
from __future__ import annotations

import dataclasses
from typing import Any

import msgpack

from ipc import messages as m
from relay.batch import BatchInput, BatchOutput, SamplingSpec
from relay.config import EngineConfig
from relay.sampling_params import SamplingParams

# The order fixes each type's ext code; append only, so a rolling restart never mixes codes.
WIRE_TYPES: list[type] = [
    SamplingParams, SamplingSpec, BatchInput, BatchOutput, EngineConfig,
    m.GenerateReq, m.TokenizedReq, m.AbortReq, m.DetokInit, m.BatchTokenOut, m.BatchStrOut,
    m.ErrorOut, m.ControlReq, m.ControlOut, m.Ready, m.Heartbeat,
]
_CODE = {cls: i + 1 for i, cls in enumerate(WIRE_TYPES)}
_FIELDS = {cls: tuple(f.name for f in dataclasses.fields(cls)) for cls in WIRE_TYPES}


def _default(obj: Any) -> msgpack.ExtType:
    code = _CODE.get(type(obj))
    if code is None:
        raise TypeError(f"{type(obj).__name__} is not a wire type")
    values = [getattr(obj, name) for name in _FIELDS[type(obj)]]
    return msgpack.ExtType(code, msgpack.packb(values, default=_default, use_bin_type=True))


def _ext_hook(code: int, data: bytes) -> Any:
    if not 1 <= code <= len(WIRE_TYPES):
        raise ValueError(f"unknown wire type code {code}")
    values = msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
    return WIRE_TYPES[code - 1](*values)


def encode(obj: Any) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes) -> Any:
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
