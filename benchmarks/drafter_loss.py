"""Which drafter loss lifts q-sampling acceptance: the feature/soft-CE weights, and a total-variation term.

Under q-sampling a chain's depth-1 acceptance is sum_x min(p(x), q(x)) = 1 - TV(p, q), so the question is which
training loss drives TV down fastest. Every variant trains from the same initialisation on the same features
(T = 1 responses of SmolLM2 on the built-in task, generated once and cached) and is scored every `--eval-every`
steps on held-out prompts, teacher-forced, with the target's full-vocabulary p: sum min(p, q), p(argmax q), and
the target's mass outside the draft vocabulary.

    python benchmarks/drafter_loss.py --json benchmarks/results/drafter_loss.json \
        --variants ce=0.1 ce=1.0 ce=1.0,tv=1.0 --steps 300
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).parent))
from acceptance_bound import position_stats  # noqa: E402
from common import environment, write_json  # noqa: E402

from tlt.drafter.buffer import FeatureBuffer  # noqa: E402
from tlt.drafter.features import collect_features  # noqa: E402
from tlt.drafter.trainer import DrafterTrainConfig, DrafterTrainer  # noqa: E402
from tlt.drafter.vocabulary import frequent_tokens  # noqa: E402
from tlt.models import load_model  # noqa: E402
from tlt.models.eagle import EagleDrafter  # noqa: E402
from tlt.rollout.engine import RolloutEngine  # noqa: E402
from tlt.rollout.request import Request  # noqa: E402
from tlt.sampling import SamplingParams  # noqa: E402
from tlt.tasks import ArithmeticTask, ChatTask  # noqa: E402


class TotalVariationTrainer(DrafterTrainer):
    """The library's loss plus `tv_weight` * TV(p, q) over the draft vocabulary (p renormalised there)."""

    def __init__(self, *args, tv_weight: float = 0.0, **kwargs):
        super().__init__(*args, **kwargs)
        self.tv_weight = tv_weight

    def loss(self, batch, weights, *, noise=True):
        if self.tv_weight <= 0:
            return super().loss(batch, weights, noise=noise)
        cfg = self.config
        predicted = self.drafter(batch.input_tokens, batch.input_features, batch.positions, batch.attention_mask)

        def weighted(per_pair):  # (weights: 0 at padding; a step's sum to 1)
            return (per_pair.float() * weights).sum()
        feature_loss = weighted(F.smooth_l1_loss(predicted, batch.target_features, reduction="none").mean(-1))
        log_q = torch.log_softmax(self.drafter.draft_logits(predicted), -1)
        with torch.no_grad():
            p = torch.softmax(self.drafter.draft_logits(batch.target_features), -1)
        ce = weighted(-(p * log_q).sum(-1))
        tv = weighted(0.5 * (p - log_q.exp()).abs().sum(-1))
        loss = cfg.feature_weight * feature_loss + cfg.ce_weight * ce + self.tv_weight * tv
        return loss, {"loss": loss.detach(), "tv": tv.detach()}


def responses(loaded, task, prompts: int, cache: Path | None, seed: int = 0) -> tuple[list, list]:
    if cache is not None and cache.exists():
        data = json.loads(cache.read_text())
        return data["prompts"], data["responses"]
    engine = RolloutEngine(loaded, max_batch_size=64)
    params = SamplingParams(temperature=1.0, max_new_tokens=256, seed=0)
    result = engine.generate([Request(task.prompt_ids(e), n=2, params=params) for e in task.sample(prompts, seed=seed)],
                             progress=True)
    prompt_ids = [list(s.prompt_ids) for s in result.samples]
    response_ids = [s.token_ids for s in result.samples]
    if cache is not None:
        cache.write_text(json.dumps({"prompts": prompt_ids, "responses": response_ids}))
    return prompt_ids, response_ids


def held_out_acceptance(forward, drafter, prompts, responses_) -> dict:
    """Teacher-forced depth-1 terms over every held-out response position, p over the full vocabulary (the same
    per-position statistics as benchmarks/acceptance_bound.py)."""
    stats = [position_stats(forward, drafter, p, r, temperature=1.0) for p, r in zip(prompts, responses_)]
    merged = {key: torch.cat([s[key] for s in stats]) for key in ("sum_min_pq", "p_argmax_q", "outside")}
    return {"sum_min_pq": float(merged["sum_min_pq"].mean()), "p_argmax_q": float(merged["p_argmax_q"].mean()),
            "outside_draft_vocab": float(merged["outside"].mean()), "positions": int(merged["outside"].shape[0])}


def parse_variant(text: str) -> dict:
    weights = {"ce": 0.1, "feature": 1.0, "tv": 0.0}
    for part in text.split(","):
        key, value = part.split("=")
        if key not in weights:
            raise SystemExit(f"unknown loss weight {key!r} in {text!r} (ce, feature, tv)")
        weights[key] = float(value)
    return weights


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--variants", nargs="+", default=["ce=0.1", "ce=1.0", "ce=1.0,tv=1.0"])
    parser.add_argument("--prompts", type=int, default=384, help="2 responses each; the last 10%% are held out")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--eval-every", type=int, default=100)
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--cache", help="JSON file for the generated responses (reused when it exists)")
    args = parser.parse_args(argv)
    loaded = load_model()
    task = ChatTask(ArithmeticTask(), loaded.tokenizer)
    prompts, responses_ = responses(loaded, task, args.prompts, Path(args.cache) if args.cache else None)
    held_from = len(prompts) - 2 * max(1, len(prompts) // 2 // 10)
    forward = RolloutEngine(loaded, max_batch_size=8).policy_forward
    buffer = FeatureBuffer(max_tokens=10_000_000, recency=0.0, seed=0)
    collect_features(forward, prompts[:held_from], responses_[:held_from], buffer, step=0)
    draft_vocab = frequent_tokens(responses_[:held_from], args.draft_vocab, loaded.spec.vocab_size)
    results = {"prompts": args.prompts, "held_out_responses": len(prompts) - held_from, "steps": args.steps,
               "variants": {}, "environment": environment(), "complete": False}
    for text in args.variants:
        weights = parse_variant(text)
        torch.manual_seed(0)
        drafter = EagleDrafter(loaded.model.config, draft_vocab).attach(forward)
        trainer = TotalVariationTrainer(drafter, buffer, DrafterTrainConfig(ce_weight=weights["ce"],
                                        feature_weight=weights["feature"]), tv_weight=weights["tv"])
        log, started = [], time.perf_counter()
        for step in range(1, args.steps + 1):
            trainer.train_steps(1)
            if step % args.eval_every == 0 or step == args.steps:
                scores = held_out_acceptance(forward, drafter, prompts[held_from:], responses_[held_from:])
                log.append(scores | {"step": step, "elapsed_s": time.perf_counter() - started})
                print(f"{text}: step {step} sum min(p, q) {scores['sum_min_pq']:.3f}", file=sys.stderr)
        results["variants"][text] = log
        write_json(args.json, results)
    results["complete"] = True
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
