"""Driving a ModelRunner step by step without a scheduler: token sequences with their own pages turned
into BatchInputs, and greedy decoding through runner.step_logits. scripts/gpu_check.py and the GPU tests
(tests/helpers/gpu_helpers.py) both use it, so it lives here, where scripts need not import tests."""

from __future__ import annotations

import torch

from relay.step import BatchInput


class Sequences:
    """Token sequences with their own pages, turned into BatchInputs step by step.

    Pages are handed out round-robin, one per sequence at a time, so page tables interleave
    (never consecutive when there are several sequences)."""

    def __init__(self, prompts: list[list[int]], page_size: int):
        self.ps = page_size
        self.tokens = [list(p) for p in prompts]
        self.cached = [0] * len(prompts)
        self.pages: list[list[int]] = [[] for _ in prompts]
        self.next_page = 1
        self.step = 0

    def pages_needed(self, extra_tokens: int) -> int:
        return 1 + sum(-(-(len(t) + extra_tokens) // self.ps) for t in self.tokens)

    def _grow(self) -> None:
        while True:
            short = [i for i, t in enumerate(self.tokens) if len(self.pages[i]) * self.ps < len(t)]
            if not short:
                return
            for i in short:
                self.pages[i].append(self.next_page)
                self.next_page += 1

    def batch(self, which: list[int] | None = None) -> BatchInput:
        """A step running every uncached token of the chosen sequences (decode where that is 1)."""
        which = list(range(len(self.tokens))) if which is None else which
        self._grow()
        ids, prefix, ext = [], [], []
        for i in which:
            new = self.tokens[i][self.cached[i] :]
            ids += new
            prefix.append(self.cached[i])
            ext.append(len(new))
        self.step += 1
        return BatchInput(
            step=self.step,
            sids=list(which),
            input_ids=ids,
            prefix_lens=prefix,
            extend_lens=ext,
            page_starts=[0] * len(which),
            new_pages=[list(self.pages[i]) for i in which],
            sample=[True] * len(which),
            output_lens=[0] * len(which),
        )

    def done(self, batch: BatchInput) -> None:
        for i, n in zip(batch.sids, batch.extend_lens):
            self.cached[i] += n

    def append(self, tokens: list[int], which: list[int] | None = None) -> None:
        for i, t in zip(range(len(self.tokens)) if which is None else which, tokens):
            self.tokens[i].append(int(t))


def run_greedy(
    runner, prompts: list[list[int]], steps: int, forced: list[list[int]] | None = None
) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill all prompts in one step, then `steps` decode steps of the whole batch through
    runner.step_logits (CUDA graphs where the runner has them). Feeds each step's argmax, or
    forced[i][step] when given (teacher forcing). Returns (argmax tokens per prompt, float32
    logits per step on the CPU)."""
    seqs = Sequences(prompts, runner.page_size)
    chosen: list[list[int]] = [[] for _ in prompts]
    logits_per_step = []
    for step in range(steps + 1):
        batch = seqs.batch()
        logits = runner.step_logits(batch, batch.new_pages)
        seqs.done(batch)
        top = logits.argmax(-1).tolist()
        logits_per_step.append(logits.float().cpu().clone())  # graph outputs are reused
        for i, t in enumerate(top):
            chosen[i].append(t)
        if step < steps:
            seqs.append(
                [forced[i][step] for i in range(len(prompts))] if forced is not None else top
            )
    return chosen, logits_per_step
