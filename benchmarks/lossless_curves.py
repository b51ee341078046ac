"""Lossless training: does full TLT mode learn exactly like the baseline? Curves over enough steps to see learning.

A small random Llama (vocab 16) learns a verifiable task (reward = share of token 5 in the response) in a few
dozen GRPO steps, which no real model does on 2 CPU cores. Baseline (no SD) and TLT mode (adaptive SD, drafter
trained from scratch by spot training on the idle worker, hot-swapped) run with 2 in-process workers and two
seeds each. SD changes which random numbers are drawn, so runs differ sample by sample; lossless means the
baseline-vs-TLT difference is no larger than the seed-to-seed difference.

    python benchmarks/lossless_curves.py --json benchmarks/results/lossless_curves.json [--steps 30]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.distributed.controller import DistributedGRPO  # noqa: E402
from tlt.models import LoadedModel, ModelSpec  # noqa: E402
from tlt.rl.config import load_config  # noqa: E402
from tlt.rl.rewards import Reward  # noqa: E402
from tlt.tasks.synthetic import IdTokenizer, TargetTokenTask, share_of_target  # noqa: E402

TARGET, VOCAB, EOS = 5, 16, 3
KEYS = ("reward_mean", "response_len_mean", "sd/tau", "spot_train_steps")


def small_model(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                         bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    return LoadedModel(model, IdTokenizer(eos_token_id=EOS), ModelSpec.from_config(config), "small-llama")


def run(mode: str, seed: int, steps: int) -> list[dict]:
    settings = {"rollout.prompts_per_step": 4, "rollout.samples_per_prompt": 8, "rollout.max_new_tokens": 24,
                "optim.lr": 0.01, "optim.micro_batch_size": 8, "run.workers": 2, "run.backend": "inprocess",
                "run.seed": seed, "run.tensorboard": False, "run.gate": 64, "run.publish_every": 5}
    settings["run.speculative"] = "adaptive" if mode == "tlt" else "off"  # tlt: spot training trains the drafter
    config = load_config(None, [f"{k}={v}" for k, v in settings.items()])
    controller = DistributedGRPO(config, loaded=small_model(0), task=TargetTokenTask(TARGET, VOCAB),
                                 reward=Reward(share_of_target))
    try:
        return [controller.train_step() for _ in range(steps)]
    finally:
        controller.close()


def mean_abs_gap(a: list[float], b: list[float]) -> float:
    return statistics.fmean(abs(x - y) for x, y in zip(a, b))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", required=True)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    curves = {}
    for mode in ("baseline", "tlt"):
        for seed in (0, 1):
            history = run(mode, seed, args.steps)
            curves[f"{mode}/seed{seed}"] = {k: [round(float(m.get(k, 0.0)), 4) for m in history] for k in KEYS}
            print(mode, seed, "reward first/last 5:", statistics.fmean(curves[f"{mode}/seed{seed}"]["reward_mean"][:5]),
                  statistics.fmean(curves[f"{mode}/seed{seed}"]["reward_mean"][-5:]))
    reward = {name: c["reward_mean"] for name, c in curves.items()}
    result = {
        "environment": environment(), "steps": args.steps, "curves": curves,
        "mode_gap": round(statistics.fmean([mean_abs_gap(reward[f"baseline/seed{s}"], reward[f"tlt/seed{s}"])
                                            for s in (0, 1)]), 4),
        "seed_gap": round(statistics.fmean([mean_abs_gap(reward[f"{m}/seed0"], reward[f"{m}/seed1"])
                                            for m in ("baseline", "tlt")]), 4),
        "final_reward": {name: round(statistics.fmean(r[-5:]), 4) for name, r in reward.items()},
        "initial_reward": {name: round(statistics.fmean(r[:5]), 4) for name, r in reward.items()},
    }
    write_json(args.json, result)
    plot(curves, Path(args.json).with_suffix(".png"))
    print({k: result[k] for k in ("mode_gap", "seed_gap", "final_reward")})


def plot(curves: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
    for name, curve in curves.items():
        style = "-" if name.startswith("baseline") else "--"
        for axis, key in zip(axes, ("reward_mean", "response_len_mean", "sd/tau")):
            axis.plot(range(1, len(curve[key]) + 1), curve[key], style, label=name)
            axis.set_title(key)
            axis.set_xlabel("RL step")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
