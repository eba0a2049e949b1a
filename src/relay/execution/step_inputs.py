"""A step's inputs on the device: the attention metadata (positions, KV slots, page tables) and
token ids of a BatchInput, and which token rows' logits the step needs."""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from relay.execution.attention.base import StepMeta
from relay.step import BatchInput


def prepare_step(
    batch: BatchInput,
    tables: list[list[int]],
    page_size: int,
    device: torch.device,
    model: torch.nn.Module,
) -> tuple[StepMeta, torch.Tensor]:
    """The step's metadata and input ids. Its positions are the rows of model's rotary tables:
    each token's position, plus the LongRoPE long-factor offset for the rows in batch.rope_long."""
    slots_of = _decode_slots if batch.is_decode else _extend_slots
    pos, slots = slots_of(batch, tables, page_size)
    pos = on_long_rope_rows(pos, batch, model)
    meta = StepMeta(
        batch.prefix_lens,
        batch.extend_lens,
        tables,
        positions=torch.from_numpy(pos).to(device),
        out_slots=torch.from_numpy(slots).to(device),
    )
    return meta, torch.tensor(batch.input_ids, dtype=torch.int64, device=device)


def _decode_slots(
    batch: BatchInput, tables: list[list[int]], ps: int
) -> tuple[np.ndarray, np.ndarray]:
    """Positions and KV slots of a pure decode step: one token per request, at its prefix's end."""
    pos = np.asarray(batch.prefix_lens, dtype=np.int64)
    last_pages = np.fromiter(
        (pt[p // ps] for pt, p in zip(tables, batch.prefix_lens)), dtype=np.int64, count=len(pos)
    )
    return pos, last_pages * ps + pos % ps


def _extend_slots(
    batch: BatchInput, tables: list[list[int]], ps: int
) -> tuple[np.ndarray, np.ndarray]:
    pos = np.concatenate(
        [np.arange(p, p + e) for p, e in zip(batch.prefix_lens, batch.extend_lens)]
    )
    slots = np.concatenate(
        [
            np.asarray(pt, dtype=np.int64)[np.arange(p, p + e) // ps] * ps
            + np.arange(p, p + e) % ps
            for pt, p, e in zip(tables, batch.prefix_lens, batch.extend_lens)
        ]
    )
    return pos, slots


def on_long_rope_rows(pos: np.ndarray, batch: BatchInput, model: torch.nn.Module) -> np.ndarray:
    """pos with the tokens of batch.rope_long's rows moved to the model's long-factor rows
    (RotaryEmbedding.long_rows; a model without them, such as a draft model on another rope,
    keeps the positions)."""
    offset = getattr(getattr(model, "rotary", None), "long_rows", 0)
    if not offset or not any(batch.rope_long):
        return pos
    per_token = np.repeat(np.asarray(batch.rope_long, dtype=np.int64), batch.extend_lens)
    return pos + offset * per_token


def last_rows(batch: BatchInput) -> list[int]:
    """The token row of each sampling request's last input token."""
    ends = np.cumsum(batch.extend_lens) - 1
    return [int(ends[i]) for i, s in enumerate(batch.sample) if s]


def with_proposals(batch: BatchInput, proposals: list[list[int]]) -> tuple[BatchInput, list[int]]:
    """The verify step: every row's proposals appended to its input tokens, and the token rows
    whose logits are needed (all of a speculating row's, the last of another sampling row)."""
    ids, lens, rows, at = [], [], [], 0
    for n, props, sample in zip(batch.extend_lens, proposals, batch.sample):
        ids += batch.input_ids[at : at + n] + props
        lens.append(n + len(props))
        at += n
        start = len(ids) - len(props) - 1
        if sample:
            rows += list(range(start, len(ids)))
    return dataclasses.replace(batch, input_ids=ids, extend_lens=lens), rows
