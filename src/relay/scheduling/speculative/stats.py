"""Counters of speculative verification, kept by the scheduler and shown by /metrics and
/get_server_info."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class SpecStats:
    num_draft_tokens: int  # the configured k: accepted counts run 0..k
    verify_rows: int = 0  # (request, step) pairs that verified proposals
    proposed_tokens: int = 0
    accepted_tokens: int = 0  # proposals the target agreed with (the bonus token not counted)
    accepted_hist: list[int] = field(default_factory=list)  # verify rows by accepted count

    def __post_init__(self) -> None:
        self.accepted_hist = self.accepted_hist or [0] * (self.num_draft_tokens + 1)

    def record(self, proposed: int, accepted: int) -> None:
        self.verify_rows += 1
        self.proposed_tokens += proposed
        self.accepted_tokens += accepted
        self.accepted_hist[min(accepted, self.num_draft_tokens)] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.accepted_tokens / max(1, self.proposed_tokens)

    @property
    def accept_length(self) -> float:
        """Tokens emitted per verify step on average (accepted proposals plus the target's own
        next token): SGLang's "accept length"."""
        return (self.accepted_tokens + self.verify_rows) / max(1, self.verify_rows)

    def to_dict(self) -> dict:
        return {
            "spec_verify_rows": self.verify_rows,
            "spec_proposed_tokens": self.proposed_tokens,
            "spec_accepted_tokens": self.accepted_tokens,
            "spec_accepted_hist": list(self.accepted_hist),
            "spec_acceptance_rate": self.acceptance_rate,
            "spec_accept_length": self.accept_length,
        }
