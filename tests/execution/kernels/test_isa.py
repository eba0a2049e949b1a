"""The instruction-set level the CPU kernels run at: found from the CPU's flags, held lower with
RELAY_CPU_ISA (never above what the CPU has), and what a held level holds torch and gcc to."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from relay.execution.kernels import isa
from tests.helpers.paths import ROOT

ZEN3 = "fpu sse4_2 avx avx2 fma f16c bmi2"
ZEN4 = ZEN3 + " avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni avx512_bf16"
SPR = ZEN4 + " amx_tile amx_bf16 amx_int8"


@pytest.mark.parametrize(
    "flags,level",
    [
        ("fpu sse4_2", "generic"),
        (ZEN3, "avx2"),
        (ZEN3 + " avx512f", "avx2"),
        (ZEN4.replace(" avx512_bf16", ""), "avx512"),
        (ZEN4, "avx512bf16"),
        (SPR, "amx"),
    ],
)
def test_the_level_is_the_highest_whose_flags_the_cpu_lists(flags, level, monkeypatch):
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    assert isa.detected_level(flags) == level


def test_a_level_is_held_lower_but_never_raised(monkeypatch):
    monkeypatch.setattr(isa, "detected_level", lambda flags=None: "avx512bf16")
    assert isa.level({}) == "avx512bf16"
    assert isa.level({isa.ENV: "AVX2"}) == "avx2"
    with pytest.raises(ValueError, match="reaches 'avx512bf16' at most"):
        isa.level({isa.ENV: "amx"})
    with pytest.raises(ValueError, match=isa.ENV):
        isa.level({isa.ENV: "sse9"})


def test_a_held_level_holds_torch_and_the_compiler(monkeypatch):
    monkeypatch.setattr(isa, "detected_level", lambda flags=None: "amx")
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    assert isa.torch_env("amx") == {}  # the CPU's own level: torch as it comes
    assert isa.torch_env("avx2") == {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
    assert isa.torch_env("avx512bf16")["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    assert (
        isa.torch_env("avx512bf16")["MKL_ENABLE_INSTRUCTIONS"] == "AVX512_E3"
    )  # VNNI + BF16, no AMX
    assert isa.torch_env("avx512")["MKL_ENABLE_INSTRUCTIONS"] == "AVX512"
    assert isa.torch_env("generic")["MKL_ENABLE_INSTRUCTIONS"] == "SSE4_2"
    assert isa.compile_flags("amx") == ["-march=native"]
    assert "-mno-amx-tile" in isa.compile_flags("avx512bf16")
    assert isa.compile_flags("avx2")[0] == "-march=x86-64-v3"


def test_an_avx512_cpu_builds_with_its_own_extras_and_a_held_level_without_them(monkeypatch):
    """At its own level an AVX-512 CPU without bf16 (a Cascade Lake) builds for all it has, VNNI
    included; a newer CPU held to avx512 builds for x86-64-v4 only, as such a CPU without VNNI would."""
    monkeypatch.setattr(isa.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(isa, "detected_level", lambda flags=None: "avx512")
    assert isa.compile_flags("avx512") == ["-march=native"]
    monkeypatch.setattr(isa, "detected_level", lambda flags=None: "avx512bf16")
    assert isa.compile_flags("avx512")[0] == "-march=x86-64-v4"


def test_the_launcher_refuses_an_unknown_level_before_anything_starts(monkeypatch, capsys):
    from launch import serve

    monkeypatch.setenv(isa.ENV, "sse9")
    with pytest.raises(SystemExit) as stop:
        serve.main([])
    assert stop.value.code == 2 and isa.ENV in capsys.readouterr().err


@pytest.mark.slow
def test_a_server_held_to_avx2_serves_and_says_so(monkeypatch, default_model_dir):
    """The whole server as an AVX2-only CPU runs it (a Zen 3): kernels built for avx2, torch held,
    the default model's answer unchanged, and the level on /get_server_info and in the log."""
    from tests.helpers.server_utils import Server

    if not isa.at_least("avx2"):
        pytest.skip("this CPU does not reach avx2")
    monkeypatch.setenv(isa.ENV, "avx2")
    server = Server("--kv-cache-gb", "0.2")
    try:
        with server.client() as c:
            assert c.get("/get_server_info").json()["cpu_isa"] == "avx2"
            body = {"prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
            assert "Paris" in c.post("/v1/completions", json=body).json()["choices"][0]["text"]
    finally:
        server.stop()
    assert "CPU kernels built for avx2 (held there by RELAY_CPU_ISA)" in server.log
    if isa.detected_level() != "avx2":
        assert f"CPU instruction-set level: avx2 (held by {isa.ENV}" in server.log


def test_the_install_step_builds_the_library_the_server_loads():
    """scripts/install.sh's `python -m relay.execution.kernels` must leave the library where a
    server looks for it (else every first start compiles again); run here on the tests' own cache,
    where it is already built, so it only checks the name."""
    from relay.execution.kernels import cpu

    if cpu.compiler() is None:
        pytest.skip("no C compiler here")
    done = subprocess.run(
        [sys.executable, "-m", "relay.execution.kernels"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.split(": ")[1].split(" (")[0] == cpu.library_path()
    assert os.path.exists(cpu.library_path())
    install = os.path.join(ROOT, "scripts", "install.sh")
    with open(install) as f:
        assert "-m relay.execution.kernels" in f.read()
