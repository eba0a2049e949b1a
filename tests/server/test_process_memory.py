"""Only the model runners hold torch. The http, tokenizer, scheduler and detokenizer processes never
import it, at start-up or while serving (each would map libtorch and hold ~200-300 MB more), with
one exception: xgrammar imports torch, so the scheduler imports it with xgrammar on its first
structured-output request (docs/architecture.md, "Processes")."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from relay.execution import model_files
from tests.helpers.server_utils import ROOT, Server

FRONT = ("relay::http", "relay::tokenizer", "relay::sched", "relay::detok")


def run_python(code: str, *args: str) -> str:
    """code's stdout, run by a fresh interpreter (this one has torch imported)."""
    out = subprocess.run(
        [sys.executable, "-c", code, *args],
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.path.join(ROOT, "src")])},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout


def test_front_process_modules_import_no_torch():
    """What each process imports before it runs: no torch, transformers or xgrammar; nor numpy
    in relay::http (its launcher, launch.serve, and its app; the others' transformers imports
    numpy when their tokenizer loads)."""
    code = """
import importlib, json, sys
heavy = ("torch", "transformers", "numpy", "xgrammar")
seen = {}
for name in sys.argv[1:]:
    importlib.import_module(name)
    seen[name] = [m for m in heavy if m in sys.modules]
print(json.dumps(seen))
"""
    modules = [
        "launch.serve",
        "procs.http_server",
        "procs.tokenizer",
        "procs.detokenizer",
        "procs.scheduler",
    ]
    seen = json.loads(run_python(code, *modules))
    for name in modules:
        allowed = set() if name in ("launch.serve", "procs.http_server") else {"numpy"}
        assert set(seen[name]) <= allowed, (name, seen[name])


def test_the_launcher_knows_the_architectures_the_models_implement():
    """The launcher checks a model's architecture from relay.hf_config's list, without importing
    the models (they import torch)."""
    from relay.execution.models import MODELS, model_class
    from relay.hf_config import ARCHITECTURES, check_architecture

    assert sorted(ARCHITECTURES) == sorted(MODELS)
    for check in (check_architecture, model_class):
        with pytest.raises(
            ValueError, match="'GPTNeoXForCausalLM'.*Relay runs DeepseekV2ForCausalLM"
        ):
            check("GPTNeoXForCausalLM")


# ---- the tokenizer ----------------------------------------------------------------------------

TEXTS = [
    "Hello world",
    " leading space, trailing space ",
    "It's 3.14159 and   three spaces\tand a tab\n\nnewlines\r\n",
    "Ünïcödé: naïve café, 你好，世界, Привет, مرحبا, 🙂👍🏽",
    "<|im_start|>user\nspecial tokens written as text<|im_end|><|endoftext|>",
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    '{"json": [1, 2, {"nested": null}], "x": "y"}',
    "",
]
CHATS = [
    [{"role": "user", "content": "Hi"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "Ünïcödé 🙂 and <|im_end|> inside"},
    ],
]

_ENCODE = """
import json, sys
from relay.text.tokenizer import Tokenizer
out = {}
for path in sys.argv[2:]:
    tok = Tokenizer(path, without_torch=True)
    texts, chats = json.loads(sys.argv[1])
    out[path] = {
        "class": type(tok.hf).__name__,
        "vocab_size": tok.vocab_size,
        "eos": tok.eos_token_id,
        "texts": [tok.encode(t) for t in texts] + [tok.encode(t, False) for t in texts],
        "decoded": [tok.decode(tok.encode(t), False) for t in texts],
        "chats": [tok.apply_chat_template(c, add_generation_prompt=g) for c in chats for g in (True, False)],
        "chat_texts": [tok.hf.apply_chat_template(c, tokenize=False) for c in chats],
    }
out["imported"] = [m for m in ("torch", "safetensors") if m in sys.modules]
print(json.dumps(out))
"""


def _tokenizer_dir(src: str, dst, tokenizer_class: str | None, model_type: str, arch: str) -> str:
    """src's tokenizer files beside a config.json of model_type, with tokenizer_config.json's
    tokenizer_class replaced (None: as src has it)."""
    os.makedirs(dst)
    for name in os.listdir(src):
        if name.startswith("tokenizer") or name.endswith(".jinja"):
            shutil.copy(os.path.join(src, name), dst)
    with open(os.path.join(src, "config.json")) as f:
        config = {**json.load(f), "model_type": model_type, "architectures": [arch]}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f)
    if tokenizer_class is not None:
        path = os.path.join(dst, "tokenizer_config.json")
        with open(path) as f:
            tc = json.load(f)
        with open(path, "w") as f:
            json.dump({**tc, "tokenizer_class": tokenizer_class}, f)
    return str(dst)


@pytest.mark.slow
def test_tokenizer_without_torch_tokenizes_as_autotokenizer(
    default_model_dir, tiny_model_dir, tmp_path
):
    """The front processes' tokenizer (Tokenizer(without_torch=True), in a process with no torch)
    is AutoTokenizer's: the same class, ids, decodes and chat templates, for the default model, a
    tiny model, and files whose named class AutoTokenizer overrides (a byte-level vocabulary named
    LlamaTokenizerFast: by that class it would tokenize otherwise; a Qwen2 model naming the generic
    class: AutoTokenizer takes Qwen2's)."""
    from transformers import AutoTokenizer

    from relay.text.tokenizer import Tokenizer

    paths = [
        default_model_dir,
        tiny_model_dir("llama"),
        _tokenizer_dir(
            default_model_dir, tmp_path / "llama", "LlamaTokenizerFast", "llama", "LlamaForCausalLM"
        ),
        _tokenizer_dir(
            default_model_dir,
            tmp_path / "qwen2",
            "PreTrainedTokenizerFast",
            "qwen2",
            "Qwen2ForCausalLM",
        ),
    ]
    got = json.loads(run_python(_ENCODE, json.dumps([TEXTS, CHATS]), *paths))
    assert got.pop("imported") == [], "loading and using the tokenizer imported torch"
    for path in paths:
        hf = AutoTokenizer.from_pretrained(path)
        tok = Tokenizer(path)  # in this process (torch imported): AutoTokenizer itself
        want = {
            "class": type(hf).__name__,
            "vocab_size": len(hf),
            "eos": hf.eos_token_id,
            "texts": [hf.encode(t) for t in TEXTS]
            + [hf.encode(t, add_special_tokens=False) for t in TEXTS],
            "decoded": [hf.decode(hf.encode(t), skip_special_tokens=False) for t in TEXTS],
            "chats": [
                tok.apply_chat_template(c, add_generation_prompt=g)
                for c in CHATS
                for g in (True, False)
            ],
            "chat_texts": [hf.apply_chat_template(c, tokenize=False) for c in CHATS],
        }
        assert got[path] == want, path
    # Loading by the class the file names would not do (why Relay does not):
    llama = paths[2]
    assert type(AutoTokenizer.from_pretrained(llama)).__name__ == "TokenizersBackend"
    from transformers import LlamaTokenizer

    assert LlamaTokenizer.from_pretrained(llama).encode(TEXTS[3]) != got[llama]["texts"][3]


@pytest.mark.slow
def test_scheduler_imports_torch_with_xgrammar_on_its_first_constraint(default_model_dir):
    """The scheduler's start-up (its tokenizer and grammar backend) imports no torch; its first
    constraint imports xgrammar, and with it torch, and compiles, after the tokenizer was loaded
    as without torch."""
    pytest.importorskip("xgrammar")
    code = """
import sys
from relay.config import ModelConfig
from relay.text.grammar import make_backend
from relay.text.tokenizer import Tokenizer, eos_ids
path = sys.argv[1]
mc = ModelConfig.from_dir(path)
backend = make_backend(path, mc.vocab_size, eos_ids(mc, Tokenizer(path, without_torch=True)))
before = [m for m in ("torch", "xgrammar") if m in sys.modules]
backend.check([("regex", "[0-9]+"), ("json_schema", '{"type": "object"}')], 120)
print(before, backend.loaded, backend.stats()["compiles"], "torch" in sys.modules)
"""
    assert run_python(code, default_model_dir).split() == ["[]", "True", "2", "True"]


# ---- the launcher ----------------------------------------------------------------------------


@pytest.mark.slow
def test_the_launcher_converts_a_gguf_file_in_a_child(tmp_path, monkeypatch):
    """A GGUF file's first conversion (it imports torch) runs in a child process; the launcher
    only finds the converted directory. A file that does not convert is one ModelFileError."""
    from launch.model_dir import needs_conversion, resolve_model_dir_apart
    from tests.helpers.gguf_files import write_gguf
    from tests.helpers.gguf_models import random_model

    monkeypatch.setenv("RELAY_CACHE_DIR", str(tmp_path / "cache"))
    path = write_gguf(str(tmp_path / "tiny.gguf"), random_model("llama"))

    def not_here(*args):
        raise AssertionError("converted in the launcher's own process")

    for writer in ("_write_hf_dir", "_write_gguf_dir"):  # in this process only
        monkeypatch.setattr(model_files, writer, not_here)
    assert needs_conversion(path)
    converted = resolve_model_dir_apart(path)
    assert os.path.exists(os.path.join(converted, "config.json")) and not needs_conversion(path)

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(b"GGUF" + bytes(60))
    with pytest.raises(model_files.ModelFileError, match="broken.gguf") as info:
        resolve_model_dir_apart(str(broken))
    assert "\n" not in str(info.value)


# ---- a running server -------------------------------------------------------------------------


def mapped_torch(pid: int) -> list[str]:
    """The torch libraries a process has mapped (libtorch, libc10, torch's _C)."""
    with open(f"/proc/{pid}/maps") as f:
        paths = {line.split()[-1] for line in f if "/" in line}
    return sorted(p for p in paths if "libtorch" in p or "libc10" in p or "/torch/" in p)


def resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return kb / 1024


@pytest.mark.slow
def test_only_the_model_runner_maps_torch_while_serving():
    """After a completion, a chat completion, streamed ones, a tool-call chat, logprobs, /generate
    and /tokenize, the http, tokenizer, scheduler and detokenizer processes have no torch library
    mapped; the model runner does. A structured-output request then brings torch into the
    scheduler (xgrammar's) and nowhere else."""
    server = Server("--load-format", "dummy-null", "--context-length", "4096")
    try:
        chat = [{"role": "user", "content": "What is the weather in Paris?"}]
        tools = [
            {
                "type": "function",
                "function": {
                    "name": "get_weather",
                    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
                },
            }
        ]
        with server.client() as c:
            for path, body in [
                ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 8}),
                ("/v1/completions", {"prompt": "Hi", "max_tokens": 4, "logprobs": 2, "echo": True}),
                ("/v1/chat/completions", {"messages": chat, "max_tokens": 8}),
                ("/v1/chat/completions", {"messages": chat, "max_tokens": 8, "tools": tools}),
                ("/v1/chat/completions", {"messages": chat, "max_tokens": 4, "logprobs": True}),
                ("/generate", {"text": "Hello", "sampling_params": {"max_new_tokens": 4}}),
                ("/tokenize", {"messages": chat}),
            ]:
                r = c.post(path, json=body)
                assert r.status_code == 200, (path, r.text)
            for path, body in [
                ("/v1/completions", {"prompt": "Once", "max_tokens": 8}),
                ("/v1/chat/completions", {"messages": chat, "max_tokens": 8, "tools": tools}),
            ]:
                with c.stream("POST", path, json={**body, "stream": True}) as r:
                    assert r.status_code == 200
                    assert "data: [DONE]" in list(r.iter_lines())
        pids = {title: server.pid_of(title) for title in FRONT[1:]}
        pids["relay::http"] = server.proc.pid
        found = {title: mapped_torch(pid) for title, pid in pids.items()}
        sizes = {title: f"{resident_mb(pid):.0f} MB" for title, pid in pids.items()}
        assert found == {title: [] for title in FRONT}, sizes
        assert mapped_torch(server.pid_of("relay::tp0")), "the runner's torch is what is looked for"

        pytest.importorskip("xgrammar")
        with server.client() as c:  # the null runner ignores the mask: only the compile matters
            c.post(
                "/generate",
                json={"text": "n=", "sampling_params": {"max_new_tokens": 2, "regex": "[0-9]+"}},
            )
        found = {title: bool(mapped_torch(pid)) for title, pid in pids.items()}
        assert found == {title: title == "relay::sched" for title in FRONT}
    finally:
        server.stop()
