"""Phi-3 and every rope scaling Relay implements give transformers' greedy output, token for token,
in float32 through the offline Engine; what Relay does not implement is refused by name at start-up.
Also: --chat-template, and --model-path as a Hugging Face repo id from the hub's cache.

Tiny random-weight models with short context lengths put the rope scalings' boundaries
(original_max_position_embeddings, max_position_embeddings) inside the prompts and generations."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import pytest
import torch

from relay import Engine, SamplingParams
from relay.config import ModelConfig
from relay.execution.model_files import ModelFileError, resolve_model_dir
from relay.rope import ROPE_TYPES, rope_settings
from tests.helpers.engine_checks import random_prompts, reference
from tests.helpers.server_utils import assert_one_line_error, serve
from tests.helpers.tiny_models import TINY_VOCAB, tiny_shape

NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=NEW_TOKENS, ignore_eos=True)
COMMON = tiny_shape(pad_token_id=0)  # (each config below sets its max_position_embeddings)
ORIGINAL = 32  # original_max_position_embeddings of the LongRoPE models


def phi3_config(partial: float = 1.0):
    from transformers import Phi3Config

    pairs = int(64 // 4 * partial) // 2
    return Phi3Config(
        **{**COMMON, "max_position_embeddings": 128},
        original_max_position_embeddings=ORIGINAL,
        partial_rotary_factor=partial,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial,
            "short_factor": [1.0 + 0.05 * i for i in range(pairs)],
            "long_factor": [2.0 + 0.75 * i for i in range(pairs)],
        },
    )


def llama_config(rope: dict, max_positions: int = 128, **extra):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    cls = {"qwen2": Qwen2Config, "qwen3": Qwen3Config}.get(extra.pop("family", None), LlamaConfig)
    return cls(
        **{**COMMON, **extra, "max_position_embeddings": max_positions},
        rope_parameters={"rope_theta": 10000.0, **rope},
    )


CONFIGS = {
    "phi3-longrope": lambda: phi3_config(),
    "phi4mini-partial-longrope": lambda: phi3_config(
        partial=0.75
    ),  # Phi-4-mini rotates 3/4 of each head
    "llama-linear": lambda: llama_config({"rope_type": "linear", "factor": 4.0}),
    # max_position_embeddings 48, served to 96: decoding crosses into the rescaled base
    "llama-dynamic": lambda: llama_config(
        {"rope_type": "dynamic", "factor": 2.0}, max_positions=48
    ),
    "llama-yarn": lambda: llama_config(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}
    ),
    "llama-llama3": lambda: llama_config(
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16,
        }
    ),
    "qwen2-yarn": lambda: llama_config(
        {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}, family="qwen2"
    ),
    "qwen3-yarn": lambda: llama_config(
        {"rope_type": "yarn", "factor": 2.0, "beta_fast": 16.0}, family="qwen3", head_dim=32
    ),
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, default_model_dir):
    from transformers import AutoModelForCausalLM

    made: dict[str, str] = {}

    def make(name: str) -> str:
        if name not in made:
            torch.manual_seed(0)
            path = str(tmp_path_factory.mktemp(name))
            AutoModelForCausalLM.from_config(CONFIGS[name](), dtype=torch.float32).save_pretrained(
                path
            )
            for f in os.listdir(default_model_dir):  # prompts are token ids: any tokenizer will do
                if f.startswith("tokenizer"):
                    shutil.copy(os.path.join(default_model_dir, f), path)
            made[name] = path
        return made[name]

    return make


def engine(path: str, **kw) -> Engine:
    return Engine(
        path, dtype="float32", page_size=4, chunked_prefill_size=24, kv_cache_gb=0.01, **kw
    )


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_greedy_output_equals_transformers(model_dir, name):
    """Prompts and 16 new tokens through prompt chunks of 24 tokens, again from the prefix cache,
    and once more in a KV pool so small that requests are retracted and recomputed. The LongRoPE
    models' original length is 32: prompts of 25 and 31 tokens grow past it while decoding
    (transformers' generate then recomputes the sequence with the long factors, and Relay too),
    prompts of 40 and 70 start past it. The dynamic-NTK model decodes past max_position_embeddings
    (transformers recomputes its base for each token decoded there)."""
    from tests.helpers.engine_checks import check_three_ways

    lengths = [3, 9, 13, 25, 31, 40, 70] if "longrope" in name else [3, 9, 17, 25, 31, 40]
    head_dim = 32 if name == "qwen3-yarn" else 16
    small = 40 * 4 * (2 * 2 * head_dim * 2 * 4) / (1 << 30)  # ~40 pages of 4 tokens
    check_three_ways(
        model_dir(name),
        random_prompts(TINY_VOCAB, lengths),
        small,
        page_size=4,
        chunked_prefill_size=24,
        kv_cache_gb=0.01,
        context_length=96 if "dynamic" in name else None,
    )


@pytest.mark.parametrize(
    "how",
    [dict(overlap_min_share=0.0), dict(speculative_algorithm="ngram")],
    ids=["overlap-scheduling", "ngram-speculation"],
)
def test_longrope_switches_to_the_long_factors_under_overlap_and_speculation(model_dir, how):
    """The step that takes a sequence past the original length recomputes it on the long factors
    with steps scheduled ahead (overlap) too, and proposals are never verified across it."""
    path = model_dir("phi3-longrope")
    rng_prompts = random_prompts(TINY_VOCAB, [20, 25, 31, 40])
    prompts = [p[:6] * 5 for p in rng_prompts]  # repetitive: n-gram proposals find matches
    expected = reference(path, prompts, NEW_TOKENS)
    eng = engine(path, **how)
    assert [o.token_ids for o in eng.generate(prompts, GREEDY)] == expected
    eng.check()


def test_the_long_factors_change_what_the_model_computes(model_dir):
    """The LongRoPE tests would pass with the short factors everywhere if they did not matter here:
    transformers' logits with the long factors swapped for the short ones differ past position 32."""
    from transformers import AutoModelForCausalLM

    path = model_dir("phi3-longrope")
    prompt = torch.tensor([random_prompts(TINY_VOCAB, [70], seed=3)[0]])
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.inference_mode():
        long = model(prompt).logits
        model.model.rotary_emb.long_inv_freq = model.model.rotary_emb.original_inv_freq
        short = model(prompt).logits
    assert (long - short).abs().max() > 0.1


def test_phi3_fused_weights_split_into_each_tensor_parallel_rank():
    """qkv_proj is [q; k; v] by rows: rank r of 2 takes its own q heads and kv heads from each part,
    not the r-th half of the fused rows; gate_up_proj likewise from gate and from up."""
    from relay.execution.distributed import TPGroup
    from relay.execution.models.phi3 import Phi3ForCausalLM

    mc = ModelConfig.from_hf_dict(phi3_config().to_dict())
    d, q, kv = mc.head_dim, mc.num_heads * mc.head_dim, mc.num_kv_heads * mc.head_dim
    qkv = torch.arange((q + 2 * kv) * mc.hidden_size, dtype=torch.float32).view(-1, mc.hidden_size)
    gate_up = torch.arange(2 * mc.intermediate_size * mc.hidden_size, dtype=torch.float32).view(
        -1, mc.hidden_size
    )
    for rank in (0, 1):
        model = Phi3ForCausalLM(mc, TPGroup(rank, 2), torch.float32, 64)
        model._load_one("model.layers.0.self_attn.qkv_proj.weight", qkv)
        model._load_one("model.layers.0.mlp.gate_up_proj.weight", gate_up)
        qh, kh = mc.num_heads // 2, mc.num_kv_heads // 2
        want = torch.cat(
            [
                qkv[rank * qh * d : (rank + 1) * qh * d],
                qkv[q + rank * kh * d : q + (rank + 1) * kh * d],
                qkv[q + kv + rank * kh * d : q + kv + (rank + 1) * kh * d],
            ]
        )
        assert torch.equal(model.layers[0].self_attn.qkv_proj.weight, want)
        i, half = mc.intermediate_size, mc.intermediate_size // 2
        want = torch.cat(
            [
                gate_up[rank * half : (rank + 1) * half],
                gate_up[i + rank * half : i + (rank + 1) * half],
            ]
        )
        assert torch.equal(model.layers[0].mlp.gate_up_proj.weight, want)


# ---- rope configs -------------------------------------------------------------------------------
def test_a_rope_type_relay_does_not_implement_is_refused_by_name():
    cfg = llama_config({"rope_type": "default"}).to_dict()
    with pytest.raises(
        ValueError, match=r"rope_parameters\.rope_type 'mrope' is not supported.*longrope"
    ):
        ModelConfig.from_hf_dict(
            {**cfg, "rope_parameters": {"rope_type": "mrope", "rope_theta": 1e4}}
        )
    with pytest.raises(ValueError, match=r"rope_scaling\.rope_type 'ntk-by-parts'"):
        ModelConfig.from_hf_dict({**cfg, "rope_scaling": {"type": "ntk-by-parts", "factor": 2.0}})
    with pytest.raises(
        ValueError, match=r"rope_scaling\.low_freq_factor is required by rope_type 'llama3'"
    ):
        ModelConfig.from_hf_dict({**cfg, "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_old_config_spellings_read_as_transformers_reads_them():
    phi = phi3_config().to_dict()
    su = {
        **phi,
        "rope_parameters": None,
        "rope_scaling": {"type": "su", "short_factor": [1.0] * 8, "long_factor": [4.0] * 8},
    }
    rope = rope_settings(su, "Phi3ForCausalLM", 16)
    assert (
        rope.scaling["rope_type"] == "longrope"
        and rope.scaling["original_max_position_embeddings"] == ORIGINAL
    )
    old = rope_settings(
        {
            "rope_theta": 5e5,
            "max_position_embeddings": 64,
            "rope_scaling": {"type": "yarn", "factor": 2.0},
        },
        "LlamaForCausalLM",
        16,
    )
    assert old.theta == 5e5 and old.scaling == {
        "rope_type": "yarn",
        "factor": 2.0,
        "original_max_position_embeddings": 64,
    }
    assert set(ROPE_TYPES) == {"default", "linear", "dynamic", "yarn", "llama3", "longrope"}


def test_the_server_refuses_an_unknown_rope_type_or_architecture_in_one_line(tmp_path, model_dir):
    path = tmp_path / "model"
    shutil.copytree(model_dir("llama-linear"), path)
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(
        json.dumps({**cfg, "rope_parameters": {"rope_type": "mrope"}})
    )
    assert_one_line_error(
        serve("--port", "0", "--model-path", str(path)), "rope_parameters.rope_type", "'mrope'"
    )
    (path / "config.json").write_text(json.dumps({**cfg, "architectures": ["MambaForCausalLM"]}))
    assert_one_line_error(
        serve("--port", "0", "--model-path", str(path)),
        "'MambaForCausalLM'",
        "LlamaForCausalLM",
        "Phi3ForCausalLM",
    )


# ---- --chat-template ----------------------------------------------------------------------------
TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


def test_a_chat_template_file_gives_a_model_without_one_its_chat_format(tmp_path, model_dir):
    from relay.text.tokenizer import Tokenizer

    path = model_dir("llama-linear")  # its tokenizer files carry no template
    messages = [{"role": "user", "content": "hi"}]
    with pytest.raises(ValueError, match="--chat-template"):
        Tokenizer(path).apply_chat_template(messages)
    file = tmp_path / "chat.jinja"
    file.write_text(TEMPLATE)
    tok = Tokenizer(path, str(file))
    assert tok.decode(tok.apply_chat_template(messages)) == "<user>hi\n<assistant>"


def test_a_chat_template_that_is_missing_or_not_jinja_stops_the_server(tmp_path, model_dir):
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for m in messages %}")
    path = model_dir("llama-linear")
    assert_one_line_error(
        serve("--port", "0", "--model-path", path, "--chat-template", str(bad)),
        "--chat-template",
        "not a valid Jinja template",
    )
    missing = str(tmp_path / "missing.jinja")
    assert_one_line_error(
        serve("--port", "0", "--model-path", path, "--chat-template", missing),
        "--chat-template",
        missing,
    )


# ---- Hugging Face repo ids ----------------------------------------------------------------------
def fake_hub_cache(root, repo_id: str, model_path: str) -> str:
    """The hub cache's layout for one repo: models--org--name/{refs/main, snapshots/<commit>/...}."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    repo = root / ("models--" + repo_id.replace("/", "--"))
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    shutil.copytree(model_path, snapshot)
    return str(snapshot)


def test_a_repo_id_resolves_to_its_snapshot_in_the_hub_cache(tmp_path, model_dir, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    path = model_dir("phi3-longrope")
    snapshot = fake_hub_cache(tmp_path, "tiny-org/tiny-phi3", path)
    assert resolve_model_dir("tiny-org/tiny-phi3") == snapshot
    prompts = random_prompts(TINY_VOCAB, [5, 12])
    assert [
        o.token_ids for o in engine("tiny-org/tiny-phi3").generate(prompts, GREEDY)
    ] == reference(path, prompts, NEW_TOKENS)
    with pytest.raises(
        ModelFileError,
        match="'tiny-org/absent' is neither a local path nor a repo in .*HF_HUB_OFFLINE",
    ):
        resolve_model_dir("tiny-org/absent")
    with pytest.raises(ModelFileError, match="does not exist"):
        resolve_model_dir(str(tmp_path / "no" / "such" / "dir"))


def test_the_server_names_a_repo_id_it_cannot_find_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert_one_line_error(
        serve("--port", "0", "--model-path", "tiny-org/absent"),
        "'tiny-org/absent'",
        "HF_HUB_OFFLINE",
    )


def test_the_cpu_rope_kernel_reads_the_long_factor_rows_as_the_torch_path_does(model_dir):
    """Phi-3 with Relay's fused CPU ops (the rope kernel reads the table rows it is given) against
    the same model on torch's ops, over a 40-token prompt on the long factors' rows (float32: the
    kernel computes what torch does to rounding)."""
    from relay.config import EngineConfig
    from relay.execution.model_runner import ModelRunner
    from tests.helpers.kernel_helpers import cpu_kernels_or_skip
    from tests.helpers.runner_batches import PS, prefill, spec

    cpu_kernels_or_skip()
    path = model_dir("phi3-longrope")
    cfg = EngineConfig(dtype="float32", page_size=PS, kv_cache_gb=0.01)
    fast, plain = (ModelRunner(cfg, path, ModelConfig.from_dir(path)) for _ in range(2))
    plain.model.fused_cpu_ops = False
    for module in plain.model.modules():
        for name in ("fused", "gemv"):
            if hasattr(module, name):
                setattr(module, name, False)
        if hasattr(module, "rotary") and module is not plain.model:
            module.rotary = None
    assert fast.model.layers[0].self_attn.rotary is not None, "the kernel must be on for this test"
    prompt = random_prompts(TINY_VOCAB, [40], seed=5)
    batch = dataclasses.replace(
        prefill([0], prompt, [spec(0)]), rope_long=[True]
    )  # the long-factor rows
    a, b = fast.step_logits(batch, batch.new_pages), plain.step_logits(batch, batch.new_pages)
    assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item()
    on_short_rows = dataclasses.replace(batch, rope_long=[False])
    short = plain.step_logits(on_short_rows, on_short_rows.new_pages)
    assert (short - b).abs().max().item() > 0.01 * b.abs().max().item(), (
        "the two sets of rows differ"
    )


def _phi3_last_logits(rank: int, tp, model_dir: str, prompt: list[int]) -> torch.Tensor:
    from relay.config import EngineConfig
    from relay.execution.model_runner import ModelRunner
    from tests.helpers.runner_batches import PS, prefill, spec

    runner = ModelRunner(
        EngineConfig(dtype="float32", tp_size=2, page_size=PS, kv_cache_gb=0.01),
        model_dir,
        ModelConfig.from_dir(model_dir),
        tp,
    )
    batch = dataclasses.replace(
        prefill([0], [prompt], [spec(0)]), rope_long=[True]
    )  # 40 tokens: past 32
    return runner.step_logits(batch, batch.new_pages)[-1]


def test_phi3_over_two_tensor_parallel_ranks_computes_transformers_logits(tmp_path, model_dir):
    """--tp 2: each rank loads its share of the fused qkv_proj and gate_up_proj; the all-reduced
    logits of a 40-token prompt (past the original length) are transformers'."""
    from tests.helpers.ranks import run_ranks

    path = model_dir("phi3-longrope")
    prompt = random_prompts(TINY_VOCAB, [40], seed=7)[0]
    from transformers import AutoModelForCausalLM

    with torch.inference_mode():
        want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)(
            torch.tensor([prompt])
        ).logits[0, -1]
    for got in run_ranks(_phi3_last_logits, tmp_path, path, prompt):
        assert (got - want).abs().max().item() < 1e-4 * want.abs().max().item() + 1e-5
