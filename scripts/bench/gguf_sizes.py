#!/usr/bin/env python3
"""gguf-sizes: Relay against llama.cpp's llama-server on random-weight GGUF files of real model sizes.

The files (gguf_models.py): a Llama-3.2-1B shape and a Llama-3.1-8B shape with the default model's
tokenizer, made with llama.cpp's convert_hf_to_gguf.py and llama-quantize into .bench/models (kept there;
made once). For each file asked for (--models, default 1b-Q4_K_M), one server at a time:

  relay     python -m launch.serve --model-path FILE --port P [--relay-args]
  llamacpp  llama-server -m FILE -np 8 -kvu -cb -c 4096 -t 2 (--llamacpp-*)

each started twice (--starts) with $RELAY_CACHE_DIR and $TMPDIR pointed at fresh empty folders under
.bench/gguf-sizes-tmp (the first start includes any conversion; the second finds its results). Relay's
CPU kernels are built into the fresh folder first, as scripts/install.sh builds them (kernel_build_s),
and records per start

  ready_s                seconds from launch to the first 200 of /health (polled every 0.2 s)
  peak RSS               the highest sum of VmRSS over the server's whole process tree, sampled every
                         --sample-interval s from launch to stop (proctree.py), also up to ready only
  RSS by process         each process's VmRSS (by title: relay::sched, llama-server, ...) at ready and
                         after the load (the steady state), its VmHWM at the end, and its PSS after the
                         load (/proc/PID/smaps_rollup: shared pages, e.g. torch's libraries in each
                         Python process, counted once; the RSS sum counts them in every process)
  disk                   bytes under the fresh cache folder and TMPDIR after each start (what the server
                         wrote and kept), and the kernel's write_bytes of its processes (/proc/PID/io)

and on the last start the random workload (random tokens, 128-256 in, 64 out, ignore_eos) at max
concurrency 1, 4 and 8 (4 requests per slot, at least 16; --quick: 8): output tok/s, TTFT, ITL, with the
client and metrics of `serving`. Also the CPU's SIMD flags and Relay's cpu_isa (/get_server_info).
Writes .bench/gguf-sizes-<date>.jsonl (results.py's format: a "server" record per engine and file, a
record per load run) and prints two markdown tables.

  python -m scripts.bench gguf-sizes                                  # 1B Q4_K_M, both engines
  python -m scripts.bench gguf-sizes --models 1b-Q4_K_M,1b-Q8_0,8b-Q4_K_M --relay-args="--kv-cache-gb 2"
  python -m scripts.bench gguf-sizes --prepare-only --models 1b-Q4_K_M,1b-Q8_0,8b-Q4_K_M   # files only
  python -m scripts.bench gguf-sizes --quick --only relay --starts 1  # a smoke run
  python -m scripts.bench gguf-sizes --from-json .bench/gguf-sizes-*.jsonl   # the tables again
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime
from typing import Any

from scripts.bench import compare, gguf_models, proctree
from scripts.bench.client import server_info
from scripts.bench.engines import LLAMA_BUILD, llama_server_cmd
from scripts.bench.results import BENCH_DIR, ROOT, ResultFile, load
from scripts.bench.servers import Server, relay_server
from scripts.bench.table import fmt, markdown
from scripts.bench.workloads import load_tokenizer

ENGINES = ("relay", "llamacpp")
GB = 1e9
# The flags a CPU table states (/proc/cpuinfo names): vector width, int8 and bfloat16 dot products, AMX.
STATED_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_tile",
    "amx_bf16",
    "amx_int8",
)


def cpu_features() -> dict[str, Any]:
    """The CPU's stated flags and the level Relay's kernels find for it (relay.execution.kernels.isa)."""
    src = os.path.join(ROOT, "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    from relay.execution.kernels import isa

    have = set(isa.cpu_flags().split())
    return {
        "cpu_simd": {f: f in have for f in STATED_FLAGS},
        "relay_detected_isa": isa.detected_level(),
    }


def flags_line(simd: dict[str, bool]) -> str:
    """avx2 avx512 vnni bf16 amx, each yes/no: one line for a table's caption."""
    avx512 = all(simd.get(f) for f in ("avx512f", "avx512bw", "avx512vl"))
    vnni = simd.get("avx512_vnni") or simd.get("avx_vnni")
    amx = simd.get("amx_tile") and (simd.get("amx_bf16") or simd.get("amx_int8"))
    words = [("avx2", simd.get("avx2")), ("avx512", avx512), ("vnni", vnni)]
    words += [("bf16", simd.get("avx512_bf16")), ("amx", amx)]
    return " ".join(f"{name}={'yes' if on else 'no'}" for name, on in words)


def tree_bytes(path: str) -> int:
    """Bytes of the files under path (their sizes; links not followed)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            total += st.st_size
    return total


def llama_system_info(log_text: str) -> str | None:
    """llama-server's `system_info: ...` line (the CPU features its build uses)."""
    for line in log_text.splitlines():
        if "system_info:" in line:
            return line.split("system_info:", 1)[1].strip()
    return None


def build_options(build: str) -> str | None:
    """The CPU options scripts/build_llama_cpp.sh built llama.cpp with (its stamp file): what its
    kernels may use (this llama-server's log has no system_info line)."""
    try:
        with open(os.path.join(build, "relay-isa-options.txt")) as f:
            return f.read().strip().replace("-D", "")
    except OSError:
        return None


# ----------------------------------------------------------------------------------- runs ---


def make_server(engine: str, path: str, args, env: dict[str, str], tag: str) -> Server:
    if engine == "relay":
        server = relay_server(
            f"gguf-{tag}",
            args.relay_port,
            ["--model-path", path, *args.relay_args.split()],
            {**args.relay_env_vars, **env},
            args.ready_timeout,
            checkout=args.relay_checkout and os.path.abspath(args.relay_checkout),
        )
    else:
        ns = argparse.Namespace(**{**vars(args), "gguf": path})
        server = Server(
            "llama.cpp llama-server",
            llama_server_cmd(ns),
            args.llamacpp_port,
            os.path.join(BENCH_DIR, "logs", f"llama-server-gguf-{tag}.log"),
            args.ready_timeout,
            env=env,
        )
    server.ready_poll = 0.2
    return server


def engine_config(engine: str, args) -> str:
    if engine == "relay":
        env_words = " ".join(f"{k}={v}" for k, v in args.relay_env_vars.items())
        return " ".join(x for x in ("defaults", env_words, args.relay_args) if x)
    return " ".join(
        x
        for x in (
            f"np{args.llamacpp_parallel} kvu cb c{args.llamacpp_ctx} t{args.threads}",
            args.llamacpp_args,
        )
        if x
    )


def one_start(
    engine: str, spec: str, path: str, i: int, args, env, out, tokenizer, wl, config
) -> dict[str, Any]:
    """Start the server once (sampling its tree), run the load on the last start, stop it; what it saw."""
    last = i == args.starts
    server = make_server(engine, path, args, env, f"{spec}-start{i}")
    rec: dict[str, Any] = {}
    sampler = proctree.Sampler(lambda: server.proc, args.sample_interval)
    with sampler:
        try:
            with server:
                st = sampler.state
                sampler.sample()
                rec.update(
                    ready_s=server.ready_s,
                    peak_rss_to_ready=st.peak_rss,
                    rss_at_ready=st.last_rss,
                    rss_at_ready_by_proc=st.by_title(since=st.last_at),
                )
                if engine == "relay":
                    try:
                        info = server_info(server.base_url)
                        rec["cpu_isa"] = info.get("cpu_isa")
                        rec["relay_version"] = info.get("version")
                    except Exception as e:  # noqa: BLE001 - recorded, not fatal
                        rec["cpu_isa_error"] = f"{type(e).__name__}: {e}"
                else:
                    rec["llamacpp_system_info"] = llama_system_info(server.log_text())
                if last:
                    t_load = time.monotonic()
                    compare.bench(
                        server,
                        "relay-openai" if engine == "relay" else "openai",
                        wl,
                        engine,
                        config,
                        out,
                        tokenizer,
                        args,
                        flush=engine == "relay",
                    )
                    rec["load_s"] = time.monotonic() - t_load
                sampler.sample()  # the steady state: after the load (or at ready, without it)
                rec.update(
                    rss_end=st.last_rss,
                    rss_end_by_proc=st.by_title(since=st.last_at),
                    pss_end_by_proc=st.pss_by_title(proctree.proc_pss),
                    hwm_by_proc=st.by_title(key="hwm"),
                    peak_rss_by_proc=st.by_title(key="peak_rss"),
                    # the root's count includes its reaped children's
                    io_write_bytes=sum(r.write_bytes for r in st.alive_at(st.last_at)),
                )
                sampler.stop()  # before the stop: its exit is no steady state
        except Exception as e:  # noqa: BLE001 - what it measured before it failed is kept
            rec["error"] = f"{type(e).__name__}: {e}"[:500]
        finally:
            rec.update(peak_rss=sampler.state.peak_rss, samples=sampler.state.samples)
    return rec


def measure(engine: str, spec: str, path: str, args, out: ResultFile, tokenizer, wl) -> None:
    """Both starts of one engine on one file, into one "server" record (its load runs: records of their own)."""
    config = engine_config(engine, args)
    run_dir = os.path.join(args.tmp_root, f"{engine}-{spec}-{datetime.now():%Y%m%d-%H%M%S}")
    cache, tmp = os.path.join(run_dir, "cache"), os.path.join(run_dir, "tmp")
    os.makedirs(cache)
    os.makedirs(tmp)
    env = {"RELAY_CACHE_DIR": cache, "TMPDIR": tmp}
    record: dict[str, Any] = {
        "kind": "server",
        "engine": engine,
        "config": config,
        "model_spec": spec,
        "model_file": os.path.relpath(path, ROOT),
        "file_bytes": os.path.getsize(path),
        "starts": [],
    }
    if engine == "relay":  # what scripts/install.sh does before a user's first start
        record["kernel_build_s"] = build_kernels(env)
    if engine == "llamacpp":
        record["llamacpp_build_options"] = build_options(args.llamacpp_build)
        record["llama_server_cmd"] = llama_server_cmd(
            argparse.Namespace(**{**vars(args), "gguf": path})
        )
    try:
        for i in range(1, args.starts + 1):
            print(f"\n=== {engine} on {spec}: start {i} of {args.starts}", flush=True)
            start = one_start(engine, spec, path, i, args, env, out, tokenizer, wl, config)
            start["disk_bytes"] = tree_bytes(cache) + tree_bytes(tmp)
            record["starts"].append(start)
            if start.get("error"):  # the other engines and files still run
                print(f"!!! {engine} on {spec} failed: {start['error']}", flush=True)
                record["error"] = f"start {i}: {start['error']}"
                break
    finally:
        record["disk_bytes_end"] = tree_bytes(cache) + tree_bytes(tmp)
        record["cache_bytes_end"] = tree_bytes(cache)
        if not args.keep_tmp:
            shutil.rmtree(run_dir, ignore_errors=True)
        out.add(flatten(record))


def build_kernels(env: dict[str, str]) -> float:
    """Seconds `python -m relay.execution.kernels` takes to build this CPU's kernels into the fresh
    cache folder: the install step, timed apart from the first start (as llama.cpp's build is)."""
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "relay.execution.kernels"], env={**os.environ, **env}, check=True
    )
    return time.perf_counter() - started


def flatten(record: dict[str, Any]) -> dict[str, Any]:
    """The first and last starts' main numbers as top-level fields (the table's), the starts kept too."""
    starts = record.get("starts") or []
    if starts:
        first, last = starts[0], starts[-1]
        record.update(
            ready_first_s=first.get("ready_s"),
            ready_second_s=last.get("ready_s") if len(starts) > 1 else None,
            peak_rss_first=first.get("peak_rss"),
            peak_rss_serving=last.get("peak_rss"),
            rss_steady=last.get("rss_end"),
            rss_steady_by_proc=last.get("rss_end_by_proc"),
            pss_steady=sum((last.get("pss_end_by_proc") or {}).values()) or None,
            disk_bytes_first=first.get("disk_bytes"),
            io_write_bytes_first=first.get("io_write_bytes"),
            cpu_isa=last.get("cpu_isa"),
        )
    return record


# -------------------------------------------------------------------------------- tables ---


def _gb(key: str):
    return lambda r: None if r.get(key) is None else r[key] / GB


def _procs(r: dict[str, Any]) -> str:
    by = r.get("rss_steady_by_proc") or {}
    return ", ".join(f"{name} {v / GB:.2f}" for name, v in by.items() if v >= 0.01 * GB) or "–"


SERVER_COLUMNS = [
    ("model", "model_spec"),
    ("engine", "engine"),
    ("file GB", _gb("file_bytes"), 2),
    ("kernel build (s)", lambda r: r.get("kernel_build_s") or "n/a"),
    ("ready 1st (s)", "ready_first_s"),
    ("ready 2nd (s)", "ready_second_s"),
    ("peak RSS 1st start (GB)", _gb("peak_rss_first"), 2),
    ("peak RSS serving (GB)", _gb("peak_rss_serving"), 2),
    ("RSS after load (GB)", _gb("rss_steady"), 2),
    ("PSS after load (GB)", _gb("pss_steady"), 2),
    ("by process (GB)", _procs),
    ("disk written (GB)", _gb("disk_bytes_end"), 2),
    ("cpu_isa", lambda r: r.get("cpu_isa") or ("–" if r.get("engine") == "relay" else "n/a")),
]

LOAD_COLUMNS = [
    ("model", "model_spec"),
    ("engine", "engine"),
    ("conc.", "max_concurrency"),
    ("req", lambda r: r.get("completed") if not r.get("error") else f"failed: {r['error'][:60]}"),
    ("output tok/s", "output_throughput"),
    ("TTFT p50 (ms)", "median_ttft_ms", 0),
    ("ITL p50 (ms)", "median_itl_ms"),
    ("ITL p99 (ms)", "p99_itl_ms"),
]


def tables(records: list[dict[str, Any]]) -> str:
    servers = [r for r in records if r.get("kind") == "server"]
    runs = [
        r for r in records if r.get("kind") != "server" and r.get("max_concurrency") is not None
    ]
    parts = [markdown(servers, SERVER_COLUMNS)]
    failed = [r for r in servers if r.get("error")]
    parts += [f"\n{r['engine']} on {r['model_spec']} failed: {r['error'][:300]}" for r in failed]
    parts += ["", markdown(runs, LOAD_COLUMNS)]
    return "\n".join(parts)


def caption(records: list[dict[str, Any]]) -> str:
    first = records[0] if records else {}
    simd = first.get("cpu_simd") or {}
    return (
        f"{first.get('timestamp', '?')}, {first.get('cpu', '?')}, {first.get('cpus', '?')} CPUs "
        f"({flags_line(simd)}; Relay finds {first.get('relay_detected_isa', '?')}), load average "
        f"{fmt(max((r.get('load_avg') or 0.0) for r in records) if records else None)} at the start "
        f"of a run, git {', '.join(dict.fromkeys(str(r.get('git')) for r in records))}"
    )


# ---------------------------------------------------------------------------------- main ---


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="Relay vs llama-server on random-weight GGUF files of real model sizes",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--models",
        default="1b-Q4_K_M",
        help="SHAPE-TYPE, comma-separated: shapes 1b, 8b; types Q4_K_M, Q8_0",
    )
    p.add_argument(
        "--only", default="relay,llamacpp", help=f"engines, comma-separated, of {ENGINES}"
    )
    p.add_argument("--prepare-only", action="store_true", help="make the files, benchmark nothing")
    p.add_argument(
        "--keep",
        action="store_true",
        help="keep the random HF folder and the bfloat16 GGUF after quantizing",
    )
    p.add_argument("--models-dir", default=gguf_models.MODELS_DIR)
    p.add_argument("--outtype", default="bf16", choices=["bf16", "f16"], help="the converter's")
    p.add_argument("--weights-seed", type=int, default=0, help="the random weights' seed")
    p.add_argument("--concurrency", default="1,4,8", help="max-concurrency levels")
    p.add_argument(
        "--input-len", type=int, default=256, help="prompts of input-len * ratio .. input-len"
    )
    p.add_argument("--input-ratio", type=float, default=0.5)
    p.add_argument("--output-len", type=int, default=64, help="output tokens (ignore_eos)")
    p.add_argument(
        "--quick", action="store_true", help="8 requests per level (else 4 per slot, 16..128)"
    )
    p.add_argument("--seed", type=int, default=1, help="the prompts' seed")
    p.add_argument("--per-request", action="store_true", help="keep each request's timeline")
    p.add_argument(
        "--starts",
        type=int,
        default=2,
        choices=[1, 2],
        help="starts per server: the first with empty cache folders, the load on the last",
    )
    p.add_argument("--threads", type=int, default=2, help="llama-server -t")
    p.add_argument("--relay-port", type=int, default=30123)
    p.add_argument(
        "--relay-args",
        default="",
        help='extra flags for `python -m launch.serve` (write --relay-args="--kv-cache-gb 2")',
    )
    p.add_argument(
        "--relay-env",
        action="append",
        default=[],
        metavar="KEY=VAL",
        help="environment variable for Relay (repeatable), e.g. RELAY_CPU_ISA=avx2",
    )
    p.add_argument("--relay-checkout", default=None, metavar="DIR", help="serve Relay from there")
    p.add_argument("--llamacpp-port", type=int, default=30124)
    p.add_argument("--llamacpp-parallel", type=int, default=8, help="llama-server -np (slots)")
    p.add_argument(
        "--llamacpp-ctx", type=int, default=4096, help="llama-server -c, shared by the slots (-kvu)"
    )
    p.add_argument("--llamacpp-args", default="", help="extra llama-server flags")
    p.add_argument(
        "--llamacpp-build",
        default=LLAMA_BUILD,
        help="llama.cpp build folder: its llama-server and llama-quantize",
    )
    p.add_argument(
        "--ready-timeout",
        type=float,
        default=3600.0,
        help="seconds to wait for a server to start (Relay converts the file at its first start)",
    )
    p.add_argument("--sample-interval", type=float, default=0.2, help="seconds between RSS samples")
    p.add_argument(
        "--tmp-root",
        default=os.path.join(BENCH_DIR, "gguf-sizes-tmp"),
        help="where each server's fresh cache folder and TMPDIR go (on disk, not tmpfs)",
    )
    p.add_argument("--keep-tmp", action="store_true", help="keep them (Relay's conversion) after")
    p.add_argument("--tokenizer", default=None, help="default: the files' (the default model's)")
    p.add_argument(
        "--output",
        default=None,
        help="results, JSON lines (default .bench/gguf-sizes-<date>.jsonl)",
    )
    p.add_argument(
        "--from-json",
        nargs="+",
        default=None,
        metavar="PATH",
        help="only print the tables of these",
    )
    args = p.parse_args(argv)
    args.engines = [e.strip() for e in args.only.split(",") if e.strip()]
    for e in args.engines:
        if e not in ENGINES:
            p.error(f"unknown engine {e!r}; choose from {ENGINES}")
    args.model_specs = [m.strip() for m in args.models.split(",") if m.strip()]
    for m in args.model_specs:
        try:
            gguf_models.parse_model_spec(m)
        except ValueError as e:
            p.error(f"--models: {e}")
    args.model_specs = ["-".join(gguf_models.parse_model_spec(m)) for m in args.model_specs]
    args.relay_env_vars, rest = compare.split_env(args.relay_env)
    if rest:
        p.error(f"--relay-env: {rest[0]!r} is not KEY=VAL")
    args.levels = [int(x) for x in args.concurrency.split(",") if x.strip()]
    args.llamacpp_build = os.path.abspath(args.llamacpp_build)
    args.tmp_root = os.path.abspath(args.tmp_root)
    return args


def workload(args) -> compare.Workload:
    flags = [
        "--dataset-name",
        "random",
        "--random-input-len",
        str(args.input_len),
        "--random-output-len",
        str(args.output_len),
        "--random-input-range-ratio",
        str(args.input_ratio),
        "--random-output-range-ratio",
        "1.0",
        "--ignore-eos",
    ]
    return compare.Workload("random", "random", flags, args.levels)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json:
        records = [r for r in load(args.from_json) if r.get("bench") == "gguf-sizes"]
        print(f"{caption(records)}\n\n{tables(records)}")
        return 0
    # A SIGTERM (e.g. from `timeout`) must still stop the server this script started.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    t_start = time.monotonic()
    paths = gguf_models.make_models(
        args.model_specs,
        args.llamacpp_build,
        args.models_dir,
        keep=args.keep,
        seed=args.weights_seed,
        outtype=args.outtype,
    )
    for spec, path in paths.items():
        print(f"{spec}: {path} ({os.path.getsize(path) / GB:.2f} GB)")
    if args.prepare_only:
        return 0
    args.tokenizer = args.tokenizer or gguf_models.tokenizer_dir(args.models_dir)
    tokenizer = load_tokenizer(args.tokenizer)
    out_path = args.output or os.path.join(
        BENCH_DIR, f"gguf-sizes-{datetime.now():%Y%m%d-%H%M%S}.jsonl"
    )
    out = ResultFile(
        out_path,
        "gguf-sizes",
        argv=sys.argv[1:] if argv is None else argv,
        note="other jobs may have been running on this machine",
        **cpu_features(),
    )
    wl = workload(args)
    for spec in args.model_specs:
        path = paths[spec]
        # (not "model": a load run's record has the served model's name there)
        out.header.update(model_spec=spec, model_file=os.path.relpath(path, ROOT))
        for engine in args.engines:
            measure(engine, spec, path, args, out, tokenizer, wl)

    print(f"\n## gguf-sizes ({caption(out.records)})\n")
    print(tables(out.records))
    print(
        "\nRSS: VmRSS summed over the server's process tree (sampled every "
        f"{args.sample_interval} s); PSS: shared pages counted once; disk: bytes left in its fresh "
        "$RELAY_CACHE_DIR and $TMPDIR. "
        "TTFT/ITL are client-side; a streamed chunk of k tokens counts as k gaps of gap/k."
    )
    print(
        f"\nresults: {os.path.relpath(out_path, ROOT)}\ntotal time: {time.monotonic() - t_start:.0f} s"
    )
    ok = [r for r in out.records if not r.get("error")]
    return 0 if ok and len(ok) == len(out.records) else 1


if __name__ == "__main__":
    sys.exit(main())
