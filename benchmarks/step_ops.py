"""Operations one decode forward launches: a device-free proxy for a GPU step's kernel count.

A captured batch-1 decode step of SmolLM2 on an H100 is launch-bound (docs/benchmarks.md §9: 776 kernels, 2.19 ms,
vs 0.13 ms of weight reads), so every kernel a layer no longer launches is time saved there. This counts the ATen
compute operations (views excluded) of one `LeanForward.run` over the rollout copy's fused layout, on the CPU, with
random weights in the default model's shape. CPU dispatch is a proxy, not the GPU's count: there F.rms_norm is one
kernel (six operations here) and a GEMM may be two (split-K).

    python benchmarks/step_ops.py --json benchmarks/results/step_ops.json
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.models import load_model  # noqa: E402
from tlt.models.kv_cache import KVCache  # noqa: E402
from tlt.models.lean_forward import LeanForward  # noqa: E402
from tlt.models.rollout_copy import RolloutCopy  # noqa: E402

VIEWS = {"view", "_unsafe_view", "slice", "select", "unsqueeze", "squeeze", "transpose", "t", "permute", "expand",
         "alias", "split", "split_with_sizes", "chunk", "as_strided", "reshape", "detach", "lift_fresh"}


class OperationCounter(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name not in VIEWS:
            self.counts[name] += 1
        return func(*args, **(kwargs or {}))


def count_step(lean: LeanForward, batch: int, num_new: int, kv_len: int) -> collections.Counter:
    cache = KVCache(lean.spec, batch, kv_len + num_new, dtype=lean.dtype)
    ids = torch.randint(0, lean.spec.vocab_size, (batch, num_new))
    lengths = torch.full((batch,), kv_len // 2)
    with torch.no_grad(), OperationCounter() as counter:
        lean.run(ids, cache.rows(0, batch), lengths, logits_at="all", kv_len=kv_len)
    return counter.counts


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--kv", type=int, default=256)
    args = parser.parse_args(argv)
    config = AutoConfig.from_pretrained(load_model().source)  # the default model's shape; weights random below
    model = AutoModelForCausalLM.from_config(config).eval()
    copy = RolloutCopy(model, torch.float32)  # the fused layout the GPU rollout decodes from (its dtype aside)
    lean = LeanForward(copy.model, copy.fused)
    lean.linear = torch.nn.functional.linear  # one GEMM per projection, as on CUDA (not oneDNN's packed linear)
    results = {"model_layers": config.num_hidden_layers, "kv_len": args.kv, "by_step": {},
               "environment": environment()}
    for name, num_new in (("decode", 1), ("verify_6", 6)):
        counts = count_step(lean, 1, num_new, args.kv)
        results["by_step"][name] = {"operations": sum(counts.values()),
                                    "per_layer": sum(counts.values()) / config.num_hidden_layers,
                                    "by_operation": dict(counts.most_common())}
        print(f"{name}: {sum(counts.values())} operations", file=sys.stderr)
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
