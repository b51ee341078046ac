"""What the training head's precision costs: the chunked log-probs' forward + backward (src/tlt/rl/actor.py) with the
lm_head in fp32 outside autocast (what tlt does, so the PPO ratio compares the head the rollout samples from) vs the
same computation with the head under bf16 autocast (what it did before), at SmolLM2-135M's head (576 x 49152).

    python benchmarks/head_precision.py --device cuda --tokens 16384 --json $OUT/head_precision_h100.json

Both variants alternate, `--repeats` times each, after a warm-up; medians. On the CPU bf16 matmuls are far slower
than fp32 (no bf16 units), so the ratio there says nothing about a GPU.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.rl import actor  # noqa: E402


def bf16_head_logits(states, weight, bias, temperature: float) -> torch.Tensor:
    """The head under bf16 autocast (forward and backward recompute alike): the variant being priced."""
    with torch.autocast(states.device.type, dtype=torch.bfloat16):
        logits = torch.nn.functional.linear(states, weight, bias).float()
    return logits / temperature if temperature not in (0, 1) else logits


def timed(device: torch.device, states, weight, targets, chunk: int) -> float:
    states.grad = weight.grad = None
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    with torch.autocast(device.type, dtype=torch.bfloat16):
        out, _ = actor.ChunkedTokenLogprobs.apply(states, weight, None, targets, 1.0, chunk)
    out.sum().backward()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1000


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--tokens", type=int, default=16 * 1024, help="response tokens in one update (16 x 1024)")
    parser.add_argument("--hidden", type=int, default=576)
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--chunk", type=int, default=actor.CHUNK_TOKENS, help="tokens per chunk (the actor's)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    generator = torch.Generator(device=device).manual_seed(0)
    states = torch.randn(args.tokens, args.hidden, device=device, generator=generator).requires_grad_()
    weight = (torch.randn(args.vocab, args.hidden, device=device, generator=generator) / 20).requires_grad_()
    targets = torch.randint(0, args.vocab, (args.tokens,), device=device, generator=generator)
    fp32_head = actor._chunk_logits
    variants = {"fp32_head": fp32_head, "bf16_head": bf16_head_logits}
    runs: dict[str, list[float]] = {name: [] for name in variants}
    try:
        for round_ in range(args.repeats + 1):  # round 0: warm-up (allocations, cuBLAS handles)
            for name, logits in variants.items():
                actor._chunk_logits = logits
                elapsed = timed(device, states, weight, targets, args.chunk)
                if round_:
                    runs[name].append(elapsed)
    finally:
        actor._chunk_logits = fp32_head
    result = {"environment": environment(), "device": str(device), "tokens": args.tokens, "hidden": args.hidden,
              "vocab": args.vocab, "chunk": args.chunk, "runs_ms": runs,
              **{f"{name}_ms": round(statistics.median(values), 3) for name, values in runs.items()}}
    result["fp32_over_bf16"] = round(result["fp32_head_ms"] / result["bf16_head_ms"], 3)
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
