"""How much a drafter can get accepted, under each acceptance rule, on fresh responses of the target.

Target-only rule: a drafted child c is accepted with probability p(c); a perfect drafter proposes the target's
top-K, so its depth-1 acceptance is the target's mean top-K mass, and a chain of depth S reaches at most
tau = 1 + a + ... + a^S. q-sampling (children drawn from the drafter's q): depth-1 acceptance of a chain is
sum_x min(p(x), q(x)) = 1 - TV(p, q), which a good drafter can push past the target's top-1 mass.

Teacher-forced on the sampled responses (every position, the drafter fed the target's own features, as at
depth 1): the target's top-K mass, p(argmax q), p of the drafter's top-2, sum min(p, q), and the target's mass
outside the draft vocabulary (never acceptable by any rule). Measured in the engine at batch 1 (real SD steps,
depth > 1 uses the drafter's own features): acceptance by depth and tau for chain and tree arms of both rules;
for the chain arms also the teacher-forced depth-1 acceptance at the positions where their rounds started.

    python benchmarks/acceptance_bound.py --drafter DIR --json benchmarks/results/acceptance_bound.json
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
from tlt.rollout.request import Request, RolloutResult  # noqa: E402
from tlt.sampling import SamplingParams  # noqa: E402
from tlt.speculative.strategy import SpecStrategy  # noqa: E402
from tlt.tasks import ArithmeticTask, ChatTask  # noqa: E402

ARMS = ["S5K1N5", "S5K1q", "S4K2N8", "S4K2q", "S3K3N9", "S3K3q"]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--drafter", help="a drafter directory (tlt drafter warmup); without one only the "
                        "target's top-K mass is measured")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--engine-prompts", type=int, default=8, help="prompts of the batch-1 SD runs")
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--temperature", type=float, default=1.0)
    args = parser.parse_args(argv)
    loaded = load_model()
    task = ChatTask(ArithmeticTask(), loaded.tokenizer)
    engine = RolloutEngine(loaded, max_batch_size=16)
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=1)
    result = engine.generate([Request(task.prompt_ids(e), params=params) for e in task.sample(args.prompts, 999)])
    drafter = EagleDrafter.load(args.drafter, loaded.model) if args.drafter else None
    stats = [position_stats(engine.forward, drafter, s.prompt_ids, s.token_ids, args.temperature)
             for s in result.samples]
    merged = {key: torch.cat([s[key] for s in stats]) for key in stats[0]}
    top = merged["top_k_mass"].mean(0).tolist()
    results = {"temperature": args.temperature, "positions": int(merged["top_k_mass"].shape[0]),
               "mean_top_k_mass": {str(k + 1): top[k] for k in range(4)},
               "perfect_chain_tau_bound": {str(s): sum(top[0] ** d for d in range(s + 1)) for s in (3, 5, 8)}}
    if drafter is not None:
        results["drafter"] = args.drafter
        results["teacher_forced_depth1"] = {
            "target_only_top1": float(merged["p_argmax_q"].mean()),
            "target_only_top2": float(merged["p_top2_q"].mean()),
            "target_top1_mass": top[0],
            "q_sampling_chain": float(merged["sum_min_pq"].mean()),
            "mass_outside_draft_vocab": float(merged["outside"].mean())}
        prompts = [task.prompt_ids(e) for e in task.sample(args.engine_prompts, 4242)]
        arms = {name: measured_arm(loaded, drafter, prompts, SpecStrategy.parse(name), params) for name in ARMS}
        results["arms_batch1"] = arms
        depth1 = {name: arm["acceptance_by_depth"][0] for name, arm in arms.items()}
        results["depth1_acceptance"] = {
            "target_only_top1": results["teacher_forced_depth1"]["target_only_top1"],
            "target_only_chain_measured": depth1["S5K1N5"],
            "target_only_chain_teacher_forced_at_round_starts":
                arms["S5K1N5"]["teacher_forced_depth1_at_round_starts"],
            "q_sampling_chain": depth1["S5K1q"],
            "q_sampling_chain_teacher_forced_at_round_starts": arms["S5K1q"]["teacher_forced_depth1_at_round_starts"],
            "target_only_tree_best": max(v for k, v in depth1.items() if not k.endswith("q") and "K1" not in k),
            "q_sampling_tree_best": max(v for k, v in depth1.items() if k.endswith("q") and "K1" not in k)}
        for name, arm in arms.items():
            print(f"{name:8s} tau {arm['tau']:.2f}  depth-1 {arm['acceptance_by_depth'][0]:.3f}", file=sys.stderr)
    results["environment"] = environment()
    write_json(args.json, results)
    return results


@torch.no_grad()
def position_stats(forward, drafter, prompt_ids, token_ids, temperature: float) -> dict:
    """Per response position: the target's top-4 mass and, with a drafter, the depth-1 acceptance terms."""
    sequence = list(prompt_ids) + list(token_ids)
    rows = KVCache(forward.spec, 1, len(sequence)).rows(0, 1)
    out = forward(torch.tensor([sequence]), rows, logits_at="all")
    first = len(prompt_ids) - 1                                  # logits at first predict the first response token
    p = torch.softmax(out.logits[0, first:] / temperature, -1)   # [R, V]
    stats = {"top_k_mass": p.sort(-1, descending=True).values[:, :4].cumsum(-1)}
    if drafter is None:
        return stats
    # pair i = (x_{i+1}, f_i) drafts x_{i+2}, verified against the target's logits at i + 1
    pairs = torch.arange(len(sequence) - 1)
    tokens = torch.tensor(sequence)[1:][None]
    causal = torch.ones(len(pairs), len(pairs), dtype=torch.bool).tril()
    hidden = drafter(tokens, out.hidden[:, :-1], pairs[None], causal[None])[0, first - 1:]
    q_draft = torch.softmax(drafter.draft_logits(hidden).float() / temperature, -1)
    q = torch.zeros_like(p)
    ids = drafter.draft_to_target if drafter.draft_to_target is not None else torch.arange(p.shape[-1])
    q[:, ids] = q_draft
    top2 = q.topk(2, -1).indices
    in_vocab = torch.zeros(p.shape[-1], dtype=torch.bool)
    in_vocab[ids] = True
    stats.update(p_argmax_q=p.gather(1, top2[:, :1])[:, 0], p_top2_q=p.gather(1, top2).sum(-1),
                 sum_min_pq=torch.minimum(p, q).sum(-1), outside=p[:, ~in_vocab].sum(-1))
    return stats


def measured_arm(loaded, drafter, prompts, strategy: SpecStrategy, params: SamplingParams) -> dict:
    """tau and acceptance by depth of real SD steps at batch 1; for a chain, also its depth-1 acceptance
    teacher-forced at the positions where its rounds started (the engine's own responses): equal to the measured
    one when the engine is exact, and below the all-positions figure because a round starts right after a
    rejected draft, at a token the drafter failed to predict, more often than a random position does."""
    engine = RolloutEngine(loaded, max_batch_size=1, drafter=drafter, speculation=strategy,
                           max_tree_size=strategy.cache_slots)
    runs = [engine.generate([Request(p, params=params)]) for p in prompts]  # one row each: its rounds in order
    steps = [step for run in runs for step in run.steps]
    summary = RolloutResult([s for run in runs for s in run.samples], steps, 0.0).speculation_summary()
    arm = {"tau": summary["tau"], "acceptance_by_depth": summary["acceptance_by_depth"],
           "tree_size": strategy.tree_size}
    if strategy.branching == 1:
        key = "sum_min_pq" if strategy.rule == "q" else "p_argmax_q"
        at_starts = [position_stats(engine.forward, drafter, run.samples[0].prompt_ids, run.samples[0].token_ids,
                                    params.temperature)[key][round_starts(run)] for run in runs]
        arm["teacher_forced_depth1_at_round_starts"] = float(torch.cat(at_starts).mean())
    return arm


def round_starts(run) -> list[int]:
    """Response positions whose token a batch-1 run's SD rounds drafted first (the tokens emitted before)."""
    emitted, starts = 0, []
    length = len(run.samples[0].token_ids)
    for step in run.steps:
        if step.mode == "sd" and emitted < length:
            starts.append(emitted)
        emitted += step.new_tokens
    return starts


if __name__ == "__main__":
    main()
