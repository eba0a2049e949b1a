"""The Llama decoder family: Llama 2/3 (and SmolLM2, TinyLlama), Mistral, Qwen2, Qwen3, Granite,
StarCoder 2.

The differences are config flags: Qwen2 has q/k/v biases, Qwen3 normalises q and k per head
before the rotary embedding, Mistral's layers attend within a sliding window (ModelConfig.
layer_windows: the attention backend masks it), Granite scales the embedding, each sublayer's
output, the attention scores and the logits by its multipliers. StarCoder 2 (its own class below)
has LayerNorms, biases on every projection and an ungated GELU MLP. q/k/v and gate/up are fused
into one GEMM each. The mixture-of-experts models (models/moe.py) are this decoder with sparse
feed-forward blocks.

This module holds the model: its forward pass, its weights' forms (packed, quantized, GGUF
blocks) and checkpoint loading. Its layers are in models/llama_layers.py; running them as one
C call per step is decided and set up in models/one_call_layers.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

import torch
from torch import nn

from relay.config import ModelConfig
from relay.execution.attention.base import AttentionBackend
from relay.execution.distributed import TPGroup
from relay.execution.gguf_blocks import GgufRows
from relay.execution.kernels import cpu as cpu_kernels
from relay.execution.kernels import cpu_gemm, cpu_layers
from relay.execution.layers import (
    LayerNorm,
    Linear,
    RMSNorm,
    RotaryEmbedding,
    VocabParallelEmbedding,
    has_float_weight,
    pack_for_cpu,
    quantize_int4,
    quantize_int8,
    w8a8_weight,
)
from relay.execution.models import one_call_layers
from relay.execution.models.linear_slots import Slot
from relay.execution.models.llama_layers import MLP, DecoderLayer, UngatedMLP
from relay.execution.weight_blocks import recover


class LlamaForCausalLM(nn.Module):
    supports_cuda_graph = True  # a step's work depends on its shapes alone (a MoE step's does not)
    Norm = RMSNorm  # the final norm's kind (Gemma's scales by 1 + w)

    def __init__(self, mc: ModelConfig, tp: TPGroup, dtype: torch.dtype, max_positions: int):
        super().__init__()
        self.config = mc
        self.tp = tp
        self.dtype = dtype
        self.embed_tokens = VocabParallelEmbedding(mc.vocab_size, mc.hidden_size, dtype, tp)
        self.layers = nn.ModuleList(self._make_layer(i) for i in range(mc.num_layers))
        self.norm = self.Norm(mc.hidden_size, mc.rms_norm_eps, dtype)
        self.lm_head = (
            self.embed_tokens
            if mc.tie_word_embeddings
            else VocabParallelEmbedding(mc.vocab_size, mc.hidden_size, dtype, tp)
        )
        self.rotary = self._make_rotary(max_positions)
        self.fused_cpu_ops = False  # see pack_for_cpu
        self.decode_layers: tuple[AttentionBackend, cpu_layers.DecodeLayers] | None = (
            None  # use_decode_layers
        )
        self.prompt_layers: tuple[AttentionBackend, cpu_layers.PromptLayers] | None = (
            None  # use_prompt_layers
        )
        self._layer_gemms: list[
            Linear
        ] = []  # the decoder layers' GEMM modules, once prompt_layers is set

    def _make_rotary(self, max_positions: int) -> RotaryEmbedding:
        """The rotary tables every layer shares (DeepSeek's rotate qk_rope_head_dim features only)."""
        mc = self.config
        return RotaryEmbedding(
            mc.head_dim,
            max_positions,
            mc.rope_theta,
            mc.rope_scaling,
            mc.partial_rotary_factor,
            mc.max_position_embeddings,
        )

    def _fused_rope(self) -> bool:
        """Whether the layers rotate q and k with Relay's CPU kernel, which reads the tables at each
        token's position itself (the step's rope then carries positions only)."""
        return self.fused_cpu_ops and self.rotary.covers_head

    def _make_layer(self, layer_id: int) -> nn.Module:
        return DecoderLayer(
            self.config, self.tp, self.dtype, layer_id, self._make_mlp(layer_id), self.Norm
        )

    def _make_mlp(self, layer_id: int) -> nn.Module:
        """Layer layer_id's feed-forward block (a MoE model's sparse layers give theirs)."""
        return MLP(self.config, self.tp, self.dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        rows: list[int] | None = None,
    ) -> torch.Tensor:
        """Hidden states after the final norm: [num_tokens, hidden], or [len(rows), hidden] of the
        given token rows (increasing): then the last layer runs everything after its attention
        for those rows only (a prompt chunk's other tokens only leave their keys and values: its
        o_proj and MLP are 2.8 % of the default model's GEMM work per token). A kept row's output
        is bit for bit what it is with all rows in the one-call prompt step; layer by layer the
        GEMMs pick their kernel by row count, so it is close."""
        t = input_ids.shape[0]
        keep = None if rows is None or len(rows) == t else rows
        hidden = self._decode_in_one_call(input_ids, positions, attn, keep)
        if hidden is not None:
            return hidden
        chunks = self.prompt_layers
        if chunks is not None and chunks[0] is attn and t > self._rows_off_panels():
            plan = attn.prompt_kernel_plan
            if plan is not None:
                return chunks[1].run(self.embed(input_ids), positions, plan, keep)
        rope = self.rotary.for_step(positions, self.dtype, fused=self._fused_rope())
        x, residual = self.embed(input_ids), None
        last = len(self.layers) - 1
        index = (
            None if keep is None else torch.tensor(keep, dtype=torch.int64, device=input_ids.device)
        )
        for i, layer in enumerate(self.layers):
            x, residual = layer(x, residual, rope, attn, index if i == last else None)
        return self.norm.add_and_norm(x, residual)[0]

    def _decode_in_one_call(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        attn: AttentionBackend,
        keep: list[int] | None,
    ) -> torch.Tensor | None:
        """forward's hidden states from the decode_layers C call, where it takes this step (a
        pure decode step over its attention backend's cache, of at most its max_rows); else None."""
        fast = self.decode_layers
        if fast is None or fast[0] is not attn or input_ids.shape[0] > fast[1].max_rows:
            return None
        plan = attn.decode_kernel_plan
        if plan is None:
            return None
        x = self.embed(input_ids).float()
        hidden = fast[1].run(x, positions, plan).to(self.dtype)
        return hidden if keep is None else hidden[keep]

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The first layer's input (Granite and Gemma scale the embedding)."""
        x = self.embed_tokens(input_ids)
        multiplier = self.config.embedding_multiplier
        return x if multiplier == 1.0 else x * multiplier

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.lm_head.logits(hidden)
        # Granite divides them (not multiplies by the inverse), as transformers does
        scaling = self.config.logits_scaling
        return logits if scaling == 1.0 else logits / scaling

    def gemm_modules(self) -> list[Linear | VocabParallelEmbedding]:
        """Every module whose weight a GEMM reads: the linear layers and the LM head."""
        return [
            m
            for m in self.modules()
            if isinstance(m, Linear)
            or (isinstance(m, VocabParallelEmbedding) and m is self.lm_head)
        ]

    def pack_for_cpu(self) -> None:
        """Give every GEMM weight a oneDNN-blocked copy (CPU only; costs one more copy of the
        weights in memory, buys ~1.3x on batched GEMMs). Not a bfloat16 weight of a float32 model
        (keep_bf16_weights): its GEMMs read it as it is."""
        for module in self.gemm_modules():
            packs = has_float_weight(module) and module.weight.dtype == self.dtype
            module.packed = pack_for_cpu(module.weight) if packs else None

    def keep_bf16_weights(self) -> None:
        """Hold the GEMM weights and the embedding in bfloat16 in a float32 model, before a
        bfloat16 checkpoint loads into them (ModelLoader: a CPU without bfloat16 dot products):
        the checkpoint's values as they are in half a float32 copy's memory. Their GEMMs widen
        them in registers (layers.cpu_matmul: cpu_gemm.gemm_widen), the float32 products of the
        same weights; the embedding widens the rows it looks up (a tied LM head is that table)."""
        modules = {id(m): m for m in [self.embed_tokens, *self.gemm_modules()]}
        for module in modules.values():
            bf16 = torch.empty_like(module.weight, dtype=torch.bfloat16)
            module.weight = nn.Parameter(bf16, requires_grad=False)

    def use_cpu_kernels(self) -> None:
        """Relay's own CPU kernels where this CPU and dtype have them: the small-batch bfloat16
        GEMM, and fused norm/rotary/silu ops (float32 too: they halve a step's small-op time on a
        2-core Xeon, docs/benchmarks.md, and greedy output still matches transformers token for
        token)."""
        self._use_gemm_kernels()
        self.fused_cpu_ops = (
            self.dtype in (torch.bfloat16, torch.float32) and cpu_kernels.available()
        )
        if self.fused_cpu_ops:
            # the norms and MLPs that have a kernel (StarCoder 2's LayerNorms and MLP have none)
            for part in (self.norm, *(p for layer in self.layers for p in layer.children())):
                if hasattr(part, "fused"):
                    part.fused = True
            # the kernel rotates whole heads; a partial rotary stays in torch
            if self._fused_rope():
                for layer in self.layers:
                    layer.self_attn.rotary = self.rotary

    def _use_gemm_kernels(self) -> None:
        """Relay's small-batch bfloat16 GEMM for every GEMM it takes."""
        gemv = self.dtype == torch.bfloat16 and cpu_gemm.gemm_bf16_available()
        for module in self.gemm_modules():
            module.gemv = gemv and module.int8 is None and module.int4 is None

    def use_decode_layers(self, attn: AttentionBackend) -> bool:
        """Run pure decode steps over attn's KV cache as one C call where everything a layer does
        is a Relay CPU kernel (one_call_layers.decode_layers says where). Returns whether it does."""
        layers = one_call_layers.decode_layers(self, attn)
        if layers is None:
            return False
        self.decode_layers = (attn, layers)
        return True

    def use_prompt_layers(self, attn: AttentionBackend) -> bool:
        """Run steps with prompt chunks over attn's KV cache as one C call where everything a layer
        does is a Relay CPU kernel on bfloat16 activations (one_call_layers.prompt_layers says
        where), for steps of more rows than go to other GEMM kernels (_rows_off_panels). Returns
        whether."""
        modules = [m for m in self.gemm_modules() if m is not self.lm_head]
        layers = one_call_layers.prompt_layers(self, attn, modules)
        if layers is None:
            return False
        # _rows_off_panels reads them each step: walking the submodules took 0.35 ms
        self._layer_gemms = modules
        self.prompt_layers = (attn, layers)
        return True

    def _rows_off_panels(self) -> int:
        """The most rows for which some decoder-layer GEMM takes another kernel than the panels
        (cpu_matmul: the blocks up to their max_rows, the bfloat16 GEMV up to GEMM_BF16_MAX_ROWS)."""
        return max(
            [cpu_gemm.GEMM_BF16_MAX_ROWS]
            + [m.blocks.max_rows for m in self._layer_gemms if m.blocks is not None]
        )

    def use_weight_blocks(self, source: GgufRows | None = None) -> int:
        """Keep each float32 GEMM weight that is exactly GGUF blocks (a GGUF checkpoint's
        dequantized floats) also as those blocks, for small-batch GEMMs: Q4_1/Q8_0 found from the
        values alone, others from the file they were converted from (source); returns how many."""
        kept = 0
        for module in self.gemm_modules():
            module.blocks = recover(module.weight)
            if module.blocks is None and source is not None:
                module.blocks = source.blocks_for(module.weight)
            kept += module.blocks is not None
        return kept

    def use_dot_blocks(self) -> None:
        """Every GEMM's blocks in the integer dot products' layout: their GEMMs round x to 8 bits
        per block (EngineConfig.block_activations)."""
        for module in self.gemm_modules():
            if module.blocks is not None:
                module.blocks = module.blocks.to_dot()

    def limit_weight_blocks(self, max_rows: int) -> None:
        """GEMMs of at most max_rows rows read the blocks; with 0, none do (a decode step in one
        C call may still: see drop_unused_weight_blocks). Blocks without a float weight beside
        them (a GGUF file loaded as blocks) take every GEMM."""
        for module in self.gemm_modules():
            if module.blocks is not None and has_float_weight(module):
                module.blocks.max_rows = max_rows

    def drop_unused_weight_blocks(self) -> None:
        """Forget the one-call decode step if it takes no batch size, and then the blocks that no
        GEMM reads."""
        if self.decode_layers is not None and not self.decode_layers[1].max_rows:
            self.decode_layers = None
        if self.decode_layers is None:
            for module in self.gemm_modules():
                if module.blocks is not None and not module.blocks.max_rows:
                    module.blocks = None

    def quantize_int4(self) -> None:
        """Weight-only 4-bit (groups of 32, scale and zero point) for every GEMM; like int8, the
        float weights become the quantized values."""
        for module in self.gemm_modules():
            module.int4, module.weight.data = quantize_int4(module.weight)

    def quantize_int8(self) -> None:
        """Weight-only int8 for every GEMM; the float weights become the quantized values so that
        every batch size computes with the same weights (a tied embedding included)."""
        for module in self.gemm_modules():
            module.int8, module.weight.data = quantize_int8(module.weight)

    def quantize_w8a8(self) -> None:
        """int8 weights (one scale per output row) for the decoder layers' GEMMs, computed in int8 x
        int8 from W8A8_MIN_ROWS rows on (activations quantized per token). Smaller GEMMs take the
        float paths over the same quantized values: at 1-3 rows Relay's kernel streams bf16
        weights faster than torch's weight-only int8 kernel computes. The LM head stays as it is:
        its logits are what sampling reads."""
        for module in self.gemm_modules():
            if isinstance(module, Linear):
                int8, module.weight.data = quantize_int8(module.weight)
                module.w8a8 = w8a8_weight(int8)

    # ---- checkpoint loading -------------------------------------------------------------
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy each rank's slice of HF-named checkpoint tensors into the fused parameters."""
        loaded: set[str] = set()
        for name, w in weights:
            target = self._load_one(name, w)
            if isinstance(target, str):
                loaded.add(target)
            elif (
                target
            ):  # a checkpoint tensor holding several parameters (all experts' weights in one)
                loaded.update(target)
        expected = {n for n, _ in self.named_parameters()}
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks weights for: {sorted(missing)[:8]}")

    def _load_one(self, name: str, w: torch.Tensor) -> str | list[str] | None:
        name = name.removeprefix("model.")
        if "rotary_emb" in name:
            return None
        if name in ("embed_tokens.weight", "lm_head.weight"):
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                return None
            module = self.embed_tokens if name.startswith("embed") else self.lm_head
            n = module.weight.shape[0]
            module.weight.copy_(w[module.start : module.start + n])
            return name
        if name in ("norm.weight", "norm.bias"):  # (StarCoder 2's LayerNorm has a bias)
            getattr(self.norm, name[5:]).copy_(w)
            return name
        m = re.fullmatch(r"layers\.(\d+)\.(.+)\.(weight|bias)", name)
        if m is None:
            raise ValueError(f"unexpected checkpoint tensor {name!r}")
        layer, part, kind = self.layers[int(m.group(1))], m.group(2), m.group(3)
        prefix = f"layers.{m.group(1)}."
        slots = self.linear_slots(prefix + part)
        if slots is not None:  # (one name: a fused checkpoint weight's parts go to one module)
            return [slot.load(w, kind) for slot in slots][0]
        module = layer.get_submodule(part)  # input/post-attention norms, q/k norms
        getattr(module, kind).copy_(w)
        return prefix + f"{part}.{kind}"

    def linear_slots(self, name: str) -> list[Slot] | None:
        """Where this rank's part of the checkpoint's linear layer `name` (model.layers.0.self_attn.
        q_proj) goes (linear_slots.Slot); None for a name that is not a decoder layer's GEMM."""
        m = re.fullmatch(r"(?:model\.)?layers\.(\d+)\.(.+)", name)
        if m is None:
            return None
        i, part = int(m.group(1)), m.group(2)
        prefix = f"layers.{i}."
        if part in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            return [self._qkv_slot(i, part[-6], 0)]
        if part == "self_attn.o_proj":
            attn, d = self.layers[i].self_attn, self.config.head_dim
            heads = slice(attn.shard.q_start * d, (attn.shard.q_start + attn.shard.q_count) * d)
            return [Slot(prefix + part, attn.o_proj, 0, slice(None), heads)]
        mlp = self.layers[i].mlp
        slot = mlp.slot(part[4:]) if part.startswith("mlp.") and hasattr(mlp, "slot") else None
        return None if slot is None else [slot.under(prefix + "mlp.")]

    def _qkv_slot(self, i: int, which: str, first_row: int) -> Slot:
        """This rank's heads of layer i's q, k or v (`which`), whose rows start at first_row of
        the checkpoint tensor (Phi-3's fused one: after q's, or q's and k's), into qkv_proj."""
        attn, d = self.layers[i].self_attn, self.config.head_dim
        sh = attn.shard
        start, count, offset = {
            "q": (sh.q_start, sh.q_count, 0),
            "k": (sh.kv_start, sh.kv_count, attn.sizes[0]),
            "v": (sh.kv_start, sh.kv_count, attn.sizes[0] + attn.sizes[1]),
        }[which]
        rows = slice(first_row + start * d, first_row + (start + count) * d)
        return Slot(f"layers.{i}.self_attn.qkv_proj", attn.qkv_proj, offset, rows)


class Starcoder2ForCausalLM(LlamaForCausalLM):
    """StarCoder 2: Llama's decoder with LayerNorms (weight and bias), biases on q/k/v/o and the
    MLP (use_bias), and the ungated MLP gelu_pytorch_tanh(x W_fc) W_proj."""

    Norm = LayerNorm

    def _make_mlp(self, layer_id: int) -> nn.Module:
        return UngatedMLP(self.config, self.tp, self.dtype)
