"""Two tensor-parallel CPU ranks in their own processes, joined as the server joins its ranks:
what the model tests run under --tp 2."""

from __future__ import annotations

import io
import multiprocessing as mp
import os
import traceback

import pytest
import torch

from relay.execution.distributed import ShmGroup, TPGroup


def run_ranks(fn, tmp_path, *args, timeout: float = 240, segment_at: str | None = None) -> list:
    """fn(rank, tp, *args) in two rank processes joined as the server joins its ranks (their
    shared memory segment at segment_at, if given); their results."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [
        ctx.Process(target=_rank_main, args=(fn, rank, str(tmp_path), args, results, segment_at))
        for rank in (0, 1)
    ]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=timeout) for _ in procs)
    for p in procs:
        p.join(30)
    for rank in (0, 1):
        if isinstance(got[rank], str):
            pytest.fail(f"rank {rank}:\n{got[rank]}")
    return [torch.load(io.BytesIO(got[rank])) for rank in (0, 1)]


def _rank_main(fn, rank: int, tmp: str, args: tuple, results, segment_at: str | None) -> None:
    try:
        torch.set_num_threads(1)
        ShmGroup.SLOT_BYTES = 256  # small slots: larger collectives go in pieces
        if segment_at is not None:
            import relay.execution.distributed

            relay.execution.distributed._shm_path = lambda init_method: segment_at
        tp = TPGroup.init(
            rank, 2, f"file://{os.path.join(tmp, 'tp_rendezvous')}", torch.device("cpu")
        )
        buf = (
            io.BytesIO()
        )  # bytes, not tensors: a tensor in a queue is a handle into its sender, gone at exit
        torch.save(fn(rank, tp, *args), buf)
        results.put((rank, buf.getvalue()))
    except Exception:
        results.put((rank, traceback.format_exc()))
