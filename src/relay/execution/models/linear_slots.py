"""Where a checkpoint's linear layer goes in a model: the models fuse q/k/v and gate/up into one
GEMM each and split every GEMM over the tensor-parallel ranks, so a checkpoint weight [out, in]
lands as some of its rows and columns in some rows of one of this rank's modules. A Slot says
which; the float loader copies through it (LlamaForCausalLM._load_one) and the loader of 4-bit
checkpoints places unpacked quants and scales by the same rows and columns
(relay.execution.quantized_checkpoint), so the two cannot disagree.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

import torch
from torch import nn


@dataclass
class Slot:
    """Rows `rows` and columns `cols` of a checkpoint weight [out, in] go into rows offset ..
    offset + len(rows) of `module`'s weight (named `name` in the model)."""

    name: str
    module: nn.Module
    offset: int
    rows: slice
    cols: slice = field(default_factory=lambda: slice(None))

    def under(self, prefix: str) -> Slot:
        """The same slot with its module named from a parent (`layers.3.mlp.`)."""
        return replace(self, name=prefix + self.name)

    def load(self, w: torch.Tensor, kind: str = "weight") -> str:
        """Copy the checkpoint's weight (or bias: its rows alone, so a row-parallel layer's, whose
        rows are all taken, is whole on every rank and added once after the sum) in; the name of
        the parameter it went to."""
        part = w[self.rows] if kind == "bias" else w[self.rows, self.cols]
        getattr(self.module, kind)[self.offset : self.offset + part.shape[0]].copy_(part)
        return f"{self.name}.{kind}"
