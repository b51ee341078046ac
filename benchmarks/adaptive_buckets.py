"""The RL run's own adaptive engine against plain decoding, batch bucket by batch bucket: does speculation ever
run where it loses?

#13 asks that speculative decoding be "never below 1.0x at a batch size where the adaptive policy turns it on".
The fixed-arm table of `speculative.py` shows where each arm wins; this shows what the policy does with them. Both
engines are built as `tlt train` builds them (`rl/replica.py: build_engine`: `run.speculative=off` and
`adaptive`, `run.gate=auto` from the device's cost curve, the run's arm set), decode the same long-tailed rollout
(the built-in task's prompts, EOS on, `max_new_tokens` 1024 by default: most answers end early, a few run long),
once untimed (graphs, compiles, the cost curve) and once timed. Every decode step's trace gives tokens per second
at its batch size; per bucket (the graph runner's: 1, 2, 4, 8, 16, 24, 32, ...) the adaptive run's speculative
steps are compared with the plain run's steps of the same bucket (medians of tokens/s). A bucket where the policy
speculated and the ratio is below 1 is listed in `sd_below_plain_where_on` (what #13 says must stay empty).

At T > 0 the two runs sample different tokens (lossless in distribution, not token for token), so their lengths
differ; per-step rates compare like with like, the rollout times are reported beside them.

    python benchmarks/adaptive_buckets.py --device cuda --drafter DIR --json benchmarks/results/adaptive_buckets_h100.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.models import load_model  # noqa: E402
from tlt.rl.config import load_config  # noqa: E402
from tlt.rl.replica import build_engine  # noqa: E402
from tlt.rollout.graph_runner import BATCH_BUCKETS, batch_bucket  # noqa: E402
from tlt.rollout.policy import policy_strategies  # noqa: E402
from tlt.rollout.request import Request  # noqa: E402
from tlt.sampling import SamplingParams  # noqa: E402
from tlt.tasks import ArithmeticTask, ChatTask  # noqa: E402


MIN_SD_STEPS = 10  # SD steps in a bucket for its ratio to count as "where the policy turns SD on"


def bucket_of(batch: int) -> int:
    """The graph runner's batch bucket (past its largest: the batch itself)."""
    return batch_bucket(batch, BATCH_BUCKETS[-1]) or batch


def rates_by_bucket(steps, mode: str | None = None) -> dict[int, list[float]]:
    """Tokens per second of each decode step (mode "sd" or "plain"; None: every step), by batch bucket: the
    tokens that landed in its call over its cycle (its start to the next step's: an overlapped step's call
    returns before its tokens do). Only calls that landed one step: an overlapped run's first call lands none
    and the call that ends it two."""
    rates: dict[int, list[float]] = {}
    for step, after in zip(steps, [*steps[1:], None]):
        if step.kind != "decode" or step.landed != 1 or (mode is not None and step.mode != mode):
            continue
        cycle = after.start_s - step.start_s if after is not None else step.wall_s
        if cycle > 0:
            rates.setdefault(bucket_of(step.batch_size), []).append(step.new_tokens / cycle)
    return rates


def compare(plain_steps, adaptive_steps) -> dict:
    """Per bucket: the plain run's median step rate, the adaptive run's speculative steps (count, median rate,
    the ratio), and the buckets where the policy speculated and lost."""
    plain = rates_by_bucket(plain_steps)
    sd = rates_by_bucket(adaptive_steps, "sd")
    by_bucket = {}
    for bucket in sorted(set(plain) | set(sd)):
        row = {"plain_steps": len(plain.get(bucket, [])), "sd_steps": len(sd.get(bucket, []))}
        if bucket in plain:
            row["plain_tok_s"] = statistics.median(plain[bucket])
        if bucket in sd:
            row["sd_tok_s"] = statistics.median(sd[bucket])
        if bucket in plain and bucket in sd:
            row["ratio"] = row["sd_tok_s"] / row["plain_tok_s"]
        by_bucket[str(bucket)] = row
    below = [f"bucket {b}: x{row['ratio']:.2f} ({row['sd_steps']} SD steps)" for b, row in by_bucket.items()
             if row.get("ratio", 1.0) < 1.0]
    # buckets where the policy speculated, not where it only explored (a few SD steps a priced-out arm gets: review)
    ratios = [row["ratio"] for row in by_bucket.values() if "ratio" in row and row["sd_steps"] >= MIN_SD_STEPS]
    return {"by_bucket": by_bucket, "sd_below_plain_where_on": below,
            "min_ratio_where_on": min(ratios) if ratios else None}  # what gpu_targets.py judges


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--drafter", required=True, help="a warmed drafter directory (run.drafter)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--prompts", type=int, default=16, help="distinct prompts, one sample each")
    parser.add_argument("--max-new-tokens", type=int, default=1024)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--gate", default="auto", help="run.gate: auto (the device's cost curve) or a batch size")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="more config overrides")
    args = parser.parse_args(argv)
    overrides = [f"model.device={args.device}", f"run.drafter={args.drafter}", f"run.gate={args.gate}",
                 f"rollout.max_new_tokens={args.max_new_tokens}", f"rollout.temperature={args.temperature}",
                 *args.set]
    configs = {mode: load_config(None, overrides + [f"run.speculative={mode}"]) for mode in ("off", "adaptive")}
    loaded = load_model(device=args.device)
    task = ChatTask(ArithmeticTask(), loaded.tokenizer)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0)
    requests = [Request(task.prompt_ids(e), params=params) for e in task.sample(args.prompts, seed=7)]
    results = {"device": args.device, "drafter": args.drafter, "prompts": args.prompts, "overrides": overrides,
               "max_new_tokens": args.max_new_tokens, "temperature": args.temperature, "environment": environment(),
               "complete": False}
    runs = {}
    for mode, config in configs.items():
        engine = build_engine(loaded, config, task=task)
        engine.generate(requests)  # untimed: graphs captured, compiles done (the cost curve ran at build)
        if engine.speculation is not None:
            engine.speculation.reset()  # as an RL step does between rollouts (rl/phases.py): the gate closes
        runs[mode] = engine.generate(requests)
        results[mode] = {"rollout_s": runs[mode].wall_s, "tokens": runs[mode].generated_tokens,
                         "tok_s": runs[mode].tokens_per_s}
        if mode == "adaptive":
            policy = engine.speculation  # None: the cost curve found no arm that pays on this device
            results[mode].update(gate=policy.gate.threshold if policy is not None else 0,
                                 arms=[a.name for a in policy_strategies(policy)],
                                 policy=policy.summary() if hasattr(policy, "summary") else None,
                                 speculation=runs[mode].speculation_summary())
        write_json(args.json, results, echo=False)
    results.update(compare(runs["off"].steps, runs["adaptive"].steps))
    results["complete"] = True
    write_json(args.json, results)
    for bucket, row in results["by_bucket"].items():
        print(f"bucket {bucket:>3}: plain {row.get('plain_tok_s', 0):8.1f} tok/s  SD {row.get('sd_tok_s', 0):8.1f} "
              f"tok/s ({row['sd_steps']} steps)  x{row.get('ratio', float('nan')):.2f}", file=sys.stderr)
    return results


if __name__ == "__main__":
    main()
