"""The instruction-set level the CPU kernels run at: found from the CPU's flags, held lower with
RELAY_CPU_ISA (never above what the CPU has), and what a held level holds torch and gcc to."""
from __future__ import annotations

import pytest

from relay.kernels import isa

ZEN3 = "fpu sse4_2 avx avx2 fma f16c bmi2"
ZEN4 = ZEN3 + " avx512f avx512bw avx512cd avx512dq avx512vl avx512_vnni avx512_bf16"
SPR = ZEN4 + " amx_tile amx_bf16 amx_int8"


@pytest.mark.parametrize("flags,level", [("fpu sse4_2", "generic"), (ZEN3, "avx2"), (ZEN3 + " avx512f", "avx2"),
                                         (ZEN4.replace(" avx512_bf16", ""), "avx512"), (ZEN4, "avx512bf16"),
                                         (SPR, "amx")])
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
    assert isa.torch_env("avx2") == {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    assert isa.torch_env("avx512bf16")["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"
    assert isa.compile_flags("amx") == ["-march=native"]
    assert "-mno-amx-tile" in isa.compile_flags("avx512bf16")
    assert isa.compile_flags("avx2")[0] == "-march=x86-64-v3"


def test_the_launcher_refuses_an_unknown_level_before_anything_starts(monkeypatch, capsys):
    from launch import serve

    monkeypatch.setenv(isa.ENV, "sse9")
    with pytest.raises(SystemExit) as stop:
        serve.main([])
    assert stop.value.code == 2 and isa.ENV in capsys.readouterr().err
