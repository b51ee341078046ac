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
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import write_json  # noqa: E402


@dataclass(frozen=True)
class Target:
    issue: int
    what: str
    file: str
    key: tuple[str, ...]  # the path to the value inside the file
    bound: float
    at_most: bool = False  # the value must be <= bound (else >=)
    temperature: tuple[str, float] | None = None  # (key, value): where the file names it, the value must match
    requires: tuple[tuple[tuple[str, ...], object], ...] = ()  # (key path, value): the file must say exactly this


T1 = ("temperature", 1.0)  # speculative.py's run temperature (an older greedy run's file also says "speedup")
T0 = ("temperature", 0.0)  # rollout_throughput.py's: greedy against greedy transformers.generate
ON_CUDA = ((("environment", "device"), "cuda"),)  # a CPU file under an _h100 name is no H100 number
TARGETS = (
    Target(13, "batch-1 decode step (ms), graphs", "rollout_throughput_h100.json", ("batch1_step_ms",), 1.0, True,
           T0, ON_CUDA),
    Target(13, "batch-1 decode step (ms), compiled", "rollout_throughput_h100.json", ("step_ms_compiled", "1"), 1.0,
           True, T0, ON_CUDA),
    Target(13, "batch-1 decode step (ms), Triton kernels", "rollout_throughput_h100.json", ("step_ms_triton", "1"),
           1.0, True, T0, ON_CUDA),
    Target(13, "batch 64 vs HF static bf16, graphs", "rollout_throughput_h100.json", ("speedup_vs_hf_static", "64"),
           3.0, temperature=T0, requires=ON_CUDA),
    Target(13, "batch 64 vs HF static bf16, compiled", "rollout_throughput_h100.json",
           ("speedup_compiled_vs_hf_static", "64"), 3.0, temperature=T0, requires=ON_CUDA),
    Target(13, "batch 64 vs HF static bf16, Triton kernels", "rollout_throughput_h100.json",
           ("speedup_triton_vs_hf_static", "64"), 3.0, temperature=T0, requires=ON_CUDA),
    Target(13, "SD greedy speed-up, batch 1", "speculative_h100.json", ("speedup_greedy", "1"), 2.5,
           temperature=("temperature_greedy", 0.0), requires=ON_CUDA),
    Target(13, "SD T=1 speed-up, batch 1", "speculative_h100.json", ("speedup", "1"), 1.5, temperature=T1,
           requires=ON_CUDA),
    Target(14, "SD T=1 speed-up, batch 1 (H100 bound)", "speculative_h100.json", ("speedup", "1"), 2.0,
           temperature=T1, requires=ON_CUDA),
    Target(14, "tau at T=1, batch 1", "speculative_h100.json", ("tau", "1"), 2.5, temperature=T1, requires=ON_CUDA),
    Target(15, "TLT vs no-SD step, equal work", "e2e_h100.json", ("speedup_vs_baseline",), 1.7,
           requires=((("equal_work",), True),)),
    Target(15, "TLT vs TRL step", "e2e_h100.json", ("speedup_vs_trl",), 4.0),
    # a lone worker training beside its own tail, serving the starting drafter: the cost of training alone
    Target(15, "spot training's slowdown of the decoding it overlaps", "e2e_h100.json", ("overlap_slowdown_median",),
           0.03, True, requires=((("spot_overhead_serves_trained_versions",), False),)),
    Target(15, "spot vs frozen step time, lone worker", "e2e_h100.json", ("spot_overhead_ratio",), 1.03, True,
           requires=((("spot_overhead_serves_trained_versions",), False),)),
    # the same, from spot_training.py's own file (the `tail` phase) when no e2e_h100.json has merged it yet
    Target(15, "spot vs frozen step time, lone worker (spot_training.py)", "spot_training_h100.json",
           ("spot_overhead_ratio",), 1.03, True, requires=((("overhead_serves_trained_versions",), False),)),
    Target(15, "tau of the spot-trained drafter over a frozen one, minus 1", "e2e_h100.json", ("tau_gain_last",),
           0.10),
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
        said = value_of(data, target.temperature[:1]) if target.temperature else None
        if said is not None and said != target.temperature[1]:
            value = None  # measured at another temperature: not this target's number
        if any(value_of(data, key) != wanted for key, wanted in target.requires):
            value = None  # e.g. natural runs, not equal work; a CPU file: not this target's number
        holds = None if value is None else (operator.le if target.at_most else operator.ge)(value, target.bound)
        rows.append({"issue": target.issue, "target": target.what, "file": target.file, "key": ".".join(target.key),
                     "value": value, "bound": f"{'<=' if target.at_most else '>='} {target.bound}", "holds": holds,
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
        holds = {True: "yes", False: "no", None: "-"}[row["holds"]]
        print(f"| #{row['issue']} | {row['target']} | {value} | {row['bound']} | {holds} |")
    devices = sorted({row["device"] for row in rows if row["device"]})
    print(f"\ndevices: {', '.join(devices) or 'none recorded'}")
    for line in below_one(results):
        print(f"SD below plain decoding: {line}")
    if args.json:
        write_json(args.json, {"targets": rows, "sd_below_plain": below_one(results), "devices": devices})
    return rows


if __name__ == "__main__":
    main()
