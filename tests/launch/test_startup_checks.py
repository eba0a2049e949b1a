"""What the server checks at start-up, before any model loads: its port, the cache directory
and the model file. Each failure is one log line naming what to fix and exit status 2, and
leaves nothing behind in the cache (no lock files). No server is started: each of these
stops within the interpreter's start-up time."""

from __future__ import annotations

import fcntl
import os
import socket
import threading

import pytest

from relay.execution import model_files
from relay.execution.model_files import ModelFileError, resolve_model_dir
from tests.helpers.server_utils import assert_one_line_error, serve, wait_until


def test_a_taken_port_stops_the_server_before_any_model_loads():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = serve("--port", str(port))
    assert_one_line_error(out, f"127.0.0.1:{port}")
    assert "relay::" not in out.stderr, "no child process started"


def test_dp_checks_its_ports_before_starting_replicas():
    """--dp: the front door's port is bound, the router's metrics port must be free."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        front = serve("--dp", "2", "--port", port)
        metrics = serve("--dp", "2", "--port", "0", "--router-prometheus-port", port)
    assert_one_line_error(front, f"127.0.0.1:{port}")
    assert_one_line_error(metrics, f"127.0.0.1:{port}", "--router-prometheus-port")


@pytest.mark.parametrize("value", ["-1", "nan", "inf"])
def test_a_shutdown_timeout_that_is_not_a_number_of_seconds_is_refused(value):
    out = serve("--shutdown-timeout", value)
    assert (
        out.returncode == 2
        and "--shutdown-timeout must be a finite number of seconds >= 0" in out.stderr
    )


def test_a_cache_directory_that_is_a_file(tmp_path):
    path = tmp_path / "cache"
    path.write_text("not a directory")
    assert_one_line_error(serve("--port", "0", cache_dir=str(path)), str(path))


def cut(src: str, dst, keep: int) -> str:
    with open(src, "rb") as f, open(dst, "wb") as out:
        out.write(f.read(keep))
    return str(dst)


def test_a_damaged_gguf_file_is_one_line(tmp_path):
    path = cut(model_files.default_model_file(), tmp_path / "small.gguf", 1024)
    cache = tmp_path / "cache"
    assert_one_line_error(serve("--port", "0", "--model-path", path, cache_dir=str(cache)), path)
    assert not list(cache.rglob("*")), "nothing is left in the cache"


@pytest.mark.parametrize(
    "keep", [0, 1024, 0.5, -100], ids=["empty", "1KB", "half", "last-100-bytes"]
)
def test_damaged_gguf_files_are_refused_before_converting(tmp_path, monkeypatch, keep):
    src = model_files.default_model_file()
    size = os.path.getsize(src)
    n = int(size * keep) if isinstance(keep, float) else keep if keep >= 0 else size + keep
    path = cut(src, tmp_path / "model.gguf", n)
    monkeypatch.setenv("RELAY_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelFileError, match="not a whole GGUF file") as info:
        resolve_model_dir(path)
    assert path in str(info.value) and "\n" not in str(info.value)
    assert not list((tmp_path / "cache").rglob("*"))


@pytest.mark.parametrize(
    "arch,writer,marker",
    [
        ("gemma2", "_write_hf_dir", model_files.CONVERTED_MARKER),  # converted to float32
        ("llama", "_write_gguf_dir", model_files.GGUF_MARKER),  # served from the file
    ],
)
def test_a_failed_conversion_leaves_no_lock_or_partial_files(
    tmp_path, monkeypatch, arch, writer, marker
):
    src = str(tmp_path / "model.gguf")
    os.symlink(model_files.default_model_file(), src)
    monkeypatch.setenv("RELAY_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(model_files, "check_gguf", lambda path: (arch, {}))

    def fail(gguf_path: str, out: str, stated: dict) -> None:
        open(os.path.join(out, "config.json"), "w").close()
        raise ValueError("tensor blk.3.ffn_down.weight is [576, 1536] where the config says ...")

    monkeypatch.setattr(model_files, writer, fail)
    with pytest.raises(ModelFileError, match="converting .* failed: tensor blk.3.ffn_down"):
        resolve_model_dir(src)
    assert os.listdir(tmp_path / "cache" / "gguf") == []

    monkeypatch.setattr(
        model_files,
        writer,
        lambda gguf_path, out, stated: open(os.path.join(out, marker), "w").close(),
    )
    done = resolve_model_dir(src)
    assert os.listdir(tmp_path / "cache" / "gguf") == [os.path.basename(done)], (
        "converted, and no lock file"
    )


def waiters_on(path: str) -> int:
    """Processes or threads blocked on a flock of the file at path (/proc/locks marks them ->)."""
    ino = os.stat(path).st_ino
    with open("/proc/locks") as f:
        return sum("->" in line and f":{ino} " in line for line in f)


def test_a_waiter_on_a_removed_lock_file_takes_the_lock_of_the_new_one(tmp_path):
    """The lock file is removed on release. A waiter that then gets the lock of the removed file
    must move to a new file at the path, or it would run beside whoever locks that one."""
    path, inside, release = str(tmp_path / "x.lock"), threading.Event(), threading.Event()

    def waiter() -> None:
        with model_files._file_lock(path):
            inside.set()
            release.wait(30)

    thread = threading.Thread(target=waiter)
    with model_files._file_lock(path):
        thread.start()
        wait_until(lambda: waiters_on(path), 10, "the waiter to block on the lock")
    assert inside.wait(10)
    try:
        with (
            open(path) as f,
            pytest.raises(BlockingIOError),
        ):  # the file at the path is the waiter's
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        release.set()
        thread.join()
    assert not os.path.exists(path)
