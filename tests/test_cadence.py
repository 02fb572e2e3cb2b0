"""Cadence advice (jaxckpt/_cadence.py): the Young–Daly interval against hand-computed values."""

import json
import math

import pytest

import jaxckpt
from jaxckpt._manager.cadence import CadenceAdvice, SaveSample, advise, lost_fraction


def saves(n, *, every_steps=100, every_s=20.0, blocking=2.0, total=8.0, t0=1000.0):
    return [SaveSample(i * every_steps, t0 + i * every_s, blocking, total) for i in range(n)]


def test_closed_form():
    # C = 2 s, R = 8 s, M = 10,000 s: τ* = sqrt(2·2·10⁴) = 200 s; 100 steps per 20 s = 5 steps/s
    advice = advise(saves(10), mtbf_s=10_000)
    assert advice == CadenceAdvice(
        interval_s=200.0, interval_steps=1000, current_interval_s=20.0, current_interval_steps=100,
        lost_fraction_now=2 / 20 + (20 / 2 + 8) / 10_000,  # 0.1018
        lost_fraction_advised=2 / 200 + (200 / 2 + 8) / 10_000,  # 0.0208
        save_cost_s=2.0, mtbf_s=10_000.0, samples=10)
    assert advice.lost_fraction_now == pytest.approx(0.1018)
    assert advice.lost_fraction_advised == pytest.approx(0.0208)
    assert lost_fraction(100.0, 2.0, 10.0, 3600.0) == pytest.approx(0.02 + 60 / 3600)


def test_young_daly_is_the_minimum_of_the_model():
    c, r, m = 3.0, 12.0, 7200.0
    best = math.sqrt(2 * c * m)
    for tau in (best * 0.5, best * 0.9, best * 1.1, best * 2):
        assert lost_fraction(tau, c, r, m) > lost_fraction(best, c, r, m)


def test_interval_is_rounded_to_whole_steps():
    # C = 0.5, M = 1000: τ* = sqrt(1000) = 31.62 s → 158.1 steps at 5 steps/s → 158 steps = 31.6 s
    advice = advise(saves(4, blocking=0.5, total=1.0), mtbf_s=1000)
    assert advice.interval_steps == 158
    assert advice.interval_s == pytest.approx(31.6)
    assert advice.lost_fraction_advised == pytest.approx(0.5 / 31.6 + (31.6 / 2 + 1.0) / 1000)


def test_medians_over_the_last_ten_saves_by_step():
    # two old, slow saves fall out of the window; input order does not matter
    blocking = [100.0, 100.0, *range(1, 11)]
    total = [500.0, 500.0, *range(11, 21)]
    data = [SaveSample(i * 10, 1000.0 + i * 4.0, float(b), float(t)) for i, (b, t) in enumerate(zip(blocking, total))]
    advice = advise(list(reversed(data)), mtbf_s=4000)
    assert advice.samples == 10
    assert advice.save_cost_s == 5.5  # median of 1..10
    # R = median(11..20) = 15.5; τ* = sqrt(2·5.5·4000) = 209.76 s at 2.5 steps/s → 524 steps
    assert advice.interval_steps == round(math.sqrt(2 * 5.5 * 4000) * 2.5) == 524
    assert advice.lost_fraction_now == pytest.approx(5.5 / 4 + (2 + 15.5) / 4000)
    assert advice.samples == advise(data, mtbf_s=4000, window=3).samples + 7


def test_a_restart_gap_does_not_skew_the_rate():
    data = saves(5)  # 5 steps/s
    data[3:] = [s._replace(commit_time=s.commit_time + 3600) for s in data[3:]]  # an hour down
    advice = advise(data, mtbf_s=10_000)
    assert advice.current_interval_s == 20.0 and advice.interval_steps == 1000


def test_zero_cost_saves_every_step():
    advice = advise(saves(3, blocking=0.0, total=0.0), mtbf_s=3600)
    assert advice.interval_steps == 1 and advice.interval_s == pytest.approx(0.2)
    assert advice.save_cost_s == 0.0
    assert advice.lost_fraction_now == pytest.approx(10 / 3600)
    assert advice.lost_fraction_advised == pytest.approx(0.1 / 3600)


def test_too_few_saves_and_bad_arguments():
    with pytest.raises(jaxckpt.CheckpointError, match="needs at least 2 committed saves with timings, got 0"):
        advise([], mtbf_s=3600)
    with pytest.raises(jaxckpt.CheckpointError, match="got 1"):
        advise(saves(1), mtbf_s=3600)
    with pytest.raises(jaxckpt.CheckpointError, match="commit time and step both advance"):
        advise(saves(3, every_s=0.0), mtbf_s=3600)
    for bad in (0, -1.0, math.inf, math.nan, True, "1h"):
        with pytest.raises(ValueError, match="mtbf_s must be a positive number of seconds"):
            advise(saves(3), mtbf_s=bad)
    with pytest.raises(ValueError, match="window must be an int >= 2"):
        advise(saves(3), mtbf_s=3600, window=1)


def test_manager_advises_from_its_history(tmp_path):
    # a run recorded by an earlier writer: 12 logged saves, none of them still committed
    lines = [{"step": s, "commit_time": 1000.0 + s / 5, "blocking_seconds": 2.0 if s else 50.0,
              "total_seconds": 8.0, "metrics": {"loss": 1.0}} for s in range(0, 1200, 100)]
    (tmp_path / "history.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    mgr = jaxckpt.CheckpointManager(tmp_path, read_only=True)
    assert "mgr.advise_interval(mtbf_s=...)" in mgr._repr_html_()
    advice = mgr.advise_interval(mtbf_s=10_000)
    assert advice == advise(saves(10, t0=1040.0), mtbf_s=10_000)
    assert "save every 1000 steps" in mgr._repr_html_()
    with pytest.raises(jaxckpt.CheckpointError, match=r"got 0 \(in '.*'\)"):
        jaxckpt.CheckpointManager(tmp_path / "empty", read_only=True).advise_interval(mtbf_s=60)
