"""What one full garbage collection costs a worker of the default run, with and without the freeze.

A worker calls gc.collect() after every update (`distributed/worker.py: _return_free_memory`), and Python starts
full collections on its own as objects accumulate. Each walks every tracked object: the model, the tokenizer and
the libraries' modules. The in-process backend freezes what exists once its workers are built
(`freeze_long_lived`); this builds that backend for the default run (one worker, plain decoding) and times
gc.collect() as built, then after gc.unfreeze() (the behaviour before the freeze), in the same process.

    python benchmarks/gc_pause.py --json benchmarks/results/gc_pause.json
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

from tlt.distributed.controller import DistributedGRPO  # noqa: E402
from tlt.rl.config import load_config  # noqa: E402


def collection_ms(repeats: int) -> float:
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - started) * 1000)
    return statistics.median(times)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args(argv)
    controller = DistributedGRPO(load_config(None, ["run.workers=1", "run.speculative=off"]))
    try:
        frozen = gc.get_freeze_count()
        results = {"frozen_objects": frozen, "frozen_collect_ms": round(collection_ms(args.repeats), 5)}
        gc.unfreeze()
        results["tracked_objects_unfrozen"] = len(gc.get_objects())
        results["unfrozen_collect_ms"] = round(collection_ms(args.repeats), 3)
        results["repeats"] = args.repeats
        results["environment"] = environment()
    finally:
        controller.close()
    print(f"gc.collect(): {results['frozen_collect_ms']} ms frozen ({frozen} objects), "
          f"{results['unfrozen_collect_ms']} ms unfrozen", file=sys.stderr)
    write_json(args.json, results)
    return results


if __name__ == "__main__":
    main()
