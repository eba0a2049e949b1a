"""Embeddings (--is-embedding, /v1/embeddings) equal transformers' final hidden states pooled
the same way, in float32: the last token's (a model directory without a sentence-transformers
config) and the mean (one with it, Normalize included), over prompts split into prefill chunks,
several inputs in one request, and prompts the prefix cache holds. Plus the API's shapes, its
refusals, and the KV pool whole afterwards."""

from __future__ import annotations

import base64
import functools
import json
import os
import random
import re
import shutil

import numpy as np
import openai
import pytest
import torch

from relay import Engine, SamplingParams
from relay.scheduling.pooling import Pooling
from tests.helpers.server_utils import Server, wait_until

VOCAB = 49152  # llama-fullvocab: text inputs tokenize into its vocabulary
CONTEXT = 512
CHUNK = 16  # prefill tokens per step: longer inputs are pooled over several steps


def write_sentence_transformers(model_dir: str, mode: str, normalize: bool = True) -> None:
    """A sentence-transformers config (modules.json, 1_Pooling) in model_dir."""
    modules = [
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {
            "idx": 1,
            "name": "1",
            "path": "1_Pooling",
            "type": "sentence_transformers.models.Pooling",
        },
    ]
    if normalize:
        modules.append(
            {
                "idx": 2,
                "name": "2",
                "path": "2_Normalize",
                "type": "sentence_transformers.models.Normalize",
            }
        )
    with open(os.path.join(model_dir, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(model_dir, "1_Pooling"), exist_ok=True)
    keys = {"cls": "pooling_mode_cls_token", "mean": "pooling_mode_mean_tokens"}
    keys["lasttoken"] = "pooling_mode_lasttoken"
    config = {"word_embedding_dimension": 64, "pooling_mode_max_tokens": False}
    config.update({key: m == mode for m, key in keys.items()})
    with open(os.path.join(model_dir, "1_Pooling", "config.json"), "w") as f:
        json.dump(config, f)


@pytest.fixture(scope="module")
def model_dirs(tiny_model_dir, tmp_path_factory) -> dict[str, str]:
    """pooling -> a tiny model directory that pools so: lasttoken has no sentence-transformers
    config (the default), mean has one (mean, then Normalize)."""
    plain = tiny_model_dir("llama-fullvocab")
    mean = str(tmp_path_factory.mktemp("embed-mean") / "model")
    shutil.copytree(plain, mean)
    write_sentence_transformers(mean, "mean")
    return {"lasttoken": plain, "mean": mean}


@functools.cache
def auto_model(model_dir: str):
    from transformers import AutoModel

    return AutoModel.from_pretrained(model_dir, dtype=torch.float32)


def reference(model_dir: str, mode: str, ids: list[int], normalize: bool = True) -> np.ndarray:
    """transformers' AutoModel final hidden states of ids, pooled (and L2-normalized)."""
    with torch.inference_mode():
        hidden = auto_model(model_dir)(torch.tensor([ids])).last_hidden_state[0]
    pooled = {"mean": hidden.mean(dim=0), "cls": hidden[0], "lasttoken": hidden[-1]}[mode]
    return (torch.nn.functional.normalize(pooled, dim=0) if normalize else pooled).numpy()


def assert_close(got, want) -> None:
    got = np.asarray(got, dtype=np.float32)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, atol=1e-4, rtol=0)
    cosine = float(got @ want) / float(np.linalg.norm(got) * np.linalg.norm(want))
    assert cosine == pytest.approx(1.0, abs=1e-4)


@pytest.fixture(scope="module")
def inputs() -> list[list[int]]:
    rng = random.Random(3)
    shared = [rng.randrange(2, VOCAB - 2) for _ in range(40)]
    return [
        shared + [rng.randrange(2, VOCAB - 2) for _ in range(60)],  # 100 tokens: 7 chunks
        shared[:24] + [rng.randrange(2, VOCAB - 2) for _ in range(9)],  # 33
        [rng.randrange(2, VOCAB - 2) for _ in range(5)],
        [7],
    ]


# ---- the server ------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=["lasttoken", "mean"])
def served(request, model_dirs):
    """(server, model directory, pooling): one server per pooling, every test on both."""
    mode, model_dir = request.param, model_dirs[request.param]
    server = Server(
        "--model-path", model_dir, "--is-embedding", "--dtype", "float32",
        "--kv-cache-gb", "0.01", "--page-size", "4", "--chunked-prefill-size", str(CHUNK),
        "--log-requests",
    )  # fmt: skip
    yield server, model_dir, mode
    server.stop()


@pytest.fixture(scope="module")
def model_name(served) -> str:
    with served[0].client() as c:
        return c.get("/v1/models").json()["data"][0]["id"]


def embed(server: Server, body: dict) -> dict:
    with server.client() as c:
        r = c.post("/v1/embeddings", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_embeddings_equal_transformers_batched_and_one_by_one(served, inputs, model_name):
    server, model_dir, mode = served
    out = embed(server, {"input": inputs, "model": model_name})
    assert out["object"] == "list" and out["model"] == model_name
    total = sum(map(len, inputs))
    assert out["usage"] == {"prompt_tokens": total, "total_tokens": total}
    assert [d["index"] for d in out["data"]] == list(range(len(inputs)))
    assert all(d["object"] == "embedding" for d in out["data"])
    for d, ids in zip(out["data"], inputs):
        assert_close(d["embedding"], reference(model_dir, mode, ids))
    # One by one (the prefix cache now holds every input): the same vectors.
    for d, ids in zip(out["data"], inputs):
        alone = embed(server, {"input": ids})["data"][0]["embedding"]
        np.testing.assert_allclose(alone, d["embedding"], atol=1e-5, rtol=0)
    assert_kv_pool_whole(server)


def test_text_inputs_embed_their_tokens(served):
    server, model_dir, mode = served
    texts = ["The quick brown fox", "jumps over the lazy dog. " * 8]  # the second: 3+ chunks
    out = embed(server, {"input": texts})
    with server.client() as c:
        ids = [c.post("/tokenize", json={"prompt": t}).json()["tokens"] for t in texts]
    assert out["usage"]["prompt_tokens"] == sum(map(len, ids)) and len(ids[1]) > 2 * CHUNK
    for d, t in zip(out["data"], ids):
        assert_close(d["embedding"], reference(model_dir, mode, t))
    single = embed(server, {"input": texts[0]})["data"][0]["embedding"]
    np.testing.assert_allclose(single, out["data"][0]["embedding"], atol=1e-5, rtol=0)


def test_base64_is_the_same_float32_values(served, inputs):
    server = served[0]
    floats = embed(server, {"input": inputs[:2]})["data"]
    packed = embed(server, {"input": inputs[:2], "encoding_format": "base64"})["data"]
    for f, p in zip(floats, packed):
        values = np.frombuffer(base64.b64decode(p["embedding"]), dtype="<f4")
        # Two requests: batched differently, the sums may round differently in the last bit.
        np.testing.assert_allclose(values, np.float32(f["embedding"]), atol=1e-6, rtol=0)


def test_openai_client_and_dimensions(served, inputs, model_name):
    server = served[0]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0)
    got = client.embeddings.create(model=model_name, input=inputs[:2])  # base64 on the wire
    want = embed(server, {"input": inputs[:2]})["data"]
    assert [len(d.embedding) for d in got.data] == [64, 64]
    for d, w in zip(got.data, want):
        np.testing.assert_allclose(np.float32(d.embedding), w["embedding"], atol=1e-6, rtol=0)
    assert got.usage.prompt_tokens == len(inputs[0]) + len(inputs[1])
    # dimensions: the first 16 values, normalized again (OpenAI's shortened embeddings).
    short = client.embeddings.create(model=model_name, input=inputs[1], dimensions=16)
    head = np.float32(want[1]["embedding"][:16])
    np.testing.assert_allclose(short.data[0].embedding, head / np.linalg.norm(head), atol=1e-6)


TOO_LONG = [5] * CONTEXT  # no room left in the context


@pytest.mark.parametrize(
    "body, param, words",
    [
        ({}, "input", "required"),
        ({"input": ""}, "input", "empty"),
        ({"input": []}, "input", "empty"),
        ({"input": ["a", ""]}, "input", "item 1"),
        ({"input": [[1, 2], []]}, "input", "item 1"),
        ({"input": [3, VOCAB]}, "input", "vocabulary"),
        ({"input": [[3], [-1]]}, "input", "item 1"),
        ({"input": 5}, "input", "a string"),
        ({"input": ["a", [1]]}, "input", "mix"),
        ({"input": [{"text": "a"}]}, "input", "item 0"),
        ({"input": TOO_LONG}, "input", "context"),
        ({"input": [[1], TOO_LONG]}, "input", "item 1"),
        ({"input": "a", "encoding_format": "hex"}, "encoding_format", "base64"),
        ({"input": "a", "dimensions": 0}, "dimensions", "[1, 64]"),
        ({"input": "a", "dimensions": 65}, "dimensions", "[1, 64]"),
        ({"input": "a", "dimensions": "8"}, "dimensions", "integer"),
        ({"input": "a", "user": 3}, "user", "string"),
        ({"input": "a", "model": 3}, "model", "string"),
    ],
)
def test_bad_requests_are_400s_naming_the_field(served, body, param, words):
    with served[0].client() as c:
        r = c.post("/v1/embeddings", json=body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_unknown_model_is_404_and_user_is_accepted(served, model_name):
    with served[0].client() as c:
        r = c.post("/v1/embeddings", json={"input": "a", "model": "nope"})
        assert r.status_code == 404 and r.json()["error"]["param"] == "model"
        ok = c.post("/v1/embeddings", json={"input": "a", "model": model_name, "user": "u1"})
        assert ok.status_code == 200, ok.text


def test_an_embedding_server_refuses_generation(served):
    bodies = {
        "/v1/completions": {"prompt": "Hi", "max_tokens": 2},
        "/v1/chat/completions": {"messages": [{"role": "user", "content": "Hi"}]},
        "/generate": {"text": "Hi"},
    }
    with served[0].client() as c:
        for path, body in bodies.items():
            r = c.post(path, json=body)
            assert r.status_code == 400, (path, r.text)
            assert "--is-embedding" in r.json()["error"]["message"], path
        assert c.get("/model_info").json()["is_generation"] is False


def test_metrics_and_request_log_count_embeddings(served, inputs):
    server = served[0]

    def counter(name: str) -> float:
        with server.client() as c:
            text = c.get("/metrics").text
        return sum(
            float(m) for m in re.findall(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
        )

    prompt, requests, generated = (
        counter(n)
        for n in (
            "relay:prompt_tokens_total",
            "relay:requests_total",
            "relay:generation_tokens_total",
        )
    )
    embed(server, {"input": inputs[2:]})
    assert counter("relay:prompt_tokens_total") == prompt + len(inputs[2]) + len(inputs[3])
    assert counter("relay:requests_total") == requests + 2
    assert counter("relay:generation_tokens_total") == generated
    wait_until(
        lambda: any(
            "rid=embe-" in line and "prompt_tokens=1 " in line and "completion_tokens=0 " in line
            for line in server.lines
        ),
        10,
        "the request log line of the one-token input",
    )


def assert_kv_pool_whole(server: Server) -> None:
    """Idle, every KV page is free or in the prefix cache (none held by a request)."""

    def idle() -> dict | None:
        with server.client() as c:
            s = c.get("/get_server_info").json()["scheduler"]
        return s if s["num_running"] == 0 and s["num_waiting"] == 0 else None

    stats = wait_until(idle, 30, "the server to be idle")
    assert stats["kv_locked_tokens"] == 0
    assert stats["kv_free_tokens"] + stats["kv_cached_tokens"] == stats["kv_total_tokens"]


def test_kv_pool_is_whole_after_everything(served):
    assert_kv_pool_whole(served[0])
    assert "KV accounting check failed" not in "".join(served[0].lines)  # the idle checks'


# ---- in process: chunks, the prefix cache and the KV accounting -------------------------------


def embed_params() -> SamplingParams:
    return SamplingParams(max_new_tokens=0, embed=True)


@pytest.mark.parametrize("mode, normalize", [("mean", False), ("cls", True)])
def test_chunked_pooling_equals_unchunked_and_the_cache_serves_no_pooled_position(
    tiny_model_dir, tmp_path, inputs, mode, normalize, monkeypatch
):
    model_dir = str(tmp_path / "model")
    shutil.copytree(tiny_model_dir("llama-fullvocab"), model_dir)
    write_sentence_transformers(model_dir, mode, normalize)
    whole = Engine(model_dir, dtype="float32", is_embedding=True, kv_cache_gb=0.01)
    chunked = Engine(
        model_dir, dtype="float32", is_embedding=True, kv_cache_gb=0.01,
        page_size=4, chunked_prefill_size=CHUNK,
    )  # fmt: skip
    steps: list[int] = []
    forward = chunked.runner.forward
    monkeypatch.setattr(
        chunked.runner, "forward", lambda b: steps.append(len(b.embed_spans)) or forward(b)
    )
    want = whole.generate(inputs, embed_params())
    for _ in range(2):  # the second time the prefix cache holds every input
        got = chunked.generate(inputs, embed_params())
        for g, w, ids in zip(got, want, inputs):
            assert g.error is None and g.token_ids == [] and g.completion_tokens == 0
            np.testing.assert_allclose(
                np.frombuffer(g.embedding, "<f4"), np.frombuffer(w.embedding, "<f4"), atol=1e-5
            )
            expected = reference(model_dir, mode, ids, normalize)
            assert_close(np.frombuffer(g.embedding, "<f4"), expected)
            # mean and cls pool position 0 on: the cache may serve none of the prompt
            assert g.cached_tokens == 0
        chunked.check()  # every KV page free, held or cached exactly once
        assert chunked.scheduler.stats().kv_locked_tokens == 0
    assert sum(n > 0 for n in steps) >= (7 if mode == "mean" else 2)


def test_last_token_pooling_reuses_the_prefix_cache(model_dirs, inputs):
    engine = Engine(
        model_dirs["lasttoken"], dtype="float32", is_embedding=True, kv_cache_gb=0.01,
        page_size=4, chunked_prefill_size=CHUNK,
    )  # fmt: skip
    want = reference(model_dirs["lasttoken"], "lasttoken", inputs[0])
    for cached in (False, True):
        out = engine.generate(inputs[0], embed_params())[0]
        # The second time, all but the last token come from the cache.
        assert (out.cached_tokens > 0) == cached
        assert_close(np.frombuffer(out.embedding, "<f4"), want)
    engine.check()


def test_a_generating_engine_refuses_embeddings(model_dirs):
    engine = Engine(model_dirs["lasttoken"], dtype="float32", kv_cache_gb=0.01)
    with pytest.raises(Exception, match="--is-embedding"):
        engine.generate([1, 2, 3], embed_params())


# ---- the sentence-transformers config ----------------------------------------------------------


@pytest.mark.parametrize("mode", ["mean", "cls", "lasttoken"])
@pytest.mark.parametrize("normalize", [True, False])
def test_pooling_follows_the_sentence_transformers_config(tmp_path, mode, normalize):
    assert Pooling.from_dir(str(tmp_path)) == Pooling("lasttoken", True)  # none: the default
    write_sentence_transformers(str(tmp_path), mode, normalize)
    assert Pooling.from_dir(str(tmp_path)) == Pooling(mode, normalize)


def test_pooling_refuses_what_it_cannot_follow(tmp_path):
    write_sentence_transformers(str(tmp_path), "mean")
    config = tmp_path / "1_Pooling" / "config.json"
    config.write_text(json.dumps({"pooling_mode_max_tokens": True}))
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        Pooling.from_dir(str(tmp_path))
    write_sentence_transformers(str(tmp_path), "mean")
    modules = json.loads((tmp_path / "modules.json").read_text())
    modules.append(
        {"idx": 3, "name": "3", "path": "3_Dense", "type": "sentence_transformers.models.Dense"}
    )
    (tmp_path / "modules.json").write_text(json.dumps(modules))
    with pytest.raises(ValueError, match="Dense"):
        Pooling.from_dir(str(tmp_path))
