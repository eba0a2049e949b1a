"""The prompt's log-probabilities in the model runner: which token rows a step's
PromptLogprobSpans score, and their scores, the float32 log-softmax over the whole vocabulary
of each of those rows' logits (relay.scheduling.prompt_logprobs says which positions).

Only the target token's log-probability and rank and the top-n travel back; the logits are
made SLICE_ROWS rows at a time, so a long prompt never holds [prompt, vocabulary] floats.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from relay.step import BatchInput, PromptLogprobChunk, PromptLogprobSpan

# Rows of logits made at once: 256 x a 152k vocabulary x 4 bytes is 156 MB (twice, with the
# log-softmax), bounded however long the prompt.
SLICE_ROWS = 256


def span_rows(batch: BatchInput) -> list[int]:
    """The token row, in the step's input, of every span's positions, span after span."""
    starts = np.cumsum([0] + list(batch.extend_lens)).tolist()
    return [
        starts[span.row] + span.first + k
        for span in batch.prompt_logprob_spans
        for k in range(len(span.targets))
    ]


def score(
    hidden: torch.Tensor,
    compute_logits: Callable[[torch.Tensor], torch.Tensor],
    spans: list[PromptLogprobSpan],
) -> list[PromptLogprobChunk]:
    """The spans' chunks from the hidden states of their rows (span_rows' order). Every TP
    rank calls it alike: compute_logits gathers the vocabulary across ranks."""
    targets = torch.tensor(
        [t for span in spans for t in span.targets], dtype=torch.int64, device=hidden.device
    )
    top_n = max(span.top_n for span in spans)
    chosen, ranks, top_vals, top_ids = [], [], [], []
    for lo in range(0, hidden.shape[0], SLICE_ROWS):
        logprobs = torch.log_softmax(compute_logits(hidden[lo : lo + SLICE_ROWS]).float(), dim=-1)
        target = logprobs.gather(1, targets[lo : lo + SLICE_ROWS, None])
        chosen.append(target[:, 0])
        ranks.append((logprobs > target).sum(dim=1) + 1)
        if top_n:
            vals, ids = logprobs.topk(top_n, dim=-1)
            top_vals.append(vals)
            top_ids.append(ids)
    # One device -> host copy of each.
    chosen_l = torch.cat(chosen).tolist()
    ranks_l = torch.cat(ranks).tolist()
    vals_l = torch.cat(top_vals).tolist() if top_n else None
    ids_l = torch.cat(top_ids).tolist() if top_n else None
    chunks, at = [], 0
    for span in spans:
        end, n = at + len(span.targets), span.top_n
        chunks.append(
            PromptLogprobChunk(
                span.row,
                chosen_l[at:end],
                ranks_l[at:end],
                [row[:n] for row in ids_l[at:end]] if n else [],
                [row[:n] for row in vals_l[at:end]] if n else [],
            )
        )
        at = end
    return chunks
