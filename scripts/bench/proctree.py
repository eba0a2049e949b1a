"""The memory of a server's whole process tree, sampled from /proc while it runs (for gguf_sizes.py).

A Sampler thread reads, every `interval` seconds from the server's launch to its stop, VmRSS of the root
process and of every descendant (found through /proc/PID/task/*/children, or PPid in /proc/*/stat where
the kernel has no children files), and keeps the highest sum, each process's highest VmRSS and, from its
last reading, its VmHWM (the kernel's own peak of that process) and its write_bytes (/proc/PID/io);
pss_by_title reads each live process's proportional set size (/proc/PID/smaps_rollup) on demand.
Processes are named by their title (`relay::sched`: what setproctitle wrote into their command line) or
their program's name, so that a table adds up by role.

The pure parts (walking a tree, summing a snapshot, naming a process) take their /proc readers as
functions, so that tests give them a fake /proc.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

KB = 1024


def parse_status(text: str) -> dict[str, str]:
    """/proc/PID/status as {key: value}: 'VmRSS:\t  1234 kB' -> {'VmRSS': '1234 kB'}."""
    out = {}
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip()] = value.strip()
    return out


def kb(status: dict[str, str], key: str) -> int:
    """A status field in bytes ('1234 kB' -> 1263616); 0 when absent (a kernel thread, a zombie)."""
    value = status.get(key, "")
    parts = value.split()
    return int(parts[0]) * KB if parts and parts[0].isdigit() else 0


def process_title(argv: list[str], comm: str = "") -> str:
    """How a table names a process: a title set with setproctitle ('relay::sched dp1') as it is, a
    Python module run with -m by its module ('python -m launch.serve' -> 'python -m launch.serve'), else
    the program's base name ('/x/bin/llama-server' -> 'llama-server'); comm when argv is empty."""
    if not argv or not argv[0]:
        return comm or "?"
    first = argv[0]
    if "::" in first or (len(argv) == 1 and " " in first):
        return first.strip()  # setproctitle writes one string over the whole command line
    prog = os.path.basename(first)
    if prog.startswith("python") and "-m" in argv[1:-1]:
        return f"{prog} -m {argv[argv.index('-m', 1) + 1]}"
    if prog.startswith("python") and len(argv) > 1 and not argv[1].startswith("-"):
        return f"{prog} {os.path.basename(argv[1])}"
    return prog


def tree_pids(root: int, children_of: Callable[[int], Iterable[int]]) -> list[int]:
    """root and every descendant, parents before children."""
    seen, order, todo = {root}, [root], [root]
    while todo:
        pid = todo.pop(0)
        for child in children_of(pid):
            if child not in seen:
                seen.add(child)
                order.append(child)
                todo.append(child)
    return order


@dataclass
class ProcRecord:
    """One process of the tree over the run."""

    pid: int
    title: str
    rss: int = 0  # the last reading, bytes
    peak_rss: int = 0  # the highest reading
    hwm: int = 0  # VmHWM at the last reading
    write_bytes: int = 0  # /proc/PID/io at the last reading: what it had written to storage
    first_seen: float = 0.0
    last_seen: float = 0.0


@dataclass
class TreeState:
    """What the samples saw: each process, the highest sum of the tree's VmRSS and when."""

    procs: dict[int, ProcRecord] = field(default_factory=dict)
    peak_rss: int = 0
    peak_at: float = 0.0
    samples: int = 0
    last_rss: int = 0  # the tree's sum at the last sample
    last_at: float = 0.0  # and when it was taken

    def update(
        self,
        root: int,
        children_of: Callable[[int], Iterable[int]],
        status_of: Callable[[int], dict[str, str] | None],
        title_of: Callable[[int], str],
        io_of: Callable[[int], int | None] = lambda pid: None,
        now: float = 0.0,
    ) -> int:
        """One sample: the tree's VmRSS sum now (processes gone meanwhile count 0). Returns it."""
        total = 0
        for pid in tree_pids(root, children_of):
            status = status_of(pid)
            if status is None:
                continue  # gone meanwhile
            rec = self.procs.get(pid)
            if rec is None:
                rec = self.procs[pid] = ProcRecord(pid, title_of(pid), first_seen=now)
            elif rec.title != (title := title_of(pid)) and title != "?":
                rec.title = title  # it set its title after we first saw it (setproctitle at start)
            rec.rss = kb(status, "VmRSS")
            rec.peak_rss = max(rec.peak_rss, rec.rss)
            rec.hwm = max(rec.hwm, kb(status, "VmHWM"))
            written = io_of(pid)
            if written is not None:
                rec.write_bytes = written
            rec.last_seen = now
            total += rec.rss
        self.samples += 1
        self.last_rss, self.last_at = total, now
        if total > self.peak_rss:
            self.peak_rss, self.peak_at = total, now
        return total

    def by_title(self, since: float = float("-inf"), key: str = "rss") -> dict[str, int]:
        """A field of ProcRecord summed per title, over the processes seen at `since` or later."""
        out: dict[str, int] = {}
        for rec in self.procs.values():
            if rec.last_seen >= since:
                out[rec.title] = out.get(rec.title, 0) + getattr(rec, key)
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def alive_at(self, t: float) -> list[ProcRecord]:
        return [r for r in self.procs.values() if r.last_seen >= t]

    def pss_by_title(self, pss_of: Callable[[int], int | None]) -> dict[str, int]:
        """Proportional set size per title of the processes alive at the last sample: shared pages
        (torch's libraries in every Python process, a file two of them map) counted once over all,
        where VmRSS counts them in each."""
        out: dict[str, int] = {}
        for rec in self.alive_at(self.last_at):
            pss = pss_of(rec.pid)
            if pss is not None:
                out[rec.title] = out.get(rec.title, 0) + pss
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))


# ---------------------------------------------------------------------------- /proc readers ---


def read_text(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except OSError:
        return None


def proc_status(pid: int, proc: str = "/proc") -> dict[str, str] | None:
    text = read_text(f"{proc}/{pid}/status")
    if text is None:
        return None
    status = parse_status(text)
    if status.get("State", "").startswith("Z"):
        return None  # a zombie holds no memory
    return status


def proc_children(pid: int, proc: str = "/proc") -> list[int]:
    """Children of pid from /proc/PID/task/*/children (kernels with CONFIG_PROC_CHILDREN), else from
    every process's PPid."""
    try:
        tasks = os.listdir(f"{proc}/{pid}/task")
    except OSError:
        return []
    kids: list[int] = []
    found = False
    for tid in tasks:
        text = read_text(f"{proc}/{pid}/task/{tid}/children")
        if text is not None:
            found = True
            kids += [int(x) for x in text.split()]
    if found:
        return kids
    return [p for p, ppid in proc_parents(proc).items() if ppid == pid]


def proc_parents(proc: str = "/proc") -> dict[int, int]:
    """Every process's parent (from /proc/PID/stat: the field after the parenthesised name)."""
    out = {}
    for name in os.listdir(proc):
        if name.isdigit():
            text = read_text(f"{proc}/{name}/stat")
            if text and ")" in text:
                fields = text.rsplit(")", 1)[1].split()
                if len(fields) > 1:
                    out[int(name)] = int(fields[1])
    return out


def proc_title(pid: int, proc: str = "/proc") -> str:
    raw = read_text(f"{proc}/{pid}/cmdline") or ""
    comm = (read_text(f"{proc}/{pid}/comm") or "").strip()
    return process_title([a for a in raw.split("\0") if a] if raw else [], comm)


def proc_pss(pid: int, proc: str = "/proc") -> int | None:
    """Pss of /proc/PID/smaps_rollup in bytes (None where unreadable)."""
    text = read_text(f"{proc}/{pid}/smaps_rollup")
    if not text:
        return None
    status = parse_status(text)
    return kb(status, "Pss") if "Pss" in status else None


def proc_write_bytes(pid: int, proc: str = "/proc") -> int | None:
    text = read_text(f"{proc}/{pid}/io")  # readable for our own processes (or as root)
    value = parse_status(text).get("write_bytes", "") if text else ""
    return int(value) if value.isdigit() else None


class Sampler:
    """`with Sampler(lambda: server.proc) as s:` samples the tree of the process the function returns
    (None until it is started) every `interval` seconds in a thread, until the block ends (or stop())."""

    def __init__(self, root: Callable[[], object], interval: float = 0.2, proc: str = "/proc"):
        self.root, self.interval, self.proc = root, interval, proc
        self.state = TreeState()
        self.t0 = time.monotonic()
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def __enter__(self) -> Sampler:
        self.t0 = time.monotonic()
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def _pid(self) -> int | None:
        p = self.root()
        return getattr(p, "pid", p) if p is not None else None

    def sample(self) -> int:
        """One sample now (also from the caller's thread: the last one before a stop)."""
        pid = self._pid()
        if pid is None:
            return 0
        with self._lock:
            return self.state.update(
                pid,
                lambda p: proc_children(p, self.proc),
                lambda p: proc_status(p, self.proc),
                lambda p: proc_title(p, self.proc),
                lambda p: proc_write_bytes(p, self.proc),
                now=time.monotonic() - self.t0,
            )

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sample()
            except Exception:  # noqa: BLE001 - a sample lost to a race must not end the sampling
                pass
            self._stop.wait(self.interval)

    def stop(self) -> None:
        if not self._stop.is_set():
            self._stop.set()
            self._thread.join(5)

    def now(self) -> float:
        return time.monotonic() - self.t0
