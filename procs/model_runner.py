"""relay::tp<rank>: one model-runner process per tensor-parallel rank.

Every rank receives every step from the scheduler and runs it; rank 0 (which samples)
sends the result back. `--load-format dummy-null` swaps in the null runner, which answers
without a model so benchmarks can measure the rest of the pipeline.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time

import zmq

from ipc.codec import decode
from ipc.messages import Ready
from ipc.nodes import NodePlan
from ipc.sockets import RUNNER_RESULT, endpoint, pull, push, runner_inbox, send
from procs.common import ProcArgs, announce_ready, child_main
from relay.config import ModelConfig
from relay.step import BatchOutput

logger = logging.getLogger(__name__)


def build_runner(args: ProcArgs, mc: ModelConfig):
    cfg = args.engine_config
    if cfg.load_format == "dummy-null":
        from relay.execution.null_runner import NullModelRunner

        return NullModelRunner(cfg, mc)
    import torch

    from relay.execution.distributed import TPGroup
    from relay.execution.model_runner import ModelRunner
    from relay.execution.placement import available_cores, pick_device

    nodes = NodePlan.from_dict(args.extra.get("nodes"))
    device = pick_device(cfg.device)
    if device.type == "cuda":  # one GPU per rank of this node
        device = torch.device(
            "cuda", args.index % nodes.ranks_per_node if nodes.multi else args.index
        )
    if (
        nodes.multi and cfg.num_threads is None
    ):  # this machine's cores are shared by its own ranks only
        cfg = dataclasses.replace(
            cfg, num_threads=max(1, available_cores() // nodes.ranks_per_node)
        )
    if (
        nodes.multi
    ):  # rank 0 hosts the rendezvous on node 0; the timeout bounds init and collectives
        tp = TPGroup.init(
            args.index, cfg.tp_size, nodes.dist_init_method, device, timeout=nodes.dist_timeout
        )
    else:
        tp = TPGroup.init(
            args.index, cfg.tp_size, f"file://{os.path.join(args.ipc_dir, 'tp_rendezvous')}", device
        )
    return ModelRunner(cfg, args.model_dir, mc, tp, device)


def main(args: ProcArgs) -> None:
    mc = ModelConfig.from_dir(args.model_dir)
    runner = build_runner(args, mc)
    ctx = zmq.Context()
    nodes = NodePlan.from_dict(args.extra.get("nodes"))
    inbox_ep = (
        nodes.inbox_endpoint(args.index)
        if nodes.is_remote(args.index)  # node 0's scheduler binds it
        else endpoint(args.ipc_dir, runner_inbox(args.index))
    )
    inbox = pull(ctx, inbox_ep, bind=False)
    leader = args.index == 0
    info = {
        "num_pages": runner.num_pages,
        "context_len": runner.context_len,
        "page_size": runner.page_size,
        "chunked_prefill_size": runner.cfg.chunked_prefill_size,
        "kv_window": runner.kv_window,
    }
    if leader:
        info["max_total_tokens"] = (runner.num_pages - 1) * runner.page_size
        results = push(ctx, endpoint(args.ipc_dir, RUNNER_RESULT))
        send(results, Ready("tp0", info=info))
    announce_ready(ctx, args.ipc_dir, Ready(args.name, info=info))
    backoff = getattr(
        runner, "thread_backoff", None
    )  # fewer threads while other work loads the cores
    while True:
        batch = decode(inbox.recv())
        start = time.perf_counter()
        try:
            out = runner.forward(batch)
        except Exception as e:
            if args.engine_config.tp_size > 1:
                raise  # the ranks' collectives are out of step now: let the launcher stop the server
            logger.exception("step %d failed", batch.step)
            out = BatchOutput(batch.step, [], error=f"model step failed: {type(e).__name__}: {e}")
        if leader:
            send(results, out)
        if backoff is not None:
            backoff.after_step(time.perf_counter() - start)


if __name__ == "__main__":
    child_main(main)
