"""Execution: running the model (model runner, layers, models, attention backends, kernels,
sampler, CUDA graphs, tensor-parallel communication, weight loading)."""
