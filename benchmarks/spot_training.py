"""Spot training on vs off on SmolLM2-135M-Instruct, same starting drafter, static SD (S4K2N8 at batch <= 8).

Two setups: 2 Ray workers x 1 thread on the CPU (the idle worker trains while the other decodes its tail), or
`--lone-worker`: one worker that trains the drafter beside its own tail (`run.tail_training=on`: a background
thread, a second CUDA stream on a GPU; drafter/tail_trainer.py) — the one-GPU setup.

Two measurements, each with the two modes' steps interleaved (benchmarks/rl_pairs.py):
  overhead  near-greedy decoding (T=0.001: the config refuses T=0 for GRPO, whose groups would be identical): SD
            is lossless, so both modes emit the same tokens (up to near-ties; `response_tokens` shows it) and do
            the same rollout and update work; the step-time ratio is what spot training costs — target <= 1.03x.
            With a lone worker the spot mode trains and publishes as always but keeps serving the starting
            drafter: a better drafter changes the SD steps per token (its gain is the tau phase's), which would
            mix into a cost. Also the slowdown of the decoding the training overlaps: the extra decoding time
            over the decoding seconds the tail trainer ran beside (target <= 3%), the wait for its stop after
            the last decode step (`tail_stop_s`) apart. With 2 Ray workers the trained versions are
            served (the swap cannot be held back in another process): that ratio includes their tau change.
  tau       sampling at T=1 (the RL setting): tau per RL step with the spot-trained drafter vs the frozen one,
            under q-sampling (--tau-strategy S5K1q; the target-only rule's tau is capped near the target's top-1
            mass whatever the drafter, so a better drafter barely shows there).

    python benchmarks/spot_training.py --drafter DIR --json benchmarks/results/spot_training.json [--steps K]
    python benchmarks/spot_training.py --lone-worker --device cuda --drafter DIR --max-new-tokens 1024 \
        --tau-steps 10 --json $OUT/spot_training_h100.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402
from rl_pairs import interleaved_runs, median  # noqa: E402

from tlt.distributed.worker import RolloutWorker  # noqa: E402

# --lone-worker's optional spot modes, beside spot and frozen: their results' key suffix
EXTRA_SPOT_MODES = {"spot_graph": "_graph", "spot_default_stream": "_default_stream"}
NEAR_GREEDY = 0.001  # the overhead phase's temperature (see the docstring)


def modes(args, temperature: float, seed: int, strategy: str) -> dict[str, list[str]]:
    # static: one fixed strategy at batch <= 8, so tau compares drafters, not the bandit's arm choices
    common = [f"run.drafter={args.drafter}", f"run.drafter_lr={args.drafter_lr}", "run.speculative=static",
              f"run.strategy={strategy}", "run.gate=8",
              f"rollout.temperature={temperature}", f"run.seed={seed}", "run.tensorboard=false",
              f"rollout.max_new_tokens={args.max_new_tokens}", f"model.device={args.device}"]
    if args.lone_worker:
        common += ["run.workers=1", "run.backend=inprocess"]
        both = {"spot": common + ["run.tail_training=on"],
                "frozen": common + ["run.tail_training=off", "run.spot_training=false"]}
        if args.drafter_graph:  # the drafter's micro-step as a CUDA graph: a third mode, interleaved with both
            both["spot_graph"] = both["spot"] + ["run.drafter_cuda_graph=true"]
        if args.default_stream:  # decoding on the default stream beside the trainer (before decoding_first)
            both["spot_default_stream"] = both["spot"] + ["run.tail_decode_priority=false"]
        return both
    common += ["run.workers=2", "run.backend=ray", "run.threads_per_worker=1",
               "optim.micro_batch_size=2"]  # 2: four resident workers fit in 24 GB
    return {"spot": common + ["run.spot_training=true"], "frozen": common + ["run.spot_training=false"]}


@contextlib.contextmanager
def serving_the_starting_drafter():
    """In-process workers load only their first drafter version; later ones are trained and published, not
    served. (The frozen mode publishes none, so it is unaffected.)"""
    original = RolloutWorker._sync_drafter

    def first_version_only(worker, engine, force: bool = False) -> None:
        if engine.drafter_version is None:
            original(worker, engine, force)

    RolloutWorker._sync_drafter = first_version_only
    try:
        yield
    finally:
        RolloutWorker._sync_drafter = original


def overlap_slowdown(history: dict) -> list[float]:
    """Per step (identical tokens in both modes), how much slower the decoding went while the tail trainer ran
    beside it: the spot mode's extra decoding seconds over the decoding seconds they overlapped, both without
    the wait for the trainer's stop after the last decode step (its last micro-step and publish, `tail_stop_s`,
    reported apart)."""
    out = []
    for spot, frozen in zip(history["spot"], history["frozen"]):
        stop = spot.get("tail_stop_s", 0.0)
        overlapped = spot.get("tail_train_share", 0.0) * spot["step_s"] - stop
        extra = spot["rollout_s"] - stop - frozen["rollout_s"]
        out.append(round(extra / (overlapped - extra), 4) if overlapped - extra > 0 else None)
    return out


def add_overlap_slowdown(summary: dict, history: dict) -> float | None:
    """Puts the per-step slowdowns into `summary`; returns their median (None: no step overlapped)."""
    per_step = overlap_slowdown(history)
    summary["overlap_slowdown_per_step"] = per_step
    slowdowns = [x for x in per_step if x is not None]
    return statistics.median(slowdowns) if slowdowns else None


def phase_seconds(timeline: dict) -> dict:
    """Seconds per interval kind (rollout, rollout_sd, logprobs, update, ...) of a step's timeline, its workers
    summed."""
    seconds: dict = {}
    for worker in timeline.get("workers", []):
        for interval in worker["intervals"]:
            seconds[interval["kind"]] = seconds.get(interval["kind"], 0.0) + interval["end"] - interval["start"]
    return {kind: round(value, 4) for kind, value in seconds.items()}


def summarize(history: dict) -> dict:
    spot, frozen = history["spot"], history["frozen"]
    ratios = [s["step_s"] / f["step_s"] for s, f in zip(spot, frozen)]
    return {
        "step_s": {name: [round(m["step_s"], 2) for m in runs] for name, runs in history.items()},
        "rollout_s": {name: [round(m["rollout_s"], 2) for m in runs] for name, runs in history.items()},
        "tau": {name: [None if m.get("sd/tau") is None else round(m["sd/tau"], 3) for m in runs]
                for name, runs in history.items()},  # null: no speculative step in that step
        "response_tokens": {name: [sum(m["response_lengths"]) for m in runs] for name, runs in history.items()},
        "spot_train_steps": [m["spot_train_steps"] for m in spot],
        "spot_train_share": [round(m["spot_train_share"], 4) for m in spot],
        "idle_fraction": {name: [round(m["idle_fraction"], 4) for m in runs] for name, runs in history.items()},
        "drafter_version": [m["drafter_version"] for m in spot],
        "samples_hot_swapped": [m["samples_hot_swapped"] for m in spot],
        "step_ratio_per_step": [round(r, 4) for r in ratios],
        "overhead_ratio_median": round(statistics.median(ratios), 4) if ratios else None,
        "median_step_s": {name: round(median(runs, "step_s"), 2) for name, runs in history.items() if runs},
        "timelines_spot": [m["timeline"] for m in spot],
        # each phase's seconds per step in both modes: where a spot step's extra time goes (the H200's 1.18x
        # was 0.03-0.2 s of rollout and ~0.06-0.13 s after it, which its spot timelines alone could not place)
        "phase_s": {name: [phase_seconds(m["timeline"]) for m in runs] for name, runs in history.items()},
        "tail_train_share": [round(m.get("tail_train_share", 0.0), 4) for m in spot],
        "tail_stop_s": [round(m.get("tail_stop_s", 0.0), 4) for m in spot],
        "rollout_ratio_per_step": [round(s["rollout_s"] / f["rollout_s"], 4) for s, f in zip(spot, frozen)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--json", required=True)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--tau-steps", type=int, default=4)
    parser.add_argument("--phases", nargs="+", choices=["overhead", "tau"], default=["overhead", "tau"],
                        help="run only these; the other phase's results already in --json are kept")
    parser.add_argument("--lone-worker", action="store_true",
                        help="one worker training beside its own tail (run.tail_training=on) instead of 2 Ray workers")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--drafter-graph", action="store_true",
                        help="with --lone-worker: a third mode whose tail trainer replays its micro-step as a CUDA "
                             "graph (run.drafter_cuda_graph=true); results under overhead_graph")
    parser.add_argument("--default-stream", action="store_true",
                        help="with --lone-worker: a mode whose rollout decodes on the default stream beside the tail "
                             "trainer (run.tail_decode_priority=false); results under overhead_default_stream")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--strategy", default="S4K2N8",
                        help="the overhead phase's static arm (near-greedy: either rule follows the argmax)")
    parser.add_argument("--tau-strategy", default="S5K1q",
                        help="the tau phase's static arm. q-sampling by default: at T=1 target-only acceptance is "
                             "capped by the target's top-1 mass whatever the drafter (S4K2N8's tau stayed near "
                             "1.6 in both modes, docs/benchmarks.md section 7), q-sampling accepts 1 - TV(p, q)")
    parser.add_argument("--drafter-lr", type=float, default=1e-4,
                        help="run.drafter_lr: the lr a warmed drafter without optimizer state goes on at (the one its "
                             "warm-up ended at: 1e-4 for the committed drafter; higher costs acceptance, "
                             "docs/benchmarks.md section 7)")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="unmeasured RL steps per mode first (CUDA: graph captures, the cost curve)")
    args = parser.parse_args()
    path = Path(args.json)
    result = json.loads(path.read_text()) if path.exists() else {}
    result.update({"environment": environment(), "drafter": args.drafter, "device": args.device,
                   "max_new_tokens": args.max_new_tokens, "warmup_steps": args.warmup_steps,
                   "drafter_lr": args.drafter_lr,
                   **({"workers": 1, "tail_training": True} if args.lone_worker else
                      {"workers": 2, "threads_per_worker": 1})})
    result["complete"] = False  # until the last write: a run killed at its time limit keeps what it measured
    write_json(args.json, result, echo=False)

    def partial(phase: str):
        def write(history: dict) -> None:  # after each step: a run its time limit cuts keeps its ratios so far
            result[phase] = summarize(history)
            if phase == "overhead":
                result["spot_overhead_ratio"] = result["overhead"]["overhead_ratio_median"]
                for mode, suffix in EXTRA_SPOT_MODES.items():
                    if history.get(mode):
                        result[f"overhead{suffix}"] = summarize({"spot": history[mode], "frozen": history["frozen"]})
            else:
                add_tau_gains(result)
            write_json(args.json, result, echo=False)
        return write

    if "overhead" in args.phases:
        print(f"== overhead (T={NEAR_GREEDY}: identical work in both modes)")
        serving = serving_the_starting_drafter() if args.lone_worker else contextlib.nullcontext()
        with serving:
            history = interleaved_runs(modes(args, NEAR_GREEDY, 0, args.strategy), args.steps,
                                       on_step=partial("overhead"),
                                       warmup_steps=args.warmup_steps)
        extra = {mode: history.pop(mode, None) for mode in EXTRA_SPOT_MODES}
        result["overhead"] = summarize(history)
        result["overhead_serves_trained_versions"] = not args.lone_worker
        result["spot_overhead_ratio"] = result["overhead"]["overhead_ratio_median"]
        if args.lone_worker:
            result["overlap_slowdown_median"] = add_overlap_slowdown(result["overhead"], history)
        for mode, suffix in EXTRA_SPOT_MODES.items():  # the same measures, against the same frozen steps
            if extra[mode] is not None:
                against = {"spot": extra[mode], "frozen": history["frozen"]}
                result[f"overhead{suffix}"] = summarize(against)
                result[f"spot_overhead_ratio{suffix}"] = result[f"overhead{suffix}"]["overhead_ratio_median"]
                result[f"overlap_slowdown_median{suffix}"] = add_overlap_slowdown(result[f"overhead{suffix}"],
                                                                                  against)
    if "tau" in args.phases:
        print(f"== tau over RL steps (T=1, {args.tau_strategy})")
        result["tau_strategy"] = args.tau_strategy
        result["tau"] = summarize(interleaved_runs(modes(args, 1.0, 0, args.tau_strategy), args.tau_steps,
                                                   on_step=partial("tau"), warmup_steps=args.warmup_steps))
        add_tau_gains(result)
    result["complete"] = True
    write_json(args.json, result)
    print(f"overhead ratio (median of per-step spot/frozen): {result.get('spot_overhead_ratio')}")
    if "tau" in result:
        print(f"tau spot {result['tau']['tau']['spot']}  frozen {result['tau']['tau']['frozen']}")


def add_tau_gains(result: dict) -> None:
    """The spot-trained drafter's tau over the frozen one's: over the run's second half and at its last step."""
    taus = result["tau"]["tau"]
    last = max(1, len(taus["spot"]) // 2)  # the second half of the run: the drafters have drifted apart
    late = {name: [t for t in taus[name][-last:] if t is not None] for name in ("spot", "frozen")}
    if late["spot"] and late["frozen"]:
        result["tau_gain_late"] = round(statistics.median(late["spot"]) / statistics.median(late["frozen"]) - 1, 4)
    both = [(s, f) for s, f in zip(taus["spot"], taus["frozen"]) if s is not None and f is not None]
    result["tau_steps"] = len(taus["spot"])  # RL steps per mode run (a run cut at its time limit: fewer)
    if both:
        result["tau_gain_last"] = round(both[-1][0] / both[-1][1] - 1, 4)  # at the last step both measured


if __name__ == "__main__":
    main()
