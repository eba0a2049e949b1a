"""An embedding's share of a step in the model runner: which token rows a step's EmbedSpans
cover, and the float32 sum of each span's final hidden states (relay.scheduling.pooling says
which positions and reduces the sums to the embedding)."""

from __future__ import annotations

import numpy as np
import torch

from relay.step import BatchInput, EmbedChunk, EmbedSpan


def span_rows(batch: BatchInput) -> list[int]:
    """The token row, in the step's input, of every span's positions, span after span."""
    starts = np.cumsum([0] + list(batch.extend_lens)).tolist()
    return [
        starts[span.row] + span.first + k for span in batch.embed_spans for k in range(span.count)
    ]


def sums(hidden: torch.Tensor, spans: list[EmbedSpan]) -> list[EmbedChunk]:
    """The spans' chunks from the hidden states of their rows (span_rows' order), summed in
    float32; one device -> host copy for the step."""
    parts = torch.split(hidden.float(), [span.count for span in spans])
    totals = torch.stack([part.sum(dim=0) for part in parts]).cpu().numpy().astype("<f4")
    return [EmbedChunk(span.row, total.tobytes()) for span, total in zip(spans, totals)]
