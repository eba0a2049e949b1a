"""A Llama-family model's decoder layers run as one C call per step (relay.execution.kernels.
cpu_layers): whether the model, its weights and the attention backend qualify (on every rank or
on none), and the layers' weights as the C structs take them. LlamaForCausalLM.use_decode_layers
and use_prompt_layers install what these build.
"""

from __future__ import annotations

import torch
from torch import nn

from relay.execution.attention.base import AttentionBackend
from relay.execution.kernels import cpu_attention, cpu_gemm, cpu_layers
from relay.execution.layers import Linear

# `model` below is a relay.execution.models.llama.LlamaForCausalLM (or a subclass), which
# imports this module: it is typed as the nn.Module it is.


def decode_layers(model: nn.Module, attn: AttentionBackend) -> cpu_layers.DecodeLayers | None:
    """Pure decode steps over attn's KV cache as one C call (cpu_layers.DecodeLayers),
    where everything a layer does is a Relay CPU kernel: every GEMM weight in GGUF blocks, no
    biases (q/k norms, Gemma's norms, GeGLU and per-layer rotary tables are the call's too), one rank or CPU ranks on shared memory (TPGroup.shm: the call then
    all-reduces as the layers do), and steps whose attention the backend gives to the C decode
    kernel (decode_kernel_plan), of at most DecodeLayers.max_rows requests (by default the
    rows the blocks are used for; the runner measures it). It keeps float32 activations (a
    bfloat16 model's too: its blocks are the checkpoint's exact weights; their GEMMs round to
    bfloat16 where BlockWeight.round_bf16 says, and past the blocks' rows read the model's
    bfloat16 panels where it has them). None where the model does not qualify."""
    layers = model.layers
    eligible = (
        computes_these_layers(model)
        and model.fused_cpu_ops
        and model.rotary.covers_head
        and model.tp.collectives_in_c
        and attn.kv.layout == "HND"
        and attn.kv.k[0].device.type == "cpu"
        and getattr(attn, "kernel", None) is not None  # (its windows and soft-cap: the call's too)
        and all(
            m.blocks is not None
            and m.blocks.in_perm is None  # (an act-order weight's x is reordered: gemm_blocks)
            and getattr(m, "bias", None) is None
            for m in model.gemm_modules()
            if m is not model.lm_head
        )
    )
    # every rank or none: the call all-reduces float32 rows where a bfloat16 model's layers all-reduce bf16
    if not model.tp.all_true(eligible):
        return None

    def gemm(m: Linear) -> cpu_layers.LayerGemm:
        panels = m.packed if isinstance(m.packed, cpu_gemm.Bf16Panels) else None
        return cpu_layers.LayerGemm(m.blocks, panels)

    weights = [layer_weights(layer, gemm) for layer in layers]
    a = layers[0].self_attn
    return cpu_layers.DecodeLayers(
        weights,
        model.norm.kernel_weight.float(),
        model.norm.eps,
        a.num_heads,
        a.num_kv_heads,
        a.head_dim,
        model.rotary.cos,
        model.rotary.sin,
        attn.kv.k,
        attn.kv.v,
        attn.kv.page_size,
        attn.scale,
        model.tp.c_group,
        attn.windows,
        attn.softcap,
        gelu=layers[0].mlp.gelu,
    )


def computes_these_layers(model: nn.Module) -> bool:
    """Whether every decoder layer is one the C call computes: RMS norms (Gemma's 1 + w too)
    before attention and before a gated MLP, Gemma 2/3's also after each, q/k norms per head, and
    the sublayers' outputs added to the residual stream as they are. Not OLMo 2's (no norm before
    a sublayer; q/k normed over the whole projection), Granite's (outputs scaled by
    residual_multiplier), StarCoder 2's (LayerNorms, an ungated MLP) or a MoE block's: those run
    layer by layer."""
    # kinds of norm, asked of their classes: a Gemma norm's kernel_weight exists only once folded
    return all(
        hasattr(type(getattr(layer, "input_layernorm", None)), "kernel_weight")
        and hasattr(type(layer.post_attention_layernorm), "kernel_weight")
        and hasattr(layer.mlp, "gate_up_proj")
        and getattr(layer, "residual_multiplier", 1.0) == 1.0
        for layer in model.layers
    )


def layer_weights(layer, gemm) -> cpu_layers.DecoderLayerWeights:
    """One decoder layer's weights as relay_decode_layers reads them (float32 norms, as their
    kernel multiplies: Gemma's 1 + w), a Llama layer's or a Gemma one's (its norms around the MLP)."""
    a = layer.self_attn

    def norm(module) -> torch.Tensor:
        return module.kernel_weight.float()

    sandwich = getattr(layer, "pre_feedforward_layernorm", None)
    return cpu_layers.DecoderLayerWeights(
        norm(layer.input_layernorm),
        norm(layer.post_attention_layernorm),
        gemm(a.qkv_proj),
        gemm(a.o_proj),
        gemm(layer.mlp.gate_up_proj),
        gemm(layer.mlp.down_proj),
        q_norm=norm(a.q_norm) if a.qk_norm else None,
        k_norm=norm(a.k_norm) if a.qk_norm else None,
        pre_mlp_norm=None if sandwich is None else norm(sandwich),
        post_mlp_norm=None if sandwich is None else norm(layer.post_feedforward_layernorm),
        cos=a.rotary.cos,  # the layer's own tables (the fused rotary: Gemma 3's sliding layers')
        sin=a.rotary.sin,
    )


def prompt_layers(
    model: nn.Module, attn: AttentionBackend, modules: list[Linear]
) -> cpu_layers.PromptLayers | None:
    """Steps with prompt chunks over attn's KV cache as one C call (cpu_layers.PromptLayers),
    where everything a layer does is a Relay CPU kernel on bfloat16 activations: a bfloat16
    model whose GEMM weights are all Bf16Panels (this CPU prefers them to oneDNN), no biases,
    q/k norms or quantization, one rank or CPU ranks on shared memory, a bfloat16 cache whose
    prompt chunks the backend gives to the C kernels (prompt_kernel_plan), and steps of more
    rows than go to other GEMM kernels (LlamaForCausalLM._rows_off_panels): the same output as
    the layers, bit for bit. modules: the decoder layers' GEMM modules. None where the model
    does not qualify."""
    eligible = (
        computes_these_layers(model)
        and model.fused_cpu_ops
        and model.rotary.covers_head
        and not model.config.qk_norm
        and model.tp.collectives_in_c
        and model.dtype == torch.bfloat16
        and attn.kv.layout == "HND"
        and attn.kv.k[0].dtype == torch.bfloat16
        and attn.kv.k[0].device.type == "cpu"
        and getattr(attn, "kernel", None) is not None
        and cpu_attention.tiled_attention_available(
            torch.bfloat16, torch.bfloat16, model.config.head_dim
        )
        and all(
            isinstance(m.packed, cpu_gemm.Bf16Panels)
            and m.bias is None
            and m.int8 is None
            and m.int4 is None
            and m.w8a8 is None
            for m in modules
        )
    )
    if not model.tp.all_true(eligible):  # every rank or none, as decode_layers
        return None
    weights = [
        cpu_layers.DecoderLayerWeights(
            layer.input_layernorm.weight,
            layer.post_attention_layernorm.weight,
            layer.self_attn.qkv_proj.packed,
            layer.self_attn.o_proj.packed,
            layer.mlp.gate_up_proj.packed,
            layer.mlp.down_proj.packed,
        )
        for layer in model.layers
    ]
    a = model.layers[0].self_attn
    return cpu_layers.PromptLayers(
        weights,
        model.norm.weight,
        model.norm.eps,
        a.num_heads,
        a.num_kv_heads,
        a.head_dim,
        model.rotary.cos,
        model.rotary.sin,
        attn.kv.k,
        attn.kv.v,
        attn.kv.page_size,
        attn.scale,
        model.tp.c_group,
        attn.windows,
        attn.softcap,
    )
