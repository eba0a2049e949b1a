"""Start-up measurements that choose a CPU runner's paths: up to which batch size a decode step
runs its layers in one C call (which GEMMs read the GGUF blocks is a fixed rule: block_rows.py)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

from relay.execution.layers import PathTiming, crossover, has_float_weight
from relay.step import BatchInput

logger = logging.getLogger(__name__)

# Batch sizes at which start-up times a decode step in one C call against the layers one by one
# (choose_decode_layers), the KV tokens per request there, and the margin the C call must win by.
DECODE_LAYERS_SIZES = (1, 4, 8, 16, 32, 64, 128)
DECODE_LAYERS_CONTEXT = 64
DECODE_LAYERS_MIN_GAIN = 0.98

# run_model(model, attn, batch, page_tables): one eager forward (ModelRunner.run_model)
RunModel = Callable[[torch.nn.Module, object, BatchInput, list[list[int]]], object]


def log_weight_blocks(model: torch.nn.Module, kept: int, rows: int) -> None:
    if rows:
        logger.info(
            "%d of %d GEMM weights are exact GGUF blocks: GEMMs of up to %d rows read those "
            "(--weight-block-rows)",
            kept,
            len(model.gemm_modules()),
            rows,
        )
    else:
        logger.info(
            "%d GEMM weights are exact GGUF blocks; %s GEMMs on the float weights are faster "
            "at every size here (a decode step in one C call may still read the blocks)",
            kept,
            str(model.dtype).removeprefix("torch."),
        )


def choose_decode_layers(
    model: torch.nn.Module, attn, run_model: RunModel, tp_size: int, page_size: int, num_pages: int
) -> None:
    """Time pure decode steps with the layers in one C call against the layers called one by
    one, at growing batch sizes (requests of DECODE_LAYERS_CONTEXT tokens on pages of the
    still empty pool), and run steps of up to the largest size the C call won at that way.
    Whole steps, not GEMMs: the call saves the interpreter between ~10 kernels per layer,
    which can pay for block GEMMs slower than the float ones. Nothing to time where its GEMMs
    past the blocks' rows are the layers' own (DecodeLayers.on_panels), or where the layers have
    no float weights (a GGUF file loaded as blocks alone): the call runs the same block kernels
    as the layers, without the interpreter between them."""
    fast = model.decode_layers
    if fast[1].on_panels:
        logger.info(
            "decode steps run their decoder layers in one C call at every batch size (past the "
            "blocks' rows on the layers' own bfloat16 panels)"
        )
        return
    layer_gemms = [m for m in model.gemm_modules() if m is not model.lm_head]
    if not any(has_float_weight(m) for m in layer_gemms):
        logger.info(
            "decode steps run their decoder layers in one C call at every batch size (the "
            "layers read the same blocks)"
        )
        return
    if (
        tp_size > 1
    ):  # timed steps are collectives, and each rank's timings could stop at another size
        logger.info(
            "decode steps of up to %d requests (the blocks' rows) run their decoder layers in one C "
            "call",
            fast[1].max_rows,
        )
        return
    per_request = -(-(DECODE_LAYERS_CONTEXT + 1) // page_size)

    def paths(size: int) -> PathTiming | None:
        if 1 + size * per_request > num_pages:
            return None
        tables = [list(range(1 + i * per_request, 1 + (i + 1) * per_request)) for i in range(size)]
        batch = BatchInput(
            -1,
            list(range(size)),
            [1] * size,
            [DECODE_LAYERS_CONTEXT] * size,
            [1] * size,
            [0] * size,
            [[]] * size,
            [True] * size,
            [1] * size,
        )

        def step(layers) -> Callable[[], None]:
            def run() -> None:
                model.decode_layers = layers
                run_model(model, attn, batch, tables)

            return run

        return PathTiming(step(fast), step(None))

    fast[1].max_rows = crossover(DECODE_LAYERS_SIZES, paths, DECODE_LAYERS_MIN_GAIN, reps=2)
    model.decode_layers = fast
    if fast[1].max_rows:
        logger.info(
            "decode steps of up to %d requests run their decoder layers in one C call (measured "
            "here)",
            fast[1].max_rows,
        )
