"""Speculative decoding end to end: a real server with n-gram speculation on the default
model gives, request by request, the greedy tokens the Engine gives without speculation,
and reports what speculation did."""

from __future__ import annotations

import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from relay import Engine, SamplingParams
from tests.helpers.server_utils import ROOT, Server

pytestmark = pytest.mark.slow

PASSAGE = (
    '{"name": "Ada Lovelace", "born": 1815, "city": "London", "languages": ["English", "French"], '
    '"notes": "wrote the first published algorithm"}'
)
PROMPTS = [
    f"Repeat this JSON exactly: {PASSAGE}\nJSON: {PASSAGE[:40]}",
    "The capital of France is",
    "1, 2, 3, 4, 5, 6, 7, 8,",
    "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n    return a - b\n\ndef",
    "Once upon a time",
    "red green blue red green blue red green",
    "Q: What is 2+2?\nA:",
    "The quick brown fox",
] * 2


@pytest.fixture(scope="module")
def server():
    # float block products: greedy output with speculation equals it without bit for bit only there
    # (int8 block activations round x, and a verify step attends through another kernel)
    s = Server(
        "--dtype",
        "float32",
        "--block-activations",
        "float",
        "--kv-cache-gb",
        "1",
        "--log-requests",
        "--speculative-algorithm",
        "ngram",
        "--speculative-disable-by-batch-size",
        "16",
    )
    yield s
    s.stop()


def test_greedy_output_through_the_server_is_the_engines_without_speculation(
    server, default_model_dir
):
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    expected = [
        o.token_ids
        for o in Engine(default_model_dir, dtype="float32", block_activations="float").generate(
            PROMPTS, params
        )
    ]

    def generate(prompt: str) -> list[int]:
        with server.client() as c:
            body = {
                "text": prompt,
                "sampling_params": {"temperature": 0, "max_new_tokens": 40, "ignore_eos": True},
            }
            return c.post("/generate", json=body).json()["output_ids"]

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # concurrently: speculating in one batch
        got = list(pool.map(generate, PROMPTS))
    assert got == expected
    with server.client() as c:
        spec = c.get("/get_server_info").json()["scheduler"]["spec"]
        metrics = c.get("/metrics").text
    assert spec["spec_accepted_tokens"] > 0 and spec["spec_accept_length"] > 1.0
    assert (
        "relay:spec_acceptance_rate" in metrics
        and "relay:spec_accepted_per_verify_bucket" in metrics
    )
    assert "spec_accepted=" in server.log


def test_logit_bias_under_speculation_is_the_engines_without_speculation(server, default_model_dir):
    """Proposals copied from the prompt carry tokens the bias bans: verification against the
    biased logits rejects them, so each request's tokens are the Engine's without speculation."""
    engine = Engine(default_model_dir, dtype="float32", block_activations="float")
    (copy,) = engine.generate(
        PROMPTS[:1], SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    )
    bias = {copy.token_ids[4]: -100.0, copy.token_ids[9]: -100.0, 11: 2.0}
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True, logit_bias=bias)
    expected = [o.token_ids for o in engine.generate(PROMPTS, params)]

    def generate(prompt: str) -> list[int]:
        with server.client() as c:
            body = {
                "text": prompt,
                "sampling_params": {
                    "temperature": 0,
                    "max_new_tokens": 40,
                    "ignore_eos": True,
                    "logit_bias": {str(k): v for k, v in bias.items()},
                },
            }
            return c.post("/generate", json=body).json()["output_ids"]

    with server.client() as c:
        before = c.get("/get_server_info").json()["scheduler"]["spec"]["spec_accepted_tokens"]
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(generate, PROMPTS))
    assert got == expected
    assert not any(t in out for out in got for t in (copy.token_ids[4], copy.token_ids[9]))
    with server.client() as c:
        assert (
            c.get("/get_server_info").json()["scheduler"]["spec"]["spec_accepted_tokens"] > before
        )


def test_a_draft_model_through_the_server_keeps_greedy_output(tiny_model_dir):
    """standalone speculation (the target's own weights in int4 as the draft) on a tiny
    full-vocabulary model: 16 concurrent requests, each the Engine's tokens without speculation."""
    path = tiny_model_dir("llama-fullvocab")
    params = SamplingParams(temperature=0, max_new_tokens=24, ignore_eos=True)
    expected = [o.token_ids for o in Engine(path, dtype="float32").generate(PROMPTS, params)]
    s = Server(
        "--model-path",
        path,
        "--dtype",
        "float32",
        "--kv-cache-gb",
        "0.25",
        "--speculative-algorithm",
        "standalone",
        "--speculative-disable-by-batch-size",
        "16",
    )
    try:

        def generate(prompt: str) -> list[int]:
            with s.client() as c:
                body = {
                    "text": prompt,
                    "sampling_params": {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True},
                }
                return c.post("/generate", json=body).json()["output_ids"]

        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            assert list(pool.map(generate, PROMPTS)) == expected
        with s.client() as c:
            assert c.get("/get_server_info").json()["scheduler"]["spec"]["spec_verify_rows"] > 0
    finally:
        s.stop()


def test_a_draft_model_with_another_vocabulary_is_refused_at_start(tiny_model_dir):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "launch.serve",
            "--speculative-algorithm",
            "standalone",
            "--speculative-draft-model-path",
            tiny_model_dir("llama"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2
    assert (
        "draft model's vocabulary (1024 tokens) differs from the target's (49152)"
        in out.stderr + out.stdout
    )
