"""Retention as a pure function, against hand-computed expectations."""

import datetime

import pytest

from jaxckpt._manager.retention import RetentionPolicy, StepInfo, best_steps, steps_to_delete


def steps(n, dt=10.0, metrics=None):
    return [StepInfo(s, 1000.0 + dt * s, {"loss": metrics[s]} if metrics else None) for s in range(n)]


def policy(**kw):
    return RetentionPolicy.make(**kw)


def test_no_limit_keeps_everything():
    assert steps_to_delete(steps(10), policy()) == []
    assert steps_to_delete(steps(10), policy(keep_period=3, keep_time_interval=50)) == []


def test_max_to_keep():
    assert steps_to_delete(steps(6), policy(max_to_keep=2)) == [0, 1, 2, 3]
    assert steps_to_delete(steps(2), policy(max_to_keep=5)) == []


def test_keep_period_protects_multiples():
    assert steps_to_delete(steps(10), policy(max_to_keep=2, keep_period=4)) == [1, 2, 3, 5, 6, 7]


def test_keep_time_interval_keeps_one_per_interval():
    # commit times 1000, 1010, ..., 1090; interval 25 s keeps 0 (1000), 3 (1030), 6 (1060), 9 (1090)
    assert steps_to_delete(steps(10), policy(max_to_keep=1, keep_time_interval=25)) == [1, 2, 4, 5, 7, 8]
    assert steps_to_delete(steps(10), policy(max_to_keep=1, keep_time_interval=datetime.timedelta(seconds=25))) == [
        1, 2, 4, 5, 7, 8]


def test_keep_best_and_latest_always_kept():
    loss = [5.0, 1.0, 3.0, 0.5, 4.0, 9.0]
    # best 2 by min loss: steps 3 and 1; the latest (5) is kept although it is the worst
    assert steps_to_delete(steps(6, metrics=loss), policy(best_metric="loss", keep_best=2)) == [0, 2, 4]
    # max mode: best 2 are 5 (9.0) and 0 (5.0)
    assert steps_to_delete(steps(6, metrics=loss), policy(best_metric="loss", best_mode="max", keep_best=2)) == [
        1, 2, 3, 4]


def test_combined_policies_union_of_keeps():
    loss = [5.0, 1.0, 3.0, 0.5, 4.0, 9.0, 7.0, 8.0]
    p = policy(max_to_keep=2, keep_best=1, best_metric="loss", keep_period=5)
    # latest 2: 6, 7; best 1: 3; period 5: 0, 5
    assert steps_to_delete(steps(8, metrics=loss), p) == [1, 2, 4]


def test_steps_without_the_metric_are_never_best():
    infos = [StepInfo(0, 0.0, None), StepInfo(1, 1.0, {"loss": 2.0}), StepInfo(2, 2.0, {"acc": 1.0}),
             StepInfo(3, 3.0, {"loss": float("nan")}), StepInfo(4, 4.0, None)]
    assert best_steps(infos, "loss", "min") == [1]
    assert steps_to_delete(infos, policy(best_metric="loss", keep_best=1)) == [0, 2, 3]


def test_ties_prefer_the_later_step():
    infos = [StepInfo(s, float(s), {"loss": 1.0}) for s in range(3)]
    assert best_steps(infos, "loss", "min") == [2, 1, 0]


@pytest.mark.parametrize("kw,msg", [
    ({"max_to_keep": 0}, "max_to_keep must be a positive int"),
    ({"keep_best": 2}, "keep_best needs best_metric"),
    ({"best_mode": "median"}, "best_mode must be 'min' or 'max'"),
    ({"keep_time_interval": -1}, "keep_time_interval must be positive"),
])
def test_bad_policies(kw, msg):
    with pytest.raises(ValueError, match=msg):
        RetentionPolicy.make(**kw)
