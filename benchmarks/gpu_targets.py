"""The GPU issues' targets against the measured files: what a GPU session's closing note needs, in one table.

    python benchmarks/gpu_targets.py [DIR ...] [--json OUT]

Reads `*_h100.json` (or `*_<gpu>.json` with --gpu) from each DIR (default benchmarks/results; a session's $OUT folder works too: a file found in
a later DIR wins) and prints, per target of issues #13, #14 and #15, the measured value, the bound and whether it
holds. A target whose file or key is missing is "not measured", never a pass. Values are read, not recomputed:
the benchmarks define them (their docstrings say how).
"""

from __future__ import annotations

import argparse
import json
import operator
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_json  # noqa: E402


@dataclass(frozen=True)
class Condition:
    """What a file must say for its value to count (e.g. it ran on CUDA, at T=1, over enough prompts)."""

    what: str
    holds: Callable[[dict], bool]


def says(key: tuple[str, ...], wanted) -> Condition:
    """The file names `wanted` at `key`: a file that does not say is not counted (a run without a temperature
    key passed a T=1 target; found by review)."""
    return Condition(f"{'.'.join(key)} = {wanted}", lambda data: value_of(data, key) == wanted)


def at_least(what: str, number: Callable[[dict], float | None], bound: float) -> Condition:
    def holds(data: dict) -> bool:
        value = number(data)
        return value is not None and value >= bound
    return Condition(f"{what} >= {bound:g}", holds)


def _prompts_at_batch_1(data: dict) -> int:
    """speculative.py's prompts at batch 1: max(rounds, min_prompts) (a one-prompt tau is that prompt's)."""
    return max(data.get("rounds") or 1, data.get("min_prompts") or 0)


def _all_on_cuda(data: dict) -> bool:
    """e2e_merge.py's `devices` (each input's device name, or its device): every input ran on a GPU."""
    devices = data.get("devices") or {}
    return bool(devices) and all(name and name != "cpu" for name in devices.values())


def _samples(prefix: tuple[str, ...]) -> Callable[[dict], int | None]:
    def count(data: dict) -> int | None:
        prompts, samples = value_of(data, prefix + ("prompts",)), value_of(data, prefix + ("samples",))
        return None if prompts is None or samples is None else prompts * samples
    return count


def _rl_settings(prefix: tuple[str, ...] = ()) -> tuple[Condition, ...]:
    """#15's runs: max_new_tokens 1024, T=1, >= 16 samples per step, every input on a GPU."""
    return (says(prefix + ("max_new_tokens",), 1024), says(prefix + ("temperature",), 1.0),
            at_least("samples per step", _samples(prefix), 16), Condition("every input on CUDA", _all_on_cuda))


@dataclass(frozen=True)
class Target:
    issue: int
    what: str
    file: str
    key: tuple[str, ...]  # the path to the value inside the file
    bound: float
    at_most: bool = False  # the value must be <= bound (else >=)
    conditions: tuple[Condition, ...] = ()


MIN_PROMPTS = 8  # speculative.py's prompts at batch 1 for a speed-up or tau to count
ON_CUDA = (says(("environment", "device"), "cuda"),)  # a CPU file under an _h100 name is no H100 number
GREEDY_PLAIN = ON_CUDA + (says(("temperature",), 0.0),)  # rollout_throughput.py: greedy vs greedy generate
SPEC = ON_CUDA + (at_least("prompts at batch 1", _prompts_at_batch_1, MIN_PROMPTS),)
SPEC_T1 = SPEC + (says(("temperature",), 1.0),)  # (an older greedy run's file also says "speedup")
SPEC_GREEDY = SPEC + (says(("temperature_greedy",), 0.0),)
UNTRAINED_SPOT = (says(("spot_overhead_serves_trained_versions",), False),)
THROUGHPUT = "rollout_throughput_h100.json"
# rollout_throughput.py's headline engine runs the file's `kernels` (Triton by default on CUDA); the other
# kernels' numbers are in *_torch / *_triton keys when the run measured them too
TARGETS = (
    Target(13, "batch-1 decode step (ms), headline engine", THROUGHPUT, ("batch1_step_ms",), 1.0, True,
           GREEDY_PLAIN),
    Target(13, "batch-1 decode step (ms), torch kernels", THROUGHPUT, ("step_ms_torch", "1"), 1.0, True,
           GREEDY_PLAIN),
    Target(13, "batch-1 decode step (ms), Triton kernels", THROUGHPUT, ("step_ms_triton", "1"), 1.0, True,
           GREEDY_PLAIN),
    Target(13, "batch-1 decode step (ms), compiled", THROUGHPUT, ("step_ms_compiled", "1"), 1.0, True, GREEDY_PLAIN),
    Target(13, "batch 64 vs HF static bf16, headline engine", THROUGHPUT, ("speedup_vs_hf_static", "64"), 3.0,
           conditions=GREEDY_PLAIN),
    Target(13, "batch 64 vs HF static bf16, torch kernels", THROUGHPUT, ("speedup_torch_vs_hf_static", "64"), 3.0,
           conditions=GREEDY_PLAIN),
    Target(13, "batch 64 vs HF static bf16, Triton kernels", THROUGHPUT, ("speedup_triton_vs_hf_static", "64"),
           3.0, conditions=GREEDY_PLAIN),
    Target(13, "batch 64 vs HF static bf16, compiled", THROUGHPUT, ("speedup_compiled_vs_hf_static", "64"), 3.0,
           conditions=GREEDY_PLAIN),
    Target(13, "SD greedy speed-up, batch 1", "speculative_h100.json", ("speedup_greedy", "1"), 2.5,
           conditions=SPEC_GREEDY),
    Target(13, "SD T=1 speed-up, batch 1", "speculative_h100.json", ("speedup", "1"), 1.5, conditions=SPEC_T1),
    # adaptive_buckets.py: the RL engine's own policy; its lowest bucket ratio where it speculated
    Target(13, "SD vs plain where the adaptive policy turns it on (lowest bucket)", "adaptive_buckets_h100.json",
           ("min_ratio_where_on",), 1.0, conditions=ON_CUDA + (says(("complete",), True),)),
    Target(14, "SD T=1 speed-up, batch 1 (H100 bound)", "speculative_h100.json", ("speedup", "1"), 2.0,
           conditions=SPEC_T1),
    Target(14, "tau at T=1, batch 1", "speculative_h100.json", ("tau", "1"), 2.5, conditions=SPEC_T1),
    Target(15, "TLT vs no-SD step, equal work", "e2e_h100.json", ("speedup_vs_baseline",), 1.7,
           conditions=(says(("equal_work",), True),) + _rl_settings()),
    # TRL against tlt's natural runs (e2e_merge.py's natural_settings: the settings those runs agree on)
    Target(15, "TLT vs TRL step", "e2e_h100.json", ("speedup_vs_trl",), 4.0,
           conditions=_rl_settings(("natural_settings",))),
    # a lone worker training beside its own tail, serving the starting drafter: the cost of training alone
    Target(15, "spot training's slowdown of the decoding it overlaps", "e2e_h100.json", ("overlap_slowdown_median",),
           0.03, True, UNTRAINED_SPOT + (Condition("every input on CUDA", _all_on_cuda),)),
    Target(15, "spot vs frozen step time, lone worker", "e2e_h100.json", ("spot_overhead_ratio",), 1.03, True,
           UNTRAINED_SPOT + (Condition("every input on CUDA", _all_on_cuda),)),
    # the same, from spot_training.py's own file (the `tail` phase) when no e2e_h100.json has merged it yet
    Target(15, "spot vs frozen step time, lone worker (spot_training.py)", "spot_training_h100.json",
           ("spot_overhead_ratio",), 1.03, True, ON_CUDA + (says(("overhead_serves_trained_versions",), False),)),
    Target(15, "tau of the spot-trained drafter over a frozen one, minus 1", "e2e_h100.json", ("tau_gain_last",),
           0.10, conditions=(at_least("RL steps (tau_steps)", lambda d: d.get("tau_steps"), 10),
                             Condition("every input on CUDA", _all_on_cuda))),
)


def read_results(dirs: list[Path], gpu: str = "h100") -> dict[str, dict]:
    """The files of card `gpu` (gpu_session.sh names them *_<gpu>.json), under the targets' *_h100 names."""
    found = {}
    for folder in dirs:
        for path in sorted(folder.glob(f"*_{gpu}.json")):
            found[path.name.replace(f"_{gpu}", "_h100")] = json.loads(path.read_text())
    return found


def value_of(data: dict | None, key: tuple[str, ...]):
    for part in key:
        if not isinstance(data, dict) or data.get(part) is None:
            return None
        data = data[part]
    return data


def check(results: dict[str, dict]) -> list[dict]:
    rows = []
    for target in TARGETS:
        data = results.get(target.file)
        value = value_of(data, target.key)
        unmet = [] if value is None else [c.what for c in target.conditions if not c.holds(data)]
        counted = None if unmet else value  # e.g. a CPU file, natural runs, another temperature: not this target's
        holds = None if counted is None else (operator.le if target.at_most else operator.ge)(counted, target.bound)
        rows.append({"issue": target.issue, "target": target.what, "file": target.file, "key": ".".join(target.key),
                     "value": counted, "bound": f"{'<=' if target.at_most else '>='} {target.bound}", "holds": holds,
                     "not_counted": {"value": value, "needs": unmet} if unmet else None,
                     "partial": data is not None and data.get("complete") is False,
                     "device": value_of(data, ("environment", "device_name"))})
    return rows


def below_one(results: dict[str, dict]) -> list[str]:
    """Batch sizes where the best SD arm lost to plain decoding (#13: never where the adaptive policy turns SD on;
    compare with the gate the run's cost curve gave)."""
    spec = results.get("speculative_h100.json") or {}
    names = {"speedup": f"T={spec.get('temperature')}", "speedup_greedy": "greedy"}
    return [f"{names[name]} batch {batch}: x{speedup:.2f}" for name in names
            for batch, speedup in sorted((spec.get(name) or {}).items(), key=lambda item: int(item[0]))
            if speedup is not None and speedup < 1.0]


def main(argv=None) -> list[dict]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("dirs", nargs="*", default=[str(Path(__file__).parent / "results")])
    parser.add_argument("--json")
    parser.add_argument("--gpu", default="h100", help="the card whose files to read: *_<gpu>.json (the targets "
                        "are the H100's; an H200 measures close to it at batch 1, where launches bound the step)")
    args = parser.parse_args(argv)
    results = read_results([Path(d) for d in args.dirs], args.gpu)
    rows = check(results)
    print("| issue | target | measured | bound | holds |\n|---|---|---|---|---|")
    for row in rows:
        value = "not measured" if row["value"] is None else f"{row['value']:.3g}" + (
            " (partial run)" if row["partial"] else "")
        if row["not_counted"]:
            value = f"not counted: {row['not_counted']['value']:.3g}, needs {'; '.join(row['not_counted']['needs'])}"
        holds = {True: "yes", False: "no", None: "-"}[row["holds"]]
        print(f"| #{row['issue']} | {row['target']} | {value} | {row['bound']} | {holds} |")
    devices = sorted({row["device"] for row in rows if row["device"]})
    print(f"\ndevices: {', '.join(devices) or 'none recorded'}")
    if args.gpu != "h100":
        print(f"note: these are the {args.gpu.upper()} files; the issues' targets name an H100")
    for line in below_one(results):
        print(f"SD below plain decoding: {line}")
    if args.json:
        write_json(args.json, {"targets": rows, "sd_below_plain": below_one(results), "devices": devices})
    return rows


if __name__ == "__main__":
    main()
