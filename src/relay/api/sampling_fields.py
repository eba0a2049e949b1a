"""The sampling fields of a request body (ranges from relay.sampling_params.RANGES) and its
output constraint (json_schema, regex, ebnf, response_format), as SamplingParams arguments."""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from relay.api.errors import bad, show
from relay.api.typed_fields import as_bool, as_dict, as_token_ids, ranged
from relay.sampling_params import (
    LOGIT_BIAS_RANGE,
    MAX_LOGIT_BIAS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    RANGES,
    InvalidParam,
    Range,
    SamplingParams,
)


def _as_stop(value: Any, param: str) -> list[str]:
    stops = [value] if isinstance(value, str) else value
    if not isinstance(stops, list):
        raise bad(param, f"'{param}' must be a string or a list of strings, got {show(value)}")
    if len(stops) > MAX_STOP_STRINGS:
        raise bad(param, f"'{param}' allows at most {MAX_STOP_STRINGS} strings, got {len(stops)}")
    for s in stops:
        if not isinstance(s, str) or not s:
            raise bad(param, f"'{param}' must hold non-empty strings, got {show(s)}")
    return list(stops)


def _as_stop_ids(value: Any, param: str) -> list[int]:
    ids = as_token_ids(value, param, allow_empty=True)
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise bad(param, f"'{param}' allows at most {MAX_STOP_TOKEN_IDS} ids, got {len(ids)}")
    return list(ids)


_TOKEN_ID_KEY = re.compile(r"[0-9]{1,10}")


def _as_logit_bias(value: Any, param: str) -> dict[int, float]:
    """OpenAI's logit_bias: {"<token id>": bias}, JSON keys being strings; the ids' vocabulary
    check is SamplingParams.validate's (it knows the model)."""
    biases = as_dict(value, param)
    if len(biases) > MAX_LOGIT_BIAS:
        raise bad(param, f"'{param}' allows at most {MAX_LOGIT_BIAS} tokens, got {len(biases)}")
    rule, (lo, hi) = Range(*LOGIT_BIAS_RANGE), LOGIT_BIAS_RANGE
    out: dict[int, float] = {}
    for key, bias in biases.items():
        if not _TOKEN_ID_KEY.fullmatch(key):
            raise bad(
                param, f"'{param}' keys must be token ids (decimal integers >= 0), got {show(key)}"
            )
        if not rule.holds(bias):
            raise bad(
                param,
                f"'{param}' values must be numbers in [{lo:g}, {hi:g}]; token {key} has {show(bias)}",
            )
        out[int(key)] = float(bias)
    return out


# SamplingParams field -> converter(value, param) that type- and range-checks one value.
FIELD_RULES: dict[str, Callable[[Any, str], Any]] = {
    **{name: ranged(name) for name in RANGES},
    "stop": _as_stop,
    "stop_token_ids": _as_stop_ids,
    "ignore_eos": as_bool,
    "skip_special_tokens": as_bool,
    "include_stop_str_in_output": as_bool,
    "logit_bias": _as_logit_bias,
}


def sampling_kwargs(
    body: dict[str, Any],
    keys: dict[str, str],
    rules: dict[str, Callable[[Any, str], Any]],
    prefix: str = "",
) -> dict[str, Any]:
    """SamplingParams keyword arguments from the API keys present in body (key -> field)."""
    return {
        name: rules[name](body[key], prefix + key)
        for key, name in keys.items()
        if body.get(key) is not None
    }


def validated(
    params: SamplingParams,
    names: dict[str, str],
    vocab_size: int | None,
    max_constraint_bytes: int | None = None,
    max_constraint_depth: int | None = None,
    max_constraint_properties: int | None = None,
) -> SamplingParams:
    """Run SamplingParams.validate(), reporting failures under the API's field names."""
    try:
        return params.validate(
            vocab_size, max_constraint_bytes, max_constraint_depth, max_constraint_properties
        )
    except InvalidParam as e:
        # Rename only in the "<field> <rule>" head: the ", got <value>" tail may quote user text.
        head, sep, tail = str(e).partition(", got ")
        head = re.sub(r"\w+", lambda m: names.get(m.group(), m.group()), head)
        raise bad(names.get(e.field, e.field), head + sep + tail) from None


# ---- constrained decoding ------------------------------------------------------------------

# API key -> SamplingParams constraint: SGLang's names, and vLLM's guided_* ones.
CONSTRAINT_KEYS = {
    "json_schema": "json_schema",
    "regex": "regex",
    "ebnf": "ebnf",
    "guided_json": "json_schema",
    "guided_regex": "regex",
    "guided_grammar": "ebnf",
}
ANY_JSON_OBJECT = '{"type": "object"}'


def constraint(
    body: dict[str, Any], prefix: str = "", response_format: bool = False
) -> tuple[dict[str, str], dict[str, str]]:
    """The output constraint a body asks for, as (SamplingParams kwargs, {field: API key});
    at most one of the constraint keys and (OpenAI routes) a JSON response_format."""
    given: dict[str, tuple[str, str]] = {}
    for key, kind in CONSTRAINT_KEYS.items():
        value = body.get(key)
        if value is None:
            continue
        if kind == "json_schema" and isinstance(value, dict):
            value = json.dumps(value)
        if not isinstance(value, str) or not value:
            what = (
                "a JSON schema (an object or its JSON text)"
                if kind == "json_schema"
                else "a non-empty string"
            )
            raise bad(prefix + key, f"'{prefix + key}' must be {what}, got {show(value)}")
        given[prefix + key] = (kind, value)
    if response_format:
        given.update(_response_format(body.get("response_format")))
    if len(given) > 1:
        raise bad(list(given)[1], f"give at most one output constraint; got {', '.join(given)}")
    return {kind: text for kind, text in given.values()}, {
        kind: key for key, (kind, _) in given.items()
    }


def _response_format(value: Any) -> dict[str, tuple[str, str]]:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""
    if value is None:
        return {}
    rf = as_dict(value, "response_format")
    kind = rf.get("type")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"response_format": ("json_schema", ANY_JSON_OBJECT)}
    if kind != "json_schema":
        raise bad(
            "response_format.type",
            "'response_format.type' must be one of text, json_object, json_schema, "
            f"got {show(kind)}",
        )
    spec = as_dict(rf.get("json_schema"), "response_format.json_schema")
    schema = spec.get("schema")
    if schema is None:
        return {"response_format.json_schema": ("json_schema", ANY_JSON_OBJECT)}
    as_dict(schema, "response_format.json_schema.schema")
    if spec.get("strict") is not None:
        as_bool(spec["strict"], "response_format.json_schema.strict")  # always strict here
    return {"response_format.json_schema.schema": ("json_schema", json.dumps(schema))}
