"""Relay's benchmark tool: `python -m scripts.bench SUBCOMMAND [flags]` from the repository root.

Every subcommand sends its load with one client (client.py: streamed requests timed per chunk, SGLang's
metric definitions in metrics.py, the workloads of workloads.py), starts servers one way (servers.py,
peer engines in engines.py), writes one result format (results.py: JSON lines with the machine and commit)
and prints one kind of table (table.py). A module per subcommand:

  serving     one load run (or a concurrency sweep) against a running server
  compare     Relay vs vLLM CPU, llama.cpp's llama-server and transformers, one server at a time
  hf          transformers static batching on the random workload (compare's baseline)
  offline     Relay's offline Engine vs transformers `generate`, no server
  goodput     goodput under latency targets: adaptive batching vs fixed step limits
  structured  grammar-constrained vs free decoding, first-seen vs cached schema latency
  dp          data-parallel replicas: cache-aware vs round-robin routing
  scheduler   the scheduler process's own cost per step and bytes sent, under load
  hardening   what a careless or hostile client costs the other users of a server
  busy-host   a short request's latency while other processes keep the cores busy
  gguf-sizes  Relay vs llama-server on random-weight GGUF files of Llama 1B/8B sizes (made with
              llama.cpp's converter and llama-quantize): start time, peak RSS, disk, tok/s

Kernel micro-benchmarks stay scripts of their own (scripts/bench_gemm_blocks.py, bench_block_dot.py,
bench_attention_cpu.py, ab_decode_attention.py, bench_moe.py, bench_weight_formats.py, cpu_peak.py,
profile_step.py, quant_quality.py): they time one kernel in-process and share nothing of the above.
"""
