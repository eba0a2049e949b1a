"""Prompt-lookup (n-gram) proposals: continue the sequence the way it went the last time
its final tokens appeared.

Each request keeps an index from every `min_window`-token n-gram to the positions where it
ends, fed incrementally as tokens arrive, so a proposal costs O(candidates x max_window)
however long the sequence is, and a sequence with no repeat costs one dict lookup.
"""

from __future__ import annotations

from collections import defaultdict

# Most recent occurrences kept per n-gram: with a one-token window a common token occurs
# thousands of times, and only recent ones are likely to continue the same way.
MAX_CANDIDATES = 8


class NgramIndex:
    def __init__(self, min_window: int, max_window: int):
        if not 1 <= min_window <= max_window:
            raise ValueError(
                f"n-gram windows must satisfy 1 <= min ({min_window}) <= max ({max_window})"
            )
        self.min_window = min_window
        self.max_window = max_window
        self.tokens: list[int] = []
        self._ends: defaultdict[tuple[int, ...], list[int]] = defaultdict(list)

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, tokens: list[int]) -> None:
        """Append tokens (the prompt first, then outputs as they are verified)."""
        w = self.min_window
        for t in tokens:
            self.tokens.append(t)
            end = len(self.tokens)
            if end > w:  # index the n-gram before the newest token: it has a continuation
                ends = self._ends[tuple(self.tokens[end - 1 - w : end - 1])]
                ends.append(end - 1)
                if len(ends) > MAX_CANDIDATES:
                    del ends[0]

    def propose(self, k: int) -> list[int]:
        """k tokens that followed the longest earlier match (ties: the most recent) of the
        sequence's last tokens; [] when not even min_window of them occurred before."""
        toks, w = self.tokens, self.min_window
        n = len(toks)
        if k <= 0 or n <= w:
            return []
        best_len, best_end = 0, -1
        for end in reversed(self._ends.get(tuple(toks[n - w :]), ())):
            length = w
            while (
                length < self.max_window
                and end - length > 0
                and toks[end - length - 1] == toks[n - length - 1]
            ):
                length += 1
            if length > best_len:
                best_len, best_end = length, end
                if length == self.max_window:
                    break
        if best_end < 0:
            return []
        # Copy on from the match; past the end, the copy reads its own proposals (a repeating
        # pattern, whose last occurrence runs into the end of the sequence, keeps repeating).
        out: list[int] = []
        for i in range(k):
            src = best_end + i
            out.append(toks[src] if src < n else out[src - n])
        return out
