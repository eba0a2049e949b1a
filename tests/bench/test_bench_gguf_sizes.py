"""scripts/bench gguf-sizes: the random models' shapes and files, the process-tree RSS sums over a fake
/proc, the tables. No server, no download, no llama.cpp (a tiny random model at most)."""

from __future__ import annotations

import json
import os

import pytest

from scripts.bench import gguf_models, gguf_sizes, proctree
from scripts.bench.gguf_models import SHAPES

# ------------------------------------------------------------------------- the model shapes --


def _params(cfg: dict) -> int:
    return sum(gguf_models.numel(shape) for _, shape in gguf_models.tensor_specs(cfg))


@pytest.mark.parametrize(
    "shape, real_params, real_vocab, lm_heads",
    [
        # Llama-3.2-1B: 1,235,814,400 parameters with its 128,256-token vocabulary, one (tied) matrix
        ("1b", 1_235_814_400, 128_256, 1),
        # Llama-3.1-8B: 8,030,261,248 with embeddings and LM head untied
        ("8b", 8_030_261_248, 128_256, 2),
    ],
)
def test_shapes_are_the_real_models_with_the_default_vocabulary(
    shape, real_params, real_vocab, lm_heads
):
    cfg = gguf_models.hf_config(SHAPES[shape], 49152, 1, 2)
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    assert cfg["model_type"] == "llama" and cfg["torch_dtype"] == "bfloat16"
    assert cfg["vocab_size"] == 49152 and (cfg["bos_token_id"], cfg["eos_token_id"]) == (1, 2)
    assert cfg["num_attention_heads"] == 32 and cfg["num_key_value_heads"] == 8
    assert cfg["rope_parameters"]["rope_theta"] == 500000.0
    assert cfg["tie_word_embeddings"] is (shape == "1b")
    if shape == "1b":
        assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (
            16,
            2048,
            8192,
        )
        assert cfg["head_dim"] == 64
    else:
        assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["intermediate_size"]) == (
            32,
            4096,
            14336,
        )
        assert cfg["head_dim"] == 128
    # The published parameter count, less the vocabulary rows this tokenizer does not have.
    assert _params(cfg) == real_params - lm_heads * (real_vocab - 49152) * cfg["hidden_size"]
    names = [n for n, _ in gguf_models.tensor_specs(cfg)]
    assert ("lm_head.weight" in names) is (shape == "8b")
    assert len(names) == len(set(names)) == 9 * cfg["num_hidden_layers"] + 1 + lm_heads


def test_model_specs_and_file_names():
    assert gguf_models.parse_model_spec("1B-q4_k_m") == ("1b", "Q4_K_M")
    assert gguf_models.parse_model_spec("8b-Q8_0") == ("8b", "Q8_0")
    for bad in ("3b-Q4_K_M", "1b-Q5_0", "1b"):
        with pytest.raises(ValueError, match="SHAPE-TYPE"):
            gguf_models.parse_model_spec(bad)
    assert gguf_models.gguf_path("8b", "Q8_0", "/m") == "/m/rand-llama-8b.Q8_0.gguf"
    args = gguf_sizes.parse_args(["--models", "1b-q8_0, 8b-Q4_K_M", "--relay-env", "A=1"])
    assert args.model_specs == ["1b-Q8_0", "8b-Q4_K_M"] and args.relay_env_vars == {"A": "1"}
    assert args.levels == [1, 4, 8] and args.llamacpp_parallel == 8 and args.starts == 2


def test_shards_keep_the_order_and_the_size_limit():
    specs = [("a", (10,)), ("b", (30,)), ("c", (100,)), ("d", (5,)), ("e", (20,))]
    shards = gguf_models.shard_plan(specs, max_bytes=80, itemsize=2)
    assert [[n for n, _ in s] for s in shards] == [["a", "b"], ["c"], ["d", "e"]]
    # the 8B's bfloat16 weights: 2 GiB shards, none over but the one-tensor ones
    cfg = gguf_models.hf_config(SHAPES["8b"], 49152, 1, 2)
    shards = gguf_models.shard_plan(gguf_models.tensor_specs(cfg))
    assert len(shards) == 8
    for s in shards:
        assert sum(gguf_models.numel(shape) * 2 for _, shape in s) <= gguf_models.SHARD_BYTES


def test_random_weights_are_readable_safetensors_shards(tmp_path):
    torch = pytest.importorskip("torch")
    from safetensors import safe_open

    shape = gguf_models.Shape("t", "tiny", 2, 64, 128, 4, 2, 16, tied=False)
    cfg = gguf_models.hf_config(shape, 96, 1, 2)
    files = gguf_models.write_random_weights(str(tmp_path), cfg, seed=3, max_shard_bytes=40_000)
    assert len(files) > 1
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    specs = dict(gguf_models.tensor_specs(cfg))
    assert set(index["weight_map"]) == set(specs)
    assert index["metadata"]["total_size"] == sum(gguf_models.numel(s) * 2 for s in specs.values())
    seen = {}
    for path in files:
        with safe_open(path, "pt") as f:
            assert f.metadata() == {"format": "pt"}
            for name in f.keys():
                assert index["weight_map"][name] == os.path.basename(path)
                seen[name] = f.get_tensor(name)
    assert set(seen) == set(specs)
    for name, t in seen.items():
        assert t.dtype == torch.bfloat16 and tuple(t.shape) == specs[name]
        if name.endswith("norm.weight"):
            assert bool((t == 1).all())
    emb = seen["model.embed_tokens.weight"].float()
    assert abs(emb.std().item() - 0.02) < 0.002 and abs(emb.mean().item()) < 0.002
    # the same seed, the same tensor
    again = gguf_models.random_tensor(
        "model.embed_tokens.weight", specs["model.embed_tokens.weight"], 3
    )
    assert torch.equal(again, seen["model.embed_tokens.weight"])


def test_the_converter_gets_its_own_gguf_py_first(monkeypatch):
    monkeypatch.setenv("PYTHONPATH", "/repo:/repo/src")
    monkeypatch.setenv("NO_LOCAL_GGUF", "1")
    env = gguf_models.converter_env("/src/llama.cpp", "/site")
    assert env["PYTHONPATH"].split(os.pathsep) == [
        "/src/llama.cpp/gguf-py",
        "/site",
        "/repo",
        "/repo/src",
    ]
    assert "NO_LOCAL_GGUF" not in env
    assert os.environ["PYTHONPATH"] == "/repo:/repo/src"  # this process's own is left alone


# --------------------------------------------------------------------------- process trees --

# A fake /proc: pid -> (parent, title, VmRSS kB, VmHWM kB); 40 is no child of the server (10).
FAKE = {
    10: (1, "relay::http", 100_000, 150_000),
    11: (10, "relay::sched", 50_000, 60_000),
    12: (10, "relay::tp0", 2_000_000, 5_000_000),
    13: (12, "gcc", 30_000, 30_000),
    14: (12, "gcc", 20_000, 25_000),
    40: (1, "other", 9_000_000, 9_000_000),
}


def _readers(procs):
    def children_of(pid):
        return [p for p, (parent, *_) in procs.items() if parent == pid]

    def status_of(pid):
        if pid not in procs:
            return None
        _, _, rss, hwm = procs[pid]
        return {"VmRSS": f"{rss} kB", "VmHWM": f"{hwm} kB"}

    def title_of(pid):
        return procs[pid][1] if pid in procs else "?"

    return children_of, status_of, title_of


def test_tree_rss_sums_the_server_and_its_descendants_only():
    children_of, status_of, title_of = _readers(FAKE)
    assert proctree.tree_pids(10, children_of) == [10, 11, 12, 13, 14]
    st = proctree.TreeState()
    total = st.update(10, children_of, status_of, title_of, now=1.0)
    assert total == (100_000 + 50_000 + 2_000_000 + 30_000 + 20_000) * 1024
    assert st.by_title()["gcc"] == 50_000 * 1024  # two processes of one title add up
    assert list(st.by_title())[0] == "relay::tp0"  # biggest first
    assert st.by_title(key="hwm")["relay::tp0"] == 5_000_000 * 1024

    # the compilers exit and the worker grows: the peak stays the first sample's sum, the state the
    # second's, and the processes gone are not in the steady state
    later = {p: v for p, v in FAKE.items() if p not in (13, 14)}
    later[12] = (10, "relay::tp0", 2_010_000, 5_000_000)
    children_of, status_of, title_of = _readers(later)
    second = st.update(10, children_of, status_of, title_of, now=2.0)
    assert second == (100_000 + 50_000 + 2_010_000) * 1024 < total
    assert (st.peak_rss, st.peak_at, st.samples, st.last_at) == (total, 1.0, 2, 2.0)
    assert set(st.by_title(since=st.last_at)) == {"relay::http", "relay::sched", "relay::tp0"}
    assert st.by_title(key="peak_rss")["relay::tp0"] == 2_010_000 * 1024
    assert [r.pid for r in st.alive_at(2.0)] == [10, 11, 12]
    # PSS of the live ones only (an unreadable one left out)
    pss = {10: 70_000, 11: None, 12: 1_900_000, 13: 5}
    assert st.pss_by_title(pss.get) == {"relay::tp0": 1_900_000, "relay::http": 70_000}


def test_a_process_gone_between_listing_and_reading_counts_nothing():
    children_of, status_of, title_of = _readers(FAKE)
    st = proctree.TreeState()
    total = st.update(10, children_of, lambda p: None if p == 12 else status_of(p), title_of)
    assert total == (100_000 + 50_000 + 30_000 + 20_000) * 1024
    assert 12 not in st.procs


def _write(path, text):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_proc_readers_on_a_fake_proc(tmp_path):
    proc = tmp_path
    _write(
        proc / "10" / "status",
        "Name:\tpython\nState:\tS (sleeping)\nVmHWM:\t  300 kB\nVmRSS:\t  200 kB\n",
    )
    _write(proc / "10" / "cmdline", "relay::http\0\0\0")
    _write(proc / "10" / "io", "rchar: 5\nwchar: 7\nwrite_bytes: 4096\ncancelled_write_bytes: 0\n")
    _write(proc / "10" / "task" / "10" / "children", "11 ")
    _write(proc / "10" / "task" / "15" / "children", "12")
    _write(proc / "11" / "status", "Name:\tz\nState:\tZ (zombie)\n")
    _write(proc / "12" / "status", "Name:\tllama-server\nState:\tR\nVmRSS:\t 1000 kB\n")
    _write(proc / "12" / "cmdline", "/b/bin/llama-server\0-m\0x.gguf\0")
    _write(proc / "12" / "smaps_rollup", "00400000-7fff [rollup]\nRss:\t 1000 kB\nPss:\t  600 kB\n")
    assert sorted(proctree.proc_children(10, str(proc))) == [11, 12]
    assert proctree.proc_status(11, str(proc)) is None  # a zombie holds no memory
    assert proctree.kb(proctree.proc_status(10, str(proc)), "VmHWM") == 300 * 1024
    assert proctree.proc_title(10, str(proc)) == "relay::http"
    assert proctree.proc_title(12, str(proc)) == "llama-server"
    assert proctree.proc_write_bytes(10, str(proc)) == 4096
    assert proctree.proc_write_bytes(12, str(proc)) is None  # not readable: unknown, not 0
    assert (
        proctree.proc_pss(12, str(proc)) == 600 * 1024 and proctree.proc_pss(10, str(proc)) is None
    )
    st = proctree.TreeState()
    st.update(
        10,
        lambda p: proctree.proc_children(p, str(proc)),
        lambda p: proctree.proc_status(p, str(proc)),
        lambda p: proctree.proc_title(p, str(proc)),
        lambda p: proctree.proc_write_bytes(p, str(proc)),
    )
    assert st.last_rss == 1200 * 1024 and st.procs[10].write_bytes == 4096


def test_children_from_parents_where_the_kernel_has_no_children_files(tmp_path):
    for pid, ppid in ((10, 1), (11, 10), (12, 11), (13, 10)):
        _write(tmp_path / str(pid) / "stat", f"{pid} (a b) S {ppid} 1 1 0")
        (tmp_path / str(pid) / "task" / str(pid)).mkdir(parents=True)
    assert sorted(proctree.proc_children(10, str(tmp_path))) == [11, 13]


@pytest.mark.parametrize(
    "argv, title",
    [
        (["relay::sched dp1"], "relay::sched dp1"),
        (
            ["/usr/bin/python3.11", "-m", "launch.serve", "--port", "1"],
            "python3.11 -m launch.serve",
        ),
        (["python", "/x/convert_hf_to_gguf.py", "dir"], "python convert_hf_to_gguf.py"),
        (["/b/llama-server", "-m", "f.gguf"], "llama-server"),
        ([], "?"),
    ],
)
def test_process_titles(argv, title):
    assert proctree.process_title(argv) == title
    assert proctree.process_title([], "kworker") == "kworker"


# ------------------------------------------------------------------------------- the tables --


def test_tables_and_flags():
    simd = {f: True for f in gguf_sizes.STATED_FLAGS} | {"amx_tile": False, "avx_vnni": False}
    assert gguf_sizes.flags_line(simd) == "avx2=yes avx512=yes vnni=yes bf16=yes amx=no"
    assert gguf_sizes.flags_line({"avx2": True}) == "avx2=yes avx512=no vnni=no bf16=no amx=no"
    server = gguf_sizes.flatten(
        {
            "kind": "server",
            "engine": "relay",
            "model_spec": "1b-Q4_K_M",
            "file_bytes": 0.8e9,
            "disk_bytes_end": 4.3e9,
            "kernel_build_s": 33.8,
            "starts": [
                {"ready_s": 120.0, "peak_rss": 9e9, "disk_bytes": 4.3e9, "cpu_isa": "avx512bf16"},
                {
                    "ready_s": 20.0,
                    "peak_rss": 5e9,
                    "rss_end": 4.5e9,
                    "rss_end_by_proc": {"relay::tp0": 4.4e9, "relay::http": 0.1e9, "x": 1e6},
                    "pss_end_by_proc": {"relay::tp0": 4.0e9, "relay::http": 0.05e9},
                    "cpu_isa": "avx512bf16",
                },
            ],
        }
    )
    failed = {"kind": "server", "engine": "llamacpp", "model_spec": "8b-Q8_0", "error": "boom"}
    run = {"engine": "relay", "model_spec": "1b-Q4_K_M", "max_concurrency": 4, "completed": 16}
    run |= {"output_throughput": 12.34, "median_ttft_ms": 812.4, "median_itl_ms": 80.0}
    lines = gguf_sizes.tables([server, failed, run]).split("\n")
    assert lines[2] == (
        "| 1b-Q4_K_M | relay | 0.80 | 33.8 | 120.0 | 20.0 | 9.00 | 5.00 | 4.50 | 4.05 | "
        "relay::tp0 4.40, relay::http 0.10 | 4.30 | avx512bf16 |"
    )
    assert lines[3].startswith("| 8b-Q8_0 | llamacpp | – |") and lines[3].endswith("| n/a |")
    assert "llamacpp on 8b-Q8_0 failed: boom" in lines
    assert lines[-1] == "| 1b-Q4_K_M | relay | 4 | 16 | 12.3 | 812 | 80.0 | – |"


def test_llama_server_system_info_line():
    log = "build: 1\nsystem_info: n_threads = 2 | CPU : AVX512 = 1 | AVX512_BF16 = 1 |\nmain: ok\n"
    assert (
        gguf_sizes.llama_system_info(log) == "n_threads = 2 | CPU : AVX512 = 1 | AVX512_BF16 = 1 |"
    )
    assert gguf_sizes.llama_system_info("nothing") is None
