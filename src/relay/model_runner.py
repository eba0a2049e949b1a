"""The model runner: weights, the KV pool's tensors, attention, sampling. One per TP rank.

`forward(BatchInput) -> BatchOutput` is its whole interface; it keeps no request state but
the sampler's (keyed by the scheduler's request handles) and each request's last sampled
token (for inputs the scheduler sent as PREVIOUS_TOKEN).
"""
from __future__ import annotations

import glob
import logging
import os

import numpy as np
import torch

from relay.attention import create_backend
from relay.attention.base import StepMeta
from relay.batch import PREVIOUS_TOKEN, BatchInput, BatchOutput
from relay.config import EngineConfig, ModelConfig
from relay.distributed import TPGroup, head_partition
from relay.kv_cache import KVCache, num_pages_for_budget
from relay.models import model_class
from relay.sampler import Sampler

logger = logging.getLogger(__name__)


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def cpu_has_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" or cpu_has_bf16() else torch.float32
    dtype = getattr(torch, name)
    if dtype == torch.float16 and device.type == "cpu":
        raise ValueError("float16 has no fast path on CPU (about 100x slower); use bfloat16 or float32")
    return dtype


def available_cores() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


class ModelRunner:
    def __init__(self, cfg: EngineConfig, model_dir: str, mc: ModelConfig, tp: TPGroup | None = None):
        self.cfg = cfg
        self.tp = tp or TPGroup()
        self.mc = mc
        self.device = pick_device(cfg.device)
        self.dtype = pick_dtype(cfg.dtype, self.device)
        if self.device.type == "cpu":
            # Each rank gets its share of the cores: oversubscribing them is ~17x slower.
            torch.set_num_threads(cfg.num_threads or max(1, available_cores() // self.tp.size))
        else:
            torch.cuda.set_device(self.device)
        self.context_len = cfg.context_length or mc.max_position_embeddings
        self.model = self._load_model(model_dir)
        self.page_size = cfg.page_size
        self.num_pages = self._agree_on_pages()
        shard = head_partition(mc.num_heads, mc.num_kv_heads, self.tp.size, self.tp.rank)
        self.kv = KVCache(mc.num_layers, self.num_pages, cfg.page_size, shard.kv_count, mc.head_dim,
                          self.dtype, self.device)
        self.attn = create_backend(cfg.attention_backend, self.device, kv=self.kv, num_heads=shard.q_count,
                                   num_kv_heads=shard.kv_count, head_dim=mc.head_dim,
                                   scale=mc.head_dim ** -0.5)
        self.sampler = Sampler(mc.vocab_size, self.device, cfg.seed) if self.tp.is_leader else None
        self.last_tokens: dict[int, int] = {}

    # ---- setup --------------------------------------------------------------------------
    def _load_model(self, model_dir: str) -> torch.nn.Module:
        cls = model_class(self.mc.architecture)
        with torch.device(self.device):
            model = cls(self.mc, self.tp, self.dtype, self.context_len)
        model.eval()
        if self.cfg.load_format == "dummy":
            torch.manual_seed(self.cfg.seed)
            for name, p in model.named_parameters():
                p.data.fill_(1.0) if "norm" in name else p.data.normal_(0.0, 0.02)
        else:
            with torch.no_grad():
                model.load_weights(iter_safetensors(model_dir, show_progress=self.tp.is_leader))
        return model

    def _agree_on_pages(self) -> int:
        bytes_per_token = self.mc.kv_bytes_per_token(self.dtype.itemsize, self.tp.size)
        pages = num_pages_for_budget(bytes_per_token, self.page_size, self.cfg.kv_cache_gb,
                                     self.cfg.mem_fraction_static, self.device)
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
        if self.sampler is not None:
            self.sampler.update(batch.released_sids, batch.new_specs)
        for sid in batch.released_sids:
            self.last_tokens.pop(sid, None)
        meta, input_ids = self._prepare(batch)
        self.attn.plan(meta)
        hidden = self.model(input_ids, meta.positions, self.attn)
        ends = np.cumsum(batch.extend_lens) - 1
        rows = [int(ends[i]) for i, s in enumerate(batch.sample) if s]
        if not rows:
            return BatchOutput(batch.step, [])
        logits = self.model.compute_logits(hidden[rows] if len(rows) < hidden.shape[0] else hidden)
        if self.sampler is None:
            return BatchOutput(batch.step, [])
        sids = [sid for sid, s in zip(batch.sids, batch.sample) if s]
        out_lens = [n for n, s in zip(batch.output_lens, batch.sample) if s]
        res = self.sampler.sample(logits, sids, out_lens)
        self.last_tokens.update(zip(sids, res.token_ids))
        return BatchOutput(batch.step, res.token_ids, res.logprobs, res.top_logprobs)

    def _prepare(self, batch: BatchInput) -> tuple[StepMeta, torch.Tensor]:
        ids = batch.input_ids
        if PREVIOUS_TOKEN in ids:
            ids = self._resolve_previous(batch)
        ps = self.page_size
        if batch.is_decode:
            pos = np.asarray(batch.prefix_lens, dtype=np.int64)
            last_pages = np.fromiter((pt[p // ps] for pt, p in zip(batch.page_tables, batch.prefix_lens)),
                                     dtype=np.int64, count=len(pos))
            slots = last_pages * ps + pos % ps
        else:
            pos = np.concatenate([np.arange(p, p + e) for p, e in zip(batch.prefix_lens, batch.extend_lens)])
            slots = np.concatenate([
                np.asarray(pt, dtype=np.int64)[np.arange(p, p + e) // ps] * ps + np.arange(p, p + e) % ps
                for pt, p, e in zip(batch.page_tables, batch.prefix_lens, batch.extend_lens)])
        dev = self.device
        meta = StepMeta(batch.prefix_lens, batch.extend_lens, batch.page_tables,
                        positions=torch.from_numpy(pos).to(dev), out_slots=torch.from_numpy(slots).to(dev))
        return meta, torch.tensor(ids, dtype=torch.int64, device=dev)

    def _resolve_previous(self, batch: BatchInput) -> list[int]:
        ids, pos = list(batch.input_ids), 0
        for sid, n in zip(batch.sids, batch.extend_lens):
            for j in range(pos, pos + n):
                if ids[j] == PREVIOUS_TOKEN:
                    ids[j] = self.last_tokens[sid]
            pos += n
        return ids


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
