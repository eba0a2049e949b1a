"""Qwen3 and Gemma 2/3 decode steps in one C call (csrc/decode_layers.c): q/k norms, Gemma's
(1 + w) norms around attention and the MLP, GeGLU, each layer's rotary tables. Their kernels
against torch at every instruction-set level this CPU reaches; tiny Q8_0 GGUF files of each model
(tests/helpers/gguf_files.py) decoded through the one-call path, bit for bit as the layers called one by
one and greedy-equal to transformers on the same file.
"""

from __future__ import annotations

import os
import shutil

import gguf
import pytest
import torch
import torch.nn.functional as F

from relay import Engine
from relay.execution import model_files
from relay.execution.block_rows import ALL_ROWS
from relay.execution.kernels import cpu_layers, cpu_ops
from relay.step import BatchInput
from tests.helpers.gguf_files import VOCAB_SIZE, write_gguf
from tests.helpers.kernel_helpers import kernel_level  # noqa: F401 (a fixture)
from tests.test_engine import random_prompts
from tests.test_gguf_models import GREEDY, NEW_TOKENS, greedy, random_model, transformers_on
from tests.test_weight_blocks import step_each_way

MODELS = ["qwen3", "gemma2", "gemma3"]


@pytest.mark.parametrize("inter", [128, 200, 5])  # whole vectors, a tail, a tail only
def test_gelu_tanh_mul_is_torchs_gelu_tanh_times_up(kernel_level, inter):
    gate_up = torch.randn(6, 2 * inter) * 3
    gate_up[0, :4] = torch.tensor([0.0, -20.0, 20.0, 1e-4])  # far out and near 0
    gate, up = gate_up.split(inter, dim=-1)
    want = F.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(cpu_ops.gelu_tanh_mul(gate_up), want, atol=1e-5, rtol=1e-5)
    got16 = cpu_ops.gelu_tanh_mul(gate_up.bfloat16()).float()
    torch.testing.assert_close(got16, want, atol=2e-2, rtol=1e-2)


@pytest.mark.parametrize("head_dim", [16, 32, 20])
def test_head_norm_norms_each_q_and_k_head_in_place_and_leaves_v(kernel_level, head_dim):
    nq, nk, t = 4, 2, 5
    qkv = torch.randn(t, (nq + 2 * nk) * head_dim + 3)[:, : (nq + 2 * nk) * head_dim]  # strided
    qw, kw = torch.randn(head_dim), torch.randn(head_dim)
    before = qkv.clone()
    cpu_ops.head_norm(qkv, qw, kw, 1e-6, nq, nk, head_dim)
    heads = before.view(t, nq + 2 * nk, head_dim)
    want_q = F.rms_norm(heads[:, :nq], (head_dim,), qw, 1e-6)
    want_k = F.rms_norm(heads[:, nq : nq + nk], (head_dim,), kw, 1e-6)
    got = qkv.view(t, nq + 2 * nk, head_dim)
    torch.testing.assert_close(got[:, :nq], want_q, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[:, nq : nq + nk], want_k, atol=1e-5, rtol=1e-5)
    assert torch.equal(got[:, nq + nk :], heads[:, nq + nk :])


@pytest.fixture
def q8_0_file(tmp_path):
    """A factory: model name (test_gguf_models' configs) -> a Q8_0 GGUF file of it; each file's
    converted directory is removed from Relay's cache afterwards."""
    made = []

    def make(name: str) -> str:
        path = str(tmp_path / name / f"{name}.gguf")
        os.makedirs(os.path.dirname(path))
        write_gguf(path, random_model(name), qtype=gguf.GGMLQuantizationType.Q8_0)
        made.append(path)
        return path

    yield make
    for path in made:
        shutil.rmtree(model_files.converted_dir(path), ignore_errors=True)


def one_call_engine(path: str) -> Engine:
    """An engine on the file whose decode steps all run in one C call: start-up times the call
    against the layers (which a tiny model's layers can win); eligible is what is tested here."""
    engine = Engine(
        path,
        dtype="float32",
        kv_cache_gb=0.01,
        block_activations="float",
        weight_block_rows=ALL_ROWS,
    )
    assert engine.runner.model.use_decode_layers(engine.runner.attn), "eligible for the C call"
    return engine


@pytest.mark.parametrize("name", MODELS)
def test_greedy_output_through_the_one_call_decode_equals_transformers(
    q8_0_file, name, monkeypatch
):
    """Prompts of 3 to 40 tokens (past Gemma's window of 8), 12 new tokens each, on a Q8_0 file
    whose GEMM weights are all blocks: the decode steps run in one C call."""
    path = q8_0_file(name)
    prompts = random_prompts(VOCAB_SIZE, [3, 11, 26, 40])
    expected = greedy(transformers_on(path, name), prompts)
    engine = one_call_engine(path)
    calls, run = [], cpu_layers.DecodeLayers.run

    def counted(self, *args):
        calls.append(args[0].shape[0])
        return run(self, *args)

    monkeypatch.setattr(cpu_layers.DecodeLayers, "run", counted)
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
    assert len(calls) >= NEW_TOKENS - 1, "every decode step ran in one C call"


@pytest.mark.parametrize("name", MODELS)
def test_a_decode_step_in_one_c_call_is_the_layers_bit_for_bit(q8_0_file, kernel_level, name):
    """A decode step of three requests (one past Gemma's window) in one C call: its logits and
    the keys and values it writes are bit for bit those of the layers called one by one, at each
    instruction-set level."""
    runner = one_call_engine(q8_0_file(name)).runner
    fast = runner.model.decode_layers
    assert_decode_call_is_the_layers(runner, fast)


def assert_decode_call_is_the_layers(runner, fast) -> None:
    """Three requests prefilled (20, 5 and 30 tokens), then one decode step of all three run in
    one C call (fast: the model's decode_layers) and by the layers one by one: the same logits
    and the same keys and values written, bit for bit."""
    ids = random_prompts(VOCAB_SIZE, [20, 5, 30], seed=1)
    tables = [[1, 2], [3], [4, 5]]
    for i, prompt in enumerate(ids):
        n = len(prompt)
        runner.step_logits(
            BatchInput(0, [i], prompt, [0], [n], [0], [tables[i]], [True], [0]), [tables[i]]
        )
    lens = [len(p) for p in ids]
    step = BatchInput(
        0, [0, 1, 2], [5, 6, 7], lens, [1] * 3, [0] * 3, [[]] * 3, [True] * 3, [1] * 3
    )
    (call, kv_call), (layered, kv_layered) = step_each_way(runner, step, tables, (fast, None))
    assert torch.equal(call, layered)
    assert all(torch.equal(a, b) for a, b in zip(kv_call, kv_layered))
