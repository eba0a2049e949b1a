"""Where a LongRoPE model (Phi-3) switches a sequence to the long factors.

A sequence longer than `after` tokens rotates every token with the long factors, as
transformers' Phi-3 generate does; a request that grows past it is recomputed so
(DecodeManager.switch_to_long_rope). `after` None: any other rope, and every test is False."""

from __future__ import annotations

from dataclasses import dataclass

from relay.scheduling.request import Req


@dataclass(frozen=True)
class LongRopeBoundary:
    after: int | None  # ModelConfig.long_rope_after

    def crosses(self, req: Req) -> bool:
        """Whether req's next decode step takes its sequence past the boundary on the short factors."""
        return (
            self.after is not None
            and not req.long_rope
            and not req.in_prefill
            and req.kv_len >= self.after
        )

    def past(self, req: Req) -> bool:
        """Whether a request starting (or restarting) now computes its sequence on the long factors."""
        return self.after is not None and req.seq_len > self.after

    def verify_crosses(self, req: Req, k: int) -> bool:
        """Whether verifying k proposals would read logits at a sequence length past the
        boundary with the KV of the short factors (plain decoding switches there first)."""
        return self.after is not None and not req.long_rope and req.kv_len + k >= self.after
