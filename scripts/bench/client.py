"""The one HTTP client of every subcommand: streamed requests (OpenAI /v1/completions or Relay's native
/generate) timed per chunk, a load run over a dataset (a concurrency cap or Poisson arrivals, warm-up, the
server's own counters before and after), and the small calls around it (readiness, model name, server info,
one timed request).

Timing follows SGLang's bench_serving: TTFT is request sent -> first chunk carrying output; a chunk carrying
k tokens counts as k inter-token gaps of gap/k, k from the server's cumulative token count (native backend)
or from re-tokenizing the streamed text.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from scripts.bench.metrics import (
    calculate_metrics,
    copied_share,
    parse_goodput,
    per_request,
    spec_delta,
)
from scripts.bench.workloads import DatasetRow, candidate_ids, encode, random_text

BACKENDS = ("relay-openai", "relay-native", "openai")
DEFAULT_BASE_URL = "http://127.0.0.1:30000"


@dataclass
class RequestOutput:
    success: bool = False
    error: str = ""
    generated_text: str = ""
    prompt_len: int = 0
    output_len: int = 0  # the server's count (usage) if reported, else filled in from re-tokenizing
    server_output_len: int | None = None
    server_prompt_len: int | None = None  # usage.prompt_tokens / meta_info.prompt_tokens
    server_cached_tokens: int | None = None
    ttft: float = 0.0
    latency: float = 0.0
    start: float = 0.0  # perf_counter at send
    # One entry per chunk that carried output: arrival time (perf_counter), text delta, and the number of
    # tokens it carried when the server says so (native backend) else None.
    chunk_times: list[float] = field(default_factory=list)
    chunk_texts: list[str] = field(default_factory=list)
    chunk_tokens: list[int | None] = field(default_factory=list)
    chunk_k: list[int] = field(default_factory=list)  # tokens per chunk, resolved by finish_outputs
    itl: list[float] = field(default_factory=list)


def _sse_events(buffer: bytearray, data: bytes) -> list[str]:
    """Append raw bytes; pop and return the payloads of every complete `data:` / `error:` line."""
    buffer += data
    out = []
    while True:
        nl = buffer.find(b"\n")
        if nl < 0:
            return out
        line = bytes(buffer[:nl]).strip()
        del buffer[: nl + 1]
        if line.startswith(b"data:"):
            out.append(line[5:].strip().decode("utf-8"))
        elif line.startswith(b"error:"):
            out.append(json.dumps({"error": line[6:].strip().decode("utf-8", "replace")}))


def _request_body(
    backend: str, model: str | None, row: DatasetRow, ignore_eos: bool, extra: dict[str, Any]
) -> tuple[str, dict[str, Any]]:
    if backend == "relay-native":
        sp = {"max_new_tokens": row.output_len, "temperature": 0.0}
        if ignore_eos:
            sp["ignore_eos"] = True
        return "/generate", {"text": row.prompt, "sampling_params": sp, "stream": True, **extra}
    body: dict[str, Any] = {
        "prompt": row.prompt,
        "max_tokens": row.output_len,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if model:
        body["model"] = model
    if ignore_eos:
        body["ignore_eos"] = True
    if backend == "openai":
        # llama.cpp's llama-server reads n_predict (max_tokens is an alias of it there) and ignore_eos, and
        # sends usage in its final /v1/completions chunk; other OpenAI-style servers ignore unknown fields.
        body["n_predict"] = row.output_len
    body.update(extra)
    return "/v1/completions", body


async def send_request(
    session,
    base_url: str,
    backend: str,
    model: str | None,
    row: DatasetRow,
    ignore_eos: bool,
    extra: dict[str, Any],
    pbar=None,
) -> RequestOutput:
    path, body = _request_body(backend, model, row, ignore_eos, extra)
    out = RequestOutput(prompt_len=row.prompt_len)
    prev_text = ""  # native: the cumulative text so far
    prev_tokens = 0  # native: the cumulative token count so far
    buffer = bytearray()
    out.start = st = time.perf_counter()
    try:
        async with session.post(base_url + path, json=body) as resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return out
            done = False
            async for data in resp.content.iter_any():
                now = time.perf_counter()
                for payload in _sse_events(buffer, data):
                    if payload == "[DONE]":
                        done = True
                        break
                    chunk = json.loads(payload)
                    if chunk.get("error"):
                        err = chunk["error"]
                        out.error = (
                            err.get("message", str(err)) if isinstance(err, dict) else str(err)
                        )
                        return out
                    if backend == "relay-native":
                        text = chunk.get("text", "")
                        meta = chunk.get("meta_info") or {}
                        n_tok = meta.get("completion_tokens")
                        if n_tok is None:
                            n_tok = len(chunk.get("output_ids") or [])
                        delta, k = text[len(prev_text) :], n_tok - prev_tokens
                        if k > 0 or delta:
                            out.chunk_times.append(now)
                            out.chunk_texts.append(delta)
                            out.chunk_tokens.append(max(k, 0))
                        prev_text, prev_tokens = text, max(prev_tokens, n_tok)
                        out.server_output_len = prev_tokens
                        if meta.get("prompt_tokens") is not None:
                            out.server_prompt_len = meta["prompt_tokens"]
                        if meta.get("cached_tokens") is not None:
                            out.server_cached_tokens = meta["cached_tokens"]
                    else:
                        choices = chunk.get("choices") or []
                        if choices:
                            c = choices[0]
                            text = c.get("text") or ""
                            toks = (
                                c.get("tokens")
                                if isinstance(c.get("tokens"), list)
                                else chunk.get("tokens")
                            )
                            k = len(toks) if isinstance(toks, list) else None
                            if text or (k or 0) > 0:
                                out.chunk_times.append(now)
                                out.chunk_texts.append(text)
                                out.chunk_tokens.append(k)
                        usage = chunk.get("usage")
                        if usage and usage.get("completion_tokens") is not None:
                            out.server_output_len = int(usage["completion_tokens"])
                            if usage.get("prompt_tokens") is not None:
                                out.server_prompt_len = int(usage["prompt_tokens"])
                            details = usage.get("prompt_tokens_details") or {}
                            if details.get("cached_tokens") is not None:
                                out.server_cached_tokens = details["cached_tokens"]
                if done:
                    break
        end = time.perf_counter()
        if not out.chunk_times:
            out.error = "the stream ended without output"
            return out
        out.latency = end - st
        out.ttft = out.chunk_times[0] - st
        out.generated_text = "".join(out.chunk_texts)
        out.success = True
    except Exception as e:  # noqa: BLE001 - a failed request is reported, not fatal
        out.error = f"{type(e).__name__}: {e}"
    finally:
        if pbar is not None:
            pbar.update(1)
    return out


def _tokens_per_chunk(tokenizer, texts: list[str]) -> list[int]:
    """Estimate how many tokens each streamed text delta carried, by re-tokenizing the whole text once and
    counting the tokens that end inside each delta's character span (at least 1 per chunk)."""
    full = "".join(texts)
    try:
        enc = tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ends = sorted(e for _, e in enc["offset_mapping"])
    except Exception:  # noqa: BLE001 - a slow tokenizer has no offsets
        return [max(1, len(encode(tokenizer, t))) for t in texts]
    counts, pos, j = [], 0, 0
    for t in texts:
        pos += len(t)
        k = 0
        while j < len(ends) and ends[j] <= pos:
            j += 1
            k += 1
        counts.append(max(1, k))
    return counts


def finish_outputs(outputs: list[RequestOutput], tokenizer) -> None:
    """After the run (outside the timed part): output counts and the per-token ITL lists."""
    for o in outputs:
        if not o.success:
            continue
        retok = len(encode(tokenizer, o.generated_text))
        o.output_len = o.server_output_len if o.server_output_len is not None else retok
        ks = o.chunk_tokens
        if any(k is None for k in ks):
            ks = _tokens_per_chunk(tokenizer, o.chunk_texts)
        o.chunk_k = list(ks)
        o.itl = []
        for i in range(1, len(o.chunk_times)):
            gap, k = o.chunk_times[i] - o.chunk_times[i - 1], ks[i]
            if k > 0:
                o.itl.extend([gap / k] * k)


async def _get_json(session, url: str) -> Any:
    try:
        async with session.get(url) as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None)
    except Exception:  # noqa: BLE001 - not every server has every endpoint
        return None


async def relay_counters(session, base_url: str) -> dict[str, Any] | None:
    info = await _get_json(session, base_url + "/get_server_info")
    if isinstance(info, dict) and isinstance(info.get("scheduler"), dict):
        return info["scheduler"]
    return None


async def resolve_model(session, base_url: str) -> str | None:
    models = await _get_json(session, base_url + "/v1/models")
    try:
        return models["data"][0]["id"]
    except (TypeError, KeyError, IndexError):
        return None


async def wait_ready(base_url: str, timeout: float = 600.0, proc=None, poll: float = 1.0) -> None:
    """Poll /health (then /v1/models) every `poll` seconds until the server answers 200."""
    import aiohttp

    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with code {proc.returncode} before it was ready"
                )
            for path in ("/health", "/v1/models"):
                try:
                    async with s.get(base_url + path) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    continue  # not listening yet
            await asyncio.sleep(poll)
    raise TimeoutError(f"{base_url} was not ready within {timeout:.0f} s")


async def _arrivals(rows: list[DatasetRow], rate: float, rng: np.random.Generator):
    for i, row in enumerate(rows):
        yield i, row
        if math.isinf(rate) or i == len(rows) - 1:
            continue
        await asyncio.sleep(float(rng.exponential(1.0 / rate)))


async def benchmark(
    args, rows: list[DatasetRow], tokenizer, model: str | None, max_concurrency: int | None
) -> dict[str, Any]:
    import aiohttp
    from tqdm import tqdm

    timeout = aiohttp.ClientTimeout(total=args.request_timeout)
    # One connection per request, as SGLang's client (a session per request) does: reusing keep-alive
    # connections raced llama-server closing them ("Server disconnected" on the next request).
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    extra = json.loads(args.extra_request_body) if args.extra_request_body else {}
    async with aiohttp.ClientSession(timeout=timeout, connector=connector) as session:
        if args.flush_cache:
            try:
                async with session.post(args.base_url + "/flush_cache") as r:
                    await r.read()
            except aiohttp.ClientError as e:  # servers without /flush_cache answer 404, not this
                print(f"POST /flush_cache failed: {e}", flush=True)
        if args.warmup_requests > 0:
            # Warm-up prompts are their own random texts: they must not seed the prefix cache with the
            # benchmark's prompts.
            wrng = np.random.default_rng(args.seed + 10_000)
            cands = candidate_ids(tokenizer)
            warm = [
                DatasetRow(*random_text(tokenizer, wrng, 32, cands), 8)
                for _ in range(args.warmup_requests)
            ]
            wouts = await asyncio.gather(
                *(
                    send_request(session, args.base_url, args.backend, model, r, True, extra)
                    for r in warm
                )
            )
            bad = [o.error for o in wouts if not o.success]
            if len(bad) == len(wouts):
                raise RuntimeError(f"every warm-up request failed; first error: {bad[0]}")
        before = await relay_counters(session, args.base_url)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        pbar = (
            None
            if args.disable_tqdm
            else tqdm(total=len(rows), desc=f"c={max_concurrency or 'inf'}", leave=False)
        )

        async def one(row: DatasetRow) -> RequestOutput:
            if sem is None:
                return await send_request(
                    session, args.base_url, args.backend, model, row, args.ignore_eos, extra, pbar
                )
            async with sem:
                return await send_request(
                    session, args.base_url, args.backend, model, row, args.ignore_eos, extra, pbar
                )

        rng = np.random.default_rng(args.seed + 1)
        start = time.perf_counter()
        tasks = []
        async for _, row in _arrivals(rows, args.request_rate, rng):
            tasks.append(asyncio.create_task(one(row)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if pbar is not None:
            pbar.close()
        after = await relay_counters(session, args.base_url)

    finish_outputs(outputs, tokenizer)
    m = calculate_metrics(rows, outputs, duration, tokenizer, parse_goodput(args.goodput))
    m["itl_k_source"] = (
        "server" if all(k is not None for o in outputs for k in o.chunk_tokens) else "retokenized"
    )
    if args.per_request:
        m["requests"] = per_request(rows, outputs, start)
    if any(
        row.passage for row in rows
    ):  # copy: how much of the output an n-gram drafter could find
        m["copied_output_share"] = copied_share(tokenizer, rows, outputs)
    m["cache_hit_rate"] = None
    if before is not None and after is not None:
        dp = after.get("prompt_tokens_total", 0) - before.get("prompt_tokens_total", 0)
        dc = after.get("cached_prompt_tokens_total", 0) - before.get(
            "cached_prompt_tokens_total", 0
        )
        m["server_prompt_tokens"] = dp
        m["server_cached_prompt_tokens"] = dc
        m["cache_hit_rate"] = dc / dp if dp > 0 else 0.0
        if before.get("spec") and after.get("spec"):
            m.update(spec_delta(before["spec"], after["spec"]))
    # What the responses' usage says (any server that reports prompt_tokens_details.cached_tokens, llama.cpp
    # included): cached prompt tokens / prompt tokens, and the server's own prompt token count.
    reported = [
        o
        for o in outputs
        if o.success and o.server_cached_tokens is not None and o.server_prompt_len
    ]
    if reported:
        m["usage_prompt_tokens"] = int(sum(o.server_prompt_len for o in reported))
        m["usage_cached_tokens"] = int(sum(o.server_cached_tokens for o in reported))
        m["usage_cache_hit_rate"] = m["usage_cached_tokens"] / max(1, m["usage_prompt_tokens"])
    errors = [o.error for o in outputs if not o.success]
    if errors:
        m["first_error"] = errors[0]
    return m


# One request at a time, synchronously (httpx): what the latency probes (busy-host, hardening, structured's
# first-seen schema) and the small calls around a load run need.


def server_info(base_url: str) -> dict[str, Any]:
    import httpx

    return httpx.get(base_url + "/get_server_info", timeout=60).json()


def timed_post(
    client, body: dict[str, Any], path: str = "/v1/completions"
) -> tuple[int | str, float]:
    """One request's HTTP status (or the transport error's name) and its latency in seconds."""
    import httpx

    t0 = time.monotonic()
    try:
        r = client.post(path, json=body)
        return r.status_code, time.monotonic() - t0
    except httpx.HTTPError as e:
        return type(e).__name__, time.monotonic() - t0


def stream_times(
    client, body: dict[str, Any], path: str = "/v1/completions"
) -> tuple[float, list[float], float]:
    """One streamed completion: when it was sent, when each chunk carrying text arrived, when it ended
    (time.monotonic)."""
    sent, arrivals = time.monotonic(), []
    with client.stream("POST", path, json={**body, "stream": True}) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                choices = json.loads(line[6:]).get("choices") or []
                if choices and choices[0].get("text"):
                    arrivals.append(time.monotonic())
    return sent, arrivals, time.monotonic()


def complete(base_url: str, model: str | None, prompt: str, max_tokens: int) -> None:
    """A short non-streamed completion that must succeed (warm-up)."""
    import httpx

    httpx.post(
        base_url + "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": max_tokens},
        timeout=300,
    ).raise_for_status()


def model_name(base_url: str) -> str | None:
    """The first model GET /v1/models lists (what --model defaults to)."""
    import aiohttp

    async def ask() -> str | None:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            return await resolve_model(s, base_url)

    return asyncio.run(ask())
