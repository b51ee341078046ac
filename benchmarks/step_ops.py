"""Operations one decode forward launches: a device-free proxy for a GPU step's kernel count.

A captured batch-1 decode step of SmolLM2 on an H100 is launch-bound (docs/benchmarks.md §9: 776 kernels, 2.19 ms,
vs 0.13 ms of weight reads), so every kernel a layer no longer launches is time saved there. This counts the ATen
compute operations (views excluded) of one `LeanForward.run` over the rollout copy's fused layout, on the CPU, with
random weights in the default model's shape; and those of one whole speculative step (`SpeculativeDecoder.run`:
catch-up, drafting, tree, verify forward, acceptance) per strategy, as the graph runner runs it (sync-free, a
random drafter). CPU dispatch is a proxy, not the GPU's count: there F.rms_norm is one kernel (six operations
here) and a GEMM may be two (split-K). Allocations (`empty`) launch nothing and are not counted.

With --kernels triton the forwards run on the fused Triton kernels (models/kernels.py, under Triton's interpreter
here): each launch counts as one operation (`triton:<kernel>`), the torch work the interpreter does to run it not.

    python benchmarks/step_ops.py --json benchmarks/results/step_ops.json [--kernels triton]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

# --kernels triton: the kernels run under Triton's interpreter, on the CPU tensors this counts over (even where a
# GPU exists); set before tlt imports them
os.environ.setdefault("TRITON_INTERPRET", "1")
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.models import draft_kernels, kernels, load_model, tree_kernels  # noqa: E402
from tlt.models.kv_cache import KVCache  # noqa: E402
from tlt.models.lean_forward import LeanForward  # noqa: E402
from tlt.models.eagle import EagleDrafter  # noqa: E402
from tlt.models.rollout_copy import RolloutCopy  # noqa: E402
from tlt.rollout.engine import RolloutEngine  # noqa: E402
from tlt.rollout.graph_runner import GraphRunner  # noqa: E402
from tlt.rollout.request import Request  # noqa: E402
from tlt.sampling import SamplingParams  # noqa: E402
from tlt.speculative.decoder import SpeculativeDecoder  # noqa: E402
from tlt.speculative.strategy import SpecStrategy  # noqa: E402

SD_STRATEGIES = ("S5K1q", "S3K1N3", "S4K2N8", "S4K2q", "S6K2q")  # S6K2q: the best T=1 arm at batch 1 on the H100

VIEWS = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "transpose", "t", "permute", "expand",
         "alias", "split", "split_with_sizes", "chunk", "as_strided", "reshape", "detach", "lift_fresh",
         "empty"}  # empty: an allocation, no kernel
COUNTERS: list = []  # the OperationCounters entered, innermost last (Triton launches count into each)


class OperationCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __enter__(self):
        COUNTERS.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        COUNTERS.pop()
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


class CountedLaunches:
    """A Triton kernel whose launches count as one operation each, the interpreter's own torch work uncounted."""

    def __init__(self, name: str, kernel):
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid):
        launch = self.kernel[grid]

        def run(*args, **kwargs):
            for counter in COUNTERS:  # every counter entered sees it, as nested modes all see an ATen op
                counter.counts[f"triton:{self.name}"] += 1
            with _disable_current_modes():
                return launch(*args, **kwargs)
        return run


def count_triton_launches() -> None:
    for module, names in ((kernels, ("_rope_and_store_kernel", "_attention_kernel", "_combine_kernel",
                                     "_silu_and_mul_kernel", "_sample_kernel", "_attention_bias_kernel")),
                          (draft_kernels, ("_draw_kernel", "_verify_q_nodes_kernel", "_expand_frontier_kernel")),
                          (tree_kernels, ("_follow_q_path_kernel", "_ancestor_mask_kernel", "_commit_path_kernel",
                                          "_gather_pairs_kernel", "_whole_tree_kernel"))):
        for name in names:
            setattr(module, name, CountedLaunches(name.strip("_").removesuffix("_kernel"), getattr(module, name)))


def count_step(lean: LeanForward, batch: int, num_new: int, kv_len: int) -> collections.Counter:
    cache = KVCache(lean.spec, batch, kv_len + num_new, dtype=lean.dtype)
    ids = torch.randint(0, lean.spec.vocab_size, (batch, num_new))
    lengths = torch.full((batch,), kv_len // 2)
    with torch.no_grad():
        # a warm-up forward first: what is made once (the RoPE table, attention's arrival counts) is not a step's
        # operation, as a captured graph's warm-up makes it before the capture
        lean.run(ids, cache.rows(0, batch), lengths, logits_at="all", kv_len=kv_len)
        with OperationCounter() as counter:
            lean.run(ids, cache.rows(0, batch), lengths, logits_at="all", kv_len=kv_len)
    return counter.counts


def counting_engine(model, strategy: SpecStrategy, kernel_choice: str) -> RolloutEngine:
    """A batch-1 engine stepping through the non-capturing graph runner (the body a CUDA graph captures), its
    linears as on CUDA. The drafter in the master's dtype: the engine serves a copy of it in the rollout's, as a
    GPU engine with graphs does (the fused serving copy, EagleDrafter.inference_copy)."""
    engine = RolloutEngine(model, max_batch_size=1, dtype="float32", drafter=EagleDrafter(model.config).attach(model),
                           speculation=strategy, max_tree_size=32, kernels=kernel_choice)
    assert engine.spec_decoder.drafter._fused_projections is not None
    engine.runner = GraphRunner(engine.forward, capture=False)
    engine.forward.linear = torch.nn.functional.linear
    engine.forward.residual_gemm = True  # as on CUDA (the drafter's serving copy runs its layer through it too)
    return engine


def count_speculative_step(model, strategy: SpecStrategy, kernel_choice: str = "torch") -> int:
    """Operations of one speculative step at batch 1 through the non-capturing graph runner (the body a CUDA graph
    captures). The master is bf16 and the rollout copy fp32, so the engine decodes from the fused layout it
    uses on a GPU (fp32: CPU bf16 ops decompose differently)."""
    engine = counting_engine(model, strategy, kernel_choice)
    counts, run = [], SpeculativeDecoder.run

    def counted(decoder, *args, **kwargs):
        with OperationCounter() as counter:
            out = run(decoder, *args, **kwargs)
        counts.append(sum(counter.counts.values()))
        return out

    SpeculativeDecoder.run = counted
    try:
        params = SamplingParams(temperature=1.0, max_new_tokens=12, stop_token_ids=(), seed=0)
        engine.generate([Request([1, 2, 3, 4, 5], params=params)])
    finally:
        SpeculativeDecoder.run = run
    return counts[-1]


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--kv", type=int, default=256)
    parser.add_argument("--kernels", default="torch", choices=["torch", "triton"],
                        help="triton: the forwards on the fused Triton kernels (rollout.kernels=triton)")
    parser.add_argument("--strategies", default=",".join(SD_STRATEGIES),
                        help="comma-separated SD strategies to count (interpreted Triton runs take minutes each)")
    args = parser.parse_args(argv)
    if args.kernels == "triton":
        count_triton_launches()
    config = AutoConfig.from_pretrained(load_model().source)  # the default model's shape; weights random below
    model = AutoModelForCausalLM.from_config(config).eval()
    # the fused layout the GPU rollout decodes from (its dtype aside); norms folded in as kernels="triton" has them
    copy = RolloutCopy(model, torch.float32, fold_norms=args.kernels == "triton")
    lean = LeanForward(copy.model, copy.fused)
    lean.linear = torch.nn.functional.linear  # one GEMM per projection, as on CUDA (not oneDNN's packed linear)
    lean.residual_gemm = True  # as on CUDA: o_proj and down_proj add into the residual inside their GEMM
    lean.use_kernels(args.kernels)
    results = {"model_layers": config.num_hidden_layers, "kv_len": args.kv, "kernels": args.kernels, "by_step": {},
               "environment": environment()}
    for name, num_new in (("decode", 1), ("verify_6", 6)):
        counts = count_step(lean, 1, num_new, args.kv)
        results["by_step"][name] = {"operations": sum(counts.values()),
                                    "per_layer": sum(counts.values()) / config.num_hidden_layers,
                                    "by_operation": dict(counts.most_common())}
        print(f"{name}: {sum(counts.values())} operations", file=sys.stderr)
    master = model.to(torch.bfloat16)
    results["speculative_step"] = {}
    for name in args.strategies.split(","):
        strategy = SpecStrategy.parse(name)
        results["speculative_step"][strategy.name] = count_speculative_step(master, strategy, args.kernels)
        print(f"speculative step {strategy.name}: {results['speculative_step'][strategy.name]} operations",
              file=sys.stderr)
        write_json(args.json, results, echo=False)  # as it goes: an interpreted run may be cut short
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
