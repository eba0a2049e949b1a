"""What a step's tokens cost against its budget, and how long a prompt chunk fits it."""

from __future__ import annotations

import math

from relay.scheduling.request import Req


class StepCost:
    def __init__(self, attention_break_even: int | None):
        # ModelConfig.attention_break_even: prompt chunks deep into a long prompt cost more
        # per token (attention over the prefix) and get fewer tokens of the step budget, so
        # a step's cost stays bounded however long the prompt. None: one token, one unit.
        self.attn_even = attention_break_even

    def chunk(self, req: Req, budget: int) -> int:
        """The most next tokens of req whose cost fits budget; at least one while any budget
        is left, so a prompt deep into a long context still advances."""
        left = req.seq_len - req.kv_len
        if budget <= 0:
            return 0
        n = budget if self.attn_even is None else int(budget / (1 + req.kv_len / self.attn_even))
        return max(1, min(left, n))

    def cost(self, req: Req, n: int) -> int:
        """Step budget units that computing req's next n tokens takes: one per token, plus
        their attention over the cached prefix in units of a token's dense work. Attention
        among the n tokens themselves is not priced: a fresh prompt of the budget's length
        runs in one step (vLLM's and SGLang's meaning of the chunk size), and deep into a
        long prompt the prefix term is what grows."""
        if self.attn_even is None or n <= 1:
            return n
        return math.ceil(n * (1 + req.kv_len / self.attn_even))
