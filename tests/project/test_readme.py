"""README.md's claims: each has a test (tests/helpers/readme_claims.py), and what the README shows runs.

Its Python examples against a server and offline, its install script's order, and the claims of its
opening that no other file tests: the defaults' greedy output is reproducible, `--deterministic` is
the exact path, `--dtype auto` follows the CPU's bf16 instructions.
"""

from __future__ import annotations

import ast
import contextlib
import io
import os
import re
import subprocess
import sys

import pytest

from tests.helpers.readme_claims import CLAIMS
from tests.helpers.server_utils import ROOT, Server

README = os.path.join(ROOT, "README.md")


def readme() -> str:
    return open(README).read()


def flat(text: str) -> str:
    return " ".join(text.split())


def feature_headings() -> list[str]:
    """The bold headings of the bullets under "## What you can do"."""
    section = readme().split("## What you can do", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^- \*\*(.+?)\*\*", section, flags=re.M)


def defined_tests(path: str) -> set[str]:
    tree = ast.parse(open(os.path.join(ROOT, path)).read())
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
        and node.name.startswith("test_")
    }


def python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", readme(), flags=re.S)


def test_every_feature_has_claims_in_the_readme_and_every_claim_a_test():
    headings = feature_headings()
    assert len(headings) >= 10, headings
    claimed = {bullet for bullet, _, _ in CLAIMS}
    assert [h for h in headings if h not in claimed] == [], "a bullet without a claim"
    stale = claimed - set(headings) - {"opening", "quick start"}
    assert not stale, f"claims of bullets the README no longer has: {stale}"
    text = flat(readme())
    assert [piece for _, piece, _ in CLAIMS if flat(piece) not in text] == []
    missing = []
    for _, _, nodes in CLAIMS:
        assert nodes
        for node in nodes:
            path, name = node.split("::")
            if not os.path.exists(os.path.join(ROOT, path)) or name not in defined_tests(path):
                missing.append(node)
    assert missing == []


def test_deterministic_is_float32_on_float_activations_and_refuses_the_rest():
    from launch.flags import build_parser, engine_config
    from relay.config import EngineConfig

    cfg = engine_config(build_parser().parse_args(["--deterministic", "--tp", "2"]))
    assert (cfg.dtype, cfg.block_activations, cfg.quantization) == ("float32", "float", None)
    assert EngineConfig.from_dict(cfg.to_dict()) == cfg  # as it travels to every process
    assert EngineConfig(deterministic=True) == EngineConfig(
        deterministic=True, dtype="float32", block_activations="float"
    )
    for against in (
        {"dtype": "bfloat16"},
        {"kv_cache_dtype": "bfloat16"},
        {"block_activations": "int8"},
        {"quantization": "int4"},
    ):
        with pytest.raises(ValueError, match=next(iter(against))):
            EngineConfig(deterministic=True, **against)
    out = subprocess.run(
        [sys.executable, "-m", "launch.serve", "--deterministic", "--quantization", "w8a8"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and "quantization='w8a8'" in out.stderr.splitlines()[-1]


@pytest.mark.parametrize("level", ["generic", "avx2", "avx512", "avx512bf16", "amx"])
def test_auto_dtype_is_bfloat16_only_where_the_cpu_has_bf16_instructions(monkeypatch, level):
    import torch

    from relay.execution.kernels import isa
    from relay.execution.placement import pick_dtype

    if not isa.at_least(level, isa.detected_level()):
        pytest.skip(f"this CPU does not reach {level}")
    monkeypatch.setenv("RELAY_CPU_ISA", level)
    bf16 = level in ("avx512bf16", "amx")
    assert pick_dtype("auto", torch.device("cpu")) == (torch.bfloat16 if bf16 else torch.float32)


def test_the_install_script_installs_the_no_deps_packages_last():
    """pip checks an install against every package already there: xgrammar installed (--no-deps)
    before Relay made `pip install -e .` print "ERROR: pip's dependency resolver ... xgrammar
    requires triton". And the README's Python example needs the openai client."""
    lines = [
        line.strip()
        for line in open(os.path.join(ROOT, "scripts", "install.sh"))
        if "pip install" in line and not line.lstrip().startswith("#")
    ]
    relay = next(i for i, line in enumerate(lines) if "install -e" in line)
    no_deps = [i for i, line in enumerate(lines) if "--no-deps" in line]
    assert len(no_deps) == 2 and min(no_deps) > relay, lines
    pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
    deps = pyproject.split("\ndependencies = [", 1)[1].split("\n]", 1)[0]
    assert re.search(r'^\s*"openai>=', deps, flags=re.M)
    assert any("from openai import OpenAI" in block for block in python_blocks())


def test_default_quality_script_parses_its_help():
    out = subprocess.run(
        [sys.executable, "scripts/default_quality.py", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0 and "--deterministic" in out.stdout


def run_block(block: str, **replace) -> str:
    for old, new in replace.items():
        assert old in block
        block = block.replace(old, new)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, "README.md", "exec"), {})
    return printed.getvalue()


@pytest.mark.slow
def test_the_readme_openai_example_runs_against_a_server():
    """The README's server, started as it says (only the port differs), answers its example."""
    (block,) = [b for b in python_blocks() if "from openai import OpenAI" in b]
    # the defaults time their steps at start: slow on a busy host
    server = Server(startup_timeout=900)
    try:
        printed = run_block(block, **{"http://127.0.0.1:30000": server.url})
    finally:
        server.stop()
    assert "Paris" in printed


@pytest.mark.slow
def test_the_readme_offline_example_runs():
    (block,) = [b for b in python_blocks() if "from relay import Engine" in b]
    printed = run_block(block)
    assert "Paris" in printed and "FinishReason." in printed


LONG_PROMPTS = [  # over 32 tokens (a page) each, so that a second run hits the prefix cache
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg "
    "combined movable metal type, oil-based ink and a screw press in the workshops of Mainz. "
    "Within fifty years",
    "A recipe for a simple bread: mix flour, water, salt and yeast, knead the dough for ten "
    "minutes, let it rise for an hour, shape it, let it rise again and bake it at",
    "Dear team, thank you all for the work on the release. Before the holidays, I would like to "
    "summarise what went well this quarter and what we should change next year. First,",
]
OTHERS = [
    "The capital of France is",
    "def fib(n):",
    "List three colors:",
    "Q: What is 2+2?\nA:",
    "Once upon a time in a land far away,",
]


@pytest.mark.slow
def test_greedy_output_with_the_defaults_is_reproducible(default_model_dir):
    """With the defaults (this CPU's dtype, int8 block activations from AVX2 up) a request's greedy
    tokens are the same alone, among others (a crowded step: decodes beside prompt chunks), from
    the prefix cache, and from a new engine (a restart)."""
    from relay import Engine, SamplingParams

    greedy = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)

    def tokens(engine, prompts):
        return [o.token_ids for o in engine.generate(prompts, greedy)]

    engine = Engine(default_model_dir, kv_cache_gb=0.2)
    alone = [tokens(engine, [p])[0] for p in LONG_PROMPTS]
    crowded = tokens(engine, OTHERS + LONG_PROMPTS + OTHERS[::-1])[len(OTHERS) : -len(OTHERS)]
    cached = engine.generate(LONG_PROMPTS, greedy)
    assert all(o.cached_tokens > 0 for o in cached)
    engine.check()
    del engine
    restarted = tokens(Engine(default_model_dir, kv_cache_gb=0.2), LONG_PROMPTS[::-1])[::-1]
    assert crowded == alone
    assert [o.token_ids for o in cached] == alone
    assert restarted == alone
