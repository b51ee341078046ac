"""End to end: RL step time of TRL's GRPOTrainer, tlt without SD (the baseline) and tlt in full TLT mode.

Same model (SmolLM2-135M-Instruct by default), task (built-in arithmetic, chat template), reward, seeds, batch
(--prompts x --samples), --max-new-tokens at T=1, optimizer and step count. The tlt modes run interleaved, one
step each in turn; TRL (trl_baseline.py: its default transformers generation, no vLLM) runs after them. tlt places
`run.workers=auto` as `tlt train` does (one worker per device: on the CPU one process on every core, as TRL's; on
CUDA one per GPU).

Natural runs (default) compare different samples: at T=1 each mode draws its own responses, and their lengths
differ (one mode's step may simply decode fewer tokens), so each step also reports its response tokens and
tokens/s beside its time, and several seeds should be pooled. `--replay` measures equal work: a reference run
without SD records every sample's length each step, then the baseline and TLT mode replay those prompts with each
sample's max_new_tokens set to its recorded length and stop tokens ignored (rollout/replay.py), so every mode
decodes exactly the same tokens per sample (checked) — still sampling at T=1, so acceptance stays realistic.
TRL is not run in a replay (its generate cannot fix per-sample lengths). `--trl-only` runs just TRL (a GPU call
of its own; the GPU image lacks trl: benchmarks/gpu_trl_wheels.sh), and benchmarks/e2e_merge.py joins the files.
`--warmup-steps N` runs N unmeasured steps per mode first (TRL too): on CUDA a mode's first steps capture its
graphs and measure its cost curve, one-off seconds that the TLT mode pays many times more than the baseline.

    python benchmarks/e2e.py --drafter DIR --json benchmarks/results/e2e.json [--steps K] [--seeds 0 1] [--quick]
    python benchmarks/e2e.py --drafter DIR --replay --json benchmarks/results/e2e_replay.json
    python benchmarks/e2e.py --drafter DIR --device cuda --max-new-tokens 1024 ... (see docs/benchmarks.md §8)
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402
from rl_pairs import interleaved_runs  # noqa: E402

CURVE_KEYS = ("reward_mean", "accuracy", "response_len_mean", "response_tokens", "step_s", "rollout_s", "train_s",
              "step_tok_s", "rollout_tok_s", "rollout_tail_share", "idle_fraction", "spot_train_share",
              "tail_train_share", "sd/tau", "sd/sd_step_share", "response_len_max",
              # the bf16 rollout vs the training forward (grpo.rollout_is: on CUDA's defaults), and the entropy
              "train/rollout_kl", "train/rollout_logprob_gap", "train/is_capped", "train/entropy")
SUMMARY_KEYS = ("step_s", "rollout_s", "train_s", "step_tok_s", "rollout_tok_s", "response_tokens",
                "response_len_mean", "response_len_max",
                "completion_len_mean", "completion_len_max")  # TRL's names for the completion lengths


def tlt_modes(args, seed: int) -> dict[str, list[str]]:
    common = [f"run.workers={args.workers}", f"run.seed={seed}", f"rollout.max_new_tokens={args.max_new_tokens}",
              f"rollout.prompts_per_step={args.prompts}", f"rollout.samples_per_prompt={args.samples}",
              f"model.device={args.device}", "run.tensorboard=false"]
    if args.model:
        common.append(f"model.path={args.model}")
    off = common + ["run.speculative=off"]
    modes = {"baseline": off,
             "tlt": common + ["run.speculative=adaptive", f"run.drafter={args.drafter}", "run.spot_training=true"]}
    return {"reference": off, **modes} if args.replay else modes


def run_trl(args, seed: int, on_step=None) -> list[dict]:
    """args.warmup_steps + args.steps TRL steps on tlt's prompts; the measured ones (the warm-up's dropped), also
    given to on_step as they come."""
    from tlt.models.default_model import default_model_dir
    from tlt.rl.config import TrainConfig
    from tlt.rl.rewards import build_reward
    from tlt.tasks import ArithmeticTask, ArithmeticTaskConfig
    from trl_baseline import trl_step_times

    config = TrainConfig()  # TRL keeps torch's own thread count: every core, as tlt's one CPU worker
    task = ArithmeticTask(ArithmeticTaskConfig(min_operations=config.task.min_operations,
                                               max_operations=config.task.max_operations))
    # exactly the prompts tlt draws: step k uses seed run.seed * 1_000_003 + k
    examples = [task.sample(args.prompts, seed=seed * 1_000_003 + k) for k in range(args.warmup_steps + args.steps)]
    steps = trl_step_times(args.model or str(default_model_dir()), examples, build_reward(config.task),
                           samples_per_prompt=args.samples, max_new_tokens=args.max_new_tokens, seed=seed,
                           use_cpu=args.device == "cpu", micro_batch_size=config.optim.micro_batch_size,
                           on_step=lambda steps: on_step and on_step(steps[args.warmup_steps:]))
    return steps[args.warmup_steps:]


def curves(history: list[dict]) -> dict:
    for metrics in history:
        metrics["response_tokens"] = sum(metrics["response_lengths"])
        metrics["step_tok_s"] = metrics["response_tokens"] / metrics["step_s"]
        metrics["response_len_max"] = max(metrics["response_lengths"])  # the rollout waits for it
    # a key a step lacks stays null (τ of a step without a speculative step is no 0)
    out = {key: [None if m.get(key) is None else _rounded(float(m[key])) for m in history] for key in CURVE_KEYS}
    out["response_lengths"] = [m["response_lengths"] for m in history]  # every sample's, per step
    return out


def _rounded(value: float) -> float:
    """4 decimals, or 3 significant digits below 0.01 (a KL of 2e-4 is not 0)."""
    return round(value, 4) if abs(value) >= 0.01 else float(f"{value:.3g}")


def trl_curves(trl: list[dict], batch: int) -> dict:
    lengths = [t.get("completion_len_mean") for t in trl]
    rollout = [None if t.get("rollout_s") is None else round(t["rollout_s"], 2) for t in trl]
    return {"step_s": [round(t["step_s"], 2) for t in trl], "reward_mean": [t.get("reward_mean") for t in trl],
            "rollout_s": rollout, "train_s": [None if r is None else round(t["step_s"] - r, 2)
                                              for r, t in zip(rollout, trl)],
            "completion_len_mean": lengths, "completion_len_max": [t.get("completion_len_max") for t in trl],
            "step_tok_s": [round(length * batch / t["step_s"], 2) if length is not None else None
                           for length, t in zip(lengths, trl)]}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True, help="warmed drafter directory (TLT mode)")
    parser.add_argument("--json", required=True)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0])
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--prompts", type=int, default=4, help="prompts per step")
    parser.add_argument("--samples", type=int, default=4, help="samples per prompt (GRPO group size)")
    parser.add_argument("--workers", default="auto", help="run.workers (default: auto, as tlt train)")
    parser.add_argument("--model", default=None, help="model directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--replay", action="store_true", help="equal work: replay a reference run's lengths")
    parser.add_argument("--quick", action="store_true", help="1 step, 128 new tokens, no TRL")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--trl-only", action="store_true", help="only TRL, on the first seed (its own call on a GPU)")
    parser.add_argument("--warmup-steps", type=int, default=0,
                        help="unmeasured RL steps per mode first (CUDA: graph captures, the cost curve)")
    args = parser.parse_args(argv)
    if args.quick:
        args.steps, args.max_new_tokens = 1, 128
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    result = {"environment": environment(), "equal_work": args.replay, "steps": args.steps,
              "max_new_tokens": args.max_new_tokens, "prompts": args.prompts, "samples": args.samples,
              "temperature": 1.0, "device": args.device, "workers": args.workers, "seeds": args.seeds, "runs": {},
              "warmup_steps": args.warmup_steps,
              "complete": False}  # until the last write: a run killed at its time limit keeps its finished steps
    for seed in [] if args.trl_only else args.seeds:
        def partial(history: dict, key=f"seed{seed}") -> None:
            result["runs"][key] = {name: curves(runs) for name, runs in history.items() if runs}
            write_json(args.json, summarized(result), echo=False)

        history = interleaved_runs(tlt_modes(args, seed), args.steps, replay_from="reference" if args.replay else None,
                                   on_step=partial, warmup_steps=args.warmup_steps)
        result["runs"][f"seed{seed}"] = {name: curves(runs) for name, runs in history.items()}
    try:
        import ray

        ray.shutdown()  # free the workers' memory before TRL loads its own copy
    except ImportError:
        pass
    if args.trl_only or not (args.quick or args.skip_trl or args.replay):
        from trl_baseline import versions

        result["trl_versions"] = versions()
        run = result["runs"].setdefault(f"seed{args.seeds[0]}", {})

        def partial_trl(steps: list[dict]) -> None:
            if steps:  # TRL's file is written step by step too
                run["trl"] = trl_curves(steps, args.prompts * args.samples)
                write_json(args.json, summarized(result), echo=False)

        run["trl"] = trl_curves(run_trl(args, args.seeds[0], on_step=partial_trl), args.prompts * args.samples)
    summarize(result)
    result["complete"] = True
    write_json(args.json, result)
    print({k: v for k, v in result.items() if k not in ("runs", "environment", "by_mode")})
    return result


def summarized(result: dict) -> dict:
    """The partial result with what can be summarized so far (a mode without steps yet has no medians)."""
    try:
        summarize(result)
    except (TypeError, ZeroDivisionError, statistics.StatisticsError):
        pass
    return result


def summarize(result: dict) -> None:
    """Medians over all steps of all seeds, per mode; ratios of medians. In a replay the modes decoded the same
    tokens, so their step-time ratio is like for like; in natural runs compare tokens/s as well."""
    runs = result["runs"].values()

    def pooled(mode: str, key: str) -> list[float]:
        return [v for run in runs if mode in run for v in run[mode].get(key, []) if v is not None]

    def med(mode: str, key: str):
        return _median(pooled(mode, key))

    modes = [m for m in ("reference", "baseline", "tlt", "trl") if pooled(m, "step_s")]
    result["by_mode"] = {m: {key: med(m, key) for key in SUMMARY_KEYS if med(m, key) is not None} for m in modes}
    result["by_seed"] = {name: {m: {key: round(statistics.median(run[m][key]), 3) for key in ("step_s", "step_tok_s")
                                    if run[m].get(key) and None not in run[m][key]} for m in run}
                         for name, run in result["runs"].items()}
    baseline, tlt = med("baseline", "step_s"), med("tlt", "step_s")
    if baseline is not None and tlt is not None:
        shares = [r / s for r, s in zip(pooled("baseline", "rollout_s"), pooled("baseline", "step_s"))]
        result.update({"baseline_step_s": baseline, "tlt_step_s": tlt,
                       "speedup_vs_baseline": round(baseline / tlt, 3),
                       "tok_s_ratio_vs_baseline": round(med("tlt", "step_tok_s") / med("baseline", "step_tok_s"), 3),
                       "rollout_speedup_vs_baseline": round(med("baseline", "rollout_s") / med("tlt", "rollout_s"), 3),
                       "rollout_share_baseline": round(statistics.median(shares), 3),
                       "rollout_tail_share_baseline": med("baseline", "rollout_tail_share"),
                       "baseline_rollout_s": med("baseline", "rollout_s"), "tlt_rollout_s": med("tlt", "rollout_s")})
    summarize_trl(result)


def summarize_trl(result: dict) -> None:
    """TRL against tlt over the seeds TRL ran (the same prompts; tlt's other seeds drew other problems): median
    step times and tokens per step-second, both tlt modes, and both sides' completion lengths."""
    same = {name: run for name, run in result["runs"].items() if "trl" in run}
    if not same:
        return
    median = lambda mode, key: _median([v for run in same.values() if mode in run
                                        for v in run[mode].get(key, []) if v is not None])
    trl = median("trl", "step_s")
    result.update({"trl_seeds": sorted(same), "trl_step_s": trl, "trl_step_tok_s": median("trl", "step_tok_s"),
                   "trl_rollout_s": median("trl", "rollout_s"),
                   "trl_completion_len_mean": median("trl", "completion_len_mean"),
                   "trl_completion_len_max": median("trl", "completion_len_max")})
    for mode, name in (("tlt", "speedup_vs_trl"), ("baseline", "baseline_speedup_vs_trl")):
        step, tok_s = median(mode, "step_s"), median(mode, "step_tok_s")
        if step is not None and trl is not None:
            result[name] = round(trl / step, 3)
        if tok_s is not None and result["trl_step_tok_s"]:
            result[name.replace("speedup", "tok_s_ratio")] = round(tok_s / result["trl_step_tok_s"], 3)


def _median(values: list[float]):
    return round(statistics.median(values), 3) if values else None


if __name__ == "__main__":
    main()
