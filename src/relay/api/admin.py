"""Operating a server: health, server and model info, load, cache flush, Prometheus metrics.

A router in front of replicas (sglang-router, `launch.serve --dp`) uses these: `/health` to
take a replica out of rotation, `/server_info` and `/model_info` (SGLang's current names; the
`get_` ones are the older names) for the served model's name when it registers a replica, and
`/get_load` for its load-aware policies.
"""

from __future__ import annotations

import asyncio

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from relay.api.docs import ERROR_RESPONSES, METRICS_RESPONSE
from relay.api.errors import ProtocolError
from relay.api.parsed_request import ParsedRequest
from relay.api.serving import EngineClient, collect, error_response
from relay.sampling_params import SamplingParams

HEALTH_GENERATE_TIMEOUT = 60.0


def add_routes(app: FastAPI, client: EngineClient) -> None:
    @app.get("/health", responses=ERROR_RESPONSES)
    async def health():
        """200 while every process's loop is turning (a heartbeat makes it through the
        pipeline in time); 503 with the reason otherwise."""
        problem = client.health_problem()
        if problem:
            return JSONResponse({"status": "unhealthy", "reason": problem}, status_code=503)
        return {"status": "ok"}

    @app.get("/health_generate", responses=ERROR_RESPONSES)
    async def health_generate(request: Request):
        """Healthy only if a one-token generation makes it through every process."""
        try:
            api = client.submit(
                ParsedRequest(SamplingParams(max_new_tokens=1, temperature=0.0), input_ids=[0]),
                "health",
            )
        except ProtocolError as e:
            return JSONResponse({"status": "unhealthy", "reason": e.message}, status_code=503)
        try:
            pieces = await asyncio.wait_for(collect(client, api, request), HEALTH_GENERATE_TIMEOUT)
        except asyncio.TimeoutError:
            client.release(api, abort=True, reason="health_check_timeout")
            return JSONResponse(
                {"status": "unhealthy", "reason": f"no token within {HEALTH_GENERATE_TIMEOUT:g} s"},
                status_code=503,
            )
        if pieces is None or any(r.error for _, r in pieces):
            return JSONResponse({"status": "unhealthy"}, status_code=503)
        return {"status": "ok"}

    @app.get("/get_server_info", responses=ERROR_RESPONSES)
    @app.get("/server_info", responses=ERROR_RESPONSES)
    async def get_server_info():
        """The server's configuration, the scheduler's counters and the requests in flight."""
        try:
            out = await client.control("get_info")
        except ProtocolError as e:
            return error_response(e)
        return {
            **client.server_info,
            "scheduler": out.data,
            "num_http_requests": client.num_requests,
        }

    @app.get("/get_model_info", responses=ERROR_RESPONSES)
    @app.get("/model_info", responses=ERROR_RESPONSES)
    async def get_model_info():
        """The served model (SGLang's shape): a router names the replica's model from it."""
        info = client.server_info
        return {
            "model_path": info.get("model_dir") or info.get("model_path"),
            "tokenizer_path": info.get("tokenizer_path") or info.get("model_dir"),
            "served_model_name": client.served_model,
            "is_generation": not info.get("is_embedding"),
            "context_len": client.context_len,
            "vocab_size": client.vocab_size,
            "replica": info.get("replica"),
        }

    @app.get("/get_load", responses=ERROR_RESPONSES)
    async def get_load():
        """SGLang's load report, one entry per data-parallel rank (a replica has one):
        requests running and waiting in the scheduler, and the KV tokens they hold."""
        try:
            out = await client.control("get_info", timeout=2.0)
        except ProtocolError as e:
            return error_response(e)
        d = out.data
        return [
            {
                "dp_rank": 0,
                "num_reqs": d["num_running"] + d["num_waiting"],
                "num_waiting_reqs": d["num_waiting"],
                "num_tokens": d["kv_locked_tokens"],
                "num_http_requests": client.num_requests,
            }
        ]

    @app.post("/flush_cache", responses=ERROR_RESPONSES)
    async def flush_cache():
        try:
            out = await client.control("flush_cache")
        except ProtocolError as e:
            return error_response(e)
        if not out.ok:
            return JSONResponse({"success": False, **out.data}, status_code=400)
        return {"success": True}

    @app.get("/metrics", response_class=Response, responses=METRICS_RESPONSE)
    async def metrics():
        try:
            out = await client.control("get_info", timeout=2.0)
            client.metrics.set_scheduler_stats(out.data)
        except ProtocolError:
            pass  # serve the histograms anyway
        body, content_type = client.metrics.render()
        return Response(body, media_type=content_type)
