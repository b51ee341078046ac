"""Does training the drafter on its own features (`DrafterTrainConfig.unroll`, drafter/unroll.py) raise τ?

A drafter drafts depth 1 from the target's features and every deeper token from its own: trained by teacher
forcing alone, it never sees its own features as input. This fine-tunes one drafter (default: the committed
SmolLM2 drafter) on the same fresh T=1 responses with each `--unroll` setting, the same steps, lr and seed, and
scores every variant on held-out responses by what decides speed: the τ of its draft chains
(tlt.drafter.chain: depth `--depth`, the target-only rule, at T=1 and greedy) and, teacher-forced, the
q-sampling acceptance at depth 1 and at the deepest unrolled level (true tokens, fed-back features).

    python benchmarks/drafter_unroll.py --json benchmarks/results/drafter_unroll.json --unroll 1 3 --steps 150
    python benchmarks/drafter_unroll.py --json benchmarks/results/drafter_unroll_scratch.json --from-scratch \
        --lr 1e-3 --steps 300 --unroll 1 3
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402
from drafter_loss import responses  # noqa: E402

from tlt.drafter.buffer import FeatureBuffer  # noqa: E402
from tlt.drafter.chain import chain_acceptance  # noqa: E402
from tlt.drafter.features import collect_features  # noqa: E402
from tlt.drafter.trainer import DrafterTrainConfig, DrafterTrainer  # noqa: E402
from tlt.models import load_model  # noqa: E402
from tlt.models.eagle import EagleDrafter  # noqa: E402
from tlt.rollout.engine import RolloutEngine  # noqa: E402
from tlt.tasks import ArithmeticTask, ChatTask  # noqa: E402

COMMITTED = Path(__file__).parent / "drafters" / "smollm2-arithmetic"


def scores(forward, drafter, held_prompts, held_responses, held_buffer, depth: int) -> dict:
    """What the variant is judged on: chain τ at T=1 and T=0, and teacher-forced q-sampling acceptance at
    depth 1 and at depth `depth` (an evaluation-only trainer over the held-out features)."""
    out = {}
    for temperature in (1.0, 0.0):
        chain = chain_acceptance(drafter, forward, held_prompts, held_responses, depth, temperature)
        out[f"tau_t{temperature:g}"] = chain.tau
        out[f"reach_t{temperature:g}"] = chain.reach_by_depth
    judge = DrafterTrainer(drafter, held_buffer, DrafterTrainConfig(unroll=depth))
    evaluated = judge.evaluate(list(held_buffer.entries))
    out.update(accept_q_depth1=evaluated["accept_q"], accept_q_deepest=evaluated["accept_q_deepest"])
    return out


def add_response_args(parser) -> None:
    """The fresh responses' flags, shared by the drafter-training probes (drafter_aux_features.py too)."""
    parser.add_argument("--prompts", type=int, default=96, help="2 responses each; the last 20%% are held out")
    parser.add_argument("--seed", type=int, default=7, help="of the prompts: not the warm-up's")
    parser.add_argument("--cache", help="JSON file for the generated responses (reused when it exists)")


def held_out_responses(args) -> tuple:
    """(loaded model, prompts, responses, index of the first held-out response, the policy's forward): T=1
    responses to the built-in task's prompts, every response of the last 20% of prompts held out."""
    loaded = load_model()
    task = ChatTask(ArithmeticTask(), loaded.tokenizer)
    prompts, responses_ = responses(loaded, task, args.prompts, Path(args.cache) if args.cache else None,
                                    seed=args.seed)
    held_from = len(prompts) - 2 * max(1, len(prompts) // 2 // 5)
    return loaded, prompts, responses_, held_from, RolloutEngine(loaded, max_batch_size=8).policy_forward


def feature_buffers(forward, prompts, responses_, held_from: int) -> tuple:
    """(training buffer, held-out buffer, (held-out prompts, responses)): the target's features of each split."""
    buffers = []
    for part in (slice(None, held_from), slice(held_from, None)):
        buffer = FeatureBuffer(max_tokens=10_000_000, recency=0.0, seed=0)
        collect_features(forward, prompts[part], responses_[part], buffer, step=0)
        buffers.append(buffer)
    return buffers[0], buffers[1], (prompts[held_from:], responses_[held_from:])


def starting_drafter(args, forward) -> EagleDrafter:
    """--drafter as saved, or with --from-scratch a fresh drafter (torch seed 0) over its draft vocabulary."""
    drafter = EagleDrafter.load(args.drafter, forward)
    if not args.from_scratch:
        return drafter
    torch.manual_seed(0)
    return drafter.like(drafter.draft_to_target).attach(forward)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--unroll", type=int, nargs="+", default=[1, 3])
    parser.add_argument("--drafter", default=str(COMMITTED), help="the drafter every variant starts from")
    parser.add_argument("--from-scratch", action="store_true", help="start every variant from a fresh drafter "
                        "(torch seed 0) over --drafter's draft vocabulary instead")
    add_response_args(parser)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=1e-4, help="a warmed drafter's (its warm-up ended there)")
    parser.add_argument("--depth", type=int, default=5, help="chain depth scored (and the judge's unroll)")
    args = parser.parse_args(argv)
    loaded, prompts, responses_, held_from, forward = held_out_responses(args)
    train_buffer, held_buffer, held = feature_buffers(forward, prompts, responses_, held_from)
    results = {"drafter": args.drafter, "prompts": args.prompts, "held_out_responses": len(held[0]),
               "steps": args.steps, "lr": args.lr, "depth": args.depth, "seed": args.seed, "variants": {},
               "environment": environment(), "complete": False}
    results["from_scratch"] = args.from_scratch
    start = starting_drafter(args, forward)
    results["before"] = scores(forward, start, *held, held_buffer, args.depth)
    print(f"before: {results['before']}", file=sys.stderr)
    write_json(args.json, results, echo=False)
    for unroll in args.unroll:
        drafter = starting_drafter(args, forward)
        trainer = DrafterTrainer(drafter, train_buffer, DrafterTrainConfig(lr=args.lr, unroll=unroll, seed=0))
        started = time.perf_counter()
        trainer.train_steps(args.steps)
        elapsed = time.perf_counter() - started
        results["variants"][str(unroll)] = row = {**scores(forward, drafter, *held, held_buffer, args.depth),
                                                  "train_s": elapsed}
        print(f"unroll {unroll}: {row}", file=sys.stderr)
        write_json(args.json, results, echo=False)
    results["complete"] = True
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
