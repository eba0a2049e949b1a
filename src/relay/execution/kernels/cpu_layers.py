"""Relay's decoder layers in one C call (csrc/decode_layers.c): a whole decode step, or a step
with prompt chunks, runs every layer's kernels without the interpreter between them."""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from relay.execution.kernels import cpu
from relay.execution.kernels.cpu_attention import (
    DECODE_CHUNK,
    DecodePlan,
    ExtendPlan,
    tiled_attention_available,
)
from relay.execution.kernels.cpu_gemm import Bf16Panels

if TYPE_CHECKING:
    from relay.execution.weight_blocks import BlockWeight

# The calls read cpu._lib, not load(): the library use() swapped in (a test's held level) is the one.


class _LayerGemm(ctypes.Structure):  # csrc/decode_layers.c
    _fields_ = [
        ("bits", ctypes.c_int64),
        ("q", ctypes.c_void_p),
        ("d", ctypes.c_void_p),
        ("m", ctypes.c_void_p),
        ("n", ctypes.c_int64),
        ("k", ctypes.c_int64),
        ("round_bf16", ctypes.c_int64),
        ("panels", ctypes.c_void_p),
        ("blocks_max_rows", ctypes.c_int64),
    ]


class _DecodeLayer(ctypes.Structure):
    _fields_ = [
        ("input_norm", ctypes.c_void_p),
        ("post_norm", ctypes.c_void_p),
        ("qkv", _LayerGemm),
        ("o", _LayerGemm),
        ("gate_up", _LayerGemm),
        ("down", _LayerGemm),
        ("k_cache", ctypes.c_void_p),
        ("v_cache", ctypes.c_void_p),
    ] + [
        (name, ctypes.c_void_p)
        for name in ("q_norm", "k_norm", "pre_mlp_norm", "post_mlp_norm", "cos", "sin")
    ]


class _DecodeStep(ctypes.Structure):
    _fields_ = (
        [(name, ctypes.c_int64) for name in ("T", "hidden", "inter", "nq", "nk", "D")]
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
        + [(name, ctypes.c_void_p) for name in ("positions", "tables", "lens", "order")]
        + [(name, ctypes.c_int64) for name in ("P", "S", "PS", "chunk", "kv_bf16", "n_groups")]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "group_first",
                "group_size",
                "group_keys",
                "final_norm",
                "x",
                "out",
                "qkv",
                "attn",
                "gate_up",
                "act",
                "tp",
                "windows",
            )
        ]
        + [("softcap", ctypes.c_float), ("gelu", ctypes.c_int64)]
    )


def layer_windows(windows: list[int | None] | None, num_layers: int) -> torch.Tensor | None:
    """Each layer's sliding window as the one-call steps read it: int64 [num_layers], 0 where a
    layer attends the whole context; None where no layer has one."""
    if not windows or not any(windows):
        return None
    assert len(windows) == num_layers, "a window (or None) for every layer"
    return torch.tensor([w or 0 for w in windows], dtype=torch.int64)


@dataclass
class LayerGemm:
    """One GEMM weight of a decoder layer as relay_decode_layers reads it: its GGUF blocks, and a
    bfloat16 model's panels (layers.pack_for_cpu), which its GEMMs of more rows than the blocks'
    max_rows (at construction) read instead, as the Python layers' GEMMs do."""

    blocks: BlockWeight
    panels: Bf16Panels | None = None


@dataclass
class DecoderLayerWeights:
    """What a one-call step reads of one decoder layer: its norms and its GEMM weights, as
    relay_decode_layers (float32 norms, LayerGemm) or relay_prompt_layers (bfloat16 norms,
    Bf16Panels) takes them. The optional parts only relay_decode_layers reads: q/k norms
    (Qwen3, Gemma 3), Gemma's sandwich norms around the MLP, and the layer's own rotary tables."""

    input_norm: torch.Tensor  # [hidden]
    post_norm: torch.Tensor  # after attention: Llama's before the MLP, Gemma's on its output alone
    qkv: LayerGemm | Bf16Panels  # q, k, v fused, no bias
    o: LayerGemm | Bf16Panels
    gate_up: LayerGemm | Bf16Panels  # gate then up
    down: LayerGemm | Bf16Panels
    q_norm: torch.Tensor | None = None  # [head_dim]: each q head normed before the rotary
    k_norm: torch.Tensor | None = None
    pre_mlp_norm: torch.Tensor | None = (
        None  # Gemma: before the MLP (post_norm then after attention)
    )
    post_mlp_norm: torch.Tensor | None = None  # Gemma: on the MLP's output
    cos: torch.Tensor | None = None  # this layer's rotary tables, where not the model's
    sin: torch.Tensor | None = None


class DecodeLayers:
    """A decoder whose GEMM weights are all GGUF blocks, run for a pure decode step in one C call
    (csrc/decode_layers.c) over one KV cache, with float32 activations: the kernels the layers
    call one by one, in their order, without the interpreter between them (bit-identical output
    for a float32 model at batch sizes whose GEMMs read the blocks in the layers too)."""

    def __init__(
        self,
        layers: list[DecoderLayerWeights],
        final_norm: torch.Tensor,
        eps: float,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        page_size: int,
        scale: float,
        tp: int | None = None,
        windows: list[int | None] | None = None,
        softcap: float | None = None,
        gelu: bool = False,
    ):
        """windows: each layer's sliding window (None: the whole context; no list: no layer has
        one); softcap: the scores' soft-cap (the attention backend's, decode_attention's); gelu:
        the MLPs gate with gelu_tanh (Gemma's GeGLU), not silu. cos/sin: the rotary tables of
        every layer without its own (DecoderLayerWeights.cos)."""

        def ptr(t: torch.Tensor | None) -> int | None:
            return None if t is None else t.data_ptr()

        def mat(w: LayerGemm) -> _LayerGemm:
            b = w.blocks
            return _LayerGemm(
                b.kernel_bits,
                b.q.data_ptr(),
                b.d.data_ptr(),
                b.m.data_ptr(),
                b.out_features,
                b.in_features,
                int(b.round_bf16),
                None if w.panels is None else w.panels.data.data_ptr(),
                b.max_rows,
            )

        self._keep = (
            layers,
            k_caches,
            v_caches,
        )  # the table's pointers point into these (and the fields below)
        self.table = (_DecodeLayer * len(layers))(
            *[
                _DecodeLayer(
                    w.input_norm.data_ptr(),
                    w.post_norm.data_ptr(),
                    mat(w.qkv),
                    mat(w.o),
                    mat(w.gate_up),
                    mat(w.down),
                    k.data_ptr(),
                    v.data_ptr(),
                    ptr(w.q_norm),
                    ptr(w.k_norm),
                    ptr(w.pre_mlp_norm),
                    ptr(w.post_mlp_norm),
                    (cos if w.cos is None else w.cos).data_ptr(),
                    (sin if w.sin is None else w.sin).data_ptr(),
                )
                for w, k, v in zip(layers, k_caches, v_caches)
            ]
        )
        first = layers[0]
        self.gelu = gelu
        self.hidden, self.inter = first.o.blocks.out_features, first.down.blocks.in_features
        self.qkv_n = first.qkv.blocks.out_features
        self.final_norm, self.eps, self.scale = final_norm, eps, scale
        self.nq, self.nk, self.d = num_heads, num_kv_heads, head_dim
        self.cos, self.sin = cos, sin
        self.slots = k_caches[0].shape[1]  # [kv heads, slots, head_dim]
        self.kv_bf16 = int(k_caches[0].dtype == torch.bfloat16)
        self.cascade = tiled_attention_available(torch.float32, k_caches[0].dtype, head_dim)
        self.page_size = page_size
        # With panels in every GEMM the call runs the layers' own kernels at every size, minus the
        # interpreter between them; without, past the blocks' rows it would not (the runner measures).
        self.on_panels = all(
            w.panels is not None
            for layer in layers
            for w in (layer.qkv, layer.o, layer.gate_up, layer.down)
        )
        self.max_rows = sys.maxsize if self.on_panels else first.qkv.blocks.max_rows
        self.tp = tp  # a tensor-parallel rank's distributed.ShmGroup.ptr: the step all-reduces as the layers do
        self.windows, self.softcap = layer_windows(windows, len(layers)), softcap or 0.0

    def run(self, x: torch.Tensor, positions: torch.Tensor, plan: DecodePlan) -> torch.Tensor:
        """x [T, hidden] float32 (the step's embeddings; used as the residual stream), positions
        int64 [T] -> the final norm's output [T, hidden]. The new keys and values go into the
        cache at each request's last position (plan.lens)."""
        t = x.shape[0]
        out, qkv, attn = (
            torch.empty(t, self.hidden),
            torch.empty(t, self.qkv_n),
            torch.empty(t, self.nq * self.d),
        )
        gate_up, act = torch.empty(t, 2 * self.inter), torch.empty(t, self.inter)
        groups = plan.num_groups if self.cascade else 0
        step = _DecodeStep(
            t,
            self.hidden,
            self.inter,
            self.nq,
            self.nk,
            self.d,
            self.eps,
            self.scale,
            positions.data_ptr(),
            plan.tables.data_ptr(),
            plan.lens.data_ptr(),
            plan.order.data_ptr(),
            plan.tables.shape[1],
            self.slots,
            self.page_size,
            DECODE_CHUNK,
            self.kv_bf16,
            groups,
            plan.groups[0].data_ptr(),
            plan.groups[1].data_ptr(),
            plan.groups[2].data_ptr(),
            self.final_norm.data_ptr(),
            x.data_ptr(),
            out.data_ptr(),
            qkv.data_ptr(),
            attn.data_ptr(),
            gate_up.data_ptr(),
            act.data_ptr(),
            self.tp,
            None if self.windows is None else self.windows.data_ptr(),
            self.softcap,
            int(self.gelu),
        )
        if not cpu._lib.relay_decode_layers(self.table, len(self.table), ctypes.byref(step)):
            raise RuntimeError(
                "relay_decode_layers failed: a GEMM refused its shape, or a tensor-parallel peer "
                "timed out"
            )
        return out


class _PromptLayer(ctypes.Structure):  # csrc/decode_layers.c
    _fields_ = [
        (name, ctypes.c_void_p)
        for name in ("input_norm", "post_norm", "qkv", "o", "gate_up", "down", "k_cache", "v_cache")
    ]


class _PromptStep(ctypes.Structure):
    _fields_ = (
        [(name, ctypes.c_int64) for name in ("T", "hidden", "inter", "nq", "nk", "D")]
        + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
        + [(name, ctypes.c_void_p) for name in ("cos", "sin", "positions", "out_slots")]
        + [(name, ctypes.c_int64) for name in ("S", "PS", "n_dec")]
        + [(name, ctypes.c_void_p) for name in ("dec_rows", "dec_tables", "dec_lens", "dec_order")]
        + [(name, ctypes.c_int64) for name in ("dec_P", "chunk", "n_groups")]
        + [(name, ctypes.c_void_p) for name in ("group_first", "group_size", "group_keys")]
        + [(name, ctypes.c_int64) for name in ("R", "ext_P")]
        + [
            (name, ctypes.c_void_p)
            for name in (
                "ext_tables",
                "q_starts",
                "prefix_lens",
                "extend_lens",
                "final_norm",
                "x",
                "out",
                "qkv",
                "attn",
                "gate_up",
                "act",
                "dec_q",
                "dec_out",
            )
        ]
        + [("n_keep", ctypes.c_int64), ("keep_rows", ctypes.c_void_p), ("tp", ctypes.c_void_p)]
        + [("windows", ctypes.c_void_p), ("softcap", ctypes.c_float)]
    )


@dataclass
class PromptPlan:
    """What relay_prompt_layers reads of a planned step with prompt chunks (the attention
    backend's plan): each row's KV slot, the chunks' ExtendPlan, and the decodes beside them."""

    out_slots: torch.Tensor  # int64 [T]
    ext: ExtendPlan
    dec_rows: torch.Tensor | None = None  # int64: the rows of one new token
    dec: DecodePlan | None = None


class PromptLayers:
    """A bfloat16 decoder whose GEMM weights are all Bf16Panels, run for a step with prompt chunks
    (and any decodes beside them) in one C call (csrc/decode_layers.c) over one bfloat16 KV cache:
    the kernels the layers call for such a step, in their order, on bfloat16 activations, so its
    output is theirs bit for bit where their GEMMs read the panels too."""

    def __init__(
        self,
        layers: list[DecoderLayerWeights],
        final_norm: torch.Tensor,
        eps: float,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        cos: torch.Tensor,
        sin: torch.Tensor,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        page_size: int,
        scale: float,
        tp: int | None = None,
        windows: list[int | None] | None = None,
        softcap: float | None = None,
    ):
        """windows, softcap: as DecodeLayers'."""
        self._keep = (layers, k_caches, v_caches)  # the table's pointers point into these
        self.table = (_PromptLayer * len(layers))(
            *[
                _PromptLayer(
                    w.input_norm.data_ptr(),
                    w.post_norm.data_ptr(),
                    w.qkv.data.data_ptr(),
                    w.o.data.data_ptr(),
                    w.gate_up.data.data_ptr(),
                    w.down.data.data_ptr(),
                    k.data_ptr(),
                    v.data_ptr(),
                )
                for w, k, v in zip(layers, k_caches, v_caches)
            ]
        )
        first = layers[0]
        self.hidden, self.inter, self.qkv_n = (
            first.o.out_features,
            first.down.in_features,
            first.qkv.out_features,
        )
        self.final_norm, self.eps, self.scale = final_norm, eps, scale
        self.nq, self.nk, self.d = num_heads, num_kv_heads, head_dim
        self.cos, self.sin = cos, sin
        self.slots = k_caches[0].shape[1]  # [kv heads, slots, head_dim]
        self.cascade = tiled_attention_available(torch.bfloat16, torch.bfloat16, head_dim)
        self.page_size = page_size
        self.tp = tp  # as DecodeLayers.tp
        self.windows, self.softcap = layer_windows(windows, len(layers)), softcap or 0.0

    def run(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        plan: PromptPlan,
        keep: list[int] | None = None,
    ) -> torch.Tensor:
        """x [T, hidden] bfloat16 (the step's embeddings; used as the residual stream), positions
        int64 [T] -> the final norm's output [T, hidden], or [len(keep), hidden] of the rows in
        keep (increasing): the last layer's o_proj and MLP then run for those rows only. Every
        row's keys and values go into the cache at plan.out_slots."""
        t, bf16 = x.shape[0], torch.bfloat16
        kept = None if keep is None else torch.tensor(keep, dtype=torch.int64)
        width = self.nq * self.d
        out, qkv, attn = (torch.empty(t, n, dtype=bf16) for n in (self.hidden, self.qkv_n, width))
        gate_up, act = (
            torch.empty(t, 2 * self.inter, dtype=bf16),
            torch.empty(t, self.inter, dtype=bf16),
        )
        dec, ext = plan.dec, plan.ext
        n_dec = 0 if plan.dec_rows is None else plan.dec_rows.numel()
        dec_q, dec_out = (
            torch.empty(max(n_dec, 1), width, dtype=bf16),
            torch.empty(max(n_dec, 1), width, dtype=bf16),
        )
        dec_plan = (
            (0, 0, 0, 0, DECODE_CHUNK, 0, 0, 0, 0)
            if dec is None
            else (
                dec.tables.data_ptr(),
                dec.lens.data_ptr(),
                dec.order.data_ptr(),
                dec.tables.shape[1],
                DECODE_CHUNK,
                dec.num_groups if self.cascade else 0,
                *(g.data_ptr() for g in dec.groups),
            )
        )
        step = _PromptStep(
            t,
            self.hidden,
            self.inter,
            self.nq,
            self.nk,
            self.d,
            self.eps,
            self.scale,
            self.cos.data_ptr(),
            self.sin.data_ptr(),
            positions.data_ptr(),
            plan.out_slots.data_ptr(),
            self.slots,
            self.page_size,
            n_dec,
            0 if plan.dec_rows is None else plan.dec_rows.data_ptr(),
            *dec_plan,
            len(ext.q_starts),
            ext.tables.shape[1],
            ext.tables.data_ptr(),
            ext.q_starts.data_ptr(),
            ext.prefix_lens.data_ptr(),
            ext.extend_lens.data_ptr(),
            self.final_norm.data_ptr(),
            x.data_ptr(),
            out.data_ptr(),
            qkv.data_ptr(),
            attn.data_ptr(),
            gate_up.data_ptr(),
            act.data_ptr(),
            dec_q.data_ptr(),
            dec_out.data_ptr(),
            -1 if kept is None else kept.numel(),
            0 if kept is None else kept.data_ptr(),
            self.tp,
            None if self.windows is None else self.windows.data_ptr(),
            self.softcap,
        )
        if not cpu._lib.relay_prompt_layers(self.table, len(self.table), ctypes.byref(step)):
            raise RuntimeError(
                "relay_prompt_layers failed: a GEMM refused its shape, or a tensor-parallel peer "
                "timed out"
            )
        return out if kept is None else out[: kept.numel()]
