"""The one result format of every subcommand: JSON lines, one record per measured run, each record its
metrics under the names metrics.py gives them plus a header saying where and when it ran:

  bench      the subcommand (serving, compare, dp, goodput, structured, hardening, scheduler, ...)
  timestamp  ISO time of the record
  git        the checkout's short commit
  host, cpu, cpus, cpu_flags, load_avg   the machine, its SIMD/AMX flags and its 1-minute load average
             when the run started (other jobs on a shared machine show there)

A file may hold records of several subcommands and runs; `load` reads any number of them (and the older
{"meta": ..., "runs": [...]} files of scripts/compare.py).
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess
from datetime import datetime
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH_DIR = os.path.join(ROOT, ".bench")
SIMD_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_int8")


def cpu_info() -> tuple[str, list[str]]:
    """The CPU's model name and which of SIMD_FLAGS it has (from /proc/cpuinfo)."""
    model, flags = platform.processor() or "cpu", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    model = value.strip()
                elif key.strip() == "flags":
                    flags = set(value.split())
                if model and flags:
                    break
    except OSError:
        pass  # not Linux: the model name platform gives
    return model, [f for f in SIMD_FLAGS if f in flags]


def machine() -> str:
    """One line for a table's caption: model, cores, SIMD flags."""
    model, flags = cpu_info()
    return f"{model}, {len(os.sched_getaffinity(0))} cores, {' '.join(flags) or 'no AVX2'}"


def git_rev() -> str | None:
    try:
        return (
            subprocess.run(
                ["git", "rev-parse", "--short", "HEAD"],
                cwd=ROOT,
                capture_output=True,
                text=True,
                timeout=10,
                check=False,
            ).stdout.strip()
            or None
        )
    except (OSError, subprocess.SubprocessError):
        return None


def header(bench: str, **extra: Any) -> dict[str, Any]:
    model, flags = cpu_info()
    return {
        "bench": bench,
        "timestamp": datetime.now().isoformat(timespec="seconds"),
        "git": git_rev(),
        "host": platform.node(),
        "cpu": model,
        "cpus": len(os.sched_getaffinity(0)),
        "cpu_flags": flags,
        "load_avg": os.getloadavg()[0],
        **extra,
    }


def jsonable(value: Any) -> Any:
    """Infinities (an unlimited request rate) as "inf": JSON has no literal for them."""
    if isinstance(value, float) and math.isinf(value):
        return "inf"
    if isinstance(value, dict):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    return value


def args_record(args) -> dict[str, Any]:
    return jsonable(dict(vars(args)))


class ResultFile:
    """Records of one run of a subcommand: each `add` stamps the header and appends one JSON line to
    `path` (none written when path is None) at once, so an interrupted run keeps what it measured."""

    def __init__(self, path: str | None, bench: str, **extra: Any):
        self.path, self.header = path, header(bench, **extra)
        self.records: list[dict[str, Any]] = []

    def add(self, fields: dict[str, Any]) -> dict[str, Any]:
        # The header's bench wins: a record carried over from another subcommand (compare keeps serving's)
        # is filed under the one that wrote it here.
        record = jsonable(
            {
                **self.header,
                "timestamp": datetime.now().isoformat(timespec="seconds"),
                **fields,
                "bench": self.header["bench"],
            }
        )
        self.records.append(record)
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "a") as f:
                f.write(json.dumps(record) + "\n")
        return record


def _legacy_compare_runs(saved: dict[str, Any]) -> list[dict[str, Any]]:
    """An older compare results file: its meta spread over each of its runs."""
    meta = saved.get("meta", {})
    stamp = {
        "bench": "compare",
        "timestamp": meta.get("date"),
        "git": meta.get("git"),
        "host": meta.get("host"),
        "cpus": meta.get("cpus"),
        "load_avg": (meta.get("load_avg_start") or [0.0])[0],
    }
    return [{**stamp, **run} for run in saved.get("runs", [])]


def load(paths: list[str]) -> list[dict[str, Any]]:
    """Every record of the given files, in order."""
    records: list[dict[str, Any]] = []
    for path in paths:
        with open(path) as f:
            text = f.read()
        try:
            whole = json.loads(text)
        except json.JSONDecodeError:
            whole = None  # JSON lines
        if isinstance(whole, dict) and "runs" in whole:
            records += _legacy_compare_runs(whole)
        elif isinstance(whole, dict):
            records.append(whole)
        else:
            records += [json.loads(line) for line in text.splitlines() if line.strip()]
    return records
