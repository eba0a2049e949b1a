"""Check a built Relay wheel as a pip user would get it (run by .ci/run).

  python scripts/check_wheel.py WHEEL                       its module list against this checkout
  python scripts/check_wheel.py WHEEL --python VENV/bin/python
      ... and, with that interpreter (a fresh venv with the wheel installed, not -e), import every
      module and start `python -m launch.serve --load-format dummy-null` from a folder outside
      the checkout until it is ready, then stop it.

Exits 1 naming what is wrong: a module or C source of the checkout that the wheel lacks (an
editable install hides such a gap), a module that fails to import from the wheel, or a server
that does not come up.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import zipfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Where each top-level package lives in the checkout (pyproject.toml finds them there)
PACKAGE_DIRS = {"relay": "src/relay", "ipc": "ipc", "procs": "procs", "launch": "launch"}
READY_LINE = "Relay is ready"
# GPU-only packages that CUDA builds of torch bring; modules that need them are skipped where absent
GPU_ONLY_PACKAGES = ("triton", "flashinfer")


def checkout_files(root: str = ROOT) -> set[str]:
    """The files a wheel must carry, as paths inside the wheel: every module and C source."""
    files = set()
    for package, folder in PACKAGE_DIRS.items():
        base = os.path.join(root, folder)
        for dirpath, dirnames, names in os.walk(base):
            dirnames[:] = [d for d in dirnames if d != "__pycache__"]
            for name in names:
                if name.endswith((".py", ".c", ".h")):
                    rel = os.path.relpath(os.path.join(dirpath, name), base)
                    files.add(f"{package}/{rel}".replace(os.sep, "/"))
    return files


def missing_from_wheel(wheel: str, root: str = ROOT) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        return sorted(checkout_files(root) - set(z.namelist()))


def module_names(root: str = ROOT) -> list[str]:
    names = []
    for path in sorted(checkout_files(root)):
        if path.endswith(".py"):
            name = path[:-3].replace("/", ".")
            names.append(name[: -len(".__init__")] if name.endswith(".__init__") else name)
    return names


def import_all(python: str, modules: list[str], cwd: str) -> None:
    code = (
        "import importlib, sys\n"
        "for m in sys.argv[1:]:\n"
        "    try:\n"
        "        importlib.import_module(m)\n"
        "    except ModuleNotFoundError as e:\n"
        f"        if e.name not in {GPU_ONLY_PACKAGES!r}:\n"
        "            raise\n"
        "        print(f'skipped {m}: needs {e.name} (GPU only)')\n"
    )
    out = subprocess.run([python, "-c", code, *modules], cwd=cwd, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"importing the wheel's modules failed:\n{out.stderr[-3000:]}")
    print(out.stdout, end="")
    print(f"imported the installed wheel's {len(modules)} modules")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop_group(proc: subprocess.Popen, sig: int) -> None:
    """Signal the server's session (it and its children); it may have ended already."""
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        pass


def serve_until_ready(python: str, cwd: str, timeout: float = 300.0) -> None:
    cmd = [python, "-m", "launch.serve", "--load-format", "dummy-null", "--port", str(free_port())]
    proc = subprocess.Popen(
        cmd,
        cwd=cwd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        start_new_session=True,
    )
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in proc.stdout:
            lines.append(line)
            if READY_LINE in line:
                ready.set()
        ready.set()  # it ended: wake the waiter

    threading.Thread(target=read, daemon=True).start()
    came_up = ready.wait(timeout) and proc.poll() is None
    stop_group(proc, signal.SIGTERM)
    try:
        code = proc.wait(60)
    except subprocess.TimeoutExpired:
        stop_group(proc, signal.SIGKILL)
        code = proc.wait()
    if not came_up:
        raise SystemExit(f"`{' '.join(cmd)}` in {cwd} did not get ready:\n{''.join(lines[-60:])}")
    print(f"the installed wheel served (dummy-null) from {cwd} and stopped with exit {code}")
    print(
        "".join(line for line in lines if "off: " in line), end=""
    )  # what a pip-only install lacks
    if code != 0:
        raise SystemExit(f"the server exited {code} on SIGTERM:\n{''.join(lines[-60:])}")


def main() -> None:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("wheel")
    p.add_argument("--python", help="an interpreter whose environment has the wheel installed")
    args = p.parse_args()
    missing = missing_from_wheel(args.wheel)
    if missing:
        raise SystemExit(
            f"{args.wheel} lacks {len(missing)} files of the checkout: {', '.join(missing)}"
        )
    print(f"{os.path.basename(args.wheel)} holds every module and C source of the checkout")
    if args.python:
        with tempfile.TemporaryDirectory(prefix="relay-wheel-check-") as outside:
            import_all(args.python, module_names(), outside)
            serve_until_ready(args.python, outside)


if __name__ == "__main__":
    sys.exit(main())
