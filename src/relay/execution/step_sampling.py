"""Turning a step's logits into its BatchOutput on the leader: token masks applied, each row
sampled (or its proposals verified), and a row whose sampling raises failed alone."""

from __future__ import annotations

import logging

import numpy as np
import torch

from relay.execution.kernels import cpu as cpu_kernels
from relay.execution.kernels import cpu_ops
from relay.execution.sampler import Sampler, SampleResult
from relay.step import BatchInput, BatchOutput

logger = logging.getLogger(__name__)


def sample_step(
    sampler: Sampler,
    batch: BatchInput,
    run: BatchInput,
    row_errors: dict[int, str],
    logits: torch.Tensor | None,
    proposals: list[list[int]] | None,
    dists: list[torch.Tensor | None] | None,
) -> BatchOutput:
    """The output of batch, whose rows in row_errors were left out of run (the rows that ran):
    logits holds a row per sampling row of run (per position, for a row verifying proposals).
    Rows whose sampling fails are added to row_errors."""
    kept = [i for i in range(len(batch.sids)) if i not in row_errors]
    sampled = [kept[j] for j, s in enumerate(run.sample) if s]  # batch row of each sampling row
    res = SampleResult([])
    if logits is not None:
        picked = [i for i, s in enumerate(run.sample) if s]
        if run.token_masks:
            apply_token_masks(logits, *_mask_rows(run, picked, proposals))
        sids = [run.sids[i] for i in picked]
        lens = [run.output_lens[i] for i in picked]
        if proposals is None:
            res, failed = _sample(sampler, logits, sids, lens)
        else:
            res, failed = _sample_and_verify(
                sampler,
                logits,
                sids,
                lens,
                [proposals[i] for i in picked],
                [dists[i] for i in picked],
            )
        row_errors.update({sampled[j]: why for j, why in failed.items()})
    return _scatter(batch, row_errors, sampled, res)


def _mask_rows(
    batch: BatchInput, picked: list[int], proposals: list[list[int]] | None
) -> tuple[list[int], list[bytes]]:
    """The token masks of a step and the logits row each applies to: a plain row has one; a
    row verifying k proposals has k + 1, one per position (concatenated in token_masks)."""
    at = {row: j for j, row in enumerate(picked)}
    if proposals is None:
        return [at[i] for i in batch.token_masks], list(batch.token_masks.values())
    starts = np.cumsum([0] + [len(proposals[i]) + 1 for i in picked]).tolist()
    rows, masks = [], []
    for i, blob in batch.token_masks.items():
        n = len(proposals[i]) + 1
        size = len(blob) // n
        rows += [starts[at[i]] + r for r in range(n)]
        masks += [blob[r * size : (r + 1) * size] for r in range(n)]
    return rows, masks


def _sample_and_verify(
    sampler: Sampler,
    logits: torch.Tensor,
    sids: list[int],
    out_lens: list[int],
    proposals: list[list[int]],
    dists: list[torch.Tensor | None],
) -> tuple[SampleResult, dict[int, str]]:
    """Sample the rows without proposals and verify those with: logits holds one row per
    plain row and len(proposals) + 1 per speculating one, in order."""
    starts = np.cumsum([0] + [len(p) + 1 for p in proposals]).tolist()
    plain = [j for j, p in enumerate(proposals) if not p]
    spec = [j for j, p in enumerate(proposals) if p]
    tokens: list[list[int]] = [[-1] for _ in sids]
    failed: dict[int, str] = {}
    res = SampleResult([])
    if plain:
        res, bad = _sample(
            sampler,
            logits[[starts[j] for j in plain]],
            [sids[j] for j in plain],
            [out_lens[j] for j in plain],
        )
        failed.update({plain[j]: why for j, why in bad.items()})
        for j, tok in zip(plain, res.token_ids):
            tokens[j] = [tok]

    def verify(js: list[int]) -> None:
        rows = [r for j in js for r in range(starts[j], starts[j + 1])]
        out = sampler.verify(
            logits[rows],
            [sids[j] for j in js],
            [out_lens[j] for j in js],
            [proposals[j] for j in js],
            [dists[j] for j in js],
        )
        for j, emitted in zip(js, out):
            tokens[j] = emitted

    try:
        if spec:
            verify(spec)
    except Exception:
        logger.exception("verifying %d requests failed; retrying request by request", len(spec))
        for j in spec:
            try:
                verify([j])
            except Exception as e:
                failed[j] = f"verifying proposals failed for this request: {type(e).__name__}: {e}"
    return _merged(tokens, plain, res), failed


def _merged(tokens: list[list[int]], plain: list[int], res: SampleResult) -> SampleResult:
    """Each row's emitted tokens as one result, with the plain rows' log-probabilities."""
    merged = SampleResult([t[0] for t in tokens], spec_token_ids=[t[1:] for t in tokens])
    if res.logprobs is not None:
        at = {j: n for n, j in enumerate(plain)}
        merged.logprobs = [res.logprobs[at[j]] if j in at else None for j in range(len(tokens))]
        if res.top_logprobs is not None:
            merged.top_logprobs = [
                res.top_logprobs[at[j]] if j in at else None for j in range(len(tokens))
            ]
    return merged


def _sample(
    sampler: Sampler, logits: torch.Tensor, sids: list[int], out_lens: list[int]
) -> tuple[SampleResult, dict[int, str]]:
    """Sample every row; if the batch raises, sample row by row to find the culprits."""
    try:
        return sampler.sample(logits, sids, out_lens), {}
    except Exception:
        logger.exception("sampling a batch of %d failed; retrying request by request", len(sids))
    parts: list[SampleResult | None] = []
    failed: dict[int, str] = {}
    for i in range(len(sids)):
        try:
            parts.append(sampler.sample(logits[i : i + 1], sids[i : i + 1], out_lens[i : i + 1]))
        except Exception as e:
            failed[i] = f"sampling failed for this request: {type(e).__name__}: {e}"
            parts.append(None)
    return _concat_results(parts), failed


def _concat_results(parts: list[SampleResult | None]) -> SampleResult:
    """Row-by-row results as one; a failed row (None) gets token -1."""
    out = SampleResult([p.token_ids[0] if p else -1 for p in parts])
    if any(p is not None and p.logprobs is not None for p in parts):
        out.logprobs = [p.logprobs[0] if p and p.logprobs else None for p in parts]
    if any(p is not None and p.top_logprobs is not None for p in parts):
        out.top_logprobs = [p.top_logprobs[0] if p and p.top_logprobs else None for p in parts]
    return out


def _scatter(
    batch: BatchInput, row_errors: dict[int, str], sampled: list[int], res: SampleResult
) -> BatchOutput:
    """The output in the batch's own row order: one entry per sampling row, -1 where it failed."""
    if not row_errors:
        return BatchOutput(
            batch.step,
            res.token_ids,
            res.logprobs,
            res.top_logprobs,
            spec_token_ids=res.spec_token_ids,
        )
    at = {row: j for j, row in enumerate(sampled)}
    rows = [i for i, s in enumerate(batch.sample) if s]

    def pick(values: list, default):
        return [values[at[r]] if r in at and r not in row_errors else default for r in rows]

    return BatchOutput(
        batch.step,
        pick(res.token_ids, -1),
        None if res.logprobs is None else pick(res.logprobs, None),
        None if res.top_logprobs is None else pick(res.top_logprobs, None),
        row_errors=row_errors,
        spec_token_ids=None if res.spec_token_ids is None else pick(res.spec_token_ids, []),
    )


def apply_token_masks(logits: torch.Tensor, rows: list[int], masks: list[bytes]) -> None:
    """Set logits[rows[i], t] to -inf for every token t that masks[i] (xgrammar's bitmask:
    bit t % 32 of int32 word t // 32) disallows. Tokens past the mask's width are disallowed.
    (Its grammar matchers are relay.text.grammar's.)"""
    blob = bytearray(b"".join(masks))
    if (
        logits.device.type == "cpu"
        and logits.dtype == torch.float32
        and logits.stride(1) == 1
        and cpu_kernels.load() is not None
    ):
        words = torch.frombuffer(blob, dtype=torch.int32).view(len(rows), -1)
        cpu_ops.apply_bitmask(logits, torch.tensor(rows, dtype=torch.int64), words)
        return
    bits = np.unpackbits(
        np.frombuffer(blob, dtype=np.uint8).reshape(len(rows), -1), axis=1, bitorder="little"
    )
    allowed = torch.from_numpy(bits).to(logits.device).bool()
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    index = torch.tensor(rows, device=logits.device)
    logits[index] = logits[index].masked_fill(~allowed[:, :vocab], float("-inf"))
