"""Mixture-of-experts models (Qwen2-MoE, Qwen3-MoE, Mixtral) compute what transformers does.

Tiny seeded random-weight checkpoints (tests/conftest.py): greedy float32 output token for token
through the offline Engine (also from the prefix cache and under retraction), a prompt step's
logits, bfloat16 next-token agreement; the MoE block alone against transformers' block, with
tied router probabilities and experts no token picks; tensor parallelism over 2 CPU ranks; and
one request through the server. The Triton grouped-GEMM path for CUDA is checked without a GPU
(interpreter, ahead-of-time compile) where Triton is installed.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from relay import Engine, SamplingParams
from relay.config import EngineConfig, ModelConfig
from relay.execution.distributed import TPGroup
from relay.execution.model_runner import ModelRunner
from relay.execution.models.moe import MoeForCausalLM, SparseMoeBlock
from tests.helpers.engine_checks import check_three_ways, random_prompts
from tests.helpers.model_families import LOGIT_PROMPTS, prompt_batch
from tests.helpers.paths import ROOT
from tests.helpers.ranks import run_ranks
from tests.helpers.tiny_models import TINY_VOCAB, tiny_config

ARCHS = ["qwen2_moe", "qwen3_moe", "mixtral"]
PS = 4


def hf_block(arch: str, config):
    """transformers' sparse MoE block for this config, random weights (seeded by the caller)."""
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    block = {
        "qwen2_moe": Qwen2MoeSparseMoeBlock,
        "qwen3_moe": Qwen3MoeSparseMoeBlock,
        "mixtral": MixtralSparseMoeBlock,
    }[arch](config)
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0, 0.3)
    return block.eval()


def relay_block(arch: str, config, hf, dtype: torch.dtype) -> SparseMoeBlock:
    """Relay's block with hf's weights, loaded through the model's checkpoint loader under the
    names transformers saves them by (per-expert tensors)."""
    mc = ModelConfig.from_hf_dict({**config.to_dict(), "num_hidden_layers": 1})
    model = MoeForCausalLM(mc, TPGroup(), dtype, 16)
    where = "block_sparse_moe" if arch == "mixtral" else "mlp"
    names = ("w1", "w3", "w2") if arch == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    state = {k: v.to(dtype) for k, v in hf.state_dict().items()}
    inter = state["experts.gate_up_proj"].shape[1] // 2
    for e in range(mc.num_experts):
        gate_up, down = state["experts.gate_up_proj"][e], state["experts.down_proj"][e]
        for name, w in zip(names, (gate_up[:inter], gate_up[inter:], down)):
            model._load_one(f"model.layers.0.{where}.experts.{e}.{name}.weight", w)
    for k, w in state.items():
        if not k.startswith("experts."):
            model._load_one(f"model.layers.0.{where}.{k}", w)
    return model.layers[0].mlp


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_block_equals_transformers_block_with_ties_and_idle_experts(arch, dtype):
    """The block's output is transformers' block's: routed over random tokens, over tokens whose
    router probabilities tie (two experts share a router row), and over a step of 1-3 tokens,
    where most experts get no token at all (and run no GEMM)."""
    torch.manual_seed(0)
    config = tiny_config(arch)
    hf = hf_block(arch, config).to(dtype)
    mine = relay_block(arch, config, hf, dtype)
    calls: list[int] = []
    for expert in mine.experts:
        expert.register_forward_hook(lambda m, args, out: calls.append(args[0].shape[0]))
    with torch.no_grad():
        hf.gate.weight[1] = hf.gate.weight[
            0
        ]  # experts 0 and 1: the same probability for every token
        mine.gate.weight[1] = mine.gate.weight[0]
    probe = torch.randn(40, config.hidden_size).to(dtype)
    for x in (probe, probe[:1], probe[5:8]):
        calls.clear()
        want = hf(x.unsqueeze(0))[0]
        got = mine(x)
        _, experts = mine.route(x)
        used = experts.unique().numel()
        counts = torch.bincount(experts.flatten()).tolist()
        assert sorted(calls) == sorted(n for n in counts if n), (
            "one GEMM per expert with tokens, over its tokens"
        )
        assert len(calls) == used
        if len(x) < 4:
            assert used < len(mine.experts), "a small step leaves experts without tokens"
        tol = 1e-6 if dtype == torch.float32 else 1e-2
        torch.testing.assert_close(got, want, atol=tol * want.abs().max().item(), rtol=0)
    _, experts = mine.route(probe)
    tied = (experts[:, 0] <= 1) & (experts[:, 1] <= 1)
    assert tied.any(), "some tokens' top two are the tied experts"


def test_fused_expert_tensors_load_as_per_expert_ones(tiny_model_dir):
    """A checkpoint holding each layer's experts as transformers 5 does in memory (3-D
    gate_up_proj [experts, 2 x inter, hidden] and down_proj [experts, hidden, inter]) loads to
    the same parameters as the per-expert tensors save_pretrained writes."""
    from relay.execution.model_loading import iter_safetensors

    path = tiny_model_dir("qwen3_moe")
    mc = ModelConfig.from_dir(path)
    per_expert = MoeForCausalLM(mc, TPGroup(), torch.float32, 16)
    with torch.no_grad():
        per_expert.load_weights(iter_safetensors(path, show_progress=False))
    tensors = dict(iter_safetensors(path, show_progress=False))
    fused = {}
    for name, w in tensors.items():
        if ".experts." not in name:
            fused[name] = w
        elif name.endswith(".experts.0.gate_proj.weight"):
            layer = name.split(".experts.")[0]
            gate_up = [
                torch.cat(
                    [
                        tensors[f"{layer}.experts.{e}.gate_proj.weight"],
                        tensors[f"{layer}.experts.{e}.up_proj.weight"],
                    ]
                )
                for e in range(mc.num_experts)
            ]
            fused[f"{layer}.experts.gate_up_proj"] = torch.stack(gate_up)
            fused[f"{layer}.experts.down_proj"] = torch.stack(
                [tensors[f"{layer}.experts.{e}.down_proj.weight"] for e in range(mc.num_experts)]
            )
    model = MoeForCausalLM(mc, TPGroup(), torch.float32, 16)
    with torch.no_grad():
        model.load_weights(fused.items())
    for (name, a), b in zip(per_expert.state_dict().items(), model.state_dict().values()):
        assert torch.equal(a, b), name


def test_sparse_and_dense_layers_follow_the_config():
    """decoder_sparse_step and mlp_only_layers pick the dense layers as transformers does."""
    from transformers import AutoModelForCausalLM, Qwen2MoeConfig

    config = Qwen2MoeConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=6,
        num_attention_heads=2,
        num_key_value_heads=1,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=8,
        shared_expert_intermediate_size=8,
        decoder_sparse_step=2,
        mlp_only_layers=[3],
    )
    hf = AutoModelForCausalLM.from_config(config)
    mc = ModelConfig.from_hf_dict(config.to_dict())
    mine = MoeForCausalLM(mc, TPGroup(), torch.float32, 16)
    sparse = [type(layer.mlp).__name__.endswith("SparseMoeBlock") for layer in hf.model.layers]
    assert (
        sparse
        == [isinstance(layer.mlp, SparseMoeBlock) for layer in mine.layers]
        == [False, True, False, False, False, True]
    )


def test_moe_configs_read_as_the_checkpoints_write_them():
    from transformers import MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig

    qwen2 = ModelConfig.from_hf_dict(Qwen2MoeConfig(num_hidden_layers=4).to_dict())
    assert (
        qwen2.num_experts,
        qwen2.num_experts_per_tok,
        qwen2.moe_renormalize,
        qwen2.attention_bias,
    ) == (60, 4, False, True)
    assert qwen2.shared_expert_intermediate_size == 5632 and not qwen2.qk_norm
    qwen3 = Qwen3MoeConfig(num_hidden_layers=4, num_experts=16, norm_topk_prob=True).to_dict()
    assert (
        "num_local_experts" in qwen3
    )  # what transformers 5 writes; Qwen's own releases say num_experts
    released = {**{k: v for k, v in qwen3.items() if k != "num_local_experts"}, "num_experts": 16}
    for cfg in (qwen3, released):
        mc = ModelConfig.from_hf_dict(cfg)
        assert (mc.num_experts, mc.moe_renormalize, mc.qk_norm, mc.attention_bias) == (
            16,
            True,
            True,
            False,
        )
    mixtral = ModelConfig.from_hf_dict(MixtralConfig(num_hidden_layers=2).to_dict())
    assert (mixtral.num_experts, mixtral.moe_intermediate_size, mixtral.moe_renormalize) == (
        8,
        14336,
        True,
    )
    assert mixtral.moe_float32_weights and mixtral.active_intermediate_size() == 2 * 14336


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_moe_models_match_transformers(tiny_model_dir, arch):
    """Greedy float32 output equals transformers' generate, token for token: a batch of prompts,
    again from the prefix cache, and in a KV pool small enough to force retraction."""
    prompts = random_prompts(TINY_VOCAB, [3, 5, 8, 13, 17, 24, 31, 40, 57, 64])
    config = tiny_config(arch)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    small = 40 * PS * (config.num_hidden_layers * 2 * head_dim * 2 * 4) / (1 << 30)  # ~40 pages
    check_three_ways(
        tiny_model_dir(arch),
        prompts,
        small,
        page_size=PS,
        chunked_prefill_size=48,
        kv_cache_gb=0.01,
    )


def runner_logits(
    model_dir: str, dtype: str = "float32", tp: TPGroup | None = None
) -> torch.Tensor:
    """Each of LOGIT_PROMPTS' last-token logits from one prompt step."""
    cfg = EngineConfig(dtype=dtype, page_size=PS, kv_cache_gb=0.01, tp_size=tp.size if tp else 1)
    runner = ModelRunner(cfg, model_dir, ModelConfig.from_dir(model_dir), *([tp] if tp else []))
    batch, tables = prompt_batch(LOGIT_PROMPTS)
    return runner.step_logits(batch, tables)


@pytest.mark.parametrize("arch", ARCHS)
def test_prompt_logits_are_transformers_logits(tiny_model_dir, arch):
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch)
    got = runner_logits(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        want = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in LOGIT_PROMPTS])
    torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)


@pytest.mark.parametrize("arch", ARCHS)
def test_bfloat16_predicts_the_next_token_transformers_does(tiny_model_dir, arch):
    """In bfloat16 (Relay's CPU kernels: fused norms, small-batch GEMM, on the expert weights
    too), teacher-forced next-token predictions agree with transformers' in bfloat16, which
    rounds differently (near-ties in the logits or the router may flip)."""
    from transformers import AutoModelForCausalLM

    path = tiny_model_dir(arch)
    prompts = random_prompts(TINY_VOCAB, [6, 11, 23, 40], seed=2)
    outs = Engine(path, dtype="bfloat16", page_size=PS, kv_cache_gb=0.01).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=12, ignore_eos=True)
    )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    agree = total = 0
    with torch.inference_mode():
        for p, o in zip(prompts, outs):
            predicted = (
                model(torch.tensor([p + o.token_ids[:-1]]))
                .logits[0, len(p) - 1 :]
                .argmax(-1)
                .tolist()
            )
            agree += sum(a == b for a, b in zip(predicted, o.token_ids))
            total += len(o.token_ids)
    assert agree / total >= 0.9, (
        f"{agree}/{total} next-token predictions agree with transformers (bf16)"
    )


def _tp_logits(rank: int, tp: TPGroup, model_dir: str) -> torch.Tensor:
    return runner_logits(model_dir, tp=tp)


@pytest.mark.parametrize("arch", ["qwen2_moe", "mixtral"])
def test_two_ranks_compute_the_logits_of_one(tmp_path, tiny_model_dir, arch):
    """--tp 2: each expert's (and the shared expert's) FFN split over two CPU ranks, the router
    replicated, one all-reduce per block: both ranks' logits are one rank's."""
    path = tiny_model_dir(arch)
    one = runner_logits(path)
    for got in run_ranks(_tp_logits, tmp_path, path):
        torch.testing.assert_close(got, one, atol=1e-4 * one.abs().max().item(), rtol=0)


@pytest.mark.slow
def test_server_serves_a_moe_model_as_the_engine_does(tiny_model_dir):
    from tests.helpers.server_utils import assert_served_completions_equal

    path = tiny_model_dir("qwen2_moe")
    prompts = random_prompts(TINY_VOCAB, [9, 30], seed=4)
    want = Engine(path, dtype="float32", kv_cache_gb=0.05).generate(
        prompts, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    )
    assert_served_completions_equal(path, prompts, want)


# ---- the Triton grouped-GEMM path (CUDA; checked here without a GPU) ----------------------------
HAS_TRITON = importlib.util.find_spec("triton") is not None


def triton_path_matches_torch_path() -> None:
    """Under TRITON_INTERPRET=1 on CPU tensors: each arch's block through kernels/triton_moe.py
    equals its torch grouped path, float32 (1e-5 of max) and float16 (1e-2), on 40, 3 and 1 tokens
    (bfloat16: numpy, under the interpreter, has none)."""
    for arch in ARCHS:
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 1e-2)):
            torch.manual_seed(0)
            config = tiny_config(arch)
            block = relay_block(arch, config, hf_block(arch, config).to(dtype), dtype)
            x = torch.randn(40, config.hidden_size).to(dtype)
            for rows in (x, x[3:6], x[:1]):
                want = block(rows)
                block.use_triton = True
                got = block(rows)
                block.use_triton = False
                torch.testing.assert_close(
                    got.float(), want.float(), atol=tol * want.abs().max().item(), rtol=0
                )
            print("ok", arch, dtype, flush=True)


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
def test_triton_grouped_experts_in_interpreter():
    path = [ROOT, os.path.join(ROOT, "src")] + os.environ.get("PYTHONPATH", "").split(os.pathsep)
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(path)}
    check = "import tests.execution.models.test_models_moe as t; t.triton_path_matches_torch_path()"
    proc = subprocess.run(
        [sys.executable, "-c", check],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0 and proc.stdout.count("ok ") == 2 * len(ARCHS), (
        proc.stdout + proc.stderr[-3000:]
    )


@pytest.mark.skipif(not HAS_TRITON, reason="triton not installed")
@pytest.mark.parametrize("arch", [90, 80])
def test_triton_expert_gemm_compiles_for_gpu(arch):
    """The grouped GEMM as fused_experts launches it (both passes, bf16/fp16/fp32) compiles to an
    sm_90 / sm_80 cubin without a GPU: Triton's typing and tl.dot shape rules, which the
    interpreter does not check."""
    import inspect

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from relay.execution.kernels import triton_moe

    fn = triton_moe._expert_gemm
    params = list(inspect.signature(fn.fn).parameters)
    for ty in ("bf16", "fp16", "fp32"):
        for by_token, out_ty in ((True, ty), (False, "fp32")):
            constexprs = dict(
                A_BY_TOKEN=by_token,
                SCALE=not by_token,
                IEEE=ty == "fp32",
                BLOCK_M=triton_moe.BLOCK_M,
                BLOCK_N=64,
                BLOCK_K=64,
            )
            types = {
                "pair_ids": "*i64",
                "block_expert": "*i32",
                "scales": "*fp32",
                "Out": f"*{out_ty}",
                "A": f"*{ty}",
                "W": f"*{ty}",
            }
            sig = {p: "constexpr" if p in constexprs else types.get(p, "i32") for p in params}
            src = ASTSource(
                fn=fn,
                signature=sig,
                constexprs={(params.index(k),): v for k, v in constexprs.items()},
            )
            options = {"num_warps": 4, "num_stages": 2}
            compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options)
            assert compiled.metadata.shared <= 99 * 1024
