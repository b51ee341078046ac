"""What spot training does to a warmed drafter: held-out acceptance after K optimizer steps on fresh on-policy data.

Spot training (idle workers, or a lone worker's tail) goes on training the run's drafter on the features of each
RL step's rollouts. This isolates that training from the RL run: fresh T=1 responses of the policy on prompts the
warm-up never drew, split by prompt into training and held-out halves; copies of the warmed drafter train on the
first with a fresh AdamW (as a run whose --drafter directory has no optimizer state starts, e.g. the committed
one) at each learning rate and lr ramp (`lr@ramp_steps`: DrafterTrainConfig.warmup_steps), and are scored on the second (teacher-forced: depth-1 sum min(p, q) at T=1, top-1)
every few steps. `--model`: the policy these fresh responses and features come from, e.g. a run's final policy
after some RL steps (`tlt train ... run.steps=10`: RUN/final): how much the policy's drift costs the warmed
drafter (step 0 against the base model's step 0), and how much training on the drifted policy's features wins back.

    python benchmarks/drafter_adaptation.py --drafter benchmarks/drafters/smollm2-arithmetic \
        --json benchmarks/results/drafter_adaptation.json
"""

from __future__ import annotations

import argparse
import copy
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.drafter.buffer import FeatureBuffer  # noqa: E402
from tlt.drafter.features import collect_features  # noqa: E402
from tlt.drafter.trainer import DrafterTrainConfig, DrafterTrainer  # noqa: E402
from tlt.models import load_model  # noqa: E402
from tlt.models.eagle import EagleDrafter  # noqa: E402
from tlt.rollout.engine import RolloutEngine  # noqa: E402
from tlt.rollout.request import Request  # noqa: E402
from tlt.sampling import SamplingParams  # noqa: E402
from tlt.tasks import ArithmeticTask, ChatTask  # noqa: E402

SCORES = ("accept_q", "accept_target_only", "top1", "loss")


def fresh_features(loaded, drafter, prompts: int, tokens: int, seed: int):
    """(training buffer, held-out entries): 2 responses per prompt, the last quarter of the prompts held out."""
    task = ChatTask(ArithmeticTask(), loaded.tokenizer)
    engine = RolloutEngine(loaded, max_batch_size=64)
    params = SamplingParams(temperature=1.0, max_new_tokens=tokens, seed=seed)
    requests = [Request(task.prompt_ids(e), n=2, params=params) for e in task.sample(prompts, seed=seed)]
    samples = engine.generate(requests, progress=True).samples
    held_from = len(samples) - 2 * max(1, prompts // 4)
    train, held = FeatureBuffer(10_000_000, recency=0.0, seed=seed), FeatureBuffer(10_000_000, recency=0.0)
    for buffer, part in ((train, samples[:held_from]), (held, samples[held_from:])):
        collect_features(engine.policy_forward, [list(s.prompt_ids) for s in part], [s.token_ids for s in part],
                         buffer, step=0)
    return train, list(held.entries), sum(len(s.token_ids) for s in samples)


def scores(trainer: DrafterTrainer, held) -> dict:
    return {key: round(value, 4) for key, value in trainer.evaluate(held).items() if key in SCORES}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--model", default="smollm2", help="the policy (default: the base SmolLM2-135M-Instruct)")
    parser.add_argument("--json", required=True)
    parser.add_argument("--prompts", type=int, default=48)
    parser.add_argument("--max-new-tokens", type=int, default=192)
    parser.add_argument("--arms", default="1e-3@0,1e-3@25,3e-4@0,3e-4@25,1e-4@0",
                        help="comma-separated lr@ramp: the learning rate and the fresh optimizer's lr ramp in steps")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--every", type=int, default=10)
    parser.add_argument("--seed", type=int, default=101, help="prompts the warm-up (seeds 0-3) never drew")
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model(args.model)
    warmed = EagleDrafter.load(args.drafter, loaded.model).float()
    started = time.perf_counter()
    train, held, generated = fresh_features(loaded, warmed, args.prompts, args.max_new_tokens, args.seed)
    result = {"environment": environment(), "drafter": args.drafter, "model": args.model, "prompts": args.prompts,
              "max_new_tokens": args.max_new_tokens, "generated_tokens": generated, "held_out_responses": len(held),
              "generate_s": round(time.perf_counter() - started, 1), "steps": args.steps, "by_arm": {}}
    for arm in args.arms.split(","):
        lr, ramp = arm.split("@")
        trainer = DrafterTrainer(copy.deepcopy(warmed).attach(loaded.model), train,
                                 DrafterTrainConfig(lr=float(lr), warmup_steps=int(ramp), temperature=1.0,
                                                    seed=args.seed))
        curve = [{"step": 0, **scores(trainer, held)}]
        while trainer.steps < args.steps:
            trainer.train_steps(args.every)
            curve.append({"step": trainer.steps, **scores(trainer, held)})
            print(f"{arm} step {trainer.steps}: {curve[-1]}", flush=True)
        result["by_arm"][f"lr={float(lr):g} ramp={int(ramp)}"] = curve
        write_json(args.json, result, echo=False)
    write_json(args.json, result)


if __name__ == "__main__":
    main()
