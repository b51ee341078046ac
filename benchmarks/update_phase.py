"""The update phase (log-probs + PPO update) of one worker of the default CPU run, before vs after issue 16 item 2.

Before: the code at BASELINE_REF (a no-grad old-log-prob forward that also feeds the drafter's features, then the
update with every position's full-vocabulary logits). After: this tree (no old-log-prob forward with one update
per step, features from the update's forward, chunked head log-probs at response positions only).

Both learn from the same recorded batch (benchmarks/results/update_phase_batch.json, rolled out once by the
engine; recorded again if missing): worker 0's shard of the default run's first step, 2 prompts x 4 samples of
the built-in task, SmolLM2-135M-Instruct, T=1, 256 new tokens. One thread (a default-run worker's: 2 on 2 cores).
Each measurement is a fresh process (the two variants alternate), so its peak RSS is the phase's own: the peak
is reset (/proc/self/clear_refs) once the model is loaded, and read back (VmHWM) after the update.

    python benchmarks/update_phase.py --json benchmarks/results/update_phase.json   # ~7 min
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BASELINE_REF = "a3d0f64d"  # main before the change
ROOT = Path(__file__).resolve().parent.parent
BATCH = ROOT / "benchmarks" / "results" / "update_phase_batch.json"


# -- one measurement (runs in a child process, under either tree) ---------------------------------------------

def measure(batch_file: str, threads: int) -> dict:
    """Score (rewards, advantages, whatever log-prob pass the tree does) + update on the recorded batch."""
    import torch

    torch.set_num_threads(threads)
    from tlt.drafter.buffer import FeatureBuffer
    from tlt.rl.trainer import GRPOTrainer

    recorded = json.loads(Path(batch_file).read_text())
    trainer = GRPOTrainer(default_config(recorded["max_new_tokens"]))
    trainer.feature_buffer = FeatureBuffer(10**9)  # a default-run worker (TLT mode) collects drafter features
    examples = trainer.task.sample(recorded["prompts"], seed=trainer.step_seed())
    rollout = _Rollout([_Sample(**s) for s in recorded["samples"]])
    allocate_optimizer_state(trainer)
    start_projection = projection(trainer.model)
    rss_start = _resident_mb(reset_peak=True)
    started, cpu_started = time.perf_counter(), time.process_time()
    batch = trainer.score(examples, rollout)
    scored = time.perf_counter()
    stats = trainer.update(batch)
    ended = time.perf_counter()
    # CPU seconds as well: on a shared machine they move less than wall time when other processes compete
    return {"score_s": scored - started, "update_s": ended - scored, "phase_s": ended - started,
            "phase_cpu_s": time.process_time() - cpu_started,
            "loss": stats["loss"], "ratio_mean": stats["ratio_mean"], "grad_norm": stats.get("grad_norm"),
            "features": len(trainer.feature_buffer), "rss_start_mb": rss_start, "peak_rss_mb": _peak_mb(),
            "update_projection": projection(trainer.model) - start_projection}


def allocate_optimizer_state(trainer) -> None:
    """Adam's moments, resident before the phase as in every step after the first: one step on zero gradients
    (no weight decay by default, so the parameters do not move)."""
    import torch

    for param in trainer.model.parameters():
        param.grad = torch.zeros_like(param)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)


def projection(model) -> float:
    """Every parameter projected on one fixed random direction: equal differences across the phase mean equal
    parameter updates (the GRPO loss itself is ~0 on-policy: a group's advantages sum to zero)."""
    import torch

    generator, total = torch.Generator().manual_seed(0), 0.0
    for param in model.parameters():  # a tied embedding/head appears once
        direction = torch.randn(param.numel(), generator=generator, dtype=torch.float64)
        total += float(param.detach().flatten().double() @ direction)
    return total


def default_config(max_new_tokens: int):
    from tlt.rl.config import load_config

    # `tlt train` defaults, run in this one process (the phase is a worker's: its shard, its thread)
    return load_config(None, ["run.speculative=off", "run.workers=1", "run.backend=inprocess",
                              "run.tensorboard=false", f"rollout.max_new_tokens={max_new_tokens}"])


class _Sample:
    def __init__(self, request_index, prompt_ids, token_ids):
        self.request_index, self.prompt_ids, self.token_ids = request_index, tuple(prompt_ids), token_ids
        # not recorded: the rollout/training mismatch metrics the phase computes from them are meaningless here
        # (their cost is the phase's); on the CPU no importance weight applies
        self.logprobs, self.finish_reason = [0.0] * len(token_ids), "stop"


class _Rollout:
    def __init__(self, samples):
        self.samples = samples


def _resident_mb(reset_peak: bool = False) -> float:
    """Current RSS; first hands freed heap pages back (as workers do after an update) and resets the peak."""
    import gc

    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    if reset_peak:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS
    return _status_kb("VmRSS") / 1024


def _peak_mb() -> float:
    return _status_kb("VmHWM") / 1024


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} missing from /proc/self/status")


# -- the driver --------------------------------------------------------------------------------------------------

def record_batch(path: Path, prompts: int, max_new_tokens: int, threads: int) -> dict:
    """Worker 0's shard of step 1 of the default run, rolled out once by the engine (T=1)."""
    import torch

    from tlt.rl.trainer import GRPOTrainer

    torch.set_num_threads(threads)
    trainer = GRPOTrainer(default_config(max_new_tokens))
    examples = trainer.task.sample(trainer.config.rollout.prompts_per_step, seed=trainer.step_seed())[:prompts]
    result = trainer.rollout(examples)
    samples = [{"request_index": s.request_index, "prompt_ids": list(s.prompt_ids), "token_ids": s.token_ids}
               for s in result.samples]
    path.write_text(json.dumps({"prompts": prompts, "max_new_tokens": max_new_tokens, "samples": samples}))
    return describe(path)


def describe(path: Path) -> dict:
    samples = json.loads(path.read_text())["samples"]
    prompts = [len(s["prompt_ids"]) for s in samples]
    responses = [len(s["token_ids"]) for s in samples]
    return {"file": str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path),
            "samples": len(samples), "prompt_lengths": prompts, "response_lengths": responses,
            "response_tokens": sum(responses)}


def export_baseline(ref: str, directory: Path) -> Path:
    """The library as it was at `ref` (git archive of src/), for the 'before' processes."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", ref, "src"], check=True, capture_output=True)
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive.stdout, check=True)
    return directory / "src"


def run_variant(source: Path, batch_file: Path, threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(source)}
    command = [sys.executable, __file__, "--measure", str(batch_file), "--threads", str(threads)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"{source}: {done.stderr[-2000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def summarize(runs: dict[str, list[dict]]) -> dict:
    median = {name: {key: statistics.median(r[key] for r in results)
                     for key in ("phase_s", "phase_cpu_s", "score_s", "update_s", "peak_rss_mb", "rss_start_mb")}
              for name, results in runs.items()}
    before, after = median["before"], median["after"]
    return {
        "speedup": round(before["phase_s"] / after["phase_s"], 3),
        "speedup_cpu_time": round(before["phase_cpu_s"] / after["phase_cpu_s"], 3),
        "update_phase_s": {name: round(m["phase_s"], 2) for name, m in median.items()},
        "update_phase_cpu_s": {name: round(m["phase_cpu_s"], 2) for name, m in median.items()},
        "score_s": {name: round(m["score_s"], 2) for name, m in median.items()},
        "update_s": {name: round(m["update_s"], 2) for name, m in median.items()},
        "peak_rss_mb": {name: round(m["peak_rss_mb"]) for name, m in median.items()},
        "peak_over_start_mb": {name: round(m["peak_rss_mb"] - m["rss_start_mb"]) for name, m in median.items()},
        "loss": {name: results[0]["loss"] for name, results in runs.items()},
        "loss_abs_diff": abs(runs["before"][0]["loss"] - runs["after"][0]["loss"]),
        "grad_norm": {name: results[0]["grad_norm"] for name, results in runs.items()},
        "update_projection": {name: results[0]["update_projection"] for name, results in runs.items()},
        "update_projection_abs_diff": abs(runs["before"][0]["update_projection"]
                                          - runs["after"][0]["update_projection"]),
        "features": {name: results[0]["features"] for name, results in runs.items()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=3, help="fresh processes per variant (alternating)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (a default-run worker has 1)")
    parser.add_argument("--batch", type=Path, default=BATCH, help="recorded batch (recorded when missing)")
    parser.add_argument("--prompts", type=int, default=2, help="prompts of a new recording (x 4 samples)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="of a new recording")
    parser.add_argument("--baseline-ref", default=BASELINE_REF)
    parser.add_argument("--measure", help=argparse.SUPPRESS)  # child mode: one measurement, JSON on stdout
    args = parser.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure, args.threads)))
        return
    sys.path.insert(0, str(Path(__file__).parent))
    from common import environment, write_json

    # one thread: two OpenMP threads on a busy 2-core machine can take 10x longer (spinning on a preempted peer)
    batch = describe(args.batch) if args.batch.exists() else record_batch(args.batch, args.prompts,
                                                                           args.max_new_tokens, threads=1)
    print(f"batch {batch}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        sources = {"before": export_baseline(args.baseline_ref, Path(tmp)), "after": ROOT / "src"}
        runs: dict[str, list[dict]] = {"before": [], "after": []}
        for repeat in range(args.repeats):
            order = ("before", "after") if repeat % 2 == 0 else ("after", "before")
            for name in order:
                runs[name].append(run_variant(sources[name], args.batch, args.threads))
                print(f"repeat {repeat + 1} {name}: {runs[name][-1]}", flush=True)
    result = {**summarize(runs), "batch": batch, "repeats": args.repeats, "threads": args.threads,
              "baseline_ref": args.baseline_ref, "runs": runs, "environment": environment(),
              "setting": "worker 0's shard of the default run's first step (tlt train defaults: 4 prompts x 4 "
                         "samples over 2 workers x 1 thread, micro-batch 4, T=1, 256 new tokens), drafter "
                         "features collected as in TLT mode, optimizer state resident (a step after the first); "
                         "phase = score() + update(); medians over fresh processes; peak RSS reset before the "
                         "phase"}
    write_json(args.json, result)


if __name__ == "__main__":
    main()
