"""/generate with a batch, as SGLang takes it: `text` a list of strings or `input_ids` a list of
token-id lists, at most MAX_PROMPTS (as /v1/completions' prompt lists). Each prompt becomes its
own request (relay.api.batched_prompts); the answer is a JSON list of the one-prompt answers,
prompt i's choice j at i * n + j, and streamed, each event one of them so far with its `index`.

SGLang's rules (io_struct.GenerateReqInput.normalize_batch_and_arguments): `sampling_params`,
`rid`, `return_logprob`, `logprob_start_len` and `top_logprobs_num` are each one value for every
prompt or a list of one per prompt; every prompt's `n` is the same, and with n > 1 the logprob
fields are single values. A list of another length (SGLang fails it later, or not at all) is a
400 naming the field. A `rid` string names the batch: prompt i runs as `<rid>-<i>` (SGLang's
`<rid>_<i>`: the dash is what lets /abort_request with `rid` end them all, as for Relay's ids).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from relay.api.errors import bad, show
from relay.api.generate import (
    LOGPROB_FIELDS,
    PER_PROMPT,
    PromptFields,
    as_rid,
    input_key,
    parse_prompt,
    request_fields,
)
from relay.api.parsed_request import MAX_PROMPTS, ParsedRequest


@dataclass
class GenerateBatch:
    prompts: list[ParsedRequest]  # each prompt's request; with a list of rids, its rid
    rid: str | None  # the client's rid for the whole batch, if it gave one string
    own_rids: bool  # rid was a list: every prompt runs under its own, none names the batch
    stream: bool


def is_batch(body: dict[str, Any]) -> bool:
    """Whether a /generate body holds several prompts (SGLang tells by the type of `text`, or of
    `input_ids`' first item)."""
    text, ids = body.get("text"), body.get("input_ids")
    return isinstance(text, list) or (
        isinstance(ids, list) and bool(ids) and isinstance(ids[0], list)
    )


def parse_batch(body: dict[str, Any], **limits: Any) -> GenerateBatch:
    """POST /generate with a batch; every prompt is checked before any runs. limits: as for
    relay.api.generate.parse_prompt."""
    size = _size(body, input_key(body))
    for key in PER_PROMPT:
        value = body.get(key)
        if isinstance(value, list) and len(value) != size:
            raise bad(
                key,
                f"'{key}' holds {len(value)} items: give one per prompt ({size}), "
                "or one value for all",
            )
    prompts = [parse_prompt(PromptFields(body, i), **limits) for i in range(size)]
    _check_n(body, prompts)
    shared = request_fields(body)
    rids = _rids(body.get("rid"))
    prompts = [
        dataclasses.replace(p, rid=rids[i] if rids else None, priority=shared["priority"])
        for i, p in enumerate(prompts)
    ]
    rid = None if rids or body.get("rid") is None else as_rid(body["rid"], "rid")
    return GenerateBatch(prompts, rid, own_rids=rids is not None, stream=shared["stream"])


def _size(body: dict[str, Any], key: str) -> int:
    count = len(body[key]) if isinstance(body[key], list) else 0
    if not count:
        raise bad(key, f"'{key}' must hold at least one prompt")
    if count > MAX_PROMPTS:
        raise bad(key, f"'{key}' may hold at most {MAX_PROMPTS} prompts, got {count}")
    return count


def _check_n(body: dict[str, Any], prompts: list[ParsedRequest]) -> None:
    """SGLang's rules for n with a batch: one n for all (its answer is the prompts' choices,
    n each), and list-valued logprob fields only with n = 1."""
    n = prompts[0].n
    for i, p in enumerate(prompts):
        if p.n != n:
            raise bad(
                f"sampling_params[{i}].n",
                f"every prompt of a batch has the same n: sampling_params[0].n is {n}, "
                f"sampling_params[{i}].n is {p.n}",
            )
    listed = [key for key in LOGPROB_FIELDS if isinstance(body.get(key), list)]
    if n > 1 and listed:
        raise bad(listed[0], f"'{listed[0]}' may be a list only with n = 1, got n = {n}")


def _rids(value: Any) -> list[str] | None:
    """A list of rids: each prompt's, checked and distinct (SGLang's rule); else None."""
    if not isinstance(value, list):
        return None
    first: dict[str, int] = {}
    for i, rid in enumerate(value):
        as_rid(rid, f"rid[{i}]")
        if rid in first:
            raise bad(f"rid[{i}]", f"'rid[{i}]' repeats rid[{first[rid]}], {show(rid)}")
        first[rid] = i
    return value
