"""The `tlt train` configurations the benchmarks build load as configs (a refused one cost a GPU call its model
load and its result: the spot-training overhead phase asked for temperature 0), on the CPU and for CUDA; and the
end-to-end summary copes with the files a GPU session writes one call at a time; the GPU targets' table reads only
numbers measured as the issues define them."""

import argparse
import dataclasses
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import e2e  # noqa: E402
import gpu_targets  # noqa: E402
import spot_training  # noqa: E402
import worker_layout  # noqa: E402
from tlt.rl.config import load_config  # noqa: E402


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("lone_worker", [False, True])
@pytest.mark.parametrize("temperature,strategy", [(spot_training.NEAR_GREEDY, "S4K2N8"), (1.0, "S5K1q")])
def test_spot_training_modes_load(device, lone_worker, temperature, strategy):
    args = argparse.Namespace(drafter="/tmp/drafter", max_new_tokens=1024, device=device, lone_worker=lone_worker,
                              drafter_graph=lone_worker, default_stream=lone_worker, drafter_lr=1e-4)
    modes = spot_training.modes(args, temperature, 0, strategy)
    assert set(modes) == ({"spot", "frozen", "spot_graph", "spot_default_stream"} if lone_worker
                          else {"spot", "frozen"})
    for name, overrides in modes.items():
        config = load_config(None, overrides)
        assert config.rollout.temperature == temperature and config.run.strategy == strategy
        assert config.run.drafter_cuda_graph == (name == "spot_graph")
        assert config.run.tail_decode_priority == (name != "spot_default_stream")
        assert config.run.drafter_lr == 1e-4  # the warmed drafter goes on at its warm-up's final lr


def test_spot_training_places_each_modes_seconds_by_phase():
    timeline = {"workers": [{"intervals": [{"kind": "rollout", "start": 0.0, "end": 0.25},
                                           {"kind": "rollout_sd", "start": 0.25, "end": 1.0},
                                           {"kind": "update", "start": 1.0, "end": 1.5}]},
                            {"intervals": [{"kind": "rollout", "start": 0.0, "end": 0.5}]}]}
    assert spot_training.phase_seconds(timeline) == {"rollout": 0.75, "rollout_sd": 0.75, "update": 0.5}
    step = {"step_s": 1.5, "rollout_s": 1.0, "response_lengths": [3], "spot_train_steps": 0, "spot_train_share": 0,
            "idle_fraction": 0, "drafter_version": 0, "samples_hot_swapped": 0, "timeline": timeline}
    summary = spot_training.summarize({"spot": [step], "frozen": [step]})
    assert summary["phase_s"]["frozen"] == [{"rollout": 0.75, "rollout_sd": 0.75, "update": 0.5}]


@pytest.mark.parametrize("argv", [[], ["--replay"], ["--device", "cuda", "--max-new-tokens", "1024"],
                                  ["--device", "cuda", "--replay", "--workers", "1"]])
def test_e2e_modes_load(argv):
    args = e2e.parse_args(["--drafter", "/tmp/drafter", "--json", "/tmp/unused.json", *argv])
    modes = e2e.tlt_modes(args, seed=3)
    assert set(modes) == ({"reference", "baseline", "tlt"} if args.replay else {"baseline", "tlt"})
    for overrides in modes.values():
        assert load_config(None, overrides).run.seed == 3


@pytest.mark.parametrize("speculative", [False, True])
def test_worker_layout_modes_load_and_differ_only_in_workers(speculative):
    modes = worker_layout.modes("/tmp/x", speculative)
    configs = {name: load_config(None, overrides) for name, overrides in modes.items()}
    assert [c.run.speculative for c in configs.values()] == ["off"] + ["adaptive" if speculative else "off"] * 2
    assert [c.run.workers for c in configs.values()] == [2, 2, 1]


def _curves(step_s: float, length: float) -> dict:
    return {"step_s": [step_s] * 3, "rollout_s": [0.9 * step_s] * 3, "train_s": [0.1 * step_s] * 3,
            "step_tok_s": [16 * length / step_s] * 3, "rollout_tok_s": [1.0] * 3, "response_tokens": [16 * length] * 3,
            "response_len_mean": [length] * 3, "rollout_tail_share": [0.8] * 3}


def test_e2e_summary_of_a_trl_only_file_and_of_both():
    trl = {"step_s": [40.0, 44.0, 42.0], "reward_mean": [0.1] * 3, "completion_len_mean": [300.0] * 3,
           "step_tok_s": [114.0] * 3}
    alone = {"runs": {"seed0": {"trl": trl}}}
    e2e.summarize(alone)  # a --trl-only call: no tlt mode to compare with yet
    assert alone["trl_step_s"] == 42.0 and alone["trl_completion_len_mean"] == 300.0
    assert "speedup_vs_trl" not in alone and "speedup_vs_baseline" not in alone
    both = {"runs": {"seed0": {"baseline": _curves(20.0, 310.0), "tlt": _curves(10.0, 305.0), "trl": trl},
                     "seed1": {"baseline": _curves(30.0, 310.0), "tlt": _curves(30.0, 305.0)}}}
    e2e.summarize(both)
    # against TRL: only the seed TRL ran (the same prompts; pooled with seed 1 tlt's median would be 30 s)
    assert both["speedup_vs_trl"] == 4.2 and both["baseline_speedup_vs_trl"] == 2.1 and both["trl_seeds"] == ["seed0"]
    assert both["tok_s_ratio_vs_trl"] == round(16 * 305.0 / 10.0 / 114.0, 3)
    assert both["by_mode"]["tlt"]["response_len_mean"] == 305.0 and both["speedup_vs_baseline"] == 1.25
    assert both["by_mode"]["trl"]["completion_len_mean"] == 300.0


def test_e2e_merge_joins_a_sessions_files():
    import e2e_merge

    replay = {"complete": True, "environment": {"device": "H100"}, "steps": 3, "warmup_steps": 1, "equal_work": True,
              "runs": {"seed0": {"reference": _curves(20.0, 300.0), "baseline": _curves(21.0, 300.0),
                                 "tlt": _curves(10.5, 300.0)}}}
    natural = {"seed0": {"baseline": _curves(20.0, 310.0), "tlt": _curves(12.0, 290.0)}}
    trl = {"complete": True, "runs": {"seed0": {"trl": {"step_s": [60.0] * 3, "completion_len_mean": [305.0] * 3,
                                                        "reward_mean": [0.1] * 3, "step_tok_s": [80.0] * 3}}}}
    spot = {"spot_overhead_ratio": 1.01, "overlap_slowdown_median": 0.02, "overhead_serves_trained_versions": False}
    merged = e2e_merge.merge(replay, natural, trl, spot)
    assert merged["equal_work"] and merged["speedup_vs_baseline"] == 2.0  # from the replay: equal work
    assert merged["speedup_vs_trl"] == 5.0  # TRL's natural steps against tlt's natural ones
    assert merged["natural_by_mode"]["trl"]["completion_len_mean"] == 305.0
    assert merged["equal_work_by_mode"]["tlt"]["train_s"] == 1.05
    assert merged["spot_overhead_ratio"] == 1.01 and merged["complete"]
    # found by review: the natural runs' tokens/s ratio sat beside the replay's speed-up under the replay's key
    assert merged["tok_s_ratio_vs_baseline"] == 2.0  # the replay's: same tokens, so the step-time ratio
    assert merged["natural_tok_s_ratio_vs_baseline"] == round((290.0 / 12.0) / (310.0 / 20.0), 3)
    # found by review: equal work was taken from the option a file came by, not from the file
    with pytest.raises(SystemExit, match="equal_work is False"):
        e2e_merge.merge({**replay, "equal_work": False}, natural, trl, spot)
    assert e2e_merge.shared_settings({"a": {"max_new_tokens": 8, "temperature": 1.0},
                                      "b": {"max_new_tokens": 8, "temperature": 1.0}}) == {
        "max_new_tokens": 8, "prompts": None, "samples": None, "temperature": 1.0}
    assert e2e_merge.shared_settings({"a": {"max_new_tokens": 8}, "b": {"max_new_tokens": 16}}) is None


def test_e2e_merge_says_partial_when_a_natural_run_was_cut(tmp_path):
    import json

    import e2e_merge

    natural = {"complete": False, "environment": {"device": "cuda"},
               "runs": {"seed0": {"baseline": _curves(20.0, 310.0), "tlt": _curves(12.0, 290.0)}}}
    (tmp_path / "natural.json").write_text(json.dumps(natural))
    merged = e2e_merge.main(["--natural", str(tmp_path / "natural.json"), "--json", str(tmp_path / "out.json")])
    assert merged["complete"] is False


def test_e2e_merge_gives_no_ratio_against_trl_measured_on_another_device(capsys):
    import e2e_merge

    result = {"speedup_vs_trl": 5.0, "tok_s_ratio_vs_trl": 1.2, "trl_step_s": 60.0}
    e2e_merge.drop_ratios_across_devices(result, {"trl": "H100"}, {"natural.json": "H100"})
    assert result["speedup_vs_trl"] == 5.0  # one device: kept
    e2e_merge.drop_ratios_across_devices(result, {"trl": "H200"}, {"natural.json": "H100"})
    assert result == {"trl_step_s": 60.0} and "no ratio against TRL" in capsys.readouterr().err


def test_trl_runs_tlts_step_without_gradient_checkpointing():
    """TRL turns gradient checkpointing on by default, tlt's is off: every TRL micro-batch recomputed its forward
    (found by review). One generation of tlt's 16 completions, one optimizer step over tlt's micro-batches."""
    pytest.importorskip("trl")
    import trl_baseline

    config = trl_baseline.grpo_config(16, 4, 2, 256, steps=3)
    assert not getattr(config, "activation_checkpointing", False) and not config.gradient_checkpointing
    assert config.generation_batch_size == 16
    assert (config.per_device_train_batch_size, config.gradient_accumulation_steps, config.num_iterations) == (2, 8, 1)
    assert (config.beta, config.loss_type, config.temperature, config.top_k) == (0.0, "grpo", 1.0, 0)
    with pytest.raises(ValueError, match="micro-batches of 3"):
        trl_baseline.grpo_config(16, 4, 3, 256, steps=3)


def test_e2e_merge_gives_no_ratio_against_trl_run_with_other_settings(capsys):
    import e2e_merge

    result = {"speedup_vs_trl": 5.0, "trl_step_s": 60.0}
    same = {"max_new_tokens": 1024, "prompts": 4, "samples": 4, "temperature": 1.0}
    e2e_merge.drop_ratios_across_settings(result, dict(same), {"natural.json": dict(same)})
    assert result["speedup_vs_trl"] == 5.0
    e2e_merge.drop_ratios_across_settings(result, {**same, "max_new_tokens": 8}, {"natural.json": dict(same)})
    assert result == {"trl_step_s": 60.0} and "'max_new_tokens': (8, 1024)" in capsys.readouterr().err


def test_gpu_targets_count_only_numbers_measured_as_the_target_says(tmp_path):
    """A greedy run's file also holds "speedup": it must not pass for the T=1 targets; a missing file or key is
    "not measured", never a pass."""
    import json

    cuda = {"device": "cuda", "device_name": "NVIDIA H100 80GB HBM3"}
    spec = {"temperature": 1.0, "speedup": {"1": 2.2, "4": 0.9}, "tau": {"1": 2.6}, "complete": True,
            "speedup_greedy": {"1": 2.7}, "temperature_greedy": 0.0, "environment": cuda, "rounds": 1,
            "min_prompts": 8}
    (tmp_path / "speculative_h100.json").write_text(json.dumps(spec))
    throughput = {"batch1_step_ms": 1.2, "complete": False, "temperature": 0.0, "environment": cuda}
    (tmp_path / "rollout_throughput_h100.json").write_text(json.dumps(throughput))
    rows = {(row["issue"], row["target"]): row for row in gpu_targets.check(gpu_targets.read_results([tmp_path]))}
    assert rows[(13, "SD T=1 speed-up, batch 1")]["holds"] is True
    assert rows[(14, "SD T=1 speed-up, batch 1 (H100 bound)")]["holds"] is True
    assert rows[(13, "SD greedy speed-up, batch 1")]["holds"] is True
    assert rows[(13, "batch-1 decode step (ms), headline engine")]["holds"] is False  # 1.2 > 1.0
    assert rows[(13, "batch-1 decode step (ms), headline engine")]["partial"] is True
    assert rows[(15, "TLT vs TRL step")]["value"] is None and rows[(15, "TLT vs TRL step")]["holds"] is None
    assert gpu_targets.below_one(gpu_targets.read_results([tmp_path])) == ["T=1.0 batch 4: x0.90"]
    spec["temperature"] = 0.0  # a greedy run's own file
    (tmp_path / "speculative_h100.json").write_text(json.dumps(spec))
    rows = {(row["issue"], row["target"]): row for row in gpu_targets.check(gpu_targets.read_results([tmp_path]))}
    assert rows[(13, "SD T=1 speed-up, batch 1")]["value"] is None
    assert rows[(14, "tau at T=1, batch 1")]["holds"] is None
    # found by review: natural runs passed the equal-work target, and CPU or T=1 throughput files the #13 ones
    settings = {"max_new_tokens": 1024, "temperature": 1.0, "prompts": 4, "samples": 4}
    e2e = {"equal_work": False, "speedup_vs_baseline": 2.0, "overlap_slowdown_median": 0.01,
           "spot_overhead_ratio": 1.01, "spot_overhead_serves_trained_versions": True, **settings,
           "devices": {"replay": "NVIDIA H100 80GB HBM3", "spot": "NVIDIA H100 80GB HBM3"}}
    (tmp_path / "e2e_h100.json").write_text(json.dumps(e2e))
    throughput.update(batch1_step_ms=0.5, environment={"device": "cpu"})
    (tmp_path / "rollout_throughput_h100.json").write_text(json.dumps(throughput))
    rows = {(row["issue"], row["target"]): row for row in gpu_targets.check(gpu_targets.read_results([tmp_path]))}
    for name in ("TLT vs no-SD step, equal work", "spot training's slowdown of the decoding it overlaps",
                 "spot vs frozen step time, lone worker"):
        assert rows[(15, name)]["value"] is None, name
    assert rows[(13, "batch-1 decode step (ms), headline engine")]["value"] is None
    e2e.update(equal_work=True, spot_overhead_serves_trained_versions=False)
    (tmp_path / "e2e_h100.json").write_text(json.dumps(e2e))
    throughput.update(environment=cuda, temperature=1.0)
    (tmp_path / "rollout_throughput_h100.json").write_text(json.dumps(throughput))
    rows = {(row["issue"], row["target"]): row for row in gpu_targets.check(gpu_targets.read_results([tmp_path]))}
    assert rows[(15, "TLT vs no-SD step, equal work")]["holds"] is True
    assert rows[(15, "spot training's slowdown of the decoding it overlaps")]["holds"] is True
    assert rows[(13, "batch-1 decode step (ms), headline engine")]["value"] is None  # T=1
    # found by review: a file that does not name its temperature, a one-prompt tau, a CPU input merged into the
    # e2e file, another max_new_tokens, a tau gain after one step passed their targets
    del spec["temperature"]
    spec["min_prompts"] = 0
    (tmp_path / "speculative_h100.json").write_text(json.dumps(spec))
    e2e.update(devices={"replay": "NVIDIA H100 80GB HBM3", "spot": "cpu"}, tau_gain_last=0.3, tau_steps=1,
               speedup_vs_trl=5.0, natural_settings=dict(settings, max_new_tokens=256))
    (tmp_path / "e2e_h100.json").write_text(json.dumps(e2e))
    rows = {(row["issue"], row["target"]): row for row in gpu_targets.check(gpu_targets.read_results([tmp_path]))}
    for issue, name in ((13, "SD T=1 speed-up, batch 1"), (14, "tau at T=1, batch 1"),
                        (15, "TLT vs no-SD step, equal work"), (15, "TLT vs TRL step"),
                        (15, "tau of the spot-trained drafter over a frozen one, minus 1")):
        assert rows[(issue, name)]["holds"] is None and rows[(issue, name)]["not_counted"]["needs"], name
    assert rows[(14, "tau at T=1, batch 1")]["not_counted"] == {
        "value": 2.6, "needs": ["prompts at batch 1 >= 8", "temperature = 1.0"]}
    e2e.update(devices={"replay": "NVIDIA H100 80GB HBM3"}, tau_steps=10, natural_settings=settings)
    (tmp_path / "e2e_h100.json").write_text(json.dumps(e2e))
    rows = {(row["issue"], row["target"]): row for row in gpu_targets.check(gpu_targets.read_results([tmp_path]))}
    for name in ("TLT vs no-SD step, equal work", "TLT vs TRL step",
                 "tau of the spot-trained drafter over a frozen one, minus 1"):
        assert rows[(15, name)]["holds"] is True, name


def test_trl_steps_reach_the_file_as_they_come():
    """A TRL run killed at its GPU call's limit keeps its finished steps: the clock hands them on after each step
    and after each step's log, and a step without its log yet still makes a curve."""
    import trl_baseline

    seen = []
    clock = trl_baseline._StepClock(log=lambda line: None, on_step=lambda steps: seen.append(e2e.trl_curves(steps, 16)))
    clock.on_train_begin(None, None, None)
    clock.on_step_end(None, None, None)
    assert seen[-1]["step_s"][0] >= 0 and seen[-1]["reward_mean"] == [None] and seen[-1]["step_tok_s"] == [None]
    clock.on_log(None, None, None, logs={"reward": 0.5, "completions/mean_length": 100.0,
                                         "completions/max_length": 200.0})
    assert len(seen) == 2 and seen[-1]["reward_mean"] == [0.5] and seen[-1]["completion_len_max"] == [200.0]


def test_speculative_step_statistics_place_the_wall_time():
    """speculative.py's step statistics (the GPU diagnosis of a step's cost): the median and p90 step, the slow
    steps (over 3x the median), prefills, and the one-off work counted during the timed run only. A step's time
    is its cycle (to the next step's start: an overlapped plain step's call returns before its tokens); the
    last step's, its call."""
    import speculative
    from tlt.rollout.request import RolloutResult, StepTrace

    walls = [0.5] + [0.002] * 9 + [0.05]
    starts = [sum(walls[:i]) for i in range(len(walls))]
    calls = [0.5] + [0.001] * 9 + [0.05]  # the calls return early; their cycles are the walls above
    steps = [StepTrace("prefill" if i == 0 else "decode", 2, 2 if i == 0 else 4, call, start_s=start)
             for i, (call, start) in enumerate(zip(calls, starts))]
    runner = argparse.Namespace(warmups=5, eager_speculative_steps=1)
    stats = speculative.step_stats(RolloutResult([], steps, 1.0), runner, before=(4, 1))
    assert stats["decode_steps"] == 10 and stats["step_ms_median"] == pytest.approx(2.0)
    assert stats["slow_steps"] == 1 and stats["slow_s"] == pytest.approx(0.05)
    assert stats["prefills"] == 1 and stats["prefill_s"] == pytest.approx(0.5)
    assert stats["warmups"] == 1 and stats["eager_speculative_steps"] == 0
    assert stats["decode_s"] == pytest.approx(0.068)


@pytest.mark.parametrize("wanted", ["4", "0:plain", "x:S4K2N8", "4:S9"])
def test_speculative_refuses_a_bad_profile_request_before_loading_the_model(wanted, capsys):
    import speculative

    with pytest.raises(SystemExit):
        speculative.main(["--profile", wanted])
    error = capsys.readouterr().err  # (the usage line names --profile whatever the error)
    assert "--profile takes BATCH:ARM" in error or f"--profile {wanted}: strategy must look like" in error


def test_adaptive_buckets_compare_each_buckets_speculative_steps_with_plain_ones(monkeypatch):
    """adaptive_buckets.py (#13: SD never below plain where the policy turns it on): per graph bucket, the
    adaptive run's SD steps against the plain run's steps; a bucket where SD ran slower is listed."""
    import adaptive_buckets
    from tlt.rollout.request import StepTrace

    assert [adaptive_buckets.bucket_of(b) for b in (1, 2, 3, 4, 5, 9)] == [1, 2, 4, 4, 8, 16]
    def one_after_another(steps):  # each starts when the one before ends (its cycle: its wall time)
        starts = [sum(s.wall_s for s in steps[:i]) for i in range(len(steps))]
        return [dataclasses.replace(s, start_s=start) for s, start in zip(steps, starts)]

    plain = one_after_another([StepTrace("decode", 1, 1, 0.001)] * 3 + [StepTrace("decode", 3, 3, 0.001)] * 2 +
                              [StepTrace("prefill", 4, 4, 0.5)])
    # an overlapped run's first call (lands no step) and the call that ends it (two) are left out
    adaptive = one_after_another([StepTrace("decode", 1, 0, 0.0002, mode="sd", landed=0)]
                                 + [StepTrace("decode", 1, 2, 0.001, mode="sd")] * 2
                                 + [StepTrace("decode", 1, 5, 0.001, mode="sd", landed=2)] * 3
                                 + [StepTrace("decode", 4, 2, 0.001, mode="sd"), StepTrace("decode", 4, 4, 0.001)])
    result = adaptive_buckets.compare(plain, adaptive)
    assert result["by_bucket"]["1"]["ratio"] == pytest.approx(2.0)
    assert result["by_bucket"]["4"] == {"plain_steps": 2, "sd_steps": 1, "plain_tok_s": pytest.approx(3000.0),
                                        "sd_tok_s": pytest.approx(2000.0), "ratio": pytest.approx(2 / 3)}
    assert result["sd_below_plain_where_on"] == ["bucket 4: x0.67 (1 SD steps)"]
    assert result["min_ratio_where_on"] is None  # 1 SD step at bucket 4, 2 at bucket 1: explorations, not "on"
    monkeypatch.setattr(adaptive_buckets, "MIN_SD_STEPS", 1)
    assert adaptive_buckets.compare(plain, adaptive)["min_ratio_where_on"] == pytest.approx(2 / 3)


def test_the_speculative_benchmark_bounds_tau_over_its_prompts_at_batch_1():
    """τ at T=1 moved ±20% between 8-prompt runs: each batch-1 run reports a bootstrap interval over its prompts
    (its SD steps split at each prefill). Controls: equal prompts give a point, one prompt no interval."""
    from types import SimpleNamespace

    import speculative
    from tlt.rollout.request import StepTrace

    def run(per_prompt):  # each prompt's SD steps, by the tokens each emitted
        steps = []
        for emitted in per_prompt:
            steps += [StepTrace("prefill", 1, 1, 0.0), StepTrace("decode", 1, 1, 0.0)]  # a plain step: not counted
            steps += [StepTrace("decode", 1, tokens, 0.0, mode="sd") for tokens in emitted]
        return SimpleNamespace(steps=steps)
    assert speculative.tau_interval(run([[3, 3]] * 8)) == [3.0, 3.0]
    low, high = speculative.tau_interval(run([[1, 1], [5, 5]] * 4))
    assert 1.0 < low < 3.0 < high < 5.0
    assert speculative.tau_interval(run([[2, 4]])) is None
