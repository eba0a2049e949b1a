"""gpt-oss (GptOssForCausalLM) computes what transformers does.

A tiny seeded random-weight model from transformers' GptOssConfig: 4 layers sliding (window 6)
and full in turn, 4 experts top-2, YaRN rope, every bias, sink and norm randomised (transformers
initialises biases to 0, where one dropped would change nothing). Greedy float32 output token
for token through the offline Engine: prompt chunks of 12 tokens over prompts of up to 78, again
from the prefix cache (two prompts sharing 72 tokens: the decode kernel's shared-prefix cascade),
on Relay's C attention kernels and on the torch paths, under n-gram speculation; the sinks shown
to matter; the released checkpoints' MXFP4 experts; --tp 2; the config as released and the
harmony default.
"""

from __future__ import annotations

import copy
import json
import multiprocessing as mp
import os
import random
import re
import shutil
import traceback

import pytest
import torch

from relay import Engine, SamplingParams
from relay.api.tool_parsers import parser_for_template
from relay.config import EngineConfig, ModelConfig
from relay.execution import mxfp4
from relay.execution.distributed import TPGroup
from relay.execution.kernels import cpu, cpu_attention
from relay.execution.model_runner import ModelRunner
from relay.step import BatchInput

VOCAB, PS, NEW = 1024, 4, 16
YARN = dict(rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False)
YARN.update(original_max_position_embeddings=64, rope_theta=150000.0)
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW, ignore_eos=True)
ENGINE = dict(dtype="float32", page_size=PS, chunked_prefill_size=12, kv_cache_gb=0.01)
SHAPE = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4)
SHAPE.update(num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=2)
SHAPE.update(sliding_window=6, max_position_embeddings=512, initializer_range=0.3, bos_token_id=1)


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    words = lambda n: [rng.randrange(2, VOCAB - 2) for _ in range(n)]  # noqa: E731
    shared, short = words(72), [words(n) for n in (3, 9, 20, 31)]
    return [*short, shared + words(5), shared + words(6), [5, 6, 7, 8] * 5]


PROMPTS = make_prompts()


def gpt_oss_config():
    from transformers import GptOssConfig

    return GptOssConfig(**SHAPE, vocab_size=VOCAB, eos_token_id=VOCAB - 1, rope_parameters=YARN)


def save(model, path: str, default_model_dir: str, state: dict | None = None) -> str:
    """model's checkpoint (or `state` under its config) and a tokenizer (prompts are token ids)."""
    model.save_pretrained(path)
    if state is not None:
        from safetensors.torch import save_file

        os.remove(os.path.join(path, "model.safetensors"))
        save_file({k: v.contiguous() for k, v in state.items()}, f"{path}/model.safetensors")
    for name in os.listdir(default_model_dir):
        if name.startswith("tokenizer"):
            shutil.copy(os.path.join(default_model_dir, name), path)
    return path


def reference(model, prompts: list[list[int]], n: int = NEW) -> list[list[int]]:
    with torch.inference_mode():
        outs = [
            model.generate(torch.tensor([p]), max_new_tokens=n, do_sample=False, pad_token_id=0)
            for p in prompts
        ]
    return [out[0, len(p) :].tolist() for out, p in zip(outs, prompts)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, default_model_dir):
    """(checkpoint directory, transformers' model, its greedy outputs of PROMPTS)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(gpt_oss_config(), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # compare full-length outputs
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") or name.endswith("sinks"):
                p.normal_(0.0, 0.5)
            elif "norm" in name:
                p.normal_(1.0, 0.2)
    path = save(model, str(tmp_path_factory.mktemp("gpt-oss")), default_model_dir)
    return path, model, reference(model, PROMPTS)


def sink_kernel_calls(monkeypatch) -> dict[str, int]:
    """Counts of Relay's C attention calls given sinks (that ran), by kernel, from now on."""
    calls = {"decode": 0, "extend": 0}
    for kind, name in (("decode", "decode_attention"), ("extend", "extend_attention")):

        def counted(*args, _kernel=getattr(cpu_attention, name), _kind=kind, **kw):
            out = _kernel(*args, **kw)
            calls[_kind] += kw.get("sinks", args[-1]) is not None and out is not False
            return out

        monkeypatch.setattr(cpu_attention, name, counted)
    return calls


def test_greedy_output_equals_transformers(tiny, monkeypatch):
    """Prompt chunks, then again from the prefix cache; on CPU through Relay's C decode and
    prompt-chunk attention kernels, sinks and windows included."""
    path, _, want = tiny
    calls = sink_kernel_calls(monkeypatch)
    engine = Engine(path, **ENGINE)
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == want
    again = engine.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in again] == want
    assert all(o.cached_tokens > 0 for o in again[1:]), "the second run hits the prefix cache"
    engine.check()
    if cpu.available():
        assert calls["decode"] > 0 and calls["extend"] > 0


def test_torch_attention_paths_equal_transformers(tiny, monkeypatch):
    """Without the C kernels: decode rows and prompt chunks (SDPA cannot add sinks) in torch."""
    path, _, want = tiny
    monkeypatch.setattr(cpu, "load", lambda: None)
    engine = Engine(path, **ENGINE)
    assert engine.runner.attn.kernel is None
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == want


def test_sinks_matter(tiny):
    """Relay's model with its sinks zeroed computes other tokens: the tests above see them."""
    path, _, want = tiny
    engine = Engine(path, **ENGINE)
    for layer in engine.runner.model.layers:
        layer.self_attn.sinks.zero_()
    got = [o.token_ids for o in engine.generate(PROMPTS, GREEDY)]
    assert sum(g != w for g, w in zip(got, want)) >= len(want) // 2


def test_ngram_speculation_and_structured_output(tiny):
    """Verified proposals (prompt-chunk attention after a prefix) leave greedy output as it is;
    a regex holds a constrained output."""
    path, _, want = tiny
    engine = Engine(
        path, **ENGINE, speculative_algorithm="ngram", speculative_disable_by_batch_size=64
    )
    assert [o.token_ids for o in engine.generate(PROMPTS, GREEDY)] == want
    assert engine.scheduler.stats().spec["spec_verify_rows"] > 0
    regex = SamplingParams(temperature=0.0, max_new_tokens=6, regex=r"[0-9]{4}")
    (out,) = engine.generate([PROMPTS[0]], regex)
    assert re.fullmatch(r"[0-9]{4}", out.text), out.text


def pack_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [..., rows, cols] rounded to MXFP4 and packed as transformers' integrations/mxfp4.py
    reads it: per 32 values an E8M0 scale byte (2 ** (byte - 127), the smallest that holds their
    largest magnitude as at most 6) and 16 bytes of E2M1 codes (indices into FP4_VALUES), the
    even value in the low nibble."""
    from transformers.integrations.mxfp4 import FP4_VALUES

    groups = w.reshape(*w.shape[:-1], -1, 32)
    exponent = torch.ceil(torch.log2(groups.abs().amax(-1).clamp_min(1e-30) / 6.0))
    scaled = groups / torch.exp2(exponent).unsqueeze(-1)
    codes = (scaled.unsqueeze(-1) - torch.tensor(FP4_VALUES)).abs().argmin(-1)
    blocks = (codes[..., 0::2] | (codes[..., 1::2] << 4)).to(torch.uint8)
    return blocks, (exponent + 127).to(torch.uint8)


def test_mxfp4_experts_load_to_transformers_weights(tiny, tmp_path, default_model_dir):
    """The experts packed into MXFP4 as the released checkpoints store them: Relay dequantizes
    them at load to the weights transformers dequantizes them to, and generates as transformers
    does on those."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    _, model, _ = tiny
    model = copy.deepcopy(model)
    state = {}
    for name, w in model.state_dict().items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            state[name] = w
            continue
        blocks, scales = pack_mxfp4(w.transpose(1, 2))  # stored [experts, out, in]
        state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
        assert torch.equal(mxfp4.dequantize(blocks, scales), theirs.transpose(1, 2))
        model.get_parameter(name).data.copy_(theirs)
    model.config.quantization_config = {"quant_method": "mxfp4"}  # as released
    path = save(model, str(tmp_path), default_model_dir, state)
    want = reference(model, PROMPTS[2:4], 8)
    outs = Engine(path, **ENGINE).generate(
        PROMPTS[2:4], SamplingParams(temperature=0.0, max_new_tokens=8, ignore_eos=True)
    )
    assert [o.token_ids for o in outs] == want


def prompt_logits(path: str, tp: TPGroup | None = None) -> torch.Tensor:
    """The last-token logits of PROMPTS[:4] from one prompt step."""
    cfg = EngineConfig(
        dtype="float32", page_size=PS, kv_cache_gb=0.01, tp_size=tp.size if tp else 1
    )
    runner = ModelRunner(cfg, path, ModelConfig.from_dir(path), *([tp] if tp else []))
    prompts, tables, first = PROMPTS[:4], [], 1
    for p in prompts:
        tables.append(list(range(first, first + -(-len(p) // PS))))
        first += len(tables[-1])
    n, zeros = len(prompts), [0] * len(prompts)
    lens = [len(p) for p in prompts]
    batch = BatchInput(
        0, list(range(n)), sum(prompts, []), zeros, lens, zeros, tables, [True] * n, zeros
    )
    return runner.step_logits(batch, tables)


def _rank(rank: int, rendezvous: str, path: str, results) -> None:
    try:
        torch.set_num_threads(1)
        tp = TPGroup.init(rank, 2, f"file://{rendezvous}", torch.device("cpu"))
        results.put((rank, prompt_logits(path, tp).tolist()))
    except Exception:
        results.put((rank, traceback.format_exc()))


def test_two_ranks_compute_transformers_logits(tiny, tmp_path):
    """--tp 2: heads and their sinks, each expert's features, the vocabulary split over two CPU
    ranks; the experts' down bias (on rank 0 only) added once."""
    path, model, _ = tiny
    with torch.inference_mode():
        want = torch.stack([model(torch.tensor([p])).logits[0, -1] for p in PROMPTS[:4]])
    ctx, rendezvous = mp.get_context("spawn"), str(tmp_path / "rendezvous")
    results = ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, rendezvous, path, results)) for r in (0, 1)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=240) for _ in procs)
    for p in procs:
        p.join(30)
    for rank in (0, 1):
        assert not isinstance(got[rank], str), got[rank]
        torch.testing.assert_close(
            torch.tensor(got[rank]), want, atol=1e-4 * want.abs().max().item(), rtol=0
        )


# openai/gpt-oss-20b's config.json, its 24 layer types left to the default (the same)
RELEASED_20B = json.loads("""{"architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss",
  "attention_bias": true, "eos_token_id": 200002, "experts_per_token": 4, "head_dim": 64,
  "hidden_size": 2880, "intermediate_size": 2880, "max_position_embeddings": 131072,
  "num_attention_heads": 64, "num_hidden_layers": 24, "num_key_value_heads": 8,
  "num_local_experts": 32, "rms_norm_eps": 1e-05, "quantization_config": {"quant_method": "mxfp4"},
  "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "rope_type": "yarn",
  "original_max_position_embeddings": 4096, "truncate": false}, "rope_theta": 150000,
  "sliding_window": 128, "swiglu_limit": 7.0, "tie_word_embeddings": false, "vocab_size": 201088}""")


def test_released_config_and_harmony_default():
    """The released config reads as GptOssConfig does, as does one naming no rope (its default)."""
    mc = ModelConfig.from_hf_dict(RELEASED_20B)
    bare = {k: v for k, v in RELEASED_20B.items() if not k.startswith("rope")}
    assert ModelConfig.from_hf_dict(bare) == mc
    assert mc.layer_windows == [128, None] * 12 and mc.kv_window(131072) is None
    assert (mc.num_experts, mc.num_experts_per_tok, mc.moe_intermediate_size) == (32, 4, 2880)
    assert mc.attention_sinks and mc.attention_bias and mc.o_proj_and_mlp_bias
    assert mc.rope_scaling["rope_type"] == "yarn" and mc.rope_theta == 150000
    assert mc.rope_scaling["factor"] == 32.0 and mc.swiglu_limit == 7.0
    # harmony whatever the template teaches: gpt-oss writes nothing else
    assert parser_for_template("<tool_call>", "GptOssForCausalLM") == "harmony"
    assert parser_for_template(None, "GptOssForCausalLM") == "harmony"
    assert parser_for_template("<tool_call>", "LlamaForCausalLM") == "hermes"
