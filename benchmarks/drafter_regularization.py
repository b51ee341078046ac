"""Does regularizing the drafter's training raise held-out acceptance, where the warm-up is data-bound?

A warm-up round trains ~8-20 passes over its responses and ends with training batches at top-1 agreement 0.81-0.84
against 0.55-0.61 held out (docs/benchmarks.md §3): the drafter memorises. Two knobs of DrafterTrainConfig were
never measured: `feature_noise` (EAGLE's uniform noise on the input features, which also stands in for the drafter's
own imperfect features at depth > 1) and AdamW's `weight_decay`. This fine-tunes one drafter (default: the committed
SmolLM2 drafter) on the same fresh T=1 responses with each variant, the same steps, lr, seed and batches, and scores
it on held-out responses every `--eval-every` steps (teacher-forced: top-1 agreement, what greedy accepts at
depth 1; Σ min(p, q) at T=1, what q-sampling accepts) and at the end by chain τ (tlt.drafter.chain, depth
`--depth`, at T=1 and greedy), besides the training batches' own top-1 (the memorisation gap).

    python benchmarks/drafter_regularization.py --json benchmarks/results/drafter_regularization.json \
        --cache /tmp/responses.json --variants none noise=0.1 noise=0.3 wd=0.1
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402
from drafter_unroll import (add_response_args, feature_buffers, held_out_responses, scores,  # noqa: E402
                            starting_drafter)

from tlt.drafter.buffer import FeatureBuffer  # noqa: E402
from tlt.drafter.trainer import DrafterTrainConfig, DrafterTrainer  # noqa: E402

COMMITTED = Path(__file__).parent / "drafters" / "smollm2-arithmetic"
KNOBS = {"noise": "feature_noise", "wd": "weight_decay"}


def parse_variant(text: str) -> dict:
    """'none' or 'noise=0.1,wd=0.05' -> DrafterTrainConfig overrides."""
    if text == "none":
        return {}
    overrides = {}
    for part in text.split(","):
        key, _, value = part.partition("=")
        if key not in KNOBS or not value:
            raise SystemExit(f"bad variant {text!r}: give 'none' or key=value pairs of {sorted(KNOBS)}")
        overrides[KNOBS[key]] = float(value)
    return overrides


def held_out_scores(trainer: DrafterTrainer, held_buffer: FeatureBuffer) -> dict:
    evaluated = trainer.evaluate(list(held_buffer.entries))
    return {"top1": evaluated["top1"], "accept_q": evaluated["accept_q"]}


def train_variant(drafter, train_buffer, held_buffer, config: DrafterTrainConfig, steps: int, every: int) -> dict:
    """Train `steps` steps, scoring held-out every `every`; the training batches' mean top-1 over each span."""
    trainer = DrafterTrainer(drafter, train_buffer, config)
    curve, started = [], time.perf_counter()
    for done in range(every, steps + every, every):
        history = trainer.train_steps(min(every, steps - (done - every)))
        curve.append({"step": min(done, steps), **held_out_scores(trainer, held_buffer),
                      "train_top1": statistics.fmean(h["top1"] for h in history)})
        print(f"  {curve[-1]}", file=sys.stderr)
    return {"curve": curve, "train_s": time.perf_counter() - started}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--variants", nargs="+", default=["none", "noise=0.1", "noise=0.3", "wd=0.1"])
    parser.add_argument("--drafter", default=str(COMMITTED), help="the drafter every variant starts from")
    parser.add_argument("--from-scratch", action="store_true", help="start every variant from a fresh drafter "
                        "(torch seed 0) over --drafter's draft vocabulary instead")
    add_response_args(parser)
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--eval-every", type=int, default=200)
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--depth", type=int, default=5, help="chain depth scored")
    args = parser.parse_args(argv)
    variants = {text: parse_variant(text) for text in args.variants}
    loaded, prompts, responses_, held_from, forward = held_out_responses(args)
    train_buffer, held_buffer, held = feature_buffers(forward, prompts, responses_, held_from)
    results = {"drafter": args.drafter, "from_scratch": args.from_scratch, "prompts": args.prompts,
               "train_responses": held_from, "held_out_responses": len(held[0]),
               "train_pairs": sum(e.num_pairs for e in train_buffer.entries),
               "steps": args.steps, "lr": args.lr, "depth": args.depth, "seed": args.seed, "variants": {},
               "environment": environment(), "complete": False}
    start = starting_drafter(args, forward)
    results["before"] = {**held_out_scores(DrafterTrainer(start, held_buffer, DrafterTrainConfig()), held_buffer),
                         **scores(forward, start, *held, held_buffer, args.depth)}
    print(f"before: {results['before']}", file=sys.stderr)
    write_json(args.json, results, echo=False)
    for text, overrides in variants.items():
        print(f"variant {text}", file=sys.stderr)
        drafter = starting_drafter(args, forward)
        config = DrafterTrainConfig(lr=args.lr, seed=0, **overrides)
        row = train_variant(drafter, train_buffer, held_buffer, config, args.steps, args.eval_every)
        row.update(scores(forward, drafter, *held, held_buffer, args.depth))
        results["variants"][text] = row
        print(f"{text}: tau {row['tau_t1']:.3f} / greedy {row['tau_t0']:.3f}", file=sys.stderr)
        write_json(args.json, results, echo=False)
    results["complete"] = True
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
