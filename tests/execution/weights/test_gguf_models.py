"""GGUF files of each Relay architecture that transformers' GGUF reader reads, served as
transformers runs them; a Mixtral file (which it cannot read) refused in one line.

Each case is a tiny seeded random-weight model (hidden 64, a byte-level BPE vocabulary of ~300
tokens) written as a GGUF file the way llama.cpp writes it (tests/helpers/gguf_files.py). The file is first
checked to hold the model it was written from: transformers reads it back to the same logits. Relay
serves a Llama, Mistral, Qwen2 or Qwen3 file from the file's own tensors (gguf_weights) and converts
the others once (relay/execution/model_files.py); its greedy float32 output equals transformers'
own from_pretrained(gguf_file=...) on the file, token for token. What a file states but
transformers' reader drops (the MoE expert widths, Qwen3's head_dim, Gemma 2's soft-caps, Gemma 3's
rope scaling: kept at values other than its config classes' defaults here) Relay passes on to it,
and the reference is told the same. The converted directories are removed from the cache after
each test.
"""

from __future__ import annotations

import os
import shutil

import gguf
import pytest
import torch

from relay import Engine, SamplingParams
from relay.execution import model_files
from relay.execution.block_rows import ALL_ROWS
from relay.execution.model_files import ModelFileError, resolve_model_dir
from tests.helpers.engine_checks import random_prompts
from tests.helpers.gguf_files import VOCAB_SIZE, write_gguf
from tests.helpers.gguf_models import (
    COMMON,
    GREEDY,
    greedy,
    random_model,
    transformers_on,
)
from tests.helpers.server_utils import assert_one_line_error, serve

F32, Q8_0 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.Q8_0


CASES = [
    "llama",
    "llama-q8_0",
    "mistral",
    "qwen2",
    "qwen3",
    "qwen2_moe",
    "qwen3_moe",
    "phi3",
    "gemma2",
    "gemma3",
]


@pytest.fixture
def gguf_file(tmp_path):
    """A factory: case name -> a GGUF file of its model (checked to read back as that model);
    each file's converted directory is removed from Relay's cache afterwards."""
    made = []

    def make(name: str) -> str:
        model = random_model(name)
        path = str(tmp_path / name / f"{name}.gguf")
        os.makedirs(os.path.dirname(path))
        write_gguf(path, model, qtype=Q8_0 if name.endswith("q8_0") else F32)
        made.append(path)
        if not name.endswith("q8_0"):  # quantized: not the same logits, by design
            x = torch.tensor([random_prompts(VOCAB_SIZE, [16])[0]])
            with torch.inference_mode():
                want, got = model(x).logits, transformers_on(path, name)(x).logits
            torch.testing.assert_close(got, want, atol=1e-4 * want.abs().max().item(), rtol=0)
        return path

    yield make
    for path in made:
        shutil.rmtree(model_files.converted_dir(path), ignore_errors=True)


@pytest.mark.parametrize("name", CASES)
def test_greedy_output_equals_transformers_on_the_gguf_file(gguf_file, name):
    """Prompts of 3 to 40 tokens (past Gemma's window of 8), 12 new tokens each. The Q8_0 file's
    GEMM weights are found again as exact Q8_0 blocks (weight_blocks) and every GEMM reads them,
    multiplying float32 activations (the checkpoint's exact products)."""
    path = gguf_file(name)
    prompts = random_prompts(VOCAB_SIZE, [3, 11, 26, 40])
    expected = greedy(transformers_on(path, name), prompts)
    engine = Engine(
        path,
        dtype="float32",
        kv_cache_gb=0.01,
        block_activations="float",
        weight_block_rows=ALL_ROWS,
    )
    if name.endswith("q8_0"):
        gemms = engine.runner.model.gemm_modules()
        assert all(m.blocks is not None for m in gemms), "every GEMM weight is in Q8_0 blocks"
    assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected


def test_a_gguf_file_is_served_from_its_own_blocks_with_no_float_copy(gguf_file):
    """A Llama Q8_0 file: every GEMM weight (q/k/v, o, gate/up, down, the LM head) is blocks read
    from the file, with no float weight beside them; the embedding is looked up from the file;
    the cache holds the config and tokenizer, no weights; the GEMM weights take the blocks' memory
    (32 int8 quants and a float32 scale: 9 bits a weight where the file has 8.5)."""
    from relay.execution.layers import has_float_weight
    from relay.execution.model_loading import weight_bytes

    path = gguf_file("llama-q8_0")
    # (blocks for every row count: with fewer, the float32 GEMMs that win past them keep floats)
    exact = dict(block_activations="float", weight_block_rows=ALL_ROWS)
    engine = Engine(path, dtype="float32", kv_cache_gb=0.01, **exact)
    model = engine.runner.model
    gemms = model.gemm_modules()
    assert len(gemms) == 2 * 4 + 1
    assert all(m.blocks is not None and not has_float_weight(m) for m in gemms)
    assert model.embed_tokens.lookup is not None and not has_float_weight(model.embed_tokens)
    cached = os.listdir(model_files.converted_dir(path))
    assert not [f for f in cached if f.endswith((".safetensors", ".bin", ".npz"))], cached
    held = sum(weight_bytes(m) for m in gemms)
    floats = 4 * sum(m.weight.numel() for m in gemms)
    assert held < 0.4 * floats, "9-10 bits a weight where float32 has 32"


def _gguf_step_logits(rank: int, tp, model_dir: str, prompt: list[int]) -> torch.Tensor:
    from relay.config import EngineConfig, ModelConfig
    from relay.execution.layers import has_float_weight
    from relay.execution.model_runner import ModelRunner
    from tests.helpers.runner_batches import PS, prefill, spec

    cfg = EngineConfig(
        dtype="float32",
        tp_size=tp.size,
        page_size=PS,
        kv_cache_gb=0.01,
        block_activations="float",
        weight_block_rows=ALL_ROWS,
    )
    runner = ModelRunner(cfg, model_dir, ModelConfig.from_dir(model_dir), tp)
    assert all(not has_float_weight(m) for m in runner.model.gemm_modules())
    batch = prefill([0], [prompt], [spec(0)])
    return runner.step_logits(batch, batch.new_pages)[-1]


def test_a_gguf_file_over_two_tensor_parallel_ranks_computes_what_one_rank_does(
    gguf_file, tmp_path
):
    """--tp 2 from the file's blocks: each rank takes its rows of q/k/v (after llama.cpp's q/k
    permutation is undone), gate/up and the LM head, and its whole blocks of o and down's inputs;
    the all-reduced logits are one rank's."""
    from relay.execution.distributed import TPGroup
    from tests.helpers.ranks import run_ranks

    model_dir = resolve_model_dir(gguf_file("llama-q8_0"))
    prompt = random_prompts(VOCAB_SIZE, [20], seed=3)[0]
    want = _gguf_step_logits(0, TPGroup(), model_dir, prompt)
    for got in run_ranks(_gguf_step_logits, tmp_path, model_dir, prompt):
        assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item()


def test_a_llama_3_file_rotates_with_its_rope_scaling(tmp_path):
    """llama.cpp stores Llama 3.1+'s rope scaling only as per-frequency divisors (rope_freqs),
    which transformers' GGUF reader ignores: Relay finds the llama3 rope again and computes what
    the model the file was written from computes (not plain rope: that model's greedy output
    differs here, 8x scaling on the longest wavelengths)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    rope = {"rope_type": "llama3", "factor": 8.0, "rope_theta": 10_000.0}
    rope |= model_files.LLAMA3_ROPE
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        LlamaConfig(**{**COMMON, "head_dim": 16}, rope_parameters=rope), dtype=torch.float32
    ).eval()
    path = str(tmp_path / "llama3.gguf")
    write_gguf(path, model)
    prompts = random_prompts(VOCAB_SIZE, [5, 30], seed=4)
    expected = greedy(model, prompts)
    engine = Engine(path, dtype="float32", kv_cache_gb=0.01, block_activations="float")
    try:
        assert [o.token_ids for o in engine.generate(prompts, GREEDY)] == expected
        assert greedy(transformers_on(path, "llama"), prompts) != expected, "plain rope differs"
    finally:
        shutil.rmtree(model_files.converted_dir(path), ignore_errors=True)


def test_a_tensor_of_another_shape_than_the_config_says_is_named_at_start(tmp_path):
    """A file whose metadata says one MLP width and whose tensors have another: one line naming
    the tensor and both shapes, exit status 2, nothing left in the cache."""
    model = random_model("llama")
    model.config.intermediate_size = 96  # the tensors stay 128 wide
    path = str(tmp_path / "wrong.gguf")
    write_gguf(path, model)
    cache = tmp_path / "cache"
    out = serve("--port", "0", "--model-path", path, cache_dir=str(cache))
    assert_one_line_error(out, path, "blk.0.ffn_gate.weight is [128, 64]", "[96, 64]")
    assert not list((cache / "gguf").rglob("*"))


def mixtral_file(path: str) -> str:
    """A Mixtral as llama.cpp writes it: a "llama" file with llama.expert_count and each layer's
    experts stacked."""
    from transformers import AutoModelForCausalLM, MixtralConfig

    torch.manual_seed(0)
    cfg = MixtralConfig(**COMMON, num_local_experts=4, num_experts_per_tok=2)
    return write_gguf(path, AutoModelForCausalLM.from_config(cfg, dtype=torch.float32))


def test_a_mixtral_gguf_file_is_refused_in_one_line_before_converting(tmp_path):
    """transformers' GGUF reader would read it as a Llama without its experts (their MLPs random):
    the server stops in one line naming the file and what it is, and converts nothing."""
    path = mixtral_file(str(tmp_path / "mixtral.gguf"))
    cache = tmp_path / "cache"
    out = serve("--port", "0", "--model-path", path, cache_dir=str(cache))
    assert_one_line_error(out, path, "'llama' file with 4 experts", "MixtralForCausalLM")
    assert not list((cache / "gguf").rglob("*"))


def test_a_gguf_architecture_relay_does_not_serve_is_named(tmp_path, monkeypatch):
    """One transformers reads but Relay does not serve (Falcon): refused before converting."""
    path = str(tmp_path / "falcon.gguf")
    writer = gguf.GGUFWriter(path, "falcon")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()
    monkeypatch.setenv("RELAY_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelFileError, match="architecture 'falcon', which Relay does not serve"):
        resolve_model_dir(path)
    assert not list((tmp_path / "cache" / "gguf").rglob("*"))


@pytest.mark.slow
def test_server_serves_a_gguf_file_as_transformers_runs_it(gguf_file):
    """Text prompts through the server on a Qwen2 GGUF file: tokenized by the file's own
    vocabulary as transformers' GGUF tokenizer does, completed greedily with its tokens' text."""
    from transformers import AutoTokenizer

    from tests.helpers.server_utils import assert_served_completions_equal

    path = gguf_file("qwen2")
    texts = ["The capital of France is", "Once upon a time, hello world and"]
    folder, file = os.path.split(path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=file)
    ids = [tok.encode(t) for t in texts]
    engine = Engine(path, dtype="float32", kv_cache_gb=0.01)
    want = engine.generate(
        texts, SamplingParams(temperature=0.0, max_new_tokens=10, ignore_eos=True)
    )
    assert [engine.tokenizer.encode(t) for t in texts] == ids
    assert [w.token_ids for w in want] == [
        g[:10] for g in greedy(transformers_on(path, "qwen2"), ids)
    ]
    assert_served_completions_equal(path, texts, want)
