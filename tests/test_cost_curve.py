"""The device cost curve: gate and arms derived from measured step costs, measured once and cached."""

import json
from pathlib import Path

import pytest
from conftest import tiny_model

from tlt.models.eagle import EagleDrafter
from tlt.rollout import cost_curve
from tlt.rollout.cost_curve import CostCurve, curve_for, measure
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.graph_runner import GraphRunner
from tlt.speculative.strategy import SpecStrategy

ARMS = [SpecStrategy.chain(3), SpecStrategy(3, 2, rule="q")]


def synthetic(ratios: dict[str, list[float]], batches=(1, 2, 4, 8, 16)) -> CostCurve:
    plain = {b: 0.01 * (1 + b / 16) for b in batches}
    steps = {arm: {b: r * plain[b] for b, r in zip(batches, values)} for arm, values in ratios.items()}
    return CostCurve("test", plain, steps)


def test_gate_is_the_last_batch_before_no_arm_pays():
    curve = synthetic({"a": [1.2, 1.5, 2.5, 3.0, 4.0], "b": [1.1, 1.4, 1.9, 2.6, 5.0]})
    assert curve.gate(2.0) == 4      # at 8 both cost >= 2 plain steps
    assert curve.gate(3.0) == 8      # a looser expectation reaches further
    assert curve.gate(1.0) == 0      # nothing pays: never speculate


def test_gate_stops_at_the_first_batch_where_nothing_pays():
    """A noisy cheap measurement past a failing batch does not reopen the gate."""
    curve = synthetic({"a": [1.2, 2.5, 1.5, 3.0, 4.0]})
    assert curve.gate(2.0) == 1


def test_arms_too_expensive_at_batch_one_are_dropped():
    curve = synthetic({"cheap": [1.2] * 5, "dear": [2.4] * 5})
    assert curve.arms(2.0) == ["cheap"]
    summary = curve.summary(2.0)
    assert summary["gate"] == 16 and summary["arms"] == ["cheap"] and summary["ratio"]["dear"]["1"] == 2.4


def test_round_trip_through_json():
    curve = synthetic({"a": [1.2, 1.5, 2.5, 3.0, 4.0]})
    again = CostCurve.from_dict(json.loads(json.dumps(curve.to_dict())))
    assert again.plain_s == curve.plain_s and again.step_s == curve.step_s


def engine_with(graph_runner: bool):
    model = tiny_model("llama")
    engine = RolloutEngine(model, max_batch_size=4, drafter=EagleDrafter(model.config), speculation=ARMS[0],
                           max_tree_size=16)
    if graph_runner:
        engine.runner = GraphRunner(engine.forward, capture=False)
        engine.set_drafter(engine.drafter)
    return engine


@pytest.mark.parametrize("graph_runner", [False, True], ids=["eager", "runner"])
def test_measure_times_plain_and_every_arm_on_the_engine(graph_runner):
    engine = engine_with(graph_runner)
    curve = measure(engine, ARMS, batches=(1, 2), repeats=1, tau=1e9)  # every arm "pays": all timed
    assert curve.batches == [1, 2]
    assert set(curve.step_s) == {a.name for a in ARMS}
    assert all(s > 0 for s in curve.plain_s.values())
    assert all(0 < curve.ratio(a.name, b) < float("inf") for a in ARMS for b in (1, 2))
    # the engine still generates afterwards (the scratch buffers and graphs are gone)
    from tlt.rollout.request import Request
    from tlt.sampling import SamplingParams
    result = engine.generate([Request([1, 2, 3], n=2, params=SamplingParams(temperature=0, max_new_tokens=6))])
    assert len(result.samples) == 2


def test_warm_ups_are_not_charged_to_the_budget(monkeypatch):
    """With rollout.compile a first SD step per arm compiles for tens of seconds: that must not end the
    measurement after the first batch size. Here every warm-up sleeps past the whole budget."""
    import time

    from tlt.rollout import cost_curve

    engine = engine_with(False)
    warmed, sd_step = set(), cost_curve._Scratch.sd_step

    def slow_first_call(scratch, strategy):
        if (scratch.batch, strategy.name) not in warmed:
            warmed.add((scratch.batch, strategy.name))
            time.sleep(1.6)
        return sd_step(scratch, strategy)

    monkeypatch.setattr(cost_curve._Scratch, "sd_step", slow_first_call)
    # a budget the timed steps stay well within even on a loaded machine (0.25 s was not, once, in CI-like load)
    curve = measure(engine, ARMS[:1], batches=(1, 2, 4), repeats=1, tau=1e9, budget_s=1.5)
    assert curve.batches == [1, 2, 4] and not curve.notes["truncated"] and curve.notes["warmup_s"] >= 4.8


def test_measuring_stops_where_no_arm_can_pay():
    """With an expectation no arm can meet, only the first batch is timed (each arm once dropped stays out)."""
    curve = measure(engine_with(False), ARMS, batches=(1, 2, 4), repeats=1, tau=0.0)
    assert curve.batches == [1] and curve.gate(0.0) == 0 and curve.arms(0.0) == []


def test_a_cheap_reading_at_a_large_batch_does_not_reopen_the_gate():
    curve = synthetic({"a": [1.5, 2.6, 1.2, 0.9, 3.0]})
    assert curve.cost("a", 8) == 2.6 and curve.ratio("a", 8) == 0.9
    assert curve.gate(2.0) == 1


def test_curve_is_cached_per_device_model_and_arms(tmp_path, monkeypatch):
    engine = engine_with(False)
    first = curve_for(engine, ARMS, cache_dir=tmp_path, batches=(1,))
    monkeypatch.setattr(cost_curve, "measure", lambda *a, **k: pytest.fail("measured again"))
    assert curve_for(engine, ARMS, cache_dir=tmp_path, batches=(1,)).plain_s == first.plain_s
    monkeypatch.undo()
    other = curve_for(engine, ARMS[:1], cache_dir=tmp_path, batches=(1,))  # another arm set: its own entry
    assert set(other.step_s) == {ARMS[0].name}
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_damaged_cache_file_is_measured_again(tmp_path):
    engine = engine_with(False)
    curve_for(engine, ARMS, cache_dir=tmp_path, batches=(1,))
    path = next(tmp_path.glob("*.json"))
    path.write_text("{not json")
    again = curve_for(engine, ARMS, cache_dir=tmp_path, batches=(1,))
    assert again.plain_s[1] > 0 and json.loads(path.read_text())["plain_s"]


@pytest.mark.parametrize("wrong", [{"plain_s": {}}, {"plain_s": {"1": 0}}, {"step_s": {"S3K1N3": {"2": 0.01}}}])
def test_a_cache_file_that_parses_but_is_wrong_is_measured_again(tmp_path, wrong):
    """JSON no gate can come from (no plain step, a time of 0, an arm timed where plain was not) failed in every
    later run until the file was deleted (found by review)."""
    engine = engine_with(False)
    curve_for(engine, ARMS, cache_dir=tmp_path, batches=(1,))
    path = next(tmp_path.glob("*.json"))
    path.write_text(json.dumps({**json.loads(path.read_text()), **wrong}))
    again = curve_for(engine, ARMS, cache_dir=tmp_path, batches=(1,))
    assert again.plain_s[1] > 0 and again.gate() in (0, 1) and json.loads(path.read_text())["plain_s"]["1"] > 0
    assert all(set(steps) <= {1} for steps in again.step_s.values())  # measured, not the file's batch-2 time


def test_a_curve_cut_by_its_budget_serves_the_workers_starting_with_it_not_later_runs(tmp_path, monkeypatch):
    """A measurement cut short on a busy machine capped the gate at its last batch for every later run on the
    device (found by review). It serves the workers starting together (each would otherwise measure again, one
    after another, under the lock: a review of the mend); a run starting TRUNCATED_KEPT_S later measures again."""
    import os
    import time

    engine = engine_with(False)
    real = cost_curve.measure
    monkeypatch.setattr(cost_curve, "measure", lambda e, s, b: real(e, s, b, budget_s=1e-3, tau=1e9))
    cut = curve_for(engine, ARMS, cache_dir=tmp_path, batches=(1, 2))
    assert cut.notes["truncated"] and cut.batches == [1]
    monkeypatch.setattr(cost_curve, "measure", lambda *a, **k: pytest.fail("a worker starting with it measured"))
    assert curve_for(engine, ARMS, cache_dir=tmp_path, batches=(1, 2)).batches == [1]
    path = next(tmp_path.glob("*.json"))
    old = time.time() - cost_curve.TRUNCATED_KEPT_S - 1
    os.utime(path, (old, old))
    monkeypatch.setattr(cost_curve, "measure", lambda e, s, b: real(e, s, b, tau=1e9))
    assert curve_for(engine, ARMS, cache_dir=tmp_path, batches=(1, 2)).batches == [1, 2]


def test_workers_starting_together_measure_once(tmp_path, monkeypatch):
    """Two threads (in-process workers) ask for the same curve: one measures, the other waits and reads it."""
    import threading
    import time as time_

    engine = engine_with(False)
    calls = []

    def slow_measure(*args, **kwargs):
        calls.append(1)
        time_.sleep(0.5)
        return CostCurve("test", {1: 0.01}, {ARMS[0].name: {1: 0.012}})

    monkeypatch.setattr(cost_curve, "measure", slow_measure)
    results = []
    threads = [threading.Thread(target=lambda: results.append(curve_for(engine, ARMS, cache_dir=tmp_path)))
               for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert calls == [1] and [r.plain_s for r in results] == [{1: 0.01}] * 2


def test_the_cache_follows_tlt_cache_as_the_model_cache_does(monkeypatch, tmp_path):
    """README: TLT_CACHE moves tlt's cache; the cost curves went on writing ~/.cache/tlt (a read-only home
    failed the first run.gate=auto) (found by review). TLT_CACHE_DIR still names the curves' own directory."""
    from tlt.rollout.cost_curve import default_cache_dir

    monkeypatch.delenv("TLT_CACHE_DIR", raising=False)
    monkeypatch.setenv("TLT_CACHE", str(tmp_path / "cache"))
    assert default_cache_dir() == tmp_path / "cache" / "cost_curves"
    monkeypatch.setenv("TLT_CACHE_DIR", str(tmp_path / "curves"))
    assert default_cache_dir() == tmp_path / "curves" / "cost_curves"
    monkeypatch.delenv("TLT_CACHE_DIR")
    monkeypatch.delenv("TLT_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_cache_dir() == tmp_path / "xdg" / "tlt" / "cost_curves"
    from tlt.models.default_model import cache_root

    assert cache_root() == tmp_path / "xdg" / "tlt"  # the model's too (it ignored XDG_CACHE_HOME: a trial)
    monkeypatch.setenv("XDG_CACHE_HOME", "relative/cache")  # the XDG spec: a relative path is ignored
    assert cache_root() == Path.home() / ".cache" / "tlt"
