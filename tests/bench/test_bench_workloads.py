"""scripts/bench (`python -m scripts.bench`): the copy workload, the metrics, compare's use of them, the one
result format and table writer: no server, no model (a stand-in tokenizer, so that the tests run in well
under a second)."""

from __future__ import annotations

import json
import os
import re
from types import SimpleNamespace

import pytest

from scripts.bench import client, compare, metrics, results, servers, serving, table, workloads
from scripts.bench.__main__ import main as bench_main


class FakeTokenizer:
    """Words and punctuation marks are tokens; an optional ChatML-like template."""

    def __init__(self, chat: bool = True):
        self.chat_template = "chatml" if chat else None

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [len(t) for t in re.findall(r"\w+|[^\w\s]", text)]

    def apply_chat_template(
        self, messages, tokenize: bool = False, add_generation_prompt: bool = False
    ) -> str:
        assert not tokenize and add_generation_prompt
        turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
        return turns + "<|im_start|>assistant\n"


def _copy_rows(
    tokenizer=None, n: int = 7, passage_len: int = 200, output_len: int = 256, seed: int = 3
):
    return workloads.build_copy_dataset(
        tokenizer or FakeTokenizer(), n, passage_len, output_len, seed
    )


def test_copy_dataset_is_deterministic_per_seed():
    a, b = _copy_rows(), _copy_rows()
    assert [(r.prompt, r.prompt_len, r.output_len, r.passage) for r in a] == [
        (r.prompt, r.prompt_len, r.output_len, r.passage) for r in b
    ]
    assert [r.prompt for r in _copy_rows(seed=4)] != [r.prompt for r in a]


@pytest.mark.parametrize("n", [1, 5, 12])
def test_copy_dataset_rows_hold_their_passage(n):
    tok = FakeTokenizer()
    rows = _copy_rows(tok, n=n, output_len=99)
    assert len(rows) == n
    for r in rows:
        assert r.passage and r.passage in r.prompt
        assert r.prompt.startswith("<|im_start|>user\n") and r.prompt.endswith(
            "<|im_start|>assistant\n"
        )
        assert r.output_len == 99
        assert r.prompt_len == len(tok.encode(r.prompt))


def test_copy_dataset_mixes_kinds_of_about_the_requested_length():
    tok = FakeTokenizer()
    rows = _copy_rows(tok, n=6, passage_len=150)
    json_rows = [r for r in rows if r.passage.startswith("{")]
    code_rows = [r for r in rows if r.passage.startswith("class ")]
    list_rows = [r for r in rows if r.passage.startswith("1. ")]
    assert len(json_rows) == len(code_rows) == len(list_rows) == 2
    for r in json_rows:
        assert json.loads(r.passage)["items"]  # a valid JSON document
    for r in list_rows:  # the instruction names the list's last number
        assert f"from 1 to {r.passage.count(chr(10)) + 1}." in r.prompt
    for r in rows:
        assert 0.75 * 150 <= len(tok.encode(r.passage)) <= 1.25 * 150


def test_copy_prompt_without_a_chat_template_is_the_bare_message():
    rows = _copy_rows(FakeTokenizer(chat=False), n=2)
    for r in rows:
        assert r.prompt.startswith("Repeat the following ") and r.prompt.endswith(r.passage)


def test_copy_is_a_dataset_of_the_cli():
    args = serving.parse_args(
        [
            "--dataset-name",
            "copy",
            "--num-prompts",
            "4",
            "--copy-passage-len",
            "60",
            "--copy-output-len",
            "70",
            "--seed",
            "3",
        ]
    )
    assert not args.ignore_eos  # copies end at EOS by default
    rows = workloads.build_dataset(args, FakeTokenizer())
    assert [r.prompt for r in rows] == [
        r.prompt for r in _copy_rows(n=4, passage_len=60, output_len=70)
    ]
    assert all(r.output_len == 70 for r in rows)


def test_copied_share():
    tok = FakeTokenizer()
    rows = _copy_rows(tok, n=2)
    copied = [SimpleNamespace(success=True, generated_text=r.passage) for r in rows]
    assert metrics.copied_share(tok, rows, copied) == 1.0
    novel = [SimpleNamespace(success=True, generated_text="zebra " * 40) for _ in rows]
    assert metrics.copied_share(tok, rows, novel) == 0.0
    failed = [SimpleNamespace(success=False, generated_text="") for _ in rows]
    assert metrics.copied_share(tok, rows, failed) is None


def test_compare_runs_copy_at_the_concurrency_levels():
    wl = compare.workloads(False, [1, 8])["copy"]
    assert wl.levels == [1, 8] and "--ignore-eos" not in wl.bench_args
    args = serving.parse_args(
        ["--base-url", "http://x", *wl.bench_args, *compare.prompts_for(wl, 8, False)]
    )
    assert (args.dataset_name, args.num_prompts, args.copy_passage_len, args.copy_output_len) == (
        "copy",
        32,
        200,
        256,
    )


def test_compare_relay_variants():
    assert compare.parse_relay_variants("") == [("", [])]
    assert compare.parse_relay_variants("base=; ngram=--speculative-algorithm ngram;") == [
        ("base", []),
        ("ngram", ["--speculative-algorithm", "ngram"]),
    ]
    for bad in ("base", "=--flag", "a=;a=--flag", "a b=--flag"):
        with pytest.raises(ValueError):
            compare.parse_relay_variants(bad)


def test_spec_delta_reports_the_runs_own_acceptance():
    before = {"spec_verify_rows": 10, "spec_proposed_tokens": 40, "spec_accepted_tokens": 30}
    after = {"spec_verify_rows": 30, "spec_proposed_tokens": 120, "spec_accepted_tokens": 70}
    d = metrics.spec_delta(before, after)
    assert d["spec_verify_rows"] == 20
    assert d["spec_acceptance_rate"] == pytest.approx(40 / 80)
    assert d["spec_accept_length"] == pytest.approx((40 + 20) / 20)


def test_goodput_counts_requests_that_meet_every_slo():
    slo = metrics.parse_goodput("ttft:2000 itl:30")
    assert slo == {"ttft": 2.0, "itl": 0.03}
    fast = client.RequestOutput(success=True, ttft=1.0, itl=[0.02] * 99)
    one_stall = client.RequestOutput(
        success=True, ttft=1.0, itl=[0.02] * 99 + [0.5]
    )  # p99 of 100 gaps ~ 0.02
    stalled = client.RequestOutput(success=True, ttft=1.0, itl=[0.02] * 90 + [0.5] * 10)
    late = client.RequestOutput(success=True, ttft=2.5, itl=[0.02])
    failed = client.RequestOutput(success=False)
    assert [metrics.meets_slo(o, slo) for o in (fast, one_stall, stalled, late, failed)] == [
        True,
        True,
        False,
        False,
        False,
    ]
    with pytest.raises(Exception, match="ttft:MS"):
        metrics.parse_goodput("tpot:5")


def test_per_request_timelines_are_relative_to_the_run():
    rows = _copy_rows(n=2)
    outs = [
        client.RequestOutput(
            success=True, start=100.5, ttft=0.25, latency=2.0, output_len=3, itl=[0.5, 0.25]
        ),
        client.RequestOutput(success=False, start=101.0),
    ]
    first, second = metrics.per_request(rows, outs, t0=100.0)
    assert first == {
        "sent": 0.5,
        "ttft": 0.25,
        "latency": 2.0,
        "prompt_len": rows[0].prompt_len,
        "output_len": 3,
        "ok": True,
        "itl": [0.5, 0.25],
    }
    assert second["sent"] == 1.0 and not second["ok"]
    assert (
        serving.parse_args(["--per-request"]).per_request and not serving.parse_args([]).per_request
    )


def test_compare_removes_only_the_shared_memory_a_stopped_server_left_unheld(tmp_path):
    (tmp_path / "before").write_bytes(b"x")
    before = servers.shm_entries(str(tmp_path))
    (tmp_path / "left").write_bytes(b"x")
    (tmp_path / "held").write_bytes(b"x")
    with open(tmp_path / "held", "rb"):  # a process still has it open
        assert servers.remove_orphaned_shm(before, str(tmp_path)) == ["left"]
    assert sorted(os.listdir(tmp_path)) == ["before", "held"]


def test_result_records_carry_the_machine_and_round_trip(tmp_path):
    path = str(tmp_path / "r.jsonl")
    out = results.ResultFile(path, "serving", label="x")
    first = out.add({"output_throughput": 12.5, "request_rate": float("inf")})
    out.add({"output_throughput": 13.0})
    loaded = results.load([path])
    assert loaded == out.records and loaded[0] == first
    assert first["bench"] == "serving" and first["label"] == "x" and first["request_rate"] == "inf"
    assert {"timestamp", "git", "cpu", "cpus", "cpu_flags", "load_avg"} <= set(first)
    assert results.ResultFile(None, "serving").add({"a": 1})["a"] == 1  # no file: nothing written


def test_older_compare_results_files_still_load(tmp_path):
    path = tmp_path / "old.json"
    path.write_text(
        json.dumps(
            {
                "meta": {
                    "date": "2026-11-30T10:00:00",
                    "cpus": 2,
                    "load_avg_start": [1.5, 1, 1],
                    "git": "abc",
                },
                "runs": [{"engine": "relay", "config": "radix", "workload": "random"}],
            }
        )
    )
    (run,) = results.load([str(path)])
    assert (run["engine"], run["timestamp"], run["cpus"], run["load_avg"]) == (
        "relay",
        "2026-11-30T10:00:00",
        2,
        1.5,
    )
    assert compare.provenance([run])["date"].startswith("2026-11-30")


def test_markdown_table_formats_each_column():
    rows = [
        {"name": "a", "tok_s": 1234.5678, "ttft": 12.6, "n": 3},
        {"name": "b", "tok_s": None, "ttft": 1.0, "n": 4},
    ]
    text = table.markdown(
        rows,
        [
            ("name", "name"),
            ("tok/s", "tok_s"),
            ("TTFT", "ttft", 0),
            ("twice", lambda r: r["n"] * 2),
        ],
    )
    assert text.split("\n") == [
        "| name | tok/s | TTFT | twice |",
        "|---|---|---|---|",
        "| a | 1,234.6 | 13 | 6 |",
        "| b | – | 1 | 8 |",
    ]


def test_compare_table_keeps_a_failed_run_as_a_row():
    ok = {
        "engine": "relay",
        "config": "radix",
        "workload": "random",
        "max_concurrency": 8,
        "completed": 32,
        "failed": 0,
        "output_throughput": 140.0,
        "median_ttft_ms": 210.4,
        "p99_ttft_ms": 900.0,
        "median_itl_ms": 30.0,
        "p99_itl_ms": 60.0,
        "cache_hit_rate": 0.5,
    }
    bad = {
        "engine": "vllm",
        "config": "bfloat16",
        "workload": "random",
        "max_concurrency": 8,
        "error": "boom",
    }
    lines = compare.markdown_table([ok, bad]).split("\n")
    assert (
        lines[2] == "| relay | radix | random | 8 | 32 | 140.0 | 210 | 900 | 30.0 | 60.0 | 50.0% |"
    )
    assert lines[3].startswith("| vllm | bfloat16 | random | 8 | failed: boom |")


def test_every_subcommand_parses_its_help(capsys):
    from scripts.bench.__main__ import SUBCOMMANDS

    for name in SUBCOMMANDS:
        with pytest.raises(SystemExit) as e:
            bench_main([name, "--help"])
        assert e.value.code == 0, name
        assert "usage:" in capsys.readouterr().out
    assert bench_main(["no-such-subcommand"]) == 2
