"""Execution: running the model (model runner, layers, models, attention backends, kernels,
sampler, the speculative draft model, CUDA graphs, tensor-parallel communication, weight
loading)."""
