"""Engine and model configuration.

`EngineConfig` is what a user sets (the offline `Engine(**config)` and the server's
flags map onto it one to one); `ModelConfig` is what a checkpoint's config.json says
(relay.hf_config reads transformers' names into its fields).
Both are plain dataclasses so they travel between processes as msgpack maps.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from relay.checkpoint_quant import CheckpointQuant, read_checkpoint_quant
from relay.hf_config import model_fields

DTYPES = ("auto", "float32", "bfloat16", "float16")
LOAD_FORMATS = ("auto", "dummy", "dummy-null")
BLOCK_ACTIVATIONS = ("auto", "int8", "float")
QUANTIZATIONS = (None, "int8", "int4", "w8a8")
SPECULATIVE_ALGORITHMS = (None, "ngram", "standalone")
# The names of relay.api.reasoning.REASONING_PARSERS and relay.api.tool_parsers.PARSERS.
REASONING_PARSERS = (None, "qwen3", "deepseek-r1")
TOOL_CALL_PARSERS = (
    None,
    "hermes",
    "llama3",
    "mistral",
    "pythonic",
    "qwen3_coder",
    "deepseek_v3",
    "deepseek_v31",
    "harmony",
)
DRAFT_QUANTIZATIONS = (None, "none", "int8", "int4")


@dataclass(frozen=True)
class EngineConfig:
    model_path: str | None = None  # HF directory or .gguf file; None = the default model
    tokenizer_path: str | None = None  # defaults to the model's own tokenizer
    chat_template: str | None = None  # a Jinja file used instead of the tokenizer's chat template
    served_model_name: str | None = None
    # Chat output parsing (relay.api.reasoning, relay.api.tool_parsers): a reasoning model's
    # <think> block split off into reasoning_content; the format tool calls are read in
    # (None: chosen from the chat template, hermes where it does not say).
    reasoning_parser: str | None = None
    tool_call_parser: str | None = None
    dtype: str = "auto"  # auto: bfloat16 on GPUs and CPUs with AVX512-BF16 or AMX, else float32
    # KV cache dtype; auto = the model's. bfloat16 under float32 weights halves the bytes
    # decode attention reads (CPU backend only).
    kv_cache_dtype: str = "auto"
    # int8: weight-only int8 (CPU); int4: weight-only 4-bit, a scale and a minimum per 32 input
    # features. A float checkpoint on the CPU block kernels is quantized at load into Q8_0 / Q4_1
    # blocks with no float copy (relay/execution/quantized_blocks.py); elsewhere torch's kernels
    # (int8: one scale per output row) beside float weights. Small decode batches read 2-4x fewer
    # weight bytes; outputs are those of the quantized weights, not the checkpoint's.
    quantization: str | None = None
    device: str = "auto"  # auto: cuda when available, else cpu
    tp_size: int = 1
    # Tokens per KV page; None: 32 on CPU, 16 on GPU. A CPU reads a page's keys as one run of
    # page_size x head_dim values per kv head, and this machine reads scattered 2 KiB runs at half
    # the speed of 4 KiB ones (docs/benchmarks.md). Also the prefix cache's matching granularity.
    page_size: int | None = None
    kv_cache_gb: float | None = None  # KV budget; wins over mem_fraction_static
    mem_fraction_static: float | None = None  # of free memory after weights
    max_running_requests: int = 256
    # Token budget of one forward step (decodes + prefill chunks); None: 256 on CPU (a step
    # then stays near 0.2 s, keeping inter-token latency low while prompts are prefilled),
    # 8192 on GPU. See default_chunked_prefill_size.
    chunked_prefill_size: int | None = None
    # Prefill-first once a prompt has waited longer than this and more prompt tokens wait than
    # one step takes beside the decodes (a burst of arrivals): steps go to prompts, and a
    # decoding request waits for its next token once, at most this long (one long gap instead
    # of a longer step at every token of the burst). 0, or a target_itl_ms: every step decodes
    # every running request.
    max_decode_stall_ms: float = 1000.0
    max_queued_requests: int = 4096  # beyond this the server answers 503
    # Constrained decoding (relay/text/grammar.py): the most bytes a constraint's text may have (a
    # JSON schema, a forced tool call's, a regex or an EBNF grammar; larger is a 400 naming the
    # field), and the seconds a request waits for its grammar to compile before it ends with a
    # 400 naming the field. A compile under way cannot be interrupted (xgrammar has no way to):
    # the request ends at the timeout, its compile runs on (see grammar.COMPILE_WORKERS).
    # A JSON schema nesting deeper than max_constraint_depth (sampling_params.json_depth: the
    # document's objects and arrays, two per nested object schema) is a 400 naming the field
    # before it queues: compile time grows about as the cube of the depth, which the byte limit
    # does not bound (2-core box, xgrammar 0.2.9: nested objects 129 levels 0.04 s, 257 0.2 s,
    # 513 1.4 s, 1601 (43 KB) 54 s; nested arrays 129 levels 0.12 s, 257 0.62 s). 128 admits
    # every schema a request body may carry as an object (api.json_body.MAX_JSON_DEPTH is 64, and
    # a forced tool call's wrapping adds at most 5), so it bites on schemas sent as JSON text.
    # Regexes and EBNF grammars are not limited: 990 nested parentheses compile in under 0.04 s,
    # and xgrammar's parser refuses about 1000 and more at once.
    # A JSON schema object with more than max_constraint_properties optional properties
    # (sampling_params.widest_object; required ones compile cheaply: 4,000 in 0.57 s) is a 400
    # naming the field before it queues: the bytes do not bound breadth's cost either (2-core
    # box, xgrammar 0.2.9, optional integer properties in one object: 256 0.03 s, 512 0.16 s,
    # 1,000 0.8 s, 2,000 13 s, ~5,900 (128 KiB) 404 s; string ones ~3-5x that). Within 128 KiB,
    # objects of at most 128 optional properties side by side compile in at most ~6 s (36
    # objects of 128 string properties; 18 of 256: 13 s, 9 of 512: 70 s).
    max_constraint_bytes: int = 128 * 1024
    max_constraint_depth: int = 128
    max_constraint_properties: int = 128
    grammar_compile_timeout: float = 30.0
    disable_radix_cache: bool = False
    context_length: int | None = None  # defaults to the model's max_position_embeddings
    attention_backend: str = "auto"
    num_threads: int | None = None  # torch threads per rank; default: cores // tp_size
    # CPU: with the default thread count, a rank whose threads wait for their cores (other
    # processes busy on them) runs on fewer until the cores are free again (relay/execution/thread_backoff.py).
    # A --num-threads given keeps its count.
    disable_thread_backoff: bool = False
    seed: int = 0
    load_format: str = "auto"  # dummy: random weights; dummy-null: no model at all
    disable_cuda_graph: bool = False
    # Overlap scheduling: the scheduler builds step N+1 while the runner computes step N, where
    # its own work is at least overlap_min_share of a step (0: always; relay/scheduling/overlap.py).
    disable_overlap_schedule: bool = False
    overlap_min_share: float = 0.1
    disable_weight_blocks: bool = (
        False  # CPU: keep GEMMs on float weights even where GGUF blocks are exact
    )
    # CPU: GEMMs of up to this many rows read the GGUF blocks (None: the rule measured per CPU
    # level, dtype and block activations in relay/execution/block_rows.py; 0: none do).
    weight_block_rows: int | None = None
    # What the GEMMs on GGUF blocks multiply: int8 rounds x to 8 bits per block of 32 and sums
    # quant products in integers (csrc/gemm_dot.c, as llama.cpp does); float multiplies float32 x by
    # the exact weights. auto: int8 on x86 with AVX2 or more (float32 and bfloat16 models), else float.
    block_activations: str = "auto"
    # The exact path on every CPU level: float32 weights and activations (dtype auto -> float32,
    # block_activations auto -> float), no quantization, float32 KV. Greedy output then equals
    # transformers' float32 token for token, and --tp 2's equals --tp 1's: TP's all-reduce sums
    # in another order, which moves a float32 activation by its last bits, and an int8 or bfloat16
    # rounding of the next GEMM's input can turn that into a whole step (docs/architecture.md).
    # A setting that contradicts it (bfloat16, int8 activations, a quantization) is refused.
    deterministic: bool = False
    cuda_graph_max_bs: int = 64
    log_requests: bool = False
    log_steps: bool = False
    # Speculative decoding (SGLang's flag names). ngram: proposals continue the last earlier
    # occurrence of a request's final tokens in its own prompt and output; standalone: a draft
    # model (speculative_draft_model_path, or when unset the target's own weights quantized with
    # speculative_draft_quantization) proposes them. The target verifies k proposals per step.
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4
    speculative_draft_model_path: str | None = None
    speculative_draft_quantization: str | None = None  # None: int4 for a self-draft, else none
    speculative_ngram_min_match_window_size: int = 1
    speculative_ngram_max_match_window_size: int = 12
    # Above this many running requests a step is no longer bound by reading the weights, and
    # verifying proposals costs more than it saves: decode normally.
    speculative_disable_by_batch_size: int = 8
    # Adaptive batching: with a p99 inter-token latency target (ms) the scheduler steers the
    # step's prefill budget and the running cap (at most the two above) from measured latency,
    # over a window of adaptive_window_s seconds; target_ttft_ms makes it grow them back while
    # first tokens come too late. None: the fixed limits.
    target_itl_ms: float | None = None
    target_ttft_ms: float | None = None
    adaptive_window_s: float = 5.0
    # Serve embeddings (/v1/embeddings) instead of generation: a prompt's final hidden states
    # pooled as the model directory's sentence-transformers config says (last token, L2
    # normalized, without one: relay.scheduling.pooling); generating routes are refused.
    is_embedding: bool = False

    def __post_init__(self) -> None:
        for name in ("dtype", "kv_cache_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ValueError(f"{name} must be one of {DTYPES}, got {getattr(self, name)!r}")
        if self.quantization not in QUANTIZATIONS:
            raise ValueError(
                f"quantization must be one of {QUANTIZATIONS}, got {self.quantization!r}"
            )
        if self.speculative_algorithm not in SPECULATIVE_ALGORITHMS:
            raise ValueError(
                f"speculative_algorithm must be one of {SPECULATIVE_ALGORITHMS}, "
                f"got {self.speculative_algorithm!r}"
            )
        if self.speculative_draft_quantization not in DRAFT_QUANTIZATIONS:
            raise ValueError(
                f"speculative_draft_quantization must be one of {DRAFT_QUANTIZATIONS}, "
                f"got {self.speculative_draft_quantization!r}"
            )
        if self.speculative_algorithm == "standalone" and self.tp_size != 1:
            raise ValueError(
                "speculative_algorithm='standalone' runs with tp_size=1 only; "
                "ngram works with any tp_size"
            )
        if (
            not 1
            <= self.speculative_ngram_min_match_window_size
            <= self.speculative_ngram_max_match_window_size
        ):
            raise ValueError("speculative n-gram windows must satisfy 1 <= min <= max")
        if self.weight_block_rows is not None and self.weight_block_rows < 0:
            raise ValueError(f"weight_block_rows must be >= 0, got {self.weight_block_rows}")
        if self.block_activations not in BLOCK_ACTIVATIONS:
            raise ValueError(
                f"block_activations must be one of {BLOCK_ACTIVATIONS}, got {self.block_activations!r}"
            )
        if self.deterministic:
            self._take_the_exact_path()
        if self.reasoning_parser not in REASONING_PARSERS:
            raise ValueError(
                f"reasoning_parser must be one of {REASONING_PARSERS}, got {self.reasoning_parser!r}"
            )
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ValueError(
                f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}"
            )
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"load_format must be one of {LOAD_FORMATS}, got {self.load_format!r}")
        for name in (
            "tp_size",
            "page_size",
            "max_running_requests",
            "chunked_prefill_size",
            "speculative_num_draft_tokens",
        ):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_constraint_bytes < 1:
            raise ValueError(f"max_constraint_bytes must be >= 1, got {self.max_constraint_bytes}")
        if self.max_constraint_depth < 1:
            raise ValueError(f"max_constraint_depth must be >= 1, got {self.max_constraint_depth}")
        if self.max_constraint_properties < 1:
            raise ValueError(
                f"max_constraint_properties must be >= 1, got {self.max_constraint_properties}"
            )
        if not self.grammar_compile_timeout > 0:
            raise ValueError(
                f"grammar_compile_timeout must be > 0, got {self.grammar_compile_timeout}"
            )
        if self.max_decode_stall_ms < 0:
            raise ValueError(f"max_decode_stall_ms must be >= 0, got {self.max_decode_stall_ms}")
        if self.mem_fraction_static is not None and not 0 < self.mem_fraction_static < 1:
            raise ValueError("mem_fraction_static must be in (0, 1)")
        if self.kv_cache_gb is not None and self.kv_cache_gb <= 0:
            raise ValueError("kv_cache_gb must be > 0")
        for name in ("target_itl_ms", "target_ttft_ms", "adaptive_window_s"):
            if getattr(self, name) is not None and not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if not 0 <= self.overlap_min_share <= 1:
            raise ValueError(f"overlap_min_share must be in [0, 1], got {self.overlap_min_share}")
        if self.speculative_disable_by_batch_size < 0:
            raise ValueError("speculative_disable_by_batch_size must be >= 0")

    def _take_the_exact_path(self) -> None:
        """deterministic: float32 with float block activations; settings against it refused."""
        against = [
            f"{name}={value!r}"
            for name, value, exact in (
                ("dtype", self.dtype, ("auto", "float32")),
                ("kv_cache_dtype", self.kv_cache_dtype, ("auto", "float32")),
                ("block_activations", self.block_activations, ("auto", "float")),
                ("quantization", self.quantization, (None,)),
            )
            if value not in exact
        ]
        if against:
            raise ValueError(
                "deterministic runs float32 weights and activations with float block "
                f"activations and no quantization; it cannot take {', '.join(against)}"
            )
        object.__setattr__(self, "dtype", "float32")  # frozen: resolved once, here
        object.__setattr__(self, "block_activations", "float")

    @property
    def draft_quantization(self) -> str | None:
        """The standalone draft's weight quantization: int4 for a self-draft unless set."""
        q = self.speculative_draft_quantization
        if q is None:
            return None if self.speculative_draft_model_path else "int4"
        return None if q == "none" else q

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def for_device(self, device_type: str) -> EngineConfig:
        """This config with what depends on the device resolved (step budget, page size)."""
        gpu = device_type == "cuda"
        return dataclasses.replace(
            self,
            chunked_prefill_size=self.chunked_prefill_size or (8192 if gpu else 256),
            page_size=self.page_size or (16 if gpu else 32),
        )

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> EngineConfig:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise TypeError(f"unknown engine options: {sorted(unknown)}")
        return cls(**d)


@dataclass
class ModelConfig:
    architecture: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float  # every norm's epsilon (StarCoder 2's LayerNorms: norm_epsilon)
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope_scaling: dict[str, Any] | None = (
        None  # relay.rope.rope_settings's: None is the default rope
    )
    eos_token_ids: list[int] = field(default_factory=list)
    bos_token_id: int | None = None
    torch_dtype: str | None = None
    partial_rotary_factor: float = (
        1.0  # the share of each head's features the rope rotates (Phi-4-mini: 0.75)
    )
    # Mixture of experts (0 experts: a dense model). A sparse layer routes each token to
    # num_experts_per_tok of num_experts MLPs of moe_intermediate_size (softmax over the router's
    # logits, then top-k; renormalised over the top-k where moe_renormalize), plus, where
    # shared_expert_intermediate_size, a shared MLP every token takes, scaled by sigmoid of its gate.
    # Layers in mlp_only_layers, and all but every decoder_sparse_step-th, stay dense.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = False
    # The routing weights stay float32 when they scale the experts' outputs (Mixtral) instead of
    # being cast to the activations' dtype first (Qwen): the same rounding as transformers in bfloat16.
    moe_float32_weights: bool = False
    shared_expert_intermediate_size: int = 0
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] = field(default_factory=list)
    # gpt-oss's experts: the clamped SwiGLU (up + 1) * gate * sigmoid(alpha * gate), the gate
    # clamped to at most swiglu_limit and up to +-swiglu_limit (models/gpt_oss_moe.py)
    swiglu_alpha: float = 1.702
    swiglu_limit: float | None = None
    # How a sparse layer picks its experts: "softmax" (Qwen, Mixtral, DeepSeek V2's greedy top-k);
    # DeepSeek V2's "group_limited_greedy" (the softmax's top-k within the moe_topk_group of
    # moe_n_group expert groups whose best expert scores highest) and V3's "noaux_tc" (sigmoid
    # scores; experts and groups (by their best two) chosen on the scores plus
    # e_score_correction_bias, weighted by the scores alone). DeepSeek's weights are then
    # multiplied by routed_scaling_factor, and its shared experts are added ungated.
    moe_routing: str = "softmax"
    moe_n_group: int = 1
    moe_topk_group: int = 1
    routed_scaling_factor: float = 1.0
    # Multi-head latent attention (DeepSeek V2/V3; kv_lora_rank 0: none). A token's keys and values
    # are kv_lora_rank latent features (normed) and qk_rope_head_dim rotated key features shared
    # by every head; the KV pool holds just those, as one head (num_kv_heads 1, head_dim
    # kv_lora_rank + qk_rope_head_dim: what attention runs on once each head's key up-projection
    # is folded into its query, models/mla.py), and the values are that head's first
    # kv_lora_rank features, not a second tensor (latent_kv).
    kv_lora_rank: int = 0
    q_lora_rank: int | None = None  # None: q is one projection (V2-Lite); else low-rank, normed
    qk_nope_head_dim: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # the rope features come as pairs (x0, x1), (x2, x3), ...
    # Attention beyond the Llama decoder's (Mistral, Mixtral, Phi-3, Gemma 2/3, gpt-oss).
    # layer_windows[i]: layer i's sliding window w (a query at position p attends the keys at
    # p - w < j <= p, as transformers' sliding_window_overlay), None where it attends the whole
    # context; [] where no layer has one.
    layer_windows: list[int | None] = field(default_factory=list)
    attn_logit_softcap: float | None = (
        None  # scores -> cap * tanh(scores / cap) before the softmax (Gemma 2)
    )
    final_logit_softcap: float | None = None  # the same on the LM head's logits (Gemma 2)
    query_pre_attn_scalar: float | None = (
        None  # scores scale by its -1/2 power, not head_dim's (Gemma)
    )
    local_rope_theta: float | None = (
        None  # Gemma 3: the sliding layers' rope base (default rope, no scaling)
    )
    # gpt-oss: each layer has a learned logit per query head in every softmax's denominator
    attention_sinks: bool = False
    # Granite's multipliers: the embedding scaled by embedding_multiplier, each attention and MLP
    # output by residual_multiplier before it joins the residual stream, the logits divided by
    # logits_scaling; attention_multiplier scales the scores in place of head_dim ** -0.5 (also
    # DeepSeek's softmax scale: relay.hf_deepseek).
    embedding_multiplier: float = 1.0
    residual_multiplier: float = 1.0
    logits_scaling: float = 1.0
    attention_multiplier: float | None = None
    # StarCoder 2 (use_bias): o_proj and the MLP's projections have biases too, not only q/k/v
    o_proj_and_mlp_bias: bool = False
    # The checkpoint's own quantization (AWQ, GPTQ, FP8: relay.checkpoint_quant); None: floats
    quantization: CheckpointQuant | None = None

    @classmethod
    def from_hf_dict(cls, cfg: dict[str, Any], model_dir: str | None = None) -> ModelConfig:
        """A checkpoint's config.json (relay.hf_config reads it; relay.checkpoint_quant its
        quantization_config, or the quantize_config.json beside it in model_dir)."""
        return cls(**model_fields(cfg), quantization=read_checkpoint_quant(cfg, model_dir))

    @classmethod
    def from_dir(cls, path: str) -> ModelConfig:
        with open(os.path.join(path, "config.json")) as f:
            cfg = cls.from_hf_dict(json.load(f), path)
        gen_path = os.path.join(path, "generation_config.json")
        if os.path.exists(gen_path):
            with open(gen_path) as f:
                eos = json.load(f).get("eos_token_id")
            extra = [eos] if isinstance(eos, int) else list(eos or [])
            cfg.eos_token_ids = sorted(set(cfg.eos_token_ids) | set(extra))
        return cfg

    @property
    def long_rope_after(self) -> int | None:
        """LongRoPE's original_max_position_embeddings: sequences longer than this rotate with the
        long factors (relay.rope); None for every other rope."""
        s = self.rope_scaling or {}
        return s["original_max_position_embeddings"] if s.get("rope_type") == "longrope" else None

    @property
    def attention_scale(self) -> float:
        """What q.k is multiplied by before the softmax."""
        if self.attention_multiplier is not None:
            return self.attention_multiplier
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def attention_windows(self, context_len: int) -> list[int | None]:
        """layer_windows where a window can matter: a window no shorter than the context a
        request may reach is the whole context ([] where none can matter)."""
        windows = [w if w is not None and w < context_len else None for w in self.layer_windows]
        return windows if any(w is not None for w in windows) else []

    def kv_window(self, context_len: int) -> int | None:
        """The fewest positions any layer looks back where every layer slides (min of the
        attention_windows): keys at j <= p - w are read by no query at position p or later, so
        their KV pages can go back to the pool (KVManager.drop_dead_pages). None where some layer
        attends the whole context (Gemma 2/3's global layers, Qwen2's below max_window_layers):
        there every key stays needed."""
        windows = self.attention_windows(context_len)
        return min(windows) if windows and None not in windows else None

    def masks_attention(self, context_len: int) -> bool:
        """Whether attention needs more than a causal mask: a sliding window that can matter,
        soft-capped scores or attention sinks (what only the torch attention backend applies)."""
        return (
            bool(self.attention_windows(context_len))
            or self.attn_logit_softcap is not None
            or self.attention_sinks
        )

    def is_moe_layer(self, layer_id: int) -> bool:
        """Whether layer layer_id's feed-forward block is sparse (transformers' rule for Qwen2/3-MoE)."""
        return (
            self.num_experts > 0
            and layer_id not in self.mlp_only_layers
            and (layer_id + 1) % self.decoder_sparse_step == 0
        )

    def active_intermediate_size(self) -> int:
        """The MLP features one token's feed-forward pass computes: a sparse layer's top-k experts
        and shared expert (a dense model's intermediate_size)."""
        if not self.num_experts:
            return self.intermediate_size
        return (
            self.num_experts_per_tok * self.moe_intermediate_size
            + self.shared_expert_intermediate_size
        )

    def attention_break_even(self) -> int:
        """The context length at which a token's attention costs as many FLOPs as its dense
        layers (q/k/v/o and MLP GEMMs): past it, attention dominates a prompt chunk's cost."""
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        dense = 2 * (
            self.hidden_size * (2 * q + 2 * kv)
            + 3 * self.hidden_size * self.active_intermediate_size()
        )
        return max(1, dense // (4 * q))  # QK^T and PV: 2 FLOPs each per query dim per key

    @property
    def latent_kv(self) -> bool:
        """Whether the KV pool holds one tensor per layer, the values being the keys' first
        kv_lora_rank features (multi-head latent attention)."""
        return self.kv_lora_rank > 0

    def kv_bytes_per_token(self, itemsize: int, tp_size: int = 1) -> int:
        """KV bytes one token takes on the busiest rank (kv heads may split unevenly; MLA's one
        latent head is on every rank)."""
        kv_heads = max(1, -(-self.num_kv_heads // tp_size))
        tensors = 1 if self.latent_kv else 2
        return tensors * self.num_layers * kv_heads * self.head_dim * itemsize
