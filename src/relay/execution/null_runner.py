"""A model runner without a model: answers each step at once with made-up tokens.

Only for measuring the pipeline around the model (HTTP, tokenizer, scheduler,
detokenizer): `launch.serve --load-format dummy-null`. It honours the same contract as
ModelRunner (page count from the same KV budget, one token per sampled request).
"""

from __future__ import annotations

from relay.config import EngineConfig, ModelConfig
from relay.memory.kv_cache import num_pages_for_budget
from relay.step import BatchInput, BatchOutput, EmbedChunk

# Made-up tokens cycle through ordinary vocabulary ids, clear of the special tokens at
# the bottom of most vocabularies, so the detokenizer does real work.
_FIRST_TOKEN, _SPAN = 1000, 4000


class NullModelRunner:
    def __init__(self, cfg: EngineConfig, mc: ModelConfig):
        import torch

        self.cfg = cfg = cfg.for_device("cpu")
        self.page_size = cfg.page_size
        self.context_len = cfg.context_length or mc.max_position_embeddings
        bytes_per_token = mc.kv_bytes_per_token(2, cfg.tp_size)
        self.num_pages = num_pages_for_budget(
            bytes_per_token,
            cfg.page_size,
            cfg.kv_cache_gb,
            cfg.mem_fraction_static,
            torch.device("cpu"),
        )
        self.kv_window = mc.kv_window(self.context_len)  # as ModelRunner's: pages drop behind it
        self.span = min(_SPAN, mc.vocab_size - _FIRST_TOKEN)
        self.zeros = bytes(4 * mc.hidden_size)  # an embedding span's hidden-state sum

    def forward(self, batch: BatchInput) -> BatchOutput:
        tokens = [
            _FIRST_TOKEN + (sid * 7919 + n) % self.span
            for sid, n, s in zip(batch.sids, batch.output_lens, batch.sample)
            if s
        ]
        pooled = [EmbedChunk(span.row, self.zeros) for span in batch.embed_spans]
        return BatchOutput(batch.step, tokens, embed_chunks=pooled)
