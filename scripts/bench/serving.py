#!/usr/bin/env python3
"""A streaming load generator for Relay and other OpenAI-compatible servers.

Metric-compatible with SGLang's `python -m sglang.bench_serving`: the same workloads (`random`,
`generated-shared-prefix`), the same metric names and definitions, a report laid out the same way. One more
workload, `copy` (see build_copy_dataset), asks a chat model to repeat a JSON document, a Python class or a
numbered list from its prompt: the case of prompt-lookup (n-gram) speculative decoding.

  request_throughput   completed requests / benchmark duration
  input_throughput     total input tokens / duration          (input lengths as built by the dataset)
  output_throughput    total output tokens / duration         (the server's own usage count when it reports
                                                                one, else the generated text re-tokenized)
  total_throughput     (input + output tokens) / duration
  concurrency          sum of E2E latencies / duration        (the average number of requests in flight)
  E2E latency          request sent -> last byte of the stream
  TTFT                 request sent -> first chunk carrying output
  TPOT                 per request (E2E - TTFT) / (output tokens - 1), requests with > 1 output token
  goodput              with --goodput: completed requests / duration counting only those that met every
                       SLO given (vLLM's bench_serving option): ttft:MS (the request's TTFT) and itl:MS (the
                       p99 of the request's own ITL gaps); reported as request_goodput
  ITL                  gaps between consecutive streamed chunks. One difference from SGLang, which counts one
                       gap per chunk: a chunk carrying k tokens counts as k gaps of gap/k, so servers that batch
                       several tokens per chunk are not flattered (k comes from the server's cumulative token
                       count on the native backend, else from re-tokenizing the streamed text).

On the copy workload the report adds the share of output tokens copied from the prompt: those inside a run
of 4 output tokens that also occurs in the prompt (re-tokenized, after the run).

When the server is Relay (GET /get_server_info answers with a "scheduler" object) the report adds the prefix-cache
hit rate over the run: the delta of cached_prompt_tokens_total / the delta of prompt_tokens_total between the
start and the end of the run (warm-up excluded).

Examples:
  python scripts/bench_serving.py --dataset-name random --num-prompts 128 --random-input-len 512 \\
      --random-output-len 256 --random-range-ratio 0.25 --max-concurrency 8 --ignore-eos
  python scripts/bench_serving.py --backend openai --base-url http://127.0.0.1:8080 ...     # llama-server
  python scripts/bench_serving.py --dataset-name generated-shared-prefix --gsp-num-groups 8 \\
      --gsp-prompts-per-group 16 --gsp-system-prompt-len 1024 --gsp-question-len 64 --gsp-output-len 128
  python scripts/bench_serving.py --dataset-name copy --num-prompts 32 --copy-passage-len 200 \\
      --copy-output-len 256 --max-concurrency 4                  # no --ignore-eos: copies end by themselves
  python scripts/bench_serving.py --sweep-concurrency 1,8,32 --plot docs/img/sweep.png ...

Other modules import the dataset builders (`build_random_dataset`, `build_gsp_dataset`, `build_copy_dataset`),
`run(args)` and `plot_sweep` from here; importing this file loads neither aiohttp nor transformers.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np

BACKENDS = ("relay-openai", "relay-native", "openai")
DATASETS = ("random", "generated-shared-prefix", "copy")
DEFAULT_BASE_URL = "http://127.0.0.1:30000"


# ------------------------------------------------------------------------------ tokenizer --

def default_tokenizer_path() -> str:
    """The converted default model's directory (it holds tokenizer.json)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    src = os.path.join(root, "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    from relay.execution.model_files import resolve_model_dir
    return resolve_model_dir(None)


def load_tokenizer(path: str | None):
    import transformers
    transformers.logging.set_verbosity_error()
    return transformers.AutoTokenizer.from_pretrained(path or default_tokenizer_path())


def _candidate_ids(tokenizer) -> np.ndarray:
    """Token ids to draw random prompts from: the vocabulary without special tokens."""
    special = set(tokenizer.all_special_ids or [])
    return np.array([i for i in range(len(tokenizer)) if i not in special], dtype=np.int64)


def _encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def random_text(tokenizer, rng: np.random.Generator, num_tokens: int, candidates: np.ndarray) -> tuple[str, int]:
    """Text that re-encodes to `num_tokens` tokens (as near as the tokenizer allows): random token ids are
    decoded, re-encoded, truncated or topped up, and decoded again, as SGLang's random dataset does."""
    ids = rng.choice(candidates, size=num_tokens).tolist()
    text = tokenizer.decode(ids)
    for _ in range(10):
        enc = _encode(tokenizer, text)
        if len(enc) == num_tokens:
            return text, num_tokens
        enc = enc[:num_tokens] if len(enc) > num_tokens else enc + rng.choice(
            candidates, size=num_tokens - len(enc)).tolist()
        text = tokenizer.decode(enc)
    return text, len(_encode(tokenizer, text))


# ------------------------------------------------------------------------------- datasets --

@dataclass
class DatasetRow:
    prompt: str
    prompt_len: int
    output_len: int
    group: int = -1  # generated-shared-prefix: which system prompt
    passage: str = ""  # copy: the text the prompt asks to have repeated


def _uniform_lens(rng: np.random.Generator, length: int, ratio: float, n: int) -> np.ndarray:
    """SGLang's semantics: uniform integers in [max(int(length * ratio), 1), length]."""
    return rng.integers(max(int(length * ratio), 1), length + 1, size=n)


def build_random_dataset(tokenizer, num_prompts: int, input_len: int, output_len: int,
                         input_range_ratio: float, output_range_ratio: float, seed: int) -> list[DatasetRow]:
    """The `random` workload: prompts of random tokens with uniform input/output lengths. The same arguments
    give the same prompts and output lengths (scripts/hf_static_baseline.py relies on it)."""
    rng = np.random.default_rng(seed)
    input_lens = _uniform_lens(rng, input_len, input_range_ratio, num_prompts)
    output_lens = _uniform_lens(rng, output_len, output_range_ratio, num_prompts)
    candidates = _candidate_ids(tokenizer)
    rows = []
    for n_in, n_out in zip(input_lens.tolist(), output_lens.tolist()):
        text, real_len = random_text(tokenizer, rng, n_in, candidates)
        rows.append(DatasetRow(text, real_len, int(n_out)))
    return rows


def build_gsp_dataset(tokenizer, num_groups: int, prompts_per_group: int, system_prompt_len: int,
                      question_len: int, output_len: int, seed: int) -> list[DatasetRow]:
    """SGLang's `generated-shared-prefix` workload: `num_groups` random system prompts, each followed by
    `prompts_per_group` random questions ("{system}\\n\\n{question}"); the requests are shuffled."""
    rng = np.random.default_rng(seed)
    candidates = _candidate_ids(tokenizer)
    rows = []
    for g in range(num_groups):
        system, _ = random_text(tokenizer, rng, system_prompt_len, candidates)
        for _ in range(prompts_per_group):
            question, _ = random_text(tokenizer, rng, question_len, candidates)
            prompt = f"{system}\n\n{question}"
            rows.append(DatasetRow(prompt, len(_encode(tokenizer, prompt)), output_len, g))
    order = rng.permutation(len(rows))
    return [rows[i] for i in order]


# `copy`: passages made from the seed with these small word lists (no download), for prompt-lookup (n-gram)
# speculative decoding, whose drafts come from text the prompt already holds.
_FIRST_NAMES = ("Alice", "Bruno", "Chen", "Dara", "Emil", "Fatima", "Goran", "Hana", "Ivan", "Jun", "Kofi",
                "Lena", "Mateo", "Nora", "Omar", "Priya", "Quinn", "Rosa", "Sven", "Tariq", "Uma", "Viktor")
_LAST_NAMES = ("Smith", "Garcia", "Novak", "Okafor", "Tanaka", "Berg", "Rossi", "Kowalski", "Silva", "Moreau",
               "Jensen", "Patel", "Nguyen", "Haddad", "Fischer", "Lopez", "Ivanova", "Cohen", "Murphy", "Sato")
_CITIES = ("Lisbon", "Oslo", "Nairobi", "Osaka", "Lima", "Krakow", "Dublin", "Austin", "Hanoi", "Porto",
           "Quito", "Tunis", "Bergen", "Leeds", "Perth", "Seville", "Zagreb", "Denver", "Lyon", "Cairo")
_PRODUCTS = ("lamp", "chair", "kettle", "notebook", "backpack", "umbrella", "blanket", "mug", "clock", "scarf")
_NOUNS = ("garden", "river", "window", "engine", "letter", "market", "bridge", "lantern", "harbor", "forest",
          "ledger", "signal", "orchard", "kettle", "tower", "meadow", "carpet", "mirror", "valley", "basket")
_ADJECTIVES = ("quiet", "bright", "old", "narrow", "heavy", "green", "silver", "distant", "warm", "broken",
               "small", "gentle", "busy", "empty", "golden", "steep", "careful", "wooden", "late", "clear")
_VERBS = ("opened", "carried", "painted", "counted", "repaired", "watched", "cleaned", "moved", "found",
          "measured", "followed", "closed", "sold", "built", "visited", "checked", "lifted", "shared")
_FN_VERBS = ("load", "parse", "count", "merge", "scale", "check", "update", "build", "format", "filter")
_SENTENCES = ("{f} {l} moved to {c} in {y} and opened a small {n} shop.",
              "Every morning, {f} walks past the {a} {n} on the way to work.",
              "The {a} {n} near the station was {v} by {f} last week.",
              "In {y}, the city of {c} built a {a} {n} beside the old {n2}.",
              "{f} said the {n} was too {a} to carry, so {l} took it instead.",
              "Nobody in {c} remembers who {v} the {n} first.")
# The instruction per passage kind ({lines}: the passage's line count). Plain "repeat exactly" on purpose:
# SmolLM2-135M-Instruct, the default model, echoes these three kinds nearly verbatim and then stops, while
# asking it for edits (set a field, rename a class) or giving it long runs of look-alike units (a JSON array
# of same-shaped records, a paragraph of template sentences) made it drop parts or loop, and loops are
# easier to draft than copies. Naming the last number of the list is what makes it stop after the list.
_COPY_INSTRUCTIONS = {
    "json": "Repeat the following JSON document exactly. Output only the JSON document.",
    "code": "Repeat the following Python class exactly. Output only the class.",
    "list": "Repeat the following numbered list exactly, from 1 to {lines}. Output only the numbered list.",
}


def _pick(rng: np.random.Generator, words: tuple[str, ...]) -> str:
    return words[int(rng.integers(len(words)))]


def _fill(tokenizer, budget: int, make, text=str) -> list[Any]:
    """Units from `make(i)` until their token counts (each unit encoded alone, which is within a few tokens
    of encoding them together) reach `budget`, stopping at whichever side of it is nearer; at least one."""
    units: list[Any] = []
    total = 0
    while total < budget:
        unit = make(len(units))
        n = len(_encode(tokenizer, text(unit)))
        if units and total + n - budget > budget - total:
            break
        units.append(unit)
        total += n
    return units


def _json_passage(rng: np.random.Generator, tokenizer, passage_len: int) -> str:
    """An order document: a customer, then line items until the passage is long enough."""
    doc: dict[str, Any] = {
        "order_id": f"A-{int(rng.integers(10000, 100000))}",
        "customer": {"name": f"{_pick(rng, _FIRST_NAMES)} {_pick(rng, _LAST_NAMES)}",
                     "email": f"{_pick(rng, _FIRST_NAMES).lower()}@example.com", "city": _pick(rng, _CITIES)},
        "items": [], "paid": bool(rng.integers(2)),
        "note": f"Leave it at the {_pick(rng, _ADJECTIVES)} {_pick(rng, _NOUNS)}."}
    head = len(_encode(tokenizer, json.dumps(doc, indent=2)))
    doc["items"] = _fill(tokenizer, passage_len - head, lambda i: {
        "sku": f"{_pick(rng, _PRODUCTS)}-{int(rng.integers(100, 1000))}", "qty": int(rng.integers(1, 10)),
        "price": round(float(rng.uniform(2, 90)), 2)}, lambda item: json.dumps(item, indent=2))
    return json.dumps(doc, indent=2)


def _code_passage(rng: np.random.Generator, tokenizer, passage_len: int) -> str:
    """A Python class: a constructor, then small methods until the passage is long enough."""
    head = (f"class {_pick(rng, _NOUNS).capitalize()}Store:\n"
            f"    def __init__(self, path):\n"
            f"        self.path = path\n"
            f"        self.items = []\n")

    def method(i: int) -> str:
        noun = _pick(rng, _NOUNS)
        return (f"\n    def {_pick(rng, _FN_VERBS)}_{noun}(self, {noun}_id):\n"
                f"        if {noun}_id < {int(rng.integers(2, 50))}:\n"
                f"            return None\n"
                f"        return self.items[{noun}_id % len(self.items)]\n")

    return head + "".join(_fill(tokenizer, passage_len - len(_encode(tokenizer, head)), method))


def _list_passage(rng: np.random.Generator, tokenizer, passage_len: int) -> str:
    """English sentences from templates, one per numbered line (the numbers keep a small model's place)."""
    def sentence(i: int) -> str:
        template = _SENTENCES[int(rng.integers(len(_SENTENCES)))]
        return f"{i + 1}. " + template.format(
            f=_pick(rng, _FIRST_NAMES), l=_pick(rng, _LAST_NAMES), c=_pick(rng, _CITIES),
            y=int(rng.integers(1950, 2025)), n=_pick(rng, _NOUNS), n2=_pick(rng, _NOUNS),
            a=_pick(rng, _ADJECTIVES), v=_pick(rng, _VERBS))

    return "\n".join(_fill(tokenizer, passage_len, sentence))


_COPY_PASSAGES = {"json": _json_passage, "code": _code_passage, "list": _list_passage}


def _chat_prompt(tokenizer, content: str) -> str:
    """The user message in the tokenizer's chat template (the default model is a chat model, and
    /v1/completions sends raw text); the bare message if the tokenizer has no template."""
    if getattr(tokenizer, "chat_template", None) and hasattr(tokenizer, "apply_chat_template"):
        return tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    return content


def build_copy_dataset(tokenizer, num_prompts: int, passage_len: int, output_len: int,
                       seed: int) -> list[DatasetRow]:
    """The `copy` workload, for prompt-lookup (n-gram) speculative decoding: each prompt asks the model to
    repeat a passage of about `passage_len` tokens (a JSON document, a Python class or a numbered list of
    sentences, the kinds taking turns), so most of a good answer is text the prompt already holds.

    `output_len` is only max_tokens: the answer ends by itself (EOS) after the passage, and a copy that
    ends is the realistic case, so this workload is meant to run without --ignore-eos (ignore_eos would
    pad every answer with whatever the model says after its copy). Output tokens, throughput and TPOT
    are counted from the tokens each request actually got (the server's usage count), so they stay right;
    but requests differ in length, so compare configurations whose outputs are the same (greedy decoding:
    a lossless speculative decoder changes no output)."""
    rng = np.random.default_rng(seed)
    kinds = list(_COPY_PASSAGES)
    rows = []
    for i in range(num_prompts):
        kind = kinds[i % len(kinds)]
        passage = _COPY_PASSAGES[kind](rng, tokenizer, passage_len)
        instruction = _COPY_INSTRUCTIONS[kind].format(lines=passage.count("\n") + 1)
        prompt = _chat_prompt(tokenizer, f"{instruction}\n\n{passage}")
        rows.append(DatasetRow(prompt, len(_encode(tokenizer, prompt)), output_len, passage=passage))
    return rows


def build_dataset(args, tokenizer) -> list[DatasetRow]:
    if args.dataset_name == "random":
        ratio = args.random_range_ratio
        return build_random_dataset(
            tokenizer, args.num_prompts, args.random_input_len, args.random_output_len,
            ratio if args.random_input_range_ratio is None else args.random_input_range_ratio,
            ratio if args.random_output_range_ratio is None else args.random_output_range_ratio, args.seed)
    if args.dataset_name == "copy":
        return build_copy_dataset(tokenizer, args.num_prompts, args.copy_passage_len, args.copy_output_len,
                                  args.seed)
    return build_gsp_dataset(tokenizer, args.gsp_num_groups, args.gsp_prompts_per_group,
                             args.gsp_system_prompt_len, args.gsp_question_len, args.gsp_output_len, args.seed)


# ------------------------------------------------------------------------------- requests --

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
        del buffer[:nl + 1]
        if line.startswith(b"data:"):
            out.append(line[5:].strip().decode("utf-8"))
        elif line.startswith(b"error:"):
            out.append(json.dumps({"error": line[6:].strip().decode("utf-8", "replace")}))


def _request_body(backend: str, model: str | None, row: DatasetRow, ignore_eos: bool,
                  extra: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    if backend == "relay-native":
        sp = {"max_new_tokens": row.output_len, "temperature": 0.0}
        if ignore_eos:
            sp["ignore_eos"] = True
        return "/generate", {"text": row.prompt, "sampling_params": sp, "stream": True, **extra}
    body: dict[str, Any] = {"prompt": row.prompt, "max_tokens": row.output_len, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}}
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


async def send_request(session, base_url: str, backend: str, model: str | None, row: DatasetRow,
                       ignore_eos: bool, extra: dict[str, Any], pbar=None) -> RequestOutput:
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
                        out.error = err.get("message", str(err)) if isinstance(err, dict) else str(err)
                        return out
                    if backend == "relay-native":
                        text = chunk.get("text", "")
                        meta = chunk.get("meta_info") or {}
                        n_tok = meta.get("completion_tokens")
                        if n_tok is None:
                            n_tok = len(chunk.get("output_ids") or [])
                        delta, k = text[len(prev_text):], n_tok - prev_tokens
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
                            toks = c.get("tokens") if isinstance(c.get("tokens"), list) else chunk.get("tokens")
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
        return [max(1, len(_encode(tokenizer, t))) for t in texts]
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
        retok = len(_encode(tokenizer, o.generated_text))
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


# -------------------------------------------------------------------------------- metrics --

def _stats(name: str, values_s: list[float], pcts=(99,)) -> dict[str, float]:
    ms = np.asarray(values_s, dtype=np.float64) * 1000.0
    if ms.size == 0:
        out = {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"std_{name}_ms": 0.0}
        out.update({f"p{p}_{name}_ms": 0.0 for p in pcts})
        return out
    out = {f"mean_{name}_ms": float(ms.mean()), f"median_{name}_ms": float(np.median(ms)),
           f"std_{name}_ms": float(ms.std())}
    out.update({f"p{p}_{name}_ms": float(np.percentile(ms, p)) for p in pcts})
    return out


def parse_goodput(text: str | None) -> dict[str, float]:
    """'ttft:2000 itl:30' -> {'ttft': 2.0, 'itl': 0.03} (seconds)."""
    slo: dict[str, float] = {}
    for part in (text or "").replace(",", " ").split():
        name, _, ms = part.partition(":")
        if name not in ("ttft", "itl") or not ms:
            raise argparse.ArgumentTypeError(f"--goodput takes ttft:MS and itl:MS, got {part!r}")
        slo[name] = float(ms) / 1000.0
    return slo


def meets_slo(o: RequestOutput, slo: dict[str, float]) -> bool:
    if not o.success:
        return False
    if "ttft" in slo and o.ttft > slo["ttft"]:
        return False
    return "itl" not in slo or not o.itl or float(np.percentile(o.itl, 99)) <= slo["itl"]


def calculate_metrics(rows: list[DatasetRow], outputs: list[RequestOutput], duration: float,
                      tokenizer, slo: dict[str, float] | None = None) -> dict[str, Any]:
    completed = total_input = total_output = total_retok = 0
    ttfts, tpots, itls, e2es = [], [], [], []
    for row, o in zip(rows, outputs):
        if not o.success:
            continue
        completed += 1
        total_input += row.prompt_len
        total_output += o.output_len
        total_retok += len(_encode(tokenizer, o.generated_text))
        if o.output_len > 1:
            tpots.append((o.latency - o.ttft) / (o.output_len - 1))
        itls.extend(o.itl)
        ttfts.append(o.ttft)
        e2es.append(o.latency)
    # Peak output throughput and peak concurrency, in 1-second buckets / at request boundaries.
    ok = [o for o in outputs if o.success]
    t0 = min((o.start for o in ok), default=0.0)
    buckets: dict[int, int] = {}
    events = []
    for o in ok:
        for t, n in zip(o.chunk_times, o.chunk_k):
            b = int(t - t0)
            buckets[b] = buckets.get(b, 0) + n
        events += [(o.start, 1), (o.start + o.latency, -1)]
    level = peak = 0
    for _, d in sorted(events):
        level += d
        peak = max(peak, level)
    dur = max(duration, 1e-9)
    m: dict[str, Any] = {
        "duration": duration,
        "completed": completed,
        "failed": len(outputs) - completed,
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "total_output_tokens_retokenized": total_retok,
        "request_throughput": completed / dur,
        "input_throughput": total_input / dur,
        "output_throughput": total_output / dur,
        "output_throughput_retokenized": total_retok / dur,
        "total_throughput": (total_input + total_output) / dur,
        "total_throughput_retokenized": (total_input + total_retok) / dur,
        "max_output_tokens_per_s": float(max(buckets.values(), default=0)),
        "max_concurrent_requests": peak,
        "concurrency": float(np.sum(e2es)) / dur if e2es else 0.0,
    }
    m.update(_stats("e2e_latency", e2es, (90, 99)))
    m.update(_stats("ttft", ttfts, (99,)))
    m.update(_stats("tpot", tpots, (99,)))
    m.update(_stats("itl", itls, (95, 99)))
    m["max_itl_ms"] = float(max(itls) * 1000.0) if itls else 0.0
    if slo:
        good = sum(1 for o in outputs if meets_slo(o, slo))
        m.update({"goodput_slo_ms": {k: v * 1000.0 for k, v in slo.items()}, "good_requests": good,
                  "request_goodput": good / dur})
    return m


def per_request(rows: list[DatasetRow], outputs: list[RequestOutput], t0: float) -> list[dict[str, Any]]:
    """Each request's timeline (seconds from the run's start): when it was sent, its first token
    and end, and its inter-token gaps; what a p99 is made of (a burst's queue, a slow step)."""
    return [{"sent": o.start - t0, "ttft": o.ttft, "latency": o.latency, "prompt_len": row.prompt_len,
             "output_len": o.output_len, "ok": o.success, "itl": [round(g, 6) for g in o.itl]}
            for row, o in zip(rows, outputs)]


def copied_share(tokenizer, rows: list[DatasetRow], outputs: list[RequestOutput], n: int = 4) -> float | None:
    """The share of output tokens inside some run of `n` output tokens that also occurs in the prompt:
    roughly what an n-gram drafter can find (1.0: all copied). None without successful outputs."""
    covered = total = 0
    for row, o in zip(rows, outputs):
        if not o.success:
            continue
        prompt_ids, out_ids = _encode(tokenizer, row.prompt), _encode(tokenizer, o.generated_text)
        grams = {tuple(prompt_ids[i:i + n]) for i in range(len(prompt_ids) - n + 1)}
        hit = [False] * len(out_ids)
        for i in range(len(out_ids) - n + 1):
            if tuple(out_ids[i:i + n]) in grams:
                hit[i:i + n] = [True] * n
        covered += sum(hit)
        total += len(out_ids)
    return covered / total if total else None


def print_report(args, m: dict[str, Any]) -> None:
    def line(label: str, value: Any, fmt: str = "{:<10.2f}") -> None:
        text = fmt.format(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)
        print(f"{label:<41}{text}")

    print("\n{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="="))
    line("Backend:", args.backend, "{}")
    line("Dataset:", args.dataset_name, "{}")
    line("Traffic request rate:", args.request_rate, "{}")
    line("Max request concurrency:", args.max_concurrency if args.max_concurrency else "not set", "{}")
    line("Successful requests:", m["completed"], "{:<10}")
    if m["failed"]:
        line("Failed requests:", m["failed"], "{:<10}")
    line("Benchmark duration (s):", m["duration"])
    line("Total input tokens:", m["total_input_tokens"], "{:<10}")
    line("Total generated tokens:", m["total_output_tokens"], "{:<10}")
    line("Total generated tokens (retokenized):", m["total_output_tokens_retokenized"], "{:<10}")
    line("Request throughput (req/s):", m["request_throughput"])
    if "request_goodput" in m:
        line(f"Request goodput (req/s, {args.goodput}):", m["request_goodput"])
    line("Input token throughput (tok/s):", m["input_throughput"])
    line("Output token throughput (tok/s):", m["output_throughput"])
    line("Peak output token throughput (tok/s):", m["max_output_tokens_per_s"])
    line("Peak concurrent requests:", m["max_concurrent_requests"], "{:<10}")
    line("Total token throughput (tok/s):", m["total_throughput"])
    line("Concurrency:", m["concurrency"])
    if m.get("copied_output_share") is not None:
        line("Output tokens copied from the prompt:", m["copied_output_share"], "{:<10.4f}")
    if m.get("cache_hit_rate") is not None:
        line("Prefix cache hit rate (server):", m["cache_hit_rate"], "{:<10.4f}")
    if m.get("spec_verify_rows"):
        line("Speculation acceptance rate:", m["spec_acceptance_rate"], "{:<10.4f}")
        line("Speculation accept length:", m["spec_accept_length"])
    if m.get("usage_cache_hit_rate") is not None:
        line("Cached prompt tokens (usage):", f"{m['usage_cached_tokens']} of {m['usage_prompt_tokens']} "
             f"({m['usage_cache_hit_rate']:.2%})", "{}")
    three = ("mean", "median", "p99")
    for title, label, key, stats in (("End-to-End Latency", "E2E Latency", "e2e_latency", three),
                                     ("Time to First Token", "TTFT", "ttft", three),
                                     ("Time per Output Token (excl. 1st token)", "TPOT", "tpot", three),
                                     ("Inter-Token Latency", "ITL", "itl", ("mean", "median", "p95", "p99", "max"))):
        print("{s:{c}^{n}}".format(s=title, n=50, c="-"))
        for stat in stats:
            line(f"{stat.capitalize()} {label} (ms):", m[f"{stat}_{key}_ms"])
    print("(ITL: a chunk carrying k tokens counts as k gaps of gap/k; k " +
          ("from the server's token counts)" if m.get("itl_k_source") == "server" else
           "estimated by re-tokenizing the streamed text)"))
    print("=" * 50, flush=True)


# ----------------------------------------------------------------------------- the run ---

async def _get_json(session, url: str) -> Any:
    try:
        async with session.get(url) as resp:
            if resp.status != 200:
                return None
            return await resp.json(content_type=None)
    except Exception:  # noqa: BLE001 - not every server has every endpoint
        return None


def spec_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """Speculative decoding over the run, from Relay's scheduler counters: the share of proposed tokens
    accepted, and tokens emitted per verify step (accepted + the target's own)."""
    rows, proposed, accepted = (after[k] - before[k] for k in
                                ("spec_verify_rows", "spec_proposed_tokens", "spec_accepted_tokens"))
    return {"spec_verify_rows": rows, "spec_acceptance_rate": accepted / max(1, proposed),
            "spec_accept_length": (accepted + rows) / max(1, rows)}


async def _relay_counters(session, base_url: str) -> dict[str, Any] | None:
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


async def wait_ready(base_url: str, timeout: float = 600.0, proc=None) -> None:
    """Poll /health (then /v1/models) until the server answers 200."""
    import aiohttp
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as s:
        while time.monotonic() < deadline:
            if proc is not None and proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {proc.returncode} before it was ready")
            for path in ("/health", "/v1/models"):
                try:
                    async with s.get(base_url + path) as r:
                        if r.status == 200:
                            return
                except (aiohttp.ClientError, TimeoutError):
                    continue  # not listening yet
            await asyncio.sleep(1.0)
    raise TimeoutError(f"{base_url} was not ready within {timeout:.0f} s")


async def _arrivals(rows: list[DatasetRow], rate: float, rng: np.random.Generator):
    for i, row in enumerate(rows):
        yield i, row
        if math.isinf(rate) or i == len(rows) - 1:
            continue
        await asyncio.sleep(float(rng.exponential(1.0 / rate)))


async def benchmark(args, rows: list[DatasetRow], tokenizer, model: str | None,
                    max_concurrency: int | None) -> dict[str, Any]:
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
            cands = _candidate_ids(tokenizer)
            warm = [DatasetRow(*random_text(tokenizer, wrng, 32, cands), 8) for _ in range(args.warmup_requests)]
            wouts = await asyncio.gather(*(send_request(session, args.base_url, args.backend, model, r, True, extra)
                                           for r in warm))
            bad = [o.error for o in wouts if not o.success]
            if len(bad) == len(wouts):
                raise RuntimeError(f"every warm-up request failed; first error: {bad[0]}")
        before = await _relay_counters(session, args.base_url)
        sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        pbar = None if args.disable_tqdm else tqdm(total=len(rows), desc=f"c={max_concurrency or 'inf'}",
                                                   leave=False)

        async def one(row: DatasetRow) -> RequestOutput:
            if sem is None:
                return await send_request(session, args.base_url, args.backend, model, row, args.ignore_eos,
                                          extra, pbar)
            async with sem:
                return await send_request(session, args.base_url, args.backend, model, row, args.ignore_eos,
                                          extra, pbar)

        rng = np.random.default_rng(args.seed + 1)
        start = time.perf_counter()
        tasks = []
        async for _, row in _arrivals(rows, args.request_rate, rng):
            tasks.append(asyncio.create_task(one(row)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        if pbar is not None:
            pbar.close()
        after = await _relay_counters(session, args.base_url)

    finish_outputs(outputs, tokenizer)
    m = calculate_metrics(rows, outputs, duration, tokenizer, parse_goodput(args.goodput))
    m["itl_k_source"] = "server" if all(k is not None for o in outputs for k in o.chunk_tokens) else "retokenized"
    if args.per_request:
        m["requests"] = per_request(rows, outputs, start)
    if any(row.passage for row in rows):  # copy: how much of the output an n-gram drafter could find
        m["copied_output_share"] = copied_share(tokenizer, rows, outputs)
    m["cache_hit_rate"] = None
    if before is not None and after is not None:
        dp = after.get("prompt_tokens_total", 0) - before.get("prompt_tokens_total", 0)
        dc = after.get("cached_prompt_tokens_total", 0) - before.get("cached_prompt_tokens_total", 0)
        m["server_prompt_tokens"] = dp
        m["server_cached_prompt_tokens"] = dc
        m["cache_hit_rate"] = dc / dp if dp > 0 else 0.0
        if before.get("spec") and after.get("spec"):
            m.update(spec_delta(before["spec"], after["spec"]))
    # What the responses' usage says (any server that reports prompt_tokens_details.cached_tokens, llama.cpp
    # included): cached prompt tokens / prompt tokens, and the server's own prompt token count.
    reported = [o for o in outputs if o.success and o.server_cached_tokens is not None and o.server_prompt_len]
    if reported:
        m["usage_prompt_tokens"] = int(sum(o.server_prompt_len for o in reported))
        m["usage_cached_tokens"] = int(sum(o.server_cached_tokens for o in reported))
        m["usage_cache_hit_rate"] = m["usage_cached_tokens"] / max(1, m["usage_prompt_tokens"])
    errors = [o.error for o in outputs if not o.success]
    if errors:
        m["first_error"] = errors[0]
    return m


def _args_record(args) -> dict[str, Any]:
    return {k: (v if not (isinstance(v, float) and math.isinf(v)) else "inf") for k, v in vars(args).items()}


def _append_json(path: str, record: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def run(args, tokenizer=None) -> list[dict[str, Any]]:
    """Run one benchmark (or one per --sweep-concurrency level); print reports; return the result dicts."""
    if tokenizer is None:
        tokenizer = load_tokenizer(args.tokenizer)

    async def main() -> list[dict[str, Any]]:
        import aiohttp
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as s:
            model = args.model or (None if args.backend == "relay-native" else await resolve_model(s, args.base_url))
        levels = ([int(x) for x in args.sweep_concurrency.split(",") if x.strip()]
                  if args.sweep_concurrency else [args.max_concurrency])
        results = []
        for i, c in enumerate(levels):
            # Each sweep level gets its own prompts (seed + i): repeating a level's prompts would hit the
            # prefix cache of the previous level.
            level_args = argparse.Namespace(**{**vars(args), "max_concurrency": c,
                                               "seed": args.seed + (i if args.sweep_concurrency else 0)})
            rows = build_dataset(level_args, tokenizer)
            m = await benchmark(level_args, rows, tokenizer, model, c)
            m.update({"backend": args.backend, "dataset_name": args.dataset_name, "base_url": args.base_url,
                      "model": model, "max_concurrency": c,
                      "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
                      "num_prompts": len(rows), "timestamp": datetime.now().isoformat(timespec="seconds"),
                      "label": args.label, "args": _args_record(level_args)})
            print_report(level_args, m)
            if m.get("first_error"):
                print(f"first error: {m['first_error']}", flush=True)
            if args.output_json:
                _append_json(args.output_json, m)
            results.append(m)
        return results

    results = asyncio.run(main())
    if args.sweep_concurrency and args.plot:
        plot_sweep({args.label or args.backend: results}, args.plot,
                   title=f"{args.dataset_name}: {results[0]['num_prompts']} requests per level")
        print(f"plot: {args.plot}")
    return results


def plot_sweep(series: dict[str, list[dict[str, Any]]], path: str, title: str = "") -> None:
    """One PNG: output throughput and median ITL vs max concurrency, one line per label."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    levels: set[int] = set()
    for label, results in series.items():
        pts = sorted((r.get("max_concurrency") or 1, r.get("output_throughput"), r.get("median_itl_ms"))
                     for r in results)
        if not pts:
            continue
        levels.update(p[0] for p in pts)
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=label)
        itl = [p for p in pts if p[2] is not None]  # the HF baseline has no ITL
        if itl:
            ax2.plot([p[0] for p in itl], [p[2] for p in itl], marker="o", label=label)
    for ax, ylabel in ((ax1, "output throughput (tok/s)"), (ax2, "median ITL (ms)")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(levels))
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.set_xlabel("max concurrency (HF: batch size)")
        ax.set_ylabel(ylabel)
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------------------------- CLI ---

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default=DEFAULT_BASE_URL)
    p.add_argument("--backend", choices=BACKENDS, default="relay-openai",
                   help="relay-openai: POST /v1/completions (stream); relay-native: POST /generate (stream, "
                        "cumulative text); openai: any OpenAI-compatible /v1/completions (llama-server too)")
    p.add_argument("--model", default=None, help="model name to send (default: the first of GET /v1/models)")
    p.add_argument("--tokenizer", default=None,
                   help="HF tokenizer dir for building prompts and counting tokens (default: Relay's converted "
                        "default model dir)")
    p.add_argument("--dataset-name", choices=DATASETS, default="random")
    p.add_argument("--num-prompts", type=int, default=128, help="random and copy datasets: number of requests")
    p.add_argument("--random-input-len", type=int, default=512)
    p.add_argument("--random-output-len", type=int, default=256)
    p.add_argument("--random-range-ratio", type=float, default=0.0,
                   help="lengths are uniform in [len * ratio, len] (SGLang's semantics)")
    p.add_argument("--random-input-range-ratio", type=float, default=None,
                   help="override --random-range-ratio for input lengths")
    p.add_argument("--random-output-range-ratio", type=float, default=None,
                   help="override --random-range-ratio for output lengths")
    p.add_argument("--gsp-num-groups", type=int, default=8)
    p.add_argument("--gsp-prompts-per-group", type=int, default=16)
    p.add_argument("--gsp-system-prompt-len", type=int, default=1024)
    p.add_argument("--gsp-question-len", type=int, default=64)
    p.add_argument("--gsp-output-len", type=int, default=128)
    p.add_argument("--copy-passage-len", type=int, default=200,
                   help="copy dataset: tokens (about) of the passage each prompt asks to have repeated")
    p.add_argument("--copy-output-len", type=int, default=256,
                   help="copy dataset: max output tokens (the answer usually ends at EOS before)")
    p.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no cap)")
    p.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals; inf sends them all at once")
    p.add_argument("--warmup-requests", type=int, default=1,
                   help="short requests (own random prompts, 8 tokens out) sent before the timed run")
    p.add_argument("--goodput", default=None,
                   help="SLOs for goodput, e.g. 'ttft:2000 itl:30' (ms; itl is each request's p99 gap)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos: generate exactly the output length")
    p.add_argument("--flush-cache", action="store_true", help="POST /flush_cache before the run (Relay/SGLang)")
    p.add_argument("--extra-request-body", default=None, help="JSON object merged into every request body")
    p.add_argument("--request-timeout", type=float, default=3 * 3600.0, help="seconds per request")
    p.add_argument("--output-json", default=None, help="append one JSON line per run (every metric + the args)")
    p.add_argument("--label", default=None, help="a name for this run in the JSON and the plot legend")
    p.add_argument("--per-request", action="store_true",
                   help="also keep each request's timeline in the result (sent, TTFT, latency, gaps)")
    p.add_argument("--sweep-concurrency", default=None,
                   help="comma-separated max-concurrency levels to run in turn, e.g. 1,8,32")
    p.add_argument("--plot", default=None, help="with --sweep-concurrency: write a PNG plot here")
    p.add_argument("--disable-tqdm", action="store_true")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.base_url = args.base_url.rstrip("/")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    results = run(args)
    return 0 if all(r["completed"] > 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
