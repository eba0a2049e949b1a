"""lm-eval-harness as a real client of prompt logprobs: its `local-completions` model, pointed
at a server's /v1/completions with token-id prompts, one per request and four per request (a
list of prompts), scores a tiny multiple-choice task (tests/helpers/lm_eval_task: a YAML and a jsonl read
by datasets' local json builder; it runs with no network) as lm-eval's own `hf` model scores it
on the same weights.

The server is its own, on the tiny random-weight model: the shared default-model server reads
GGUF blocks with 8-bit activations, whose loglikelihoods on this task differ from transformers'
float ones by up to 0.55 (measured), where this test allows 1e-3."""

from __future__ import annotations

import os

import pytest
import yaml

from tests.helpers.server_utils import ROOT, Server

pytestmark = pytest.mark.slow
lm_eval = pytest.importorskip("lm_eval")
TaskManager = pytest.importorskip("lm_eval.tasks").TaskManager

TASK_DIR = os.path.join(ROOT, "tests", "helpers", "lm_eval_task")
TASK = "relay_tiny_mc"
SERVED = "tiny"


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir):
    return tiny_model_dir("llama-fullvocab")  # the default model's tokenizer: text fits it


@pytest.fixture(scope="module")
def server(model_dir):
    s = Server(
        "--model-path",
        model_dir,
        "--served-model-name",
        SERVED,
        "--dtype",
        "float32",
        "--kv-cache-gb",
        "0.05",
    )
    yield s
    s.stop()


def task_config() -> dict:
    with open(os.path.join(TASK_DIR, f"{TASK}.yaml")) as f:
        config = yaml.safe_load(f)
    config["dataset_kwargs"]["data_files"]["test"] = os.path.join(TASK_DIR, f"{TASK}.jsonl")
    return config


def loglikelihoods(model: str, model_args: dict) -> list[list[float]]:
    """Each question's choices' loglikelihoods, as lm-eval scored them."""
    out = lm_eval.simple_evaluate(
        model=model,
        model_args=model_args,
        tasks=[task_config()],
        # Without lm-eval's own ~13,000 task files indexed first (20 s of YAML parsing)
        task_manager=TaskManager(include_defaults=False),
        log_samples=True,
        # lm-eval would seed Python's, numpy's and torch's global generators: leave them be
        random_seed=None,
        numpy_random_seed=None,
        torch_random_seed=None,
    )
    samples = sorted(out["samples"][TASK], key=lambda s: s["doc_id"])
    return [[resp[0][0] for resp in s["resps"]] for s in samples]


@pytest.fixture(scope="module")
def reference(model_dir):
    return loglikelihoods(
        "hf", {"pretrained": model_dir, "dtype": "float32", "device": "cpu", "batch_size": 1}
    )


@pytest.mark.parametrize("batch_size", [1, 4])
def test_lm_eval_local_completions_scores_as_its_hf_model_does(
    server, model_dir, reference, batch_size
):
    got = loglikelihoods(
        "local-completions",
        {
            "base_url": server.url + "/v1/completions",
            "model": SERVED,
            "tokenizer": model_dir,
            "tokenizer_backend": "huggingface",
            "tokenized_requests": True,
            "batch_size": batch_size,
            "max_length": 512,
        },
    )
    assert [len(choices) for choices in got] == [4, 3, 3, 2, 4]
    assert got == [pytest.approx(choices, abs=1e-3) for choices in reference]
    # Random weights spread the scores: a client that read the wrong positions would not match.
    assert len({round(x, 3) for choices in reference for x in choices}) > 10
