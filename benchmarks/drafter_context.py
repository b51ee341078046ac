"""Does the drafter's context at training match the one it serves with? Depth-1 acceptance, both ways.

Training (spot training and `tlt drafter warmup`) keeps each sample's pairs from its last prompt token on: the
drafter attends over the response only. Serving feeds it every pair from slot 0: it also attends over the prompt.
This scores one drafter, teacher-forced (fed the target's own features, as at depth 1), on fresh T=1 responses
with each context: sum min(p, q) over the draft vocabulary (q-sampling's depth-1 acceptance) and top-1 agreement,
at the same response positions. A gap says what training with the serving context could win.

    python benchmarks/drafter_context.py --drafter benchmarks/drafters/smollm2-arithmetic \
        --json benchmarks/results/drafter_context.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.models import KVCache, load_model  # noqa: E402
from tlt.models.eagle import EagleDrafter  # noqa: E402
from tlt.rollout.engine import RolloutEngine  # noqa: E402
from tlt.rollout.request import Request  # noqa: E402
from tlt.sampling import SamplingParams  # noqa: E402
from tlt.tasks import ArithmeticTask, ChatTask  # noqa: E402

EARLY = 16  # the first response tokens, where the prompt is most of what the drafter could attend to


@torch.no_grad()
def depth1(drafter: EagleDrafter, tokens: torch.Tensor, features: torch.Tensor, first: int, temperature: float):
    """Per response position (pairs from `first` on, predicting tokens first + 1 ...): sum min(p, q) and whether
    argmax q = argmax p, for the drafter fed pairs [first, end) of one sequence."""
    x, f = tokens[first + 1:][None], features[first:-1][None]
    length = x.shape[1]
    predicted = drafter(x, f, torch.arange(length)[None], torch.ones(length, length, dtype=torch.bool).tril()[None])
    q = torch.softmax(drafter.draft_logits(predicted[0]) / temperature, -1)
    p = torch.softmax(drafter.draft_logits(features[first + 1:]) / temperature, -1)
    return torch.minimum(p, q).sum(-1), (q.argmax(-1) == p.argmax(-1)).float()


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafter", required=True)
    parser.add_argument("--json")
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--seed", type=int, default=404, help="the task's prompts (other than warm-up seeds 0-3)")
    args = parser.parse_args(argv)
    temperature = 1.0
    loaded = load_model(device="cpu")
    engine = RolloutEngine(loaded, max_batch_size=args.prompts)
    target = engine.policy_forward
    drafter = EagleDrafter.load(args.drafter, loaded.model).attach(target)
    task = ChatTask(ArithmeticTask(), loaded.tokenizer)
    params = SamplingParams(temperature=temperature, max_new_tokens=args.max_new_tokens, seed=args.seed)
    prompts = [task.prompt_ids(e) for e in task.sample(args.prompts, seed=args.seed)]
    rollout = engine.generate([Request(p, params=params) for p in prompts])
    scores = {"response_only": ([], []), "with_prompt": ([], [])}
    early = {"response_only": [], "with_prompt": []}
    for sample in rollout.samples:
        ids = torch.tensor(list(sample.prompt_ids) + list(sample.token_ids))
        cache = KVCache(target.spec, 1, len(ids))
        features = target(ids[None], cache.rows(0, 1), logits_at=None).hidden[0].float()
        start = len(sample.prompt_ids) - 1  # the last prompt token's pair drafts the first response token
        for name, first in (("response_only", start), ("with_prompt", 0)):
            accept, top1 = depth1(drafter, ids, features, first, temperature)
            accept, top1 = accept[start - first:], top1[start - first:]  # the response's positions in both
            scores[name][0].append(accept)
            scores[name][1].append(top1)
            early[name].append(accept[:EARLY])
    result = {"drafter": args.drafter, "prompts": args.prompts, "max_new_tokens": args.max_new_tokens,
              "temperature": temperature, "seed": args.seed, "positions": int(sum(a.numel() for a in
                                                                                  scores["response_only"][0])),
              "environment": environment()}
    for name, (accepts, top1s) in scores.items():
        result[f"accept_q_{name}"] = round(float(torch.cat(accepts).mean()), 4)
        result[f"top1_{name}"] = round(float(torch.cat(top1s).mean()), 4)
        result[f"accept_q_first{EARLY}_{name}"] = round(float(torch.cat(early[name]).mean()), 4)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
