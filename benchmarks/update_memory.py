"""Activation memory of the update's training forward and backward, per token, against `rl/update_memory.py`'s rule.

The update warns when its largest micro-batch's activations (estimated: layers x (12 hidden + 4 intermediate) x the
element size, per token; half with gradient checkpointing) pass the free memory, because on the CPU a process past
it is killed by the system without a message. This measures what the rule estimates: for each row length, a fresh
process loads the default model (fp32, CPU), runs `token_logprobs` and its backward over one row of random tokens,
and reports the rise of its peak resident memory, per token, beside the rule's number.

    python benchmarks/update_memory.py --json benchmarks/results/update_memory.json
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import environment, write_json  # noqa: E402

# One measurement, in its own process so that each peak is its own
PROBE = """
import json, resource, sys, torch
from tlt.models import load_model
from tlt.rl.actor import PackedSamples, token_logprobs
from tlt.rl.update_memory import activation_bytes
tokens, checkpointed = int(sys.argv[1]), sys.argv[2] == "1"
model = load_model(None).model.train()
if checkpointed:
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
generator = torch.Generator().manual_seed(0)
ids = lambda: torch.randint(0, model.config.vocab_size, (tokens // 2,), generator=generator).tolist()
batch = PackedSamples.build([ids()], [ids()], pad_id=0)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
token_logprobs(model, batch, 1.0).logprobs.sum().backward()
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"tokens": tokens, "checkpointed": checkpointed,
                  "measured_mb_per_token": (peak - before) * 1024 / tokens / 1e6,
                  "rule_mb_per_token": activation_bytes(model.config, tokens, element_size=4,
                                                        checkpointed=checkpointed) / tokens / 1e6}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json")
    parser.add_argument("--tokens", default="2048,4096", help="row lengths, comma-separated")
    args = parser.parse_args()
    rows = []
    for tokens in (int(t) for t in args.tokens.split(",")):
        for checkpointed in (False, True):
            done = subprocess.run([sys.executable, "-c", PROBE, str(tokens), "1" if checkpointed else "0"],
                                  capture_output=True, text=True, check=True)
            rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
            print(rows[-1])
    if args.json:
        write_json(args.json, {"rows": rows, "environment": environment(),
                               "command": "python benchmarks/update_memory.py --json " + args.json})


if __name__ == "__main__":
    main()
