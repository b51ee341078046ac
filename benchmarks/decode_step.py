"""One decode step of the default model on CUDA, taken apart: eager vs graph replay, kernels per step, and
(optionally) Inductor-fused kernels under the same graph, and the step on the fused Triton kernels
(rollout.kernels=triton, models/kernels.py) beside torch's. Tells where a batch-1 step's time goes.

    python benchmarks/decode_step.py --json out.json [--compile [--compile-mode max-autotune]] [--batches 1,16,64]
        [--kv 512] [--no-triton]

`kernels_by_name` lists the most frequent kernels of a step (what is left to fuse).
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from torch.nn.attention import sdpa_kernel

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, median_time, write_json  # noqa: E402

from tlt.models import load_model  # noqa: E402
from tlt.models.kv_cache import KVCache  # noqa: E402
from tlt.models.lean_forward import COMPILE_MODES, LeanForward  # noqa: E402
from tlt.models.rollout_copy import RolloutCopy  # noqa: E402
from tlt.rollout.graph_runner import CAPTURED_ATTENTION  # noqa: E402


def timed_ms(fn, repeats: int = 50) -> float:
    return median_time(fn, repeats, "cuda") * 1000


def kernels_per_call(fn) -> tuple[int, dict[str, int]]:
    """(kernels one call launches, the 15 most frequent kernel names with their counts)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = Counter(e.name[:80] for e in prof.events() if e.device_type.name == "CUDA")
    return sum(names.values()), dict(names.most_common(15))


def capture(fn):
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--json")
    parser.add_argument("--batches", default="1,16,64")
    parser.add_argument("--kv", type=int, default=512, help="attended KV length (a graph's block)")
    parser.add_argument("--compile", action="store_true", help="also Inductor-compile the step before capture")
    parser.add_argument("--no-triton", action="store_true", help="skip the step on the Triton kernels")
    parser.add_argument("--compile-mode", default="inductor", choices=sorted(COMPILE_MODES),
                        help="as rollout.compile (max-autotune: Inductor's max-autotune-no-cudagraphs)")
    args = parser.parse_args(argv)
    loaded = load_model(device="cuda")
    copy = RolloutCopy(loaded.model, torch.bfloat16)
    lean = LeanForward(copy.model, copy.fused)
    folded = None if args.no_triton else RolloutCopy(loaded.model, torch.bfloat16, fold_norms=True)
    results = {"kv_len": args.kv, "by_batch": {}, "environment": environment(),
               "attention": [backend.name for backend in CAPTURED_ATTENTION],
               "complete": False}  # until the last write: a run killed at its time limit keeps its finished rows
    # Without gradients, as the engine decodes: the fused kernels and the residual GEMMs serve only forwards
    # without autograd (before 2026-11-27 this ran with it: its "triton" rows timed torch's kernels over the folded
    # copy, 540 kernels like torch's, and compared their logits on a zero KV cache: 8.9 apart in bf16)
    with sdpa_kernel(CAPTURED_ATTENTION), torch.inference_mode():  # the graphs' attention kernels
        for batch in [int(b) for b in args.batches.split(",")]:
            measure_batch(args, lean, copy, folded, batch, results)
    results["complete"] = True
    write_json(args.json, results)
    return results


def measure_batch(args, lean: LeanForward, copy: RolloutCopy, folded: RolloutCopy | None, batch: int,
                  results: dict) -> None:
    cache = KVCache(lean.spec, batch, args.kv, device="cuda", dtype=torch.bfloat16)
    rows = cache.rows(0, batch)
    ids = torch.randint(0, lean.spec.vocab_size, (batch, 1), device="cuda")
    lengths = torch.full((batch,), args.kv // 2, device="cuda")

    def step(forward=lean.run):
        return forward(ids, rows, lengths, logits_at="all", kv_len=args.kv).logits

    row = {"eager_ms": timed_ms(step)}
    row["kernels"], row["kernels_by_name"] = kernels_per_call(step)
    graph = capture(step)
    row["graph_ms"] = timed_ms(graph.replay)
    results["by_batch"][str(batch)] = row
    if folded is not None:
        measure_triton(folded, step, row)
    write_json(args.json, results, echo=False)  # before the compile's minutes
    if args.compile:
        started = time.perf_counter()
        compiled_lean = LeanForward(copy.model, copy.fused)
        compiled_lean.compile(args.compile_mode)  # what rollout.compile runs
        compiled = compiled_lean.run
        step(compiled)
        row["compile_s"] = time.perf_counter() - started
        row["compile_mode"] = args.compile_mode
        row["compiled_kernels"], row["compiled_kernels_by_name"] = kernels_per_call(lambda: step(compiled))
        row["compiled_graph_ms"] = timed_ms(capture(lambda: step(compiled)).replay)
    write_json(args.json, results, echo=False)
    print(batch, row, file=sys.stderr, flush=True)


def measure_triton(folded: RolloutCopy, step, row: dict) -> None:
    """The same step on the fused Triton kernels over a copy with its norms folded in, as kernels="triton"
    decodes: eager, kernels, graph replay, and its largest logit difference from torch's step (both bf16:
    rounding, not a defect, below ~0.1 at SmolLM2's logit scale)."""
    fused = LeanForward(folded.model, folded.fused)
    fused.use_kernels("triton")
    reference = step().float()
    try:
        row["triton_eager_ms"] = timed_ms(lambda: step(fused.run))
        row["triton_max_logit_diff"] = float((step(fused.run).float() - reference).abs().max())
        row["triton_kernels"], row["triton_kernels_by_name"] = kernels_per_call(lambda: step(fused.run))
        row["triton_graph_ms"] = timed_ms(capture(lambda: step(fused.run)).replay)
    except Exception as error:  # a kernel that does not build or capture here: recorded, the torch rows stand
        row["triton_error"] = f"{type(error).__name__}: {error}"[:500]


if __name__ == "__main__":
    main()
