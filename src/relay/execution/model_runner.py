"""The model runner: weights, the KV pool's tensors, attention, sampling. One per TP rank.

`forward(BatchInput) -> BatchOutput` is its whole interface. It keeps what the scheduler sent
once per request, keyed by the request's handle (sid): the sampler's state, and the page
table that each step's changes are applied to; and the token it last sampled for each, the
input of a decode row the scheduler built before it saw that token (PENDING_TOKEN).
"""
from __future__ import annotations

import dataclasses
import glob
import logging
import os
from collections.abc import Callable

import numpy as np
import torch

from relay.execution.attention import backend_class
from relay.execution.attention.base import StepMeta
from relay.scheduling.batch import PENDING_TOKEN, BatchInput, BatchOutput, SamplingSpec
from relay.config import EngineConfig, ModelConfig
from relay.execution.distributed import TPGroup, head_partition
from relay.text.grammar import apply_token_masks
from relay.execution.kernels import cpu as cpu_kernels
from relay.execution.kernels import isa
from relay.memory.kv_cache import KVCache, cuda_free_bytes, num_pages_for_budget
from relay.execution.layers import Linear, PathTiming, blocks_crossover_rows, crossover, int4_supported
from relay.execution.models import model_class
from relay.execution.sampler import SampleResult, Sampler
from relay.sampling_params import SamplingParams
from relay.scheduling.speculative.draft_check import check_draft_model, draft_model_dir
from relay.scheduling.speculative.draft_model import Drafter
from relay.execution.thread_backoff import ThreadBackoff, backoff_supported

logger = logging.getLogger(__name__)

WARM_UP_SIDS = (-2, -1)  # request handles of the start-up warm-up; the scheduler's are >= 0
# Batch sizes at which start-up times a decode step in one C call against the layers one by one
# (_measure_decode_layers), the KV tokens per request there, and the margin the C call must win by.
DECODE_LAYERS_SIZES = (1, 4, 8, 16, 32, 64, 128)
DECODE_LAYERS_CONTEXT = 64
DECODE_LAYERS_MIN_GAIN = 0.98


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_fast_bf16() -> bool:
    """bfloat16 dot-product instructions (AVX512-BF16, or AMX-BF16) at the instruction-set level
    this process runs at (relay.execution.kernels.isa: the CPU's, or lower where RELAY_CPU_ISA holds it)."""
    return isa.at_least("avx512bf16")


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    """auto: bfloat16 on GPUs and on CPUs with bf16 dot products (AVX512-BF16 or AMX), where bf16
    GEMMs run 2.3-2.5x fp32's speed (docs/benchmarks.md); float32 on other CPUs, where torch
    emulates bf16 and its GEMMs measured slower than fp32 (~165 vs ~270 GFLOP/s)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_fast_bf16() else torch.float32
    dtype = getattr(torch, name)
    if dtype == torch.float16 and device.type == "cpu":
        raise ValueError("float16 has no fast path on CPU (about 100x slower); use bfloat16 or float32")
    return dtype


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_dir: str, mc: ModelConfig, tp: TPGroup | None = None,
                 device: torch.device | None = None):
        self.tp = tp or TPGroup()
        self.mc = mc
        self.device = device or pick_device(cfg.device)
        self.cfg = cfg = cfg.for_device(self.device.type)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        self.kv_dtype = self.dtype if cfg.kv_cache_dtype == "auto" else pick_dtype(cfg.kv_cache_dtype, self.device)
        if self.kv_dtype != self.dtype and self.device.type != "cpu":
            raise ValueError("a kv_cache_dtype other than the model dtype is only supported on CPU")
        if cfg.quantization and self.device.type != "cpu":
            raise ValueError(f"quantization={cfg.quantization!r} runs on CPU only")
        if cfg.quantization == "w8a8" and not cpu_kernels.available():
            raise ValueError("quantization='w8a8' needs Relay's CPU kernels (a C compiler; RELAY_CPU_KERNELS not 0)")
        if cfg.quantization == "w8a8" and not isa.int8_dot_products():
            raise ValueError(f"quantization='w8a8' needs a CPU with VNNI int8 dot products (AVX512-VNNI); this one "
                             f"runs at {isa.level()!r}, where int8 GEMMs are slower than float32: use 'int8' "
                             f"(weight-only) or no quantization")
        if cfg.quantization == "int4" and not int4_supported():
            raise ValueError("quantization='int4' needs torch's CPU int4 kernels (torch >= 2.6)")
        # What the step loop calls after every step on CPU (None: the thread count stays).
        self.thread_backoff: ThreadBackoff | None = None
        if self.device.type == "cpu":
            # Each rank gets its share of the cores: oversubscribing them is ~17x slower.
            threads = cfg.num_threads or max(1, available_cores() // self.tp.size)
            torch.set_num_threads(threads)
            if cfg.num_threads is None and not cfg.disable_thread_backoff and threads > 1 and backoff_supported():
                self.thread_backoff = ThreadBackoff(threads)
        else:
            torch.cuda.set_device(self.device)
        self.context_len = cfg.context_length or mc.max_position_embeddings
        self.model = self._load_model(model_dir, mc, cfg.quantization)
        self.draft_mc = self.draft_model = None
        if cfg.speculative_algorithm == "standalone":
            draft_dir = draft_model_dir(cfg, model_dir)
            self.draft_mc = check_draft_model(mc, draft_dir, model_dir)
            self.draft_model = self._load_model(draft_dir, self.draft_mc, cfg.draft_quantization)
        self.page_size = cfg.page_size
        self.num_pages = self._agree_on_pages()
        self.kv, self.attn = self._kv_and_attention(mc)
        if self.device.type == "cpu" and self.model.use_decode_layers(self.attn):
            self._measure_decode_layers()
        if self.device.type == "cpu" and self.model.use_prompt_layers(self.attn):
            logger.info("steps with prompt chunks run their decoder layers in one C call on the bfloat16 panels")
        self.model.drop_unused_weight_blocks()
        self.drafter = None
        if self.draft_model is not None:
            _, draft_attn = self._kv_and_attention(self.draft_mc)
            if self.device.type == "cpu":
                self.draft_model.use_decode_layers(draft_attn)
            self.draft_model.drop_unused_weight_blocks()
            self.drafter = Drafter(self.draft_model, draft_attn, self.run_model)
        self.sampler = Sampler(mc.vocab_size, self.device, cfg.seed) if self.tp.is_leader else None
        self.page_tables: dict[int, list[int]] = {}  # sid -> the KV pages of its prefix and new tokens
        self.last_tokens: dict[int, int] = {}  # sid -> its token sampled last (the leader's: overlap)
        self.cuda_graphs = self._build_cuda_graphs()  # None on CPU / --disable-cuda-graph
        self._warm_up()

    def _warm_up(self) -> None:
        """Run every kind of step once before the server says it is ready, so the first request
        pays for no kernel build, oneDNN primitive or first-call path: two prompts (one sampled
        greedily, one with temperature, top-p and top-k), a mixed step, two decode steps, and
        with speculative decoding a step that verifies proposals."""
        lens = [min(40, self.context_len - 7), min(17, self.context_len - 7)]
        counts = [-(-(n + 6) // self.page_size) for n in lens]  # room for the decode and verify steps' tokens
        if 1 + sum(counts) > self.num_pages:
            return  # a pool this small serves tests only
        pages = [list(range(1, 1 + counts[0])), list(range(1 + counts[0], 1 + sum(counts)))]
        specs = [SamplingSpec(WARM_UP_SIDS[0], SamplingParams(temperature=0), []),
                 SamplingSpec(WARM_UP_SIDS[1], SamplingParams(temperature=1.0, top_p=0.9, top_k=20), [])]
        steps = [BatchInput(-1, [WARM_UP_SIDS[0]], [1] * lens[0], [0], [lens[0]], [0], [pages[0]], [True], [0],
                            specs[:1]),
                 BatchInput(-1, list(WARM_UP_SIDS), [1] * (1 + lens[1]), [lens[0], 0], [1, lens[1]], [len(pages[0]), 0],
                            [[], pages[1]], [True, True], [1, 0], specs[1:])]
        steps += [BatchInput(-1, list(WARM_UP_SIDS), [1, 1], [lens[0] + 1 + i, lens[1] + i], [1, 1],
                             [len(pages[0]), len(pages[1])], [[], []], [True, True], [2 + i, 1 + i]) for i in range(2)]
        if self.cfg.speculative_algorithm:
            verify = dataclasses.replace(steps[-1], input_ids=[1, 1], prefix_lens=[lens[0] + 3, lens[1] + 2],
                                         output_lens=[4, 3], spec_lens=[2, 2])
            if self.drafter is None:
                verify.proposed_ids = [1, 1, 1, 1]
            else:  # the draft has read nothing of these requests yet
                verify.catchup_lens, verify.draft_prefix_lens = [lens[0] + 3, lens[1] + 2], [0, 0]
                verify.catchup_ids = [1] * sum(verify.catchup_lens)
            steps.append(verify)
        steps.append(BatchInput(-1, [], [], [], [], [], [], [], [], released_sids=list(WARM_UP_SIDS)))
        for batch in steps:
            out = self.forward(batch)
            if out.row_errors or out.error:
                raise RuntimeError(f"the warm-up step failed: {out.error or out.row_errors}")

    # ---- setup --------------------------------------------------------------------------
    def _load_model(self, model_dir: str, mc: ModelConfig, quantization: str | None) -> torch.nn.Module:
        """The model's weights, quantized, and on CPU packed for its GEMMs (and kept in their
        GGUF blocks where those are exact: see _wants_weight_blocks)."""
        blocks = self._wants_weight_blocks(model_dir, quantization)
        # A bfloat16 model's blocks are recovered from the checkpoint's float32 values, before
        # they are rounded: loaded into a float32 twin first.
        model = self._build_model(model_dir, mc, torch.float32 if blocks else self.dtype)
        kept = model.use_weight_blocks() if blocks else 0
        if model.dtype != self.dtype:
            model = self._cast_keeping_blocks(model, mc)
        if kept and self._int8_block_activations():
            model.use_dot_blocks()
        if quantization == "int8":
            model.quantize_int8()  # before packing: the packed copy holds the quantized values
        elif quantization == "w8a8":
            model.quantize_w8a8()
        elif quantization == "int4":
            model.quantize_int4()
        if self.device.type == "cpu":
            if os.environ.get("RELAY_PACKED_GEMM", "1") != "0":
                model.pack_for_cpu()
            model.use_cpu_kernels()
        if kept or (self.tp.size > 1 and self.device.type == "cpu"):  # every CPU rank: they agree on the crossover
            self._measure_weight_blocks(model, kept)
        return model

    def _new_model(self, mc: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
        with torch.device(self.device):
            model = model_class(mc.architecture)(mc, self.tp, dtype, self.context_len)
        return model.eval()

    def _build_model(self, model_dir: str, mc: ModelConfig, dtype: torch.dtype) -> torch.nn.Module:
        model = self._new_model(mc, dtype)
        if self.cfg.load_format == "dummy":
            torch.manual_seed(self.cfg.seed)
            for name, p in model.named_parameters():
                p.data.fill_(1.0) if "norm" in name else p.data.normal_(0.0, 0.02)
        else:
            with torch.no_grad():
                model.load_weights(iter_safetensors(model_dir, show_progress=self.tp.is_leader))
        return model

    def _wants_weight_blocks(self, model_dir: str, quantization: str | None) -> bool:
        """Whether to look for GGUF blocks in the checkpoint's GEMM weights: on CPU, unquantized,
        with the kernel built; in bfloat16 only from a float32 checkpoint (a bf16 one has lost
        them) whose float32 twin fits in a quarter of the free memory."""
        if (self.device.type != "cpu" or quantization is not None or self.cfg.disable_weight_blocks
                or self.cfg.load_format == "dummy" or not cpu_kernels.gemm_blocks_available()):
            return False
        if self.dtype == torch.float32:
            return True
        float32_bytes = checkpoint_float32_bytes(model_dir)
        return 0 < float32_bytes < available_memory_bytes() // 4

    def _int8_block_activations(self) -> bool:
        """Whether the GEMMs on GGUF blocks round activations to int8 (EngineConfig.block_activations):
        by default for a float32 model where the CPU has AVX2 (x86: its integer dot products;
        elsewhere the level is generic, where the plain C sums are slower than float); a bfloat16
        model's blocks already multiply bfloat16-rounded activations, in bfloat16 dot products)."""
        if self.cfg.block_activations != "auto":
            return self.cfg.block_activations == "int8"
        return self.dtype == torch.float32 and isa.at_least("avx2")

    def _cast_keeping_blocks(self, twin: torch.nn.Module, mc: ModelConfig) -> torch.nn.Module:
        """The model in self.dtype with twin's weights (rounded) and twin's blocks (exact)."""
        model = self._new_model(mc, self.dtype)
        model.load_state_dict(twin.state_dict())
        for mine, theirs in zip(model.gemm_modules(), twin.gemm_modules()):
            mine.blocks = theirs.blocks
            if mine.blocks is not None:
                mine.blocks.round_bf16 = self.dtype == torch.bfloat16
        return model

    def _measure_weight_blocks(self, model: torch.nn.Module, kept: int) -> None:
        """Time the first layer's GEMMs from blocks and from the float weights at growing row
        counts and give every GEMM the measured crossover (none where the floats always win)."""
        sample = [m for m in model.gemm_modules() if isinstance(m, Linear) and m.blocks is not None][:4]
        rows = blocks_crossover_rows(sample) if kept else 0
        # Tensor-parallel ranks take the leader's: each times its own shards, and ranks whose steps
        # took different paths would call different collectives.
        rows = self.tp.broadcast_ints([rows], self.device)[0]
        model.limit_weight_blocks(rows)
        if not kept:
            return
        if rows:
            logger.info("%d of %d GEMM weights are exact GGUF blocks: GEMMs of up to %d rows read those "
                        "(measured %s against %s)", kept, len(model.gemm_modules()), rows,
                        "here" if self.tp.size == 1 else "by rank 0", str(self.dtype).removeprefix("torch."))
        else:
            logger.info("%d GEMM weights are exact GGUF blocks, but %s GEMMs measured faster here at every "
                        "size (a decode step in one C call may still read them)", kept,
                        str(self.dtype).removeprefix("torch."))

    def _measure_decode_layers(self) -> None:
        """Time pure decode steps with the layers in one C call against the layers called one by
        one, at growing batch sizes (requests of DECODE_LAYERS_CONTEXT tokens on pages of the
        still empty pool), and run steps of up to the largest size the C call won at that way.
        Whole steps, not GEMMs: the call saves the interpreter between ~10 kernels per layer,
        which can pay for block GEMMs slower than the float ones. Nothing to time where its GEMMs
        past the blocks' rows are the layers' own (DecodeLayers.on_panels)."""
        fast = self.model.decode_layers
        if fast[1].on_panels:
            logger.info("decode steps run their decoder layers in one C call at every batch size (past the "
                        "blocks' rows on the layers' own bfloat16 panels)")
            return
        if self.tp.size > 1:  # timed steps are collectives, and each rank's timings could stop at another size
            logger.info("decode steps of up to %d requests (the blocks' rows) run their decoder layers in one C "
                        "call", fast[1].max_rows)
            return
        per_request = -(-(DECODE_LAYERS_CONTEXT + 1) // self.page_size)

        def paths(size: int) -> PathTiming | None:
            if 1 + size * per_request > self.num_pages:
                return None
            tables = [list(range(1 + i * per_request, 1 + (i + 1) * per_request)) for i in range(size)]
            batch = BatchInput(-1, list(range(size)), [1] * size, [DECODE_LAYERS_CONTEXT] * size, [1] * size,
                               [0] * size, [[]] * size, [True] * size, [1] * size)

            def step(layers) -> Callable[[], None]:
                def run() -> None:
                    self.model.decode_layers = layers
                    self.run_model(self.model, self.attn, batch, tables)
                return run
            return PathTiming(step(fast), step(None))

        fast[1].max_rows = crossover(DECODE_LAYERS_SIZES, paths, DECODE_LAYERS_MIN_GAIN, reps=2)
        self.model.decode_layers = fast
        if fast[1].max_rows:
            logger.info("decode steps of up to %d requests run their decoder layers in one C call (measured "
                        "here)", fast[1].max_rows)

    def _kv_and_attention(self, mc: ModelConfig):
        """A KV pool of num_pages pages for this model's layers, and an attention backend on it."""
        shard = head_partition(mc.num_heads, mc.num_kv_heads, self.tp.size, self.tp.rank)
        attn_cls = backend_class(self.cfg.attention_backend, self.device, self.dtype,
                                 mc.masks_attention(self.context_len))
        kv = KVCache(mc.num_layers, self.num_pages, self.page_size, shard.kv_count, mc.head_dim,
                     self.kv_dtype, self.device, layout=attn_cls.kv_layout)
        attn = attn_cls(kv=kv, num_heads=shard.q_count, num_kv_heads=shard.kv_count, head_dim=mc.head_dim,
                        scale=mc.attention_scale, windows=mc.attention_windows(self.context_len),
                        softcap=mc.attn_logit_softcap)
        return kv, attn

    def _agree_on_pages(self) -> int:
        bytes_per_token = self.mc.kv_bytes_per_token(self.kv_dtype.itemsize, self.tp.size)
        if self.draft_mc is not None:  # the draft's pool has as many pages, of its own size
            bytes_per_token += self.draft_mc.kv_bytes_per_token(self.kv_dtype.itemsize, self.tp.size)
        free = None
        if self.device.type == "cuda" and self.cfg.kv_cache_gb is None:
            free = self._free_bytes_after_warmup()
        pages = num_pages_for_budget(bytes_per_token, self.page_size, self.cfg.kv_cache_gb,
                                     self.cfg.mem_fraction_static, self.device, free_bytes=free)
        if self.tp.size > 1:  # every rank must hold the same pages
            t = torch.tensor([pages], dtype=torch.int64, device=self.device)
            torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MIN)
            pages = int(t.item())
        if pages < 2:
            raise RuntimeError("the KV budget holds less than 2 pages; raise --kv-cache-gb")
        return pages

    # ---- the step -----------------------------------------------------------------------
    @torch.inference_mode()
    def forward(self, batch: BatchInput) -> BatchOutput:
        """Run one step. A request whose input is malformed is left out of it (every rank
        reaches the same verdict, so the ranks stay in step) and so is one whose sampling
        raises; both come back in row_errors while the rest of the batch runs."""
        batch = self._fill_pending(batch)
        for sid, sample in zip(batch.sids, batch.sample):
            if sample:  # until this step samples it anew (a step that raises leaves none)
                self.last_tokens.pop(sid, None)
        row_errors = self.invalid_rows(batch)
        run = batch.without(set(row_errors)) if row_errors else batch
        if self.sampler is not None:
            self.sampler.update(run.released_sids, run.new_specs)
        for sid in run.released_sids:
            self.page_tables.pop(sid, None)
            self.last_tokens.pop(sid, None)
        for sid, start, pages in zip(run.sids, run.page_starts, run.new_pages):
            table = self.page_tables.setdefault(sid, [])
            del table[start:]
            table.extend(pages)
        tables = [self.page_tables[sid] for sid in run.sids]
        speculative = bool(run.spec_lens or run.catchup_lens)
        proposals, dists = self._proposals(run, tables) if speculative else (None, None)
        logits = None
        if run.sids and speculative:
            verify, rows = _with_proposals(run, proposals)
            logits = self.step_logits(verify, tables, rows)
        elif run.sids:
            logits = self.step_logits(run, tables)
        if self.sampler is None:
            return BatchOutput(batch.step, [], row_errors=row_errors)
        kept = [i for i in range(len(batch.sids)) if i not in row_errors]
        sampled = [kept[j] for j, s in enumerate(run.sample) if s]  # batch row of each sampling row
        res = SampleResult([])
        if logits is not None:
            picked = [i for i, s in enumerate(run.sample) if s]
            if run.token_masks:
                apply_token_masks(logits, *_mask_rows(run, picked, proposals))
            sids = [run.sids[i] for i in picked]
            lens = [run.output_lens[i] for i in picked]
            if proposals is None:
                res, failed = self._sample(logits, sids, lens)
            else:
                res, failed = self._sample_and_verify(logits, sids, lens, [proposals[i] for i in picked],
                                                      [dists[i] for i in picked])
            row_errors.update({sampled[j]: why for j, why in failed.items()})
        out = _scatter(batch, row_errors, sampled, res)
        self._remember_tokens(batch, out)
        return out

    def _fill_pending(self, batch: BatchInput) -> BatchInput:
        """The batch with each PENDING_TOKEN input (a decode row's only one) replaced by the
        token the leader sampled for that request last, sent to the other ranks (one small
        collective, only in steps that have such inputs); one it lacks stays, and its row fails."""
        if not batch.input_ids or min(batch.input_ids) != PENDING_TOKEN or sum(batch.extend_lens) != len(batch.input_ids):
            return batch  # (a malformed batch: invalid_rows fails it)
        ends = np.cumsum(batch.extend_lens) - 1
        rows = [(int(e), sid) for sid, e in zip(batch.sids, ends) if batch.input_ids[e] == PENDING_TOKEN]
        tokens = self.tp.broadcast_ints([self.last_tokens.get(sid, PENDING_TOKEN) for _, sid in rows], self.device)
        ids = list(batch.input_ids)
        for (i, _), tok in zip(rows, tokens):
            ids[i] = tok
        return dataclasses.replace(batch, input_ids=ids)

    def _remember_tokens(self, batch: BatchInput, out: BatchOutput) -> None:
        """Keep each sampling row's last emitted token for a PENDING_TOKEN in the next step."""
        sids = [sid for sid, s in zip(batch.sids, batch.sample) if s]
        spec = out.spec_token_ids or [[]] * len(sids)
        for sid, tok, more in zip(sids, out.next_token_ids, spec):
            tok = more[-1] if more else tok
            if tok >= 0:
                self.last_tokens[sid] = tok
            else:  # its row failed: a pending input that follows must fail too
                self.last_tokens.pop(sid, None)

    def _proposals(self, batch: BatchInput, tables: list[list[int]]
                   ) -> tuple[list[list[int]], list[torch.Tensor | None]]:
        """Per row, the tokens to verify after its input token, and for sampled requests the
        draft distributions they came from (None: the proposals were certain, as n-gram's)."""
        if self.drafter is not None:
            return self.drafter.propose(batch, tables, self.sampler)
        return batch.row_runs(batch.proposed_ids, batch.spec_lens), [None] * len(batch.sids)

    def _sample_and_verify(self, logits: torch.Tensor, sids: list[int], out_lens: list[int],
                           proposals: list[list[int]], dists: list[torch.Tensor | None]
                           ) -> tuple[SampleResult, dict[int, str]]:
        """Sample the rows without proposals and verify those with: logits holds one row per
        plain row and len(proposals) + 1 per speculating one, in order."""
        starts = np.cumsum([0] + [len(p) + 1 for p in proposals]).tolist()
        plain = [j for j, p in enumerate(proposals) if not p]
        spec = [j for j, p in enumerate(proposals) if p]
        tokens: list[list[int]] = [[-1] for _ in sids]
        failed: dict[int, str] = {}
        res = SampleResult([])
        if plain:
            res, bad = self._sample(logits[[starts[j] for j in plain]], [sids[j] for j in plain],
                                    [out_lens[j] for j in plain])
            failed.update({plain[j]: why for j, why in bad.items()})
            for j, tok in zip(plain, res.token_ids):
                tokens[j] = [tok]
        def verify(js: list[int]) -> None:
            rows = [r for j in js for r in range(starts[j], starts[j + 1])]
            out = self.sampler.verify(logits[rows], [sids[j] for j in js], [out_lens[j] for j in js],
                                      [proposals[j] for j in js], [dists[j] for j in js])
            for j, emitted in zip(js, out):
                tokens[j] = emitted

        try:
            if spec:
                verify(spec)
        except Exception:
            logger.exception("verifying %d requests failed; retrying request by request", len(spec))
            for j in spec:
                try:
                    verify([j])
                except Exception as e:
                    failed[j] = f"verifying proposals failed for this request: {type(e).__name__}: {e}"
        merged = SampleResult([t[0] for t in tokens], spec_token_ids=[t[1:] for t in tokens])
        if res.logprobs is not None:
            at = {j: n for n, j in enumerate(plain)}
            merged.logprobs = [res.logprobs[at[j]] if j in at else None for j in range(len(sids))]
            if res.top_logprobs is not None:
                merged.top_logprobs = [res.top_logprobs[at[j]] if j in at else None for j in range(len(sids))]
        return merged, failed

    def _sample(self, logits: torch.Tensor, sids: list[int], out_lens: list[int]
                ) -> tuple[SampleResult, dict[int, str]]:
        """Sample every row; if the batch raises, sample row by row to find the culprits."""
        try:
            return self.sampler.sample(logits, sids, out_lens), {}
        except Exception:
            logger.exception("sampling a batch of %d failed; retrying request by request", len(sids))
        parts: list[SampleResult | None] = []
        failed: dict[int, str] = {}
        for i in range(len(sids)):
            try:
                parts.append(self.sampler.sample(logits[i:i + 1], sids[i:i + 1], out_lens[i:i + 1]))
            except Exception as e:
                failed[i] = f"sampling failed for this request: {type(e).__name__}: {e}"
                parts.append(None)
        return _concat_results(parts), failed

    def invalid_rows(self, batch: BatchInput) -> dict[int, str]:
        """Rows whose input would index outside the model, the KV pool or the request's page
        table, with why. The scheduler never builds them; this keeps a bug (or a bad id that
        slipped past the door) from failing a whole batch, or on a GPU from poisoning the
        device. Every rank holds the same tables, so every rank reaches the same verdict."""
        vocab = self.mc.vocab_size
        specs_ok = all(_ids_within(s.stop_token_ids, vocab) and _ids_within(s.prompt_ids, vocab)
                       for s in batch.new_specs)
        pages_ok = all(_ids_within(pages, self.num_pages, 1) for pages in batch.new_pages)
        spec_ok = (_ids_within(batch.proposed_ids, vocab) and _ids_within(batch.catchup_ids, vocab)
                   and len(batch.proposed_ids) == (0 if self.drafter else sum(batch.spec_lens))
                   and len(batch.catchup_ids) == sum(batch.catchup_lens))
        if (_ids_within(batch.input_ids, vocab) and pages_ok and specs_ok and spec_ok
                and sum(batch.extend_lens) == len(batch.input_ids) and not self._bad_tables(batch)):
            return {}
        return self._find_invalid_rows(batch)

    def _bad_tables(self, batch: BatchInput) -> list[int]:
        """Rows whose page update leaves a gap, or whose table would not hold their tokens."""
        released = set(batch.released_sids)
        bad = []
        for i, sid in enumerate(batch.sids):
            held = 0 if sid in released else len(self.page_tables.get(sid, ()))
            end = batch.prefix_lens[i] + batch.extend_lens[i] + (batch.spec_lens[i] if batch.spec_lens else 0)
            start = batch.page_starts[i]
            if start > held or (start + len(batch.new_pages[i])) * self.page_size < end or end > self.context_len:
                bad.append(i)
        return bad

    def _find_invalid_rows(self, batch: BatchInput) -> dict[int, str]:
        vocab = self.mc.vocab_size
        bad_specs = {s.sid for s in batch.new_specs
                     if not (_ids_within(s.stop_token_ids, vocab) and _ids_within(s.prompt_ids, vocab))}
        bad_tables = set(self._bad_tables(batch))
        errors: dict[int, str] = {}
        start = 0
        proposed = batch.row_runs(batch.proposed_ids, batch.spec_lens)
        catchup = batch.row_runs(batch.catchup_ids, batch.catchup_lens)
        for i, (sid, n) in enumerate(zip(batch.sids, batch.extend_lens)):
            if PENDING_TOKEN in batch.input_ids[start:start + n]:
                errors[i] = "its previous step failed: there is no sampled token to continue from"
            elif not _ids_within(batch.input_ids[start:start + n] + proposed[i] + catchup[i], vocab):
                errors[i] = f"an input token id is outside the vocabulary [0, {vocab})"
            elif sid in bad_specs:
                errors[i] = f"a stop or prompt token id is outside the vocabulary [0, {vocab})"
            elif i in bad_tables or not _ids_within(batch.new_pages[i], self.num_pages, 1):
                errors[i] = "the request's KV pages or positions are out of range"
            start += n
        spec_lens_ok = (len(batch.proposed_ids) == (0 if self.drafter else sum(batch.spec_lens))
                        and len(batch.catchup_ids) == sum(batch.catchup_lens))
        if start != len(batch.input_ids) or not spec_lens_ok:  # the lengths disagree: no row can be trusted
            errors = {i: "malformed batch: input ids and extend lengths disagree" for i in range(len(batch.sids))}
        return errors

    def _prepare(self, batch: BatchInput, tables: list[list[int]], model: torch.nn.Module | None = None
                 ) -> tuple[StepMeta, torch.Tensor]:
        """The step's metadata and input ids. Its positions are the rows of model's rotary tables
        (default: the model's): each token's position, plus the LongRoPE long-factor offset for
        the rows in batch.rope_long."""
        ps = self.page_size
        if batch.is_decode:
            pos = np.asarray(batch.prefix_lens, dtype=np.int64)
            last_pages = np.fromiter((pt[p // ps] for pt, p in zip(tables, batch.prefix_lens)),
                                     dtype=np.int64, count=len(pos))
            slots = last_pages * ps + pos % ps
        else:
            pos = np.concatenate([np.arange(p, p + e) for p, e in zip(batch.prefix_lens, batch.extend_lens)])
            slots = np.concatenate([
                np.asarray(pt, dtype=np.int64)[np.arange(p, p + e) // ps] * ps + np.arange(p, p + e) % ps
                for pt, p, e in zip(tables, batch.prefix_lens, batch.extend_lens)])
        pos = _on_long_rope_rows(pos, batch, model if model is not None else self.model)
        dev = self.device
        meta = StepMeta(batch.prefix_lens, batch.extend_lens, tables,
                        positions=torch.from_numpy(pos).to(dev), out_slots=torch.from_numpy(slots).to(dev))
        return meta, torch.tensor(batch.input_ids, dtype=torch.int64, device=dev)

    # ---- GPU: CUDA graphs, the warm-up that sizes the KV pool ----------------------------
    @torch.inference_mode()
    def step_logits(self, batch: BatchInput, tables: list[list[int]], rows: list[int] | None = None
                    ) -> torch.Tensor | None:
        """Run one step's forward over these page tables (one per request, covering its
        prefix and new tokens); float32 logits [rows, vocab] of the given token rows (default:
        each sampling request's last token; None when there are none). Decode steps that fit a
        captured CUDA graph replay it (logits included); everything else runs eagerly."""
        graphs = self.cuda_graphs
        if graphs is not None and graphs.can_run(len(batch.extend_lens), batch.is_decode):
            meta, input_ids = self._prepare(batch, tables)
            rows = _last_rows(batch) if rows is None else rows
            logits = graphs.replay(meta, input_ids)
            if not rows:
                return None
            return logits[rows] if len(rows) < logits.shape[0] else logits
        return self.run_model(self.model, self.attn, batch, tables, rows)

    def run_model(self, model: torch.nn.Module, attn, batch: BatchInput, tables: list[list[int]],
                  rows: list[int] | None = None) -> torch.Tensor | None:
        """An eager forward of model over its KV pool (attn's) and these page tables; float32
        logits of the given token rows (default: each sampling request's last token)."""
        meta, input_ids = self._prepare(batch, tables, model)
        rows = _last_rows(batch) if rows is None else rows
        attn.plan(meta)
        ordered = all(a < b for a, b in zip(rows, rows[1:]))
        hidden = model(input_ids, meta.positions, attn, rows if ordered else None)
        if not rows:
            return None
        return model.compute_logits(hidden if ordered else hidden[rows])

    def _build_cuda_graphs(self):
        if self.device.type != "cuda" or self.cfg.disable_cuda_graph:
            return None
        if not self.attn.supports_cuda_graph:
            logger.info("the %s attention backend does not support CUDA graphs: decode runs eagerly",
                        self.attn.name)
            return None
        if not self.model.supports_cuda_graph:
            logger.info("%s steps run eagerly: which experts run depends on the tokens, which a CUDA graph "
                        "cannot follow", self.model.config.architecture)
            return None
        max_bs = min(self.cfg.cuda_graph_max_bs, self.cfg.max_running_requests)
        if max_bs < 1:
            return None
        from relay.execution.cuda_graph import CudaGraphRunner

        return CudaGraphRunner(self.model, self.attn, self.device, max_bs, -(-self.context_len // self.page_size))

    @torch.inference_mode()
    def _free_bytes_after_warmup(self) -> int:
        """Free GPU memory after one forward of a full step (chunked_prefill_size tokens, logits
        and a sampler-sized softmax/sort for up to max_running_requests rows) on a throwaway
        KV cache; the activations' blocks stay cached by torch, outside what the KV pool gets."""
        mc, ps = self.mc, self.page_size
        n = max(1, min(self.cfg.chunked_prefill_size, self.context_len - 1))
        shard = head_partition(mc.num_heads, mc.num_kv_heads, self.tp.size, self.tp.rank)
        attn_cls = backend_class(self.cfg.attention_backend, self.device, self.dtype,
                                 mc.masks_attention(self.context_len))
        pages = -(-n // ps) + 1
        kv = KVCache(mc.num_layers, pages, ps, shard.kv_count, mc.head_dim, self.dtype, self.device,
                     layout=attn_cls.kv_layout)
        attn = attn_cls(kv=kv, num_heads=shard.q_count, num_kv_heads=shard.kv_count, head_dim=mc.head_dim,
                        scale=mc.attention_scale, windows=mc.attention_windows(self.context_len),
                        softcap=mc.attn_logit_softcap)
        dev = self.device
        meta = StepMeta([0], [n], [list(range(1, pages))], positions=torch.arange(n, device=dev),
                        out_slots=torch.arange(ps, ps + n, device=dev))
        attn.plan(meta)
        hidden = self.model(torch.zeros(n, dtype=torch.int64, device=dev), meta.positions, attn)
        rows = min(n, self.cfg.max_running_requests)
        logits = self.model.compute_logits(hidden[:rows])
        torch.softmax(logits, dim=-1).sort(dim=-1, descending=True)
        del kv, attn, meta, hidden, logits
        free = cuda_free_bytes(dev)
        logger.info("after weights and a warm-up step: %.2f GiB GPU memory free", free / (1 << 30))
        return free


def _last_rows(batch: BatchInput) -> list[int]:
    ends = np.cumsum(batch.extend_lens) - 1
    return [int(ends[i]) for i, s in enumerate(batch.sample) if s]


def _mask_rows(batch: BatchInput, picked: list[int], proposals: list[list[int]] | None
               ) -> tuple[list[int], list[bytes]]:
    """The token masks of a step and the logits row each applies to: a plain row has one; a
    row verifying k proposals has k + 1, one per position (concatenated in token_masks)."""
    at = {row: j for j, row in enumerate(picked)}
    if proposals is None:
        return [at[i] for i in batch.token_masks], list(batch.token_masks.values())
    starts = np.cumsum([0] + [len(proposals[i]) + 1 for i in picked]).tolist()
    rows, masks = [], []
    for i, blob in batch.token_masks.items():
        n = len(proposals[i]) + 1
        size = len(blob) // n
        rows += [starts[at[i]] + r for r in range(n)]
        masks += [blob[r * size:(r + 1) * size] for r in range(n)]
    return rows, masks


def _with_proposals(batch: BatchInput, proposals: list[list[int]]) -> tuple[BatchInput, list[int]]:
    """The verify step: every row's proposals appended to its input tokens, and the token rows
    whose logits are needed (all of a speculating row's, the last of another sampling row)."""
    ids, lens, rows, at = [], [], [], 0
    for n, props, sample in zip(batch.extend_lens, proposals, batch.sample):
        ids += batch.input_ids[at:at + n] + props
        lens.append(n + len(props))
        at += n
        start = len(ids) - len(props) - 1
        if sample:
            rows += list(range(start, len(ids)))
    return dataclasses.replace(batch, input_ids=ids, extend_lens=lens), rows


def _ids_within(ids: list[int], hi: int, lo: int = 0) -> bool:
    return not ids or (min(ids) >= lo and max(ids) < hi)


def _concat_results(parts: list[SampleResult | None]) -> SampleResult:
    """Row-by-row results as one; a failed row (None) gets token -1."""
    out = SampleResult([p.token_ids[0] if p else -1 for p in parts])
    if any(p is not None and p.logprobs is not None for p in parts):
        out.logprobs = [p.logprobs[0] if p and p.logprobs else None for p in parts]
    if any(p is not None and p.top_logprobs is not None for p in parts):
        out.top_logprobs = [p.top_logprobs[0] if p and p.top_logprobs else None for p in parts]
    return out


def _scatter(batch: BatchInput, row_errors: dict[int, str], sampled: list[int], res: SampleResult) -> BatchOutput:
    """The output in the batch's own row order: one entry per sampling row, -1 where it failed."""
    if not row_errors:
        return BatchOutput(batch.step, res.token_ids, res.logprobs, res.top_logprobs,
                           spec_token_ids=res.spec_token_ids)
    at = {row: j for j, row in enumerate(sampled)}
    rows = [i for i, s in enumerate(batch.sample) if s]
    pick = lambda values, default: [values[at[r]] if r in at and r not in row_errors else default  # noqa: E731
                                    for r in rows]
    return BatchOutput(batch.step, pick(res.token_ids, -1),
                       None if res.logprobs is None else pick(res.logprobs, None),
                       None if res.top_logprobs is None else pick(res.top_logprobs, None), row_errors=row_errors,
                       spec_token_ids=None if res.spec_token_ids is None else pick(res.spec_token_ids, []))


def iter_safetensors(model_dir: str, show_progress: bool = True):
    """(name, tensor) for every tensor of the checkpoint, with a progress bar."""
    from safetensors import safe_open
    from tqdm import tqdm

    files = sorted(glob.glob(os.path.join(model_dir, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {model_dir}")
    handles = [safe_open(f, framework="pt") for f in files]
    names = [(h, k) for h in handles for k in h.keys()]
    for h, k in tqdm(names, desc="Loading weights", unit="tensor", disable=not show_progress, leave=False):
        yield k, h.get_tensor(k)


def checkpoint_float32_bytes(model_dir: str) -> int:
    """The bytes of the checkpoint's float32 tensors (what a float32 twin of the model holds);
    0 if its GEMM weights are stored in another dtype."""
    from safetensors import safe_open

    total, gemm_weights_elsewhere = 0, False
    for path in sorted(glob.glob(os.path.join(model_dir, "*.safetensors"))):
        with safe_open(path, framework="pt") as f:
            for name in f.keys():
                part = f.get_slice(name)
                if part.get_dtype() == "F32":
                    total += 4 * int(np.prod(part.get_shape()))
                elif name.endswith("proj.weight"):
                    gemm_weights_elsewhere = True
    return 0 if gemm_weights_elsewhere else total


def available_memory_bytes() -> int:
    """MemAvailable from /proc/meminfo (where there is none: the physical memory)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _on_long_rope_rows(pos: np.ndarray, batch: BatchInput, model: torch.nn.Module) -> np.ndarray:
    """pos with the tokens of batch.rope_long's rows moved to the model's long-factor rows
    (RotaryEmbedding.long_rows; a model without them, such as a draft model on another rope,
    keeps the positions)."""
    offset = getattr(getattr(model, "rotary", None), "long_rows", 0)
    if not offset or not any(batch.rope_long):
        return pos
    per_token = np.repeat(np.asarray(batch.rope_long, dtype=np.int64), batch.extend_lens)
    return pos + offset * per_token
