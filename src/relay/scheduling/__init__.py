"""Scheduling: which requests run in each step (admission, KV reservation and retraction,
batches, overlap, adaptive batch sizes, speculative decoding's plans)."""
