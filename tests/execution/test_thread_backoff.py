"""Compute threads that back off on a loaded machine (relay/execution/thread_backoff.py): the policy's
decisions from fed readings, and the readings the runner takes from /proc."""

from __future__ import annotations

import os
import threading

import pytest

from relay.config import EngineConfig
from relay.execution.thread_backoff import (
    ThreadBackoff,
    ThreadPolicy,
    backoff_supported,
    read_idle_jiffies,
)

QUIET, STARVED = 0.02, 0.55  # the step thread's run-queue wait, as a share of its step time


def window(
    policy: ThreadPolicy,
    now: float,
    share: float,
    idle: float | None = None,
    busy: float = 0.25,
    wall: float = 0.3,
) -> int:
    """A verdict on `busy` seconds of steps within `wall`, waiting `share` of them."""
    return policy.verdict(now, busy, share * busy, wall, idle)


def test_a_quiet_machine_keeps_every_thread():
    policy = ThreadPolicy(2)
    assert [window(policy, t, QUIET, idle=0.1) for t in range(100)] == [2] * 100
    assert policy.drops == policy.raises == 0


def test_starved_threads_halve_and_come_back_when_the_cores_have_room():
    policy = ThreadPolicy(8, hold_s=2.0, max_hold_s=64.0)
    assert [window(policy, 0.1 * i, STARVED, idle=0.0) for i in range(5)] == [4, 2, 1, 1, 1]
    lowered = 0.2
    # The load goes: the cores have room beside the steps, but the hold is not over yet...
    assert window(policy, lowered + 1.0, QUIET, idle=7.0) == 1
    # ...then the count doubles, a verdict on each count before the next.
    assert window(policy, lowered + 2.0, QUIET, idle=7.0) == 2
    assert window(policy, lowered + 2.3, QUIET, idle=6.0) == 4
    assert window(policy, lowered + 2.6, QUIET, idle=4.0) == 8
    assert window(policy, lowered + 2.9, QUIET, idle=0.0) == 8
    assert policy.hold == 2.0


def test_idle_cores_while_the_steps_were_rare_are_no_room():
    """Between requests the runner's own cores are idle: that says nothing about room."""
    policy = ThreadPolicy(2, hold_s=2.0, max_hold_s=64.0)
    window(policy, 0.0, STARVED)
    policy.hold = 64.0  # as after failed tries
    assert window(policy, 5.0, QUIET, idle=1.8, busy=0.25, wall=10.0) == 1
    assert (
        window(policy, 6.0, QUIET, idle=1.0, busy=0.25, wall=0.3) == 2
    )  # busy steps beside an idle core


def test_a_try_that_starves_again_doubles_the_hold_and_one_that_holds_resets_it():
    """Other processes use every core, so there is never room: each try comes after the hold,
    which doubles while the tries starve (a try under a load that stays costs a window a minute)."""
    policy = ThreadPolicy(2, hold_s=2.0, max_hold_s=16.0)
    window(policy, 0.0, STARVED)
    now, holds = 0.0, []
    for _ in range(5):
        assert window(policy, now + policy.hold - 0.01, 0.3, idle=0.0) == 1  # not yet
        now += policy.hold
        assert window(policy, now, 0.3, idle=0.0) == 2  # the try
        assert window(policy, now + 0.3, STARVED) == 1
        holds.append(policy.hold)
        now += 0.3
    assert holds == [4.0, 8.0, 16.0, 16.0, 16.0]
    # A neighbour at a low priority leaves no idle time but yields the cores: the try holds.
    now += policy.hold
    assert window(policy, now, 0.3, idle=0.0) == 2
    assert window(policy, now + 0.3, QUIET, idle=0.0) == 2
    assert policy.hold == 2.0 and policy.raises == 6 and policy.drops == 6


def test_one_thread_never_changes():
    policy = ThreadPolicy(1)
    assert [
        window(policy, t, share, idle=1.0) for t in range(10) for share in (QUIET, STARVED)
    ] == [1] * 20


def test_the_flags():
    assert not EngineConfig().disable_thread_backoff
    from launch.flags import engine_config, parse_args

    assert engine_config(parse_args(["--disable-thread-backoff"])).disable_thread_backoff
    assert engine_config(parse_args(["--num-threads", "2"])).num_threads == 2


def test_idle_jiffies(tmp_path):
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  9 9 9 9 9 9 9 9 0 0\ncpu0 1 0 1 10 2 0 0 0 0 0\ncpu1 1 1 1 20 0 0 0 1 0 0\n"
    )
    assert read_idle_jiffies([0], str(stat)) == (12, 14)
    assert read_idle_jiffies([0, 1], str(stat)) == (32, 38)


@pytest.mark.skipif(not backoff_supported(), reason="Linux /proc with per-thread schedstat")
def test_the_runner_side_reads_proc_and_applies_the_count(monkeypatch):
    assert read_idle_jiffies(sorted(os.sched_getaffinity(0)))[1] > 0
    applied = []
    import torch

    monkeypatch.setattr(torch, "set_num_threads", applied.append)
    backoff = ThreadBackoff(
        2, ThreadPolicy(2, window_s=0.01, starved_share=-1.0)
    )  # every verdict: starved
    backoff.after_step(0.02)  # the first step sets the baseline only
    assert backoff.threads == 2 and applied == []
    backoff.after_step(0.005)  # not a window yet
    assert applied == []
    backoff.after_step(0.005)
    assert backoff.threads == 1 and applied == [1] and backoff.policy.last_share is not None
    # Steps moved to another thread: its own schedstat, a new baseline.
    t = threading.Thread(target=backoff.after_step, args=(0.02,))
    t.start()
    t.join()
    assert backoff._tid == t.native_id and applied == [1]


def test_the_runner_backs_off_only_from_its_default_count(tiny_model_dir):
    import torch

    from relay.config import ModelConfig
    from relay.execution.model_runner import ModelRunner
    from relay.execution.placement import available_cores

    path = tiny_model_dir("llama")
    mc = ModelConfig.from_dir(path)
    cores = available_cores()

    def backoff(**flags):
        runner = ModelRunner(
            EngineConfig(dtype="float32", page_size=4, kv_cache_gb=0.01, **flags), path, mc
        )
        return runner.thread_backoff

    try:
        made = backoff()
        assert (made is not None) == (cores > 1 and backoff_supported())
        assert made is None or made.policy.max_threads == cores
        assert backoff(num_threads=cores) is None  # a count given is kept
        assert backoff(disable_thread_backoff=True) is None
    finally:
        torch.set_num_threads(cores)
