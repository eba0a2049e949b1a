"""Qwen3 and Gemma 2/3 decode steps in one C call (csrc/decode_layers.c): q/k norms, Gemma's
(1 + w) norms around attention and the MLP, GeGLU, each layer's rotary tables. Their kernels
against torch at every instruction-set level this CPU reaches; tiny Q8_0 GGUF files of each model
(tests/helpers/gguf_files.py) decoded through the one-call path, bit for bit as the layers called one by
one and greedy-equal to transformers on the same file.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from relay.execution.kernels import cpu_layers, cpu_ops
from tests.helpers.block_checks import assert_decode_call_is_the_layers
from tests.helpers.engine_checks import random_prompts
from tests.helpers.gguf_files import VOCAB_SIZE
from tests.helpers.gguf_models import (  # noqa: F401 (q8_0_file: a fixture)
    GREEDY,
    NEW_TOKENS,
    greedy,
    one_call_engine,
    q8_0_file,
    transformers_on,
)
from tests.helpers.kernel_helpers import kernel_level  # noqa: F401 (a fixture)

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
