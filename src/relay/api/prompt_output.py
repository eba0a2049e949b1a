"""The prompt in a response: /v1/completions' echo (the prompt's text, and its tokens first in
`logprobs`), vLLM's `prompt_logprobs`, SGLang's `input_token_logprobs`. Pure functions over a
record's relay.outputs.PromptLogprobs (the scheduler fills it in, the detokenizer its texts).

The first position's entries are null everywhere: nothing before it is scored.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from relay.outputs import PromptLogprobs

# JSON has no -Infinity; OpenAI documents -9999.0 as its stand-in for "very unlikely".
LOGPROB_FLOOR = -9999.0


def logprob(x: Any) -> float:
    return float(x) if isinstance(x, (int, float)) and math.isfinite(x) else LOGPROB_FLOOR


def _nullable(x: float | None) -> float | None:
    return None if x is None else logprob(x)


@dataclass
class PromptView:
    """What a completion request asked to see of its prompt."""

    echo_text: str | None = None  # echo: the prompt's text, before the output's
    echo_logprobs: int | None = None  # echo with logprobs N: the prompt's tokens first, top N
    prompt_logprobs: int | None = None  # vLLM's prompt_logprobs M: that list, top M


def _padded(lp: PromptLogprobs) -> PromptLogprobs:
    """lp with a null entry for each position a runner did not score (one without a model)."""
    missing = len(lp.token_ids) - len(lp.logprobs)
    if not missing:
        return lp
    pad = [None] * missing
    return dataclasses.replace(
        lp,
        logprobs=lp.logprobs + pad,
        ranks=lp.ranks + pad,
        top=lp.top + pad,
        top_texts=None if lp.top_texts is None else lp.top_texts + pad,
    )


def _top(lp: PromptLogprobs, k: int, n: int | None = None) -> list[tuple[int, str, float]]:
    """Position k's n likeliest (None: as many as were computed) as (id, text, logprob)."""
    top = lp.top[k]
    if top is None or n == 0:
        return []
    texts = (lp.top_texts or [None] * len(lp.top))[k] or [""] * len(top[0])
    return list(zip(top[0][:n], texts[:n], top[1][:n]))


def _texts(lp: PromptLogprobs) -> list[str]:
    return lp.texts if lp.texts is not None else [""] * len(lp.token_ids)


def legacy_top(
    top: list[tuple[int, str, float]], token: int, text: str, lp: float | None
) -> dict[str, float]:
    """A legacy completion's `top_logprobs` entry for a position whose token is (token, text,
    lp): its likeliest tokens `top`, then the token itself when it is not among them, as OpenAI
    and vLLM answer (up to logprobs + 1 entries). Keyed by text: of two tokens with one text,
    the likelier stays."""
    out: dict[str, float] = {}
    for _, t, x in top:
        out.setdefault(t, logprob(x))
    if all(token != t for t, _, _ in top):
        out.setdefault(text, logprob(lp))
    return out


def echo_logprobs(lp: PromptLogprobs | None, n: int) -> dict[str, list]:
    """The prompt's part of a legacy completion's `logprobs`: tokens, token_logprobs and
    top_logprobs (legacy_top's, the n likeliest; null where nothing was scored)."""
    if lp is None:
        return {"tokens": [], "token_logprobs": [], "top_logprobs": []}
    lp = _padded(lp)
    texts = _texts(lp)
    tops = [
        None if x is None else legacy_top(_top(lp, k, n), lp.token_ids[k], texts[k], x)
        for k, x in enumerate(lp.logprobs)
    ]
    return {
        "tokens": list(texts),
        "token_logprobs": [_nullable(x) for x in lp.logprobs],
        "top_logprobs": tops,
    }


def vllm_prompt_logprobs(lp: PromptLogprobs | None, m: int) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per position {token id: {logprob, rank, decoded_token}} of the
    prompt's token and the m likeliest; null at the first."""
    if lp is None:
        return None
    lp = _padded(lp)
    texts = _texts(lp)
    out: list[dict[str, Any] | None] = []
    for k, token in enumerate(lp.token_ids):
        if lp.logprobs[k] is None:
            out.append(None)
            continue
        entry = {
            str(token): {
                "logprob": logprob(lp.logprobs[k]),
                "rank": lp.ranks[k],
                "decoded_token": texts[k],
            }
        }
        for rank, (t, text, x) in enumerate(_top(lp, k, m), start=1):
            entry.setdefault(str(t), {"logprob": logprob(x), "rank": rank, "decoded_token": text})
        out.append(entry)
    return out


def sglang_input_logprobs(
    lp: PromptLogprobs | None,
) -> tuple[list[list[Any]], list[list[list[Any]] | None]]:
    """SGLang's input_token_logprobs ([logprob, token id, text] per position; the first
    [null, id, text]) and input_top_logprobs (per position such triples, null at the first)."""
    if lp is None:
        return [], []
    lp = _padded(lp)
    texts = _texts(lp)
    tokens = [[_nullable(x), t, s] for x, t, s in zip(lp.logprobs, lp.token_ids, texts)]
    tops = [
        None if k == 0 else [[logprob(x), t, s] for t, s, x in _top(lp, k)]
        for k in range(len(lp.token_ids))
    ]
    return tokens, tops
