"""What a pip user installs: the wheel carries every module and C source of the checkout (an
editable install hides a package left out), and the start-up log names the features that are off."""

from __future__ import annotations

import subprocess
import sys
import zipfile

import pytest

from relay import optional_features
from scripts.check_wheel import ROOT, checkout_files, missing_from_wheel, module_names


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("dist")
    # No build isolation: the test environment's setuptools builds it, with no index needed
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-q",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(out),
            ROOT,
        ],
        check=True,
        capture_output=True,
    )
    return str(next(out.glob("relay-*.whl")))


def test_the_wheel_holds_every_module_and_c_source(wheel):
    assert missing_from_wheel(wheel) == []
    names = set(module_names())
    for expected in (
        "relay.scheduling.speculative.ngram",
        "relay.execution.kernels.cpu",
        "procs.scheduler",
        "ipc.codec",
        "launch.serve",
    ):
        assert expected in names
    assert "relay/execution/kernels/csrc/gemm_blocks.c" in checkout_files()


def test_a_module_left_out_of_the_wheel_is_named(wheel, tmp_path):
    thinned = tmp_path / "thinned.whl"
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(thinned, "w") as dst:
        for item in src.infolist():
            if not item.filename.startswith("relay/scheduling/speculative/"):
                dst.writestr(item, src.read(item))
    missing = missing_from_wheel(str(thinned))
    assert (
        "relay/scheduling/speculative/ngram.py" in missing
        and "relay/scheduling/speculative/__init__.py" in missing
    )


def test_missing_optional_packages_are_named_with_how_to_install(monkeypatch):
    monkeypatch.setattr(optional_features, "_installed", lambda module: module != "xgrammar")
    off = optional_features.missing_features()
    assert len(off) == 1 and "xgrammar" in off[0] and "relay[grammar]" in off[0]
    monkeypatch.setattr(optional_features, "_installed", lambda module: True)
    monkeypatch.setattr(optional_features, "compiler", lambda: None)
    assert [line.split(":")[0] for line in optional_features.missing_features()] == [
        "Relay's C kernels for CPUs"
    ]


def test_optional_features_finds_the_c_compiler_as_the_kernels_do(monkeypatch):
    """optional_features keeps its own copy of the kernels' compiler rule (their module imports
    torch, which the launcher must not): the two agree, with $CC set or not."""
    from relay.execution.kernels import cpu

    for cc in (None, "/opt/some-cc"):
        if cc is None:
            monkeypatch.delenv("CC", raising=False)
        else:
            monkeypatch.setenv("CC", cc)
        assert optional_features.compiler() == cpu.compiler()
