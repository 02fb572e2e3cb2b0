"""Save policies (issue 33): ``CheckpointManager(save_policy=...)`` with the policies of
``jaxckpt.policies``; a real 4-process job with skewed clocks saving exactly the same
steps in every process (tests/mp_policy_worker.py)."""

import json
import math
import os

import numpy as np
import pytest
from conftest import run_workers

import jaxckpt
from jaxckpt import policies
from jaxckpt._manager import decisions

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Clock:
    def __init__(self):
        self.t = 1000.0

    def __call__(self):
        return self.t


def run(path, policy, steps, clock, per_step=1.0, **kw):
    saved = []
    with jaxckpt.CheckpointManager(path, save_policy=policy, clock=clock, async_save=False, **kw) as mgr:
        for step in steps:
            clock.t += per_step
            if mgr.save(step, {"x": np.full(4, step)}):
                saved.append(step)
        listed = mgr.all_steps()
    assert listed == saved
    return saved


def test_step_policies_and_any_of(tmp_path):
    clock = Clock()
    assert run(tmp_path / "a", policies.every_steps(4), range(13), clock) == [0, 4, 8, 12]
    assert run(tmp_path / "b", policies.at_steps([2, 5, 11]), range(13), clock) == [2, 5, 11]
    # every 10 s of the clock, counted from the last save of either member
    got = run(tmp_path / "c", policies.any_of(policies.every_seconds(10), policies.at_steps([3])), range(40), clock)
    assert got == [3, 13, 23, 33]
    assert policies.any_of(policies.every_steps(2), policies.at_steps([1])).local
    assert not policies.any_of(policies.every_steps(2), policies.continuous()).local


def test_the_interval_shorthand_and_refusals(tmp_path):
    clock = Clock()
    assert run(tmp_path / "a", None, range(7), clock, save_interval_steps=3) == [0, 3, 6]
    with pytest.raises(jaxckpt.CheckpointError, match=r"^save_policy=every_steps\(n=2\) and save_interval_steps=3 "
                                                      r"both say when to save: give one"):
        jaxckpt.CheckpointManager(tmp_path / "b", save_policy=policies.every_steps(2), save_interval_steps=3)
    with pytest.raises(jaxckpt.CheckpointError, match="^save_policy must be a jaxckpt.policies.SavePolicy, got 5$"):
        jaxckpt.CheckpointManager(tmp_path / "c", save_policy=5)
    for bad, message in ((lambda: policies.every_steps(0), r"every_steps\(n\) must be a positive int, got 0"),
                         (lambda: policies.every_seconds(-1), r"every_seconds\(s\) must be a positive number"),
                         (lambda: policies.at_steps([]), "at_steps needs non-negative int steps"),
                         (lambda: policies.goodput(max_overhead=2), r"goodput\(max_overhead\) must be a share"),
                         (lambda: policies.any_of(3), "any_of needs save policies")):
        with pytest.raises(ValueError, match=message):
            bad()


def test_continuous_saves_again_once_the_last_commits(tmp_path):
    clock = Clock()
    # synchronous saves commit within save(): the next step saves again, at most one per 2.5 s
    assert run(tmp_path / "a", policies.continuous(2.5), range(10), clock) == [0, 3, 6, 9]
    facts = policies.Facts(7, now=10.0, last_save_step=5, last_save_time=9.0, committed=False)
    assert not policies.continuous().should_save(facts)
    assert policies.continuous().should_save(facts._replace(committed=True))


def test_goodput_is_young_daly_from_the_measured_costs_and_learns_the_mtbf():
    g = policies.goodput(mtbf_s=3600.0)
    facts = policies.Facts(0, now=100.0, last_save_step=None, last_save_time=0.0)
    assert g.interval_s(facts) is None and g.should_save(facts)  # nothing measured: at once
    assert not g.should_save(facts._replace(last_save_step=0))  # ... then it waits for a measurement
    facts = facts._replace(last_save_step=0, blocking_s=(2.0, 1.0, 3.0), total_s=(5.0, 5.0, 5.0))
    assert g.interval_s(facts) == pytest.approx(math.sqrt(2 * 2.0 * 3600.0))  # 120 s
    assert not g.should_save(facts._replace(now=119.0)) and g.should_save(facts._replace(now=120.1))
    assert policies.goodput(mtbf_s=3600.0, max_overhead=0.01).interval_s(facts) == pytest.approx(200.0)
    assert g.interval_s(facts._replace(total_s=(500.0,))) == 500.0  # never before the last save can commit
    learned = policies.goodput()
    assert learned.mtbf(facts) == policies.PRIOR_MTBF_S  # no restart yet: the prior
    assert learned.mtbf(facts._replace(run_s=7200.0, restarts=3)) == pytest.approx((7200 + 86400) / 4)


def test_goodput_counts_the_runs_restarts_from_its_history(tmp_path):
    clock = Clock()
    for _ in range(3):  # three runs of the same directory, each a manager started anew
        with jaxckpt.CheckpointManager(tmp_path, save_policy=policies.goodput(), clock=clock,
                                       async_save=False) as mgr:
            mgr.save(mgr.latest_step() + 1 if mgr.latest_step() is not None else 0, {"x": np.zeros(3)})
            facts = mgr._record.facts(0)
            clock.t += 100.0
    assert facts.restarts == 2 and facts.run_s == pytest.approx(200.0)
    assert [r.started for r in jaxckpt.history(tmp_path)] == [1000.0, 1100.0, 1200.0]


def test_a_policy_of_ones_own(tmp_path):
    class Late(policies.SavePolicy):  # every 5 s, and at step 7 whatever the time
        def should_save(self, facts):
            return facts.since_last_s() >= 5 or facts.step == 7

    assert run(tmp_path, Late(), range(12), Clock()) == [4, 7]


def test_a_decision_point_is_one_answer_for_should_save_and_save(tmp_path):
    clock = Clock()
    with jaxckpt.CheckpointManager(tmp_path, save_policy=policies.every_seconds(1.5), clock=clock,
                                   async_save=False) as mgr:
        clock.t += 2
        assert mgr.should_save(0) and mgr.should_save(0)
        clock.t += 10  # asked again for the same step: the same answer, whatever the time
        assert mgr.save(0, {"x": np.zeros(2)})
        assert not mgr.should_save(0)  # saved


def test_every_process_saves_the_same_steps_with_skewed_clocks(tmp_path):
    """Four real processes, each clock at its own rate (1x to 1.75x) and offset (hours
    apart), each process at its own pace; each policy's saves are the same steps in every
    process, and so are its should_save answers; a SIGTERM to process 2 saves once more,
    at the step the job agreed on."""
    specs = {
        "steps": ["every_steps", 7],
        "seconds": ["every_seconds", 0.1],
        "continuous": ["continuous", 0.0],
        "goodput": ["goodput", {"mtbf_s": 1.0}],
        "mixed": ["any_of", ["at_steps", [5, 50]], ["every_seconds", 0.2]],
        "preemption": ["any_of", ["on_preemption"], ["every_steps", 50]],
    }
    args = {"path": str(tmp_path), "policies": specs, "steps": 120, "sigterm": [2, 60], "batch_s": 0.02}
    res = run_workers(os.path.join(ROOT, "tests", "mp_policy_worker.py"), 4,
                      lambda i, port: [port, 4, i, json.dumps(args)], 300)
    for p in range(4):
        assert "crash" not in res[p], res[p]
    for name in specs:
        saved = res[0][name]["saved"]
        for p in range(1, 4):
            assert res[p][name]["saved"] == saved, (name, p, res[p][name]["saved"], saved)
            assert res[p][name]["asked"] == res[0][name]["asked"], name
        assert res[0][name]["steps"] == saved, name
    assert res[0]["steps"]["saved"] == list(range(0, 120, 7))
    for name in ("seconds", "continuous", "goodput"):
        assert len(res[0][name]["saved"]) >= 3, (name, res[0][name]["saved"])
    assert {5, 50} <= set(res[0]["mixed"]["saved"]) and len(res[0]["mixed"]["saved"]) >= 4
    extra = [s for s in res[0]["preemption"]["saved"] if s % 50]
    assert res[0]["preemption"]["saved"][:2] == [0, 50] and len(extra) == 1 and 60 < extra[0] < 120, res[0]


def test_the_notebook_view_shows_the_policy_and_its_next_save(tmp_path):
    clock = Clock()
    cases = [(None, "save_policy=every_steps(n=1); next save: step 2"),
             (policies.any_of(policies.at_steps([10, 20]), policies.on_preemption()),
              "save_policy=any_of(at_steps([10, 20]), on_preemption()); next save: step 10"),
             (policies.every_seconds(60), "save_policy=every_seconds(s=60); next save: in about 59 s")]
    for k, (policy, text) in enumerate(cases):
        with jaxckpt.CheckpointManager(tmp_path / str(k), save_policy=policy, clock=clock, async_save=False) as mgr:
            mgr.save(0, {"x": np.zeros(3)}, force=True)
            clock.t += 1
            mgr.save(1, {"x": np.zeros(3)})
            assert text in mgr._repr_html_(), (text, mgr._repr_html_())


def _job(tmp_path, nproc=2, timeout=200, env=None, **args):
    args = {"path": str(tmp_path), **args}
    return run_workers(os.path.join(ROOT, "tests", "mp_policy_worker.py"), nproc,
                       lambda i, port: [port, nproc, i, json.dumps(args)], timeout, env=env)


def test_a_process_behind_process_0_reads_its_decisions_after_it_closed(tmp_path):
    """A breaker's case: 20 short managers one after the other, no collective in their
    loops, process 1 starting each 0.3 s late: process 0 closed and deleted the decisions
    before process 1 read them, and process 1 waited out its bound (5 s here; 10 min by
    default). Now the last process to close deletes them."""
    res = _job(tmp_path, policies={"s": ["every_seconds", 3600]}, managers=20, steps=40, lag=0.3,
               no_barriers=True, env={"JAXCKPT_STALL_S": "5"})
    for p in (0, 1):
        assert "crash" not in res[p], res[p]
        assert [m["saved"] for m in res[p]["s"]] == [[]] * 20


def test_time_policies_decide_at_steps_with_the_time_they_are_expected_at(tmp_path):
    """A breaker's case: with 10 s steps (the manager's clock), every_seconds(60) saved
    every 240 s with two processes (decided two 8-step points ahead, the planned save
    counted as made at the planning time). Now each step ahead is asked with the time it
    is expected at: a save every 6 steps, as with one process; numpy steps too (they broke
    the publisher's JSON). Steps that jump by 2**30 cost one question each."""
    res = _job(tmp_path, policies={"s": ["every_seconds", 60], "c": ["counted", 3600]},
               steps=60, fake_step_s=10.0, numpy_steps=True)
    for p in (0, 1):
        assert "crash" not in res[p], res[p]
        saved = res[p]["s"]["saved"]
        assert saved == res[0]["s"]["saved"] and len(saved) >= 8, saved
        assert all(b - a == 6 for a, b in zip(saved[2:], saved[3:])), saved
    res = _job(tmp_path / "jump", policies={"c": ["counted", 3600]}, step_list=[i << 30 for i in range(40)])
    assert "crash" not in res[0] and "crash" not in res[1], res
    assert res[0]["c"]["saved"] == res[1]["c"]["saved"] == []
    assert res[0]["c"]["asks"] <= 40 * (decisions.MAX_ASKS + 1), res[0]["c"]["asks"]  # not 2**30 / 8 a call


def test_a_second_breakers_cases_local_saves_a_clock_set_back_a_fast_start_a_dropped_manager(tmp_path):
    """(1) any_of(every_steps(70), every_seconds(1)) with 10 ms steps: process 0 ignored
    the local saves ahead of it and added time-based ones 0.27 s after them; now they
    count: the steps of one process, multiples of 70 only. (2) Process 0's clock set back
    8 s (NTP) at t = 3 s: the rate measured across the jump packed 8 s of steps into one
    batch (an 18 s gap); now the rate is measured anew: the 9 s gap one process has.
    (3) A fast loop's first half second wrote a key every 2 steps; now the rate is
    measured within 256 steps. (4) A manager dropped without close() left its keys."""
    res = _job(tmp_path / "a", policies={"m": ["any_of", ["every_steps", 70], ["every_seconds", 1.0]]},
               steps=700, fake_step_s=0.01, no_barriers=True)
    for p in (0, 1):
        assert res[p]["m"]["saved"] == list(range(0, 700, 70)), res[p]["m"]["saved"]
    res = _job(tmp_path / "b", policies={"s": ["every_seconds", 1.0]}, steps=1500, fake_step_s=0.01,
               clock_jump=[300, 8.0], no_barriers=True)
    saved = res[0]["s"]["saved"]
    assert res[1]["s"]["saved"] == saved
    gaps = [(b - a) * 0.01 for a, b in zip(saved, saved[1:])]
    assert max(gaps) <= 9.2, (max(gaps), saved)
    res = _job(tmp_path / "c", policies={"s": ["every_seconds", 3600]}, steps=20000, no_barriers=True, fast=True)
    assert res[0]["s"]["saved"] == res[1]["s"]["saved"] and res[0]["s"]["batches"] <= 200, res[0]["s"]["batches"]
    res = _job(tmp_path / "d", policies={"s": ["every_seconds", 3600]}, steps=300, unclosed=True)
    assert res[0]["s"]["keys_left"] == res[1]["s"]["keys_left"] == 0, res
