"""bfloat16 checkpoints on CPUs without bfloat16 dot products (AVX2, AVX-512 without BF16; here
RELAY_CPU_ISA=avx2): the float32 model keeps the checkpoint's bfloat16 GEMM weights and embedding
as they are (ModelLoader._keeps_bf16_weights), its GEMMs widen them to float32 in registers
(csrc/gemm_widen.c) and compute what float32 GEMMs on the widened weights do; the resident
weights are half a float32 checkpoint's (weight_bytes counts oneDNN's packed copies too), and
greedy decoding is transformers' in float32 on the same bfloat16-rounded weights."""

from __future__ import annotations

import pytest
import torch

from relay.config import EngineConfig, ModelConfig
from relay.execution.kernels import cpu_gemm, isa
from relay.execution.model_loading import weight_bytes
from relay.execution.model_runner import ModelRunner
from scripts.runner_steps import run_greedy
from tests.helpers.engine_checks import random_prompts, reference
from tests.helpers.kernel_helpers import cpu_kernels_or_skip, held_at, kernel_level  # noqa: F401 (a fixture)
from tests.helpers.tiny_models import tiny_llama_config

VOCAB = 512
PAGE = 4


@pytest.mark.parametrize(
    "m,n,k",
    [
        (1, 100, 64),
        (1, 37, 4104),  # (K past gemm_widen.c's SHORT_K: one row takes NF weight rows at a time)
        (3, 33, 70),
        (8, 64, 256),
        (9, 77, 200),
        (13, 40, 129),
        (70, 96, 512),
    ],
)
def test_widening_gemm_is_float32_gemm_on_the_widened_weights(kernel_level, m, n, k):
    """At every level this CPU reaches, the GEMVs (up to 8 rows; one or NF weight rows at a time)
    and the tiles (more), with K's tail past a whole vector and features past a strip's or NF's end: float32 products of the same
    weights, summed in another order (a tight tolerance: float32 rounding, not bfloat16's)."""
    torch.manual_seed(m * n + k)
    x = torch.randn(m, k + 3)[:, :k]  # rows apart by more than K: x_stride is honoured
    w = torch.randn(n, k).to(torch.bfloat16)
    bias = torch.randn(n)
    y = cpu_gemm.gemm_widen(x, w, bias)
    ref = x @ w.float().T + bias
    assert y.dtype == torch.float32
    torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    alone = cpu_gemm.gemm_widen(x[-1:], w, bias)
    torch.testing.assert_close(alone, ref[-1:], rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    assert cpu_gemm.gemm_widen(x[:0], w).shape == (0, n)  # (a step whose rows all left)


def tiny_llama(tied: bool):
    return tiny_llama_config(
        vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=tied
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """(tied, dtype) -> a tiny random Llama saved by save_pretrained in that dtype (the same
    weights: the float32 ones are the bfloat16 ones widened)."""
    from transformers import AutoModelForCausalLM

    made = {}
    for tied in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_llama(tied), dtype=torch.float32)
        model = model.to(torch.bfloat16)
        for dtype in (torch.bfloat16, torch.float32):
            path = str(tmp_path_factory.mktemp(f"llama-{'tied' if tied else 'untied'}-{dtype}"))
            model.to(dtype).save_pretrained(path)
            made[tied, dtype] = path
    return made


@pytest.fixture
def avx2(monkeypatch):
    """This process held to AVX2, as a Zen 3 runs: the level's rules (float32 models) and its
    kernel library."""
    cpu_kernels_or_skip()
    if not isa.at_least("avx2"):
        pytest.skip("this CPU (or RELAY_CPU_ISA) does not reach avx2")
    monkeypatch.setenv(isa.ENV, "avx2")
    with held_at("avx2"):
        yield


def runner_for(path: str) -> ModelRunner:
    cfg = EngineConfig(page_size=PAGE, kv_cache_gb=0.01)
    return ModelRunner(cfg, path, ModelConfig.from_dir(path))


def gemm_weight_elements(model) -> int:
    return sum(m.weight.numel() for m in {id(m): m for m in model.gemm_modules()}.values())


@pytest.mark.parametrize("tied", [False, True])
def test_a_bf16_checkpoint_holds_half_a_float32_ones_weight_bytes(avx2, checkpoints, tied):
    """Loaded at AVX2 (a float32 model), the bfloat16 checkpoint's weights stay bfloat16 with no
    packed copy: half the float32 weights' bytes (norms aside), where the float32 checkpoint's
    hold their oneDNN-packed copies besides (counted)."""
    bf16 = runner_for(checkpoints[tied, torch.bfloat16]).model
    f32 = runner_for(checkpoints[tied, torch.float32]).model
    assert bf16.dtype == f32.dtype == torch.float32
    float32_weights = 4 * sum(p.numel() for p in f32.parameters())
    # (weight_bytes counts the rotary tables too: buffers, the same in both)
    tables = sum(b.numel() * b.element_size() for b in f32.buffers())
    assert weight_bytes(f32) - tables > 1.5 * float32_weights  # the oneDNN-packed copies count
    assert weight_bytes(bf16) - tables < 0.52 * float32_weights
    for module in bf16.gemm_modules():
        assert module.weight.dtype == torch.bfloat16 and module.packed is None
    assert 2 * gemm_weight_elements(bf16) <= weight_bytes(bf16)


def test_the_embedding_widens_the_rows_it_looks_up_and_a_tied_head_reads_its_table(
    avx2, checkpoints
):
    model = runner_for(checkpoints[True, torch.bfloat16]).model
    table = model.embed_tokens.weight
    assert table.dtype == torch.bfloat16 and model.lm_head is model.embed_tokens
    ids = torch.tensor([3, 7, 3, VOCAB - 1])
    rows = model.embed_tokens(ids)
    assert rows.dtype == torch.float32 and torch.equal(rows, table[ids].float())
    h = torch.randn(5, table.shape[1])
    logits = model.compute_logits(h)
    ref = h @ table.float().T
    torch.testing.assert_close(logits, ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


@pytest.mark.parametrize("tied", [False, True])
def test_greedy_decode_at_avx2_is_transformers_float32_on_the_bf16_weights(avx2, checkpoints, tied):
    """Token for token: prompts of 5-30 tokens prefilled together (the tiles) then decoded as a
    batch (the GEMVs), against transformers in float32 on the checkpoint's weights widened."""
    path = checkpoints[tied, torch.bfloat16]
    runner = runner_for(path)
    assert runner.model.layers[0].mlp.down_proj.weight.dtype == torch.bfloat16
    prompts = random_prompts(VOCAB, [5, 12, 30], seed=int(tied))
    steps = 12
    got, _ = run_greedy(runner, prompts, steps)
    assert got == reference(path, prompts, steps + 1)
