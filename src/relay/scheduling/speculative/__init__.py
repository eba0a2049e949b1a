"""Speculative decoding: proposers (n-gram lookup, a draft model) and their bookkeeping.

The scheduler proposes n-gram drafts itself (it holds every request's tokens); a draft
model runs inside the model runner (relay.execution.draft_model). Either way the runner verifies the proposals in one
forward pass of the target model, and the sampler decides which to keep (exact greedy
agreement, or rejection sampling that preserves the target's distribution).
"""

from relay.scheduling.speculative.ngram import NgramIndex
from relay.scheduling.speculative.stats import SpecStats

ALGORITHMS = ("ngram", "standalone")

__all__ = ["ALGORITHMS", "NgramIndex", "SpecStats"]
