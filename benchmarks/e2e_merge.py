"""Join the end-to-end files a GPU session writes one call at a time into one result (e.g. e2e_h100.json).

    python benchmarks/e2e_merge.py --replay e2e_replay_h100.json --natural e2e_h100_seed0.json e2e_h100_seed1.json \
        --trl e2e_trl_h100.json --spot spot_training_h100.json --json benchmarks/results/e2e_h100.json

Equal work (`equal_work: true`): `speedup_vs_baseline` and the per-mode times come from the length-matched replay
(every mode decodes the same tokens per sample). TRL cannot replay lengths, so `speedup_vs_trl` compares natural
runs on the same prompts: median step times over the seeds TRL ran (`trl_seeds`; tlt's other natural seeds drew
other problems), with tokens per step-second (`tok_s_ratio_vs_trl`), the baseline's ratios beside TLT mode's
(`baseline_speedup_vs_trl`: what tlt does without SD) and both sides' completion lengths (mean, max). TRL ran in a
call of its own: the ratios against it are left out when it ran on another device than the natural runs, or with
other settings (max_new_tokens, prompts, samples, temperature). `spot_overhead_ratio` is spot_training.py's overhead
phase (a lone worker training beside its tail, serving the starting drafter); `tau_gain_late` / `tau_gain_last` its
tau phase (spot-trained over frozen drafter, over the run's second half / at its last step, after `tau_steps`). Per
mode (`*_by_mode`): `step_s`, `rollout_s`, `train_s` (the update phase: rewards, log-probs, update) and the
completion lengths (`response_len_mean`). Inputs measured on different devices are named in `devices`; the
settings the natural runs share in `natural_settings`. A `--replay` file must say `equal_work: true` itself.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_json  # noqa: E402
from e2e import summarize  # noqa: E402


TRL_KEYS = ("speedup_vs_trl", "baseline_speedup_vs_trl", "tok_s_ratio_vs_trl", "baseline_tok_s_ratio_vs_trl",
            "trl_seeds", "trl_step_s", "trl_step_tok_s", "trl_rollout_s", "trl_completion_len_mean",
            "trl_completion_len_max")
VS_TRL = ("speedup_vs_trl", "baseline_speedup_vs_trl", "tok_s_ratio_vs_trl", "baseline_tok_s_ratio_vs_trl")


def _read(path: str) -> dict:
    data = json.loads(Path(path).read_text())
    if not data.get("complete", True):
        print(f"note: {path} is partial (its run hit its time limit): its finished steps are used")
    return data


def _pooled_natural(files: list[dict]) -> dict:
    runs = {}
    for data in files:
        for seed, modes in data["runs"].items():
            runs.setdefault(seed, {}).update(modes)
    return runs


def merge(replay: dict | None, natural: dict, trl: dict | None, spot: dict | None) -> dict:
    if replay is not None and replay.get("equal_work") is not True:  # its own flag, not the option it came by
        raise SystemExit("--replay takes e2e.py --replay's output (equal_work: true); this file's equal_work is "
                         f"{replay.get('equal_work')!r}: pass a natural run with --natural")
    result = {"equal_work": replay is not None, "environment": (replay or {}).get("environment")}
    if replay is not None:
        summarize(replay)
        result.update({key: replay.get(key) for key in (
            "speedup_vs_baseline", "tok_s_ratio_vs_baseline", "rollout_speedup_vs_baseline", "baseline_step_s",
            "tlt_step_s",
            "baseline_rollout_s", "tlt_rollout_s", "rollout_share_baseline", "rollout_tail_share_baseline",
            "steps", "warmup_steps", "max_new_tokens", "prompts", "samples", "temperature")})
        result["equal_work_by_mode"] = replay["by_mode"]
    runs = dict(natural)
    if trl is not None:
        for seed, modes in trl["runs"].items():
            runs.setdefault(seed, {}).update({"trl": modes["trl"]})
    if runs:
        pooled = {"runs": runs}
        summarize(pooled)
        result["natural_by_mode"] = pooled["by_mode"]
        result["natural_seeds"] = sorted(runs)
        for key in TRL_KEYS:
            if key in pooled:
                result[key] = pooled[key]
        if trl is not None:
            result["trl_versions"] = trl.get("trl_versions")
        for key in ("speedup_vs_baseline", "tok_s_ratio_vs_baseline"):  # natural runs: named so, never beside
            if key in pooled:                                           # the replay's own under its keys
                result[f"natural_{key}"] = pooled[key]
    if spot is not None:
        result["spot_overhead_ratio"] = spot.get("spot_overhead_ratio")
        result["overlap_slowdown_median"] = spot.get("overlap_slowdown_median")
        result["spot_overhead_serves_trained_versions"] = spot.get("overhead_serves_trained_versions")
        for key in ("tau_gain_late", "tau_gain_last", "tau_steps"):
            if key in spot:
                result[key] = spot[key]
    if trl is not None and "speedup_vs_trl" not in result:
        print("WARNING: no speedup_vs_trl: it compares TRL with tlt's natural runs (e2e.py without --replay, "
              "e.g. the e2e-natural phase); pass them with --natural", file=sys.stderr)
    result["complete"] = all(part.get("complete", True) for part in (replay, trl, spot) if part is not None)
    return result


def devices(named: dict[str, dict | None]) -> dict[str, str]:
    """The device each input ran on (its environment's device name, else its device)."""
    found = {}
    for name, data in named.items():
        environment = (data or {}).get("environment") or {}
        if environment:
            found[name] = environment.get("device_name") or environment.get("device")
    return found


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replay", help="e2e.py --replay output (equal work)")
    parser.add_argument("--natural", nargs="*", default=[], help="e2e.py natural-run outputs (one per seed or more)")
    parser.add_argument("--trl", help="e2e.py --trl-only output")
    parser.add_argument("--spot", nargs="*", default=[], help="spot_training.py outputs (overhead and/or tau)")
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    spot, parts = {}, [_read(path) for path in args.spot]
    for part in parts:
        spot.update({k: v for k, v in part.items() if v is not None})
    if parts:
        spot["complete"] = all(part.get("complete", True) for part in parts)  # not the last file's alone
    replay, trl = (_read(args.replay) if args.replay else None), (_read(args.trl) if args.trl else None)
    natural = {path: _read(path) for path in args.natural}
    result = merge(replay, _pooled_natural(list(natural.values())), trl, spot or None)
    result["complete"] = result["complete"] and all(data.get("complete", True) for data in natural.values())
    inputs = {"replay": replay, "trl": trl, **natural, "spot": spot}
    result["devices"] = devices(inputs)
    if len(set(result["devices"].values())) > 1:
        print(f"WARNING: the inputs ran on different devices: {result['devices']}", file=sys.stderr)
    drop_ratios_across_devices(result, devices({"trl": trl}), devices(natural))
    drop_ratios_across_settings(result, trl, natural)
    result["natural_settings"] = shared_settings(natural)
    write_json(args.json, result)
    return result


SETTINGS = ("max_new_tokens", "prompts", "samples", "temperature")


def shared_settings(natural: dict[str, dict]) -> dict | None:
    """The settings every natural run shares (what TRL's ratios were measured at); None when they differ."""
    found = {tuple((key, data.get(key)) for key in SETTINGS) for data in natural.values()}
    if len(found) != 1:
        if found:
            print(f"WARNING: the natural runs differ in {SETTINGS}: no natural_settings", file=sys.stderr)
        return None
    return dict(found.pop())


def drop_ratios_across_settings(result: dict, trl: dict | None, natural: dict[str, dict]) -> None:
    """A step of 256 tokens is no peer of one of 1024: TRL's ratios go when its run's settings differ."""
    if trl is None:
        return
    differ = {path: {key: (trl.get(key), data.get(key)) for key in SETTINGS if trl.get(key) != data.get(key)}
              for path, data in natural.items()}
    differ = {path: keys for path, keys in differ.items() if keys}
    if differ:
        _drop_vs_trl(result, f"TRL's run and the natural runs differ in {differ} (TRL's, theirs)")


def drop_ratios_across_devices(result: dict, trl_device: dict, natural_devices: dict) -> None:
    """Step times on two devices are no ratio: TRL's ratios go when TRL ran on another device than tlt's runs."""
    other = set(natural_devices.values()) - set(trl_device.values())
    if trl_device and other:
        _drop_vs_trl(result, f"TRL ran on {trl_device['trl']}, tlt's natural runs on {sorted(other)} (run both on "
                             f"one device)")


def _drop_vs_trl(result: dict, why: str) -> None:
    for key in VS_TRL:
        result.pop(key, None)
    print(f"WARNING: {why}: no ratio against TRL", file=sys.stderr)


if __name__ == "__main__":
    main()
