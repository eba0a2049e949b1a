"""Random-weight GGUF files of real model shapes, made with llama.cpp's own tools (for gguf_sizes.py).

  shape  what it copies
  1b     Llama-3.2-1B: 16 layers, hidden 2048, intermediate 8192, 32 heads / 8 KV heads of 64, tied
         embeddings, rope_theta 500000
  8b     Llama-3.1-8B: 32 layers, hidden 4096, intermediate 14336, 32 heads / 8 KV heads of 128,
         untied, rope_theta 500000

Both with the vocabulary and tokenizer of the default model (SmolLM2-135M-Instruct, 49,152 tokens), so
that any workload built with its tokenizer fits; no Llama 3 rope scaling. The steps, each skipped when its
output exists (everything under .bench/models, ignored by git):

  1. NAME-hf/             config.json (transformers' LlamaConfig), the default model's tokenizer files
                          (read from its GGUF by transformers, written by save_pretrained), bfloat16
                          weights ~ N(0, 0.02) (norms 1) in safetensors shards of <= 2 GiB written one
                          tensor at a time (the 8B's 16 GB is never whole in memory) + the shard index
  2. NAME.bf16.gguf       llama.cpp's convert_hf_to_gguf.py --outtype bf16 (the copy vendored in the
                          llama-cpp-python sdist that scripts/build_llama_cpp.sh extracts, with its own
                          gguf-py first on PYTHONPATH)
  3. NAME.TYPE.gguf       llama-quantize (scripts/build_llama_cpp.sh builds it) to Q4_K_M, Q8_0

Once every quantized file asked for exists, the HF folder and the bfloat16 GGUF are deleted (keep=True
keeps them). `python -m scripts.bench gguf-sizes --prepare-only --models 1b-Q8_0,8b-Q4_K_M` makes files
without benchmarking them.
"""

from __future__ import annotations

import glob
import json
import os
import shutil
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Any

from scripts.bench.results import BENCH_DIR, ROOT

MODELS_DIR = os.path.join(BENCH_DIR, "models")
QUANT_TYPES = ("Q4_K_M", "Q8_0")
SHARD_BYTES = 2 << 30  # at most this much of the weights per safetensors file
INIT_STD = 0.02


@dataclass(frozen=True)
class Shape:
    name: str  # file names: rand-llama-NAME.*
    copies: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    tied: bool
    rope_theta: float = 500000.0
    max_positions: int = 131072
    rms_norm_eps: float = 1e-5


SHAPES = {
    "1b": Shape("1b", "Llama-3.2-1B", 16, 2048, 8192, 32, 8, 64, tied=True),
    "8b": Shape("8b", "Llama-3.1-8B", 32, 4096, 14336, 32, 8, 128, tied=False),
}


def parse_model_spec(spec: str) -> tuple[str, str]:
    """'1b-Q4_K_M' -> ('1b', 'Q4_K_M')."""
    shape, _, qtype = spec.strip().partition("-")
    if shape.lower() not in SHAPES or qtype.upper() not in QUANT_TYPES:
        raise ValueError(
            f"{spec!r}: want SHAPE-TYPE with SHAPE one of {', '.join(SHAPES)} and TYPE one of "
            f"{', '.join(QUANT_TYPES)}, e.g. 1b-Q4_K_M"
        )
    return shape.lower(), qtype.upper()


def base_name(shape: str) -> str:
    return f"rand-llama-{shape}"


def gguf_path(shape: str, qtype: str, models_dir: str = MODELS_DIR) -> str:
    return os.path.join(models_dir, f"{base_name(shape)}.{qtype}.gguf")


def hf_config(shape: Shape, vocab_size: int, bos_id: int | None, eos_id: int | None) -> dict:
    """config.json of the random model: transformers' LlamaConfig of the shape."""
    from transformers import LlamaConfig

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=shape.intermediate,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.kv_heads,
        head_dim=shape.head_dim,
        hidden_act="silu",
        max_position_embeddings=shape.max_positions,
        rms_norm_eps=shape.rms_norm_eps,
        tie_word_embeddings=shape.tied,
        rope_theta=shape.rope_theta,
        bos_token_id=bos_id,
        eos_token_id=eos_id,
        architectures=["LlamaForCausalLM"],
    ).to_dict()
    cfg["torch_dtype"] = cfg["dtype"] = "bfloat16"
    return cfg


def tensor_specs(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every weight of a Llama config, in the order they are written."""
    h, inter, vocab = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    hd = cfg.get("head_dim") or h // cfg["num_attention_heads"]
    q, kv = cfg["num_attention_heads"] * hd, cfg["num_key_value_heads"] * hd
    specs: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (vocab, h))]
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        specs += [
            (p + "input_layernorm.weight", (h,)),
            (p + "self_attn.q_proj.weight", (q, h)),
            (p + "self_attn.k_proj.weight", (kv, h)),
            (p + "self_attn.v_proj.weight", (kv, h)),
            (p + "self_attn.o_proj.weight", (h, q)),
            (p + "post_attention_layernorm.weight", (h,)),
            (p + "mlp.gate_proj.weight", (inter, h)),
            (p + "mlp.up_proj.weight", (inter, h)),
            (p + "mlp.down_proj.weight", (h, inter)),
        ]
    specs.append(("model.norm.weight", (h,)))
    if not cfg.get("tie_word_embeddings"):
        specs.append(("lm_head.weight", (vocab, h)))
    return specs


def numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def shard_plan(
    specs: list[tuple[str, tuple[int, ...]]], max_bytes: int = SHARD_BYTES, itemsize: int = 2
) -> list[list[tuple[str, tuple[int, ...]]]]:
    """The tensors split in order into shards of at most max_bytes (a bigger tensor gets one of its own)."""
    shards: list[list[tuple[str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = numel(shape) * itemsize
        if shards[-1] and size + nbytes > max_bytes:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def safetensors_header(
    tensors: list[tuple[str, tuple[int, ...]]], dtype: str = "BF16", itemsize: int = 2
) -> bytes:
    """The 8-byte length and the JSON header of a safetensors file of these tensors in this order,
    padded with spaces to a multiple of 8 bytes (the format's alignment)."""
    meta: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape in tensors:
        end = offset + numel(shape) * itemsize
        meta[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, end]}
        offset = end
    text = json.dumps(meta, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def random_tensor(name: str, shape: tuple[int, ...], seed: int):
    """bfloat16 ~ N(0, INIT_STD), norms ones; the same name and seed give the same tensor."""
    import zlib

    import torch

    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=torch.bfloat16)
    g = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return (torch.randn(shape, generator=g, dtype=torch.float32) * INIT_STD).to(torch.bfloat16)


def write_random_weights(
    out_dir: str, cfg: dict, seed: int = 0, max_shard_bytes: int = SHARD_BYTES
) -> list[str]:
    """model-0000i-of-0000n.safetensors + model.safetensors.index.json, one tensor in memory at a time."""
    import torch

    shards = shard_plan(tensor_specs(cfg), max_shard_bytes)
    n = len(shards)
    weight_map, total, files = {}, 0, []
    for i, tensors in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{n:05d}.safetensors"
        path = os.path.join(out_dir, fname)
        with open(path + ".part", "wb") as f:
            f.write(safetensors_header(tensors))
            for name, shape in tensors:
                t = random_tensor(name, shape, seed)
                f.write(t.view(torch.int16).numpy().data)
                weight_map[name] = fname
                total += t.numel() * 2
                del t
        os.replace(path + ".part", path)
        files.append(path)
        print(f"    wrote {fname} ({os.path.getsize(path) / 1e9:.2f} GB)", flush=True)
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    return files


# ----------------------------------------------------------------------------- llama.cpp ---


def llama_cpp_source() -> str:
    """The llama.cpp sources scripts/build_llama_cpp.sh extracted (it links .bench/llama.cpp to them)."""
    link = os.path.join(BENCH_DIR, "llama.cpp")
    if os.path.isfile(os.path.join(link, "convert_hf_to_gguf.py")):
        return os.path.realpath(link)
    found = sorted(glob.glob(os.path.join(BENCH_DIR, "llama-cpp-python-*", "vendor", "llama.cpp")))
    found = [d for d in found if os.path.isfile(os.path.join(d, "convert_hf_to_gguf.py"))]
    if not found:
        raise FileNotFoundError(
            "no llama.cpp sources with convert_hf_to_gguf.py under .bench: run scripts/build_llama_cpp.sh"
        )
    return found[-1]


CONVERTER_SITE = os.path.join(BENCH_DIR, "converter-site")


def converter_site() -> str | None:
    """A folder with sentencepiece for the converter, where this environment lacks it: Llama's
    set_vocab imports it before it looks for a tokenizer.model (and fails without it, even for a
    tokenizer.json vocabulary). Installed there with pip --target once, not into this environment."""
    import importlib.util

    if importlib.util.find_spec("sentencepiece") is not None:
        return None
    if not os.path.isdir(os.path.join(CONVERTER_SITE, "sentencepiece")):
        print(f"    installing sentencepiece for the converter into {CONVERTER_SITE}", flush=True)
        subprocess.run(
            [sys.executable, "-m", "pip", "install", "--quiet", "--target", CONVERTER_SITE]
            + ["sentencepiece>=0.1.98,<0.3.0"],
            check=True,
        )
    return CONVERTER_SITE


def converter_env(src: str, site: str | None = None) -> dict[str, str]:
    """The environment of convert_hf_to_gguf.py: its own gguf-py first on PYTHONPATH (the gguf package
    installed here may be older than the converter; the script puts it first itself unless
    NO_LOCAL_GGUF is set) and `site` (converter_site()) after it, for that subprocess only."""
    env = dict(os.environ)
    env.pop("NO_LOCAL_GGUF", None)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (os.path.join(src, "gguf-py"), site, env.get("PYTHONPATH", "")) if p
    )
    return env


def run_logged(cmd: list[str], log_path: str, env: dict[str, str] | None = None) -> float:
    """Run cmd with its output in log_path; raise with the log's tail when it fails. Returns seconds."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    print(f"    $ {' '.join(cmd)}\n      (log: {os.path.relpath(log_path)})", flush=True)
    t0 = time.monotonic()
    with open(log_path, "w") as log:
        rc = subprocess.run(
            cmd, stdout=log, stderr=subprocess.STDOUT, env=env, check=False
        ).returncode
    if rc != 0:
        with open(log_path, errors="replace") as f:
            last = "".join(f.readlines()[-25:])
        raise RuntimeError(f"{cmd[0]} ... exited {rc}; the last lines of {log_path}:\n{last}")
    return time.monotonic() - t0


# --------------------------------------------------------------------------------- steps ---


def default_tokenizer():
    """The default model's tokenizer, read from its GGUF by transformers."""
    import transformers

    src = os.path.join(ROOT, "src")
    if src not in sys.path:
        sys.path.insert(0, src)
    from relay.execution.model_files import default_model_file

    transformers.logging.set_verbosity_error()
    path = default_model_file()
    return transformers.AutoTokenizer.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path)
    )


def tokenizer_dir(models_dir: str = MODELS_DIR) -> str:
    """The default model's tokenizer files, saved once (the workloads' tokenizer and every HF folder's)."""
    out = os.path.join(models_dir, "smollm2-tokenizer")
    if not os.path.exists(os.path.join(out, "tokenizer.json")):
        os.makedirs(models_dir, exist_ok=True)
        tmp = out + ".part"
        shutil.rmtree(tmp, ignore_errors=True)
        default_tokenizer().save_pretrained(tmp)
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    return out


def make_hf_dir(shape: Shape, out: str, seed: int, models_dir: str = MODELS_DIR) -> None:
    import transformers

    tok_dir = tokenizer_dir(models_dir)
    transformers.logging.set_verbosity_error()
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    tmp = out + ".part"
    shutil.rmtree(tmp, ignore_errors=True)
    os.makedirs(tmp)
    for name in os.listdir(tok_dir):
        shutil.copy(os.path.join(tok_dir, name), tmp)
    cfg = hf_config(shape, len(tok), tok.bos_token_id, tok.eos_token_id)
    with open(os.path.join(tmp, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    write_random_weights(tmp, cfg, seed)
    os.replace(tmp, out)


def make_models(
    specs: list[str],
    llama_build: str,
    models_dir: str = MODELS_DIR,
    keep: bool = False,
    seed: int = 0,
    outtype: str = "bf16",
) -> dict[str, str]:
    """The GGUF file of every 'SHAPE-TYPE' spec, made where missing: {spec: path}."""
    wanted: dict[str, list[str]] = {}
    for spec in specs:
        shape, qtype = parse_model_spec(spec)
        wanted.setdefault(shape, [])
        if qtype not in wanted[shape]:
            wanted[shape].append(qtype)
    paths = {}
    quantize = os.path.join(llama_build, "bin", "llama-quantize")
    logs = os.path.join(BENCH_DIR, "logs")
    for shape, qtypes in wanted.items():
        base = os.path.join(models_dir, base_name(shape))
        hf, full = base + "-hf", f"{base}.{outtype}.gguf"
        missing = [q for q in qtypes if not os.path.exists(gguf_path(shape, q, models_dir))]
        if missing:
            print(f"\n### making {', '.join(f'{base_name(shape)}.{q}.gguf' for q in missing)}")
            if not os.path.exists(full):
                if not os.path.exists(os.path.join(hf, "model.safetensors.index.json")):
                    t0 = time.monotonic()
                    make_hf_dir(SHAPES[shape], hf, seed, models_dir)
                    print(f"    random HF folder {hf}: {time.monotonic() - t0:.0f} s", flush=True)
                src = llama_cpp_source()
                cmd = [
                    sys.executable,
                    os.path.join(src, "convert_hf_to_gguf.py"),
                    hf,
                    "--outtype",
                    outtype,
                    "--outfile",
                    full + ".part",
                ]
                env = converter_env(src, converter_site())
                s = run_logged(cmd, os.path.join(logs, f"convert-{shape}.log"), env)
                os.replace(full + ".part", full)
                print(f"    {full}: {os.path.getsize(full) / 1e9:.2f} GB in {s:.0f} s", flush=True)
            if not os.access(quantize, os.X_OK):
                raise FileNotFoundError(f"{quantize} is missing: run scripts/build_llama_cpp.sh")
            for q in missing:
                out = gguf_path(shape, q, models_dir)
                cmd = [quantize, full, out + ".part", q, str(os.cpu_count() or 1)]
                s = run_logged(cmd, os.path.join(logs, f"quantize-{shape}-{q}.log"))
                os.replace(out + ".part", out)
                print(f"    {out}: {os.path.getsize(out) / 1e9:.2f} GB in {s:.0f} s", flush=True)
        if not keep:
            for path in (hf, full):
                if os.path.isdir(path):
                    shutil.rmtree(path)
                    print(f"    removed {path} (--keep keeps it)")
                elif os.path.exists(path):
                    os.remove(path)
                    print(f"    removed {path} (--keep keeps it)")
        for q in qtypes:
            paths[f"{shape}-{q}"] = gguf_path(shape, q, models_dir)
    return paths
