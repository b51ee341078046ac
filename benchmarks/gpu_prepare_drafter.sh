#!/usr/bin/env bash
# Rebuild the warmed drafter the benchmarks and GPU sessions use, benchmarks/drafters/smollm2-arithmetic, on this
# CPU: warm-up rounds of `tlt drafter warmup` on the built-in task, each on fresh prompts and going on from
# the last (docs/benchmarks.md §3: the warm-up is data-bound; drafters A, B, C, D there), then its bf16 copy.
#
#   bash benchmarks/gpu_prepare_drafter.sh        # ~25 min per 256 prompts on 2 cores; a finished round is kept
#
# Why a committed drafter: a GPU session has 15 device minutes, too few to warm one there as well as measure, and
# a session's CPU would need over an hour for these rounds. Why bf16: half the bytes (8.4 MB; the fp32 drafter is
# 16.8) for the working tree that travels with every device call, and the GPU engine serves it in the rollout's
# bf16 anyway; on the CPU it loads as those values in fp32. Its AdamW state is not kept (`--init` starts new
# moments). PROMPTS (one count per round: D's recipe, 256 256 256 512), STEPS, WORK (the fp32 rounds) and OUT_DIR
# set the run.
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
python=${PYTHON:-.venv/bin/python}
read -r -a prompts <<< "${PROMPTS:-256 256 256 512}"
rounds=${#prompts[@]}
work=${WORK:-.gpu/drafter-rounds}
out=${OUT_DIR:-benchmarks/drafters/smollm2-arithmetic}
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo '/.gpu/' >> .git/info/exclude; }
commands=()
for round in $(seq 0 $((rounds - 1))); do
  dir=$work/round$round
  # the first round at a constant lr (drafter A), the next ones from the last with a cosine one (B, C, D)
  args=(--out "$dir" --prompts "${prompts[$round]}" --steps "${STEPS:-1000}" --seed "$round")
  [ "$round" -gt 0 ] && args+=(--init "$work/round$((round - 1))" --lr-schedule cosine)
  commands+=("tlt drafter warmup ${args[*]}")
  if [ -s "$dir/warmup_report.json" ]; then continue; fi  # a finished round (a killed one is started again)
  "$python" -m tlt.cli drafter warmup "${args[@]}" --overwrite
done
mkdir -p "$out"
"$python" - "$work/round$((rounds - 1))" "$out" "${commands[@]}" <<'EOF'
import json
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file

from tlt.files import save_checked_tensors

source, out, *commands = sys.argv[1:]
tensors = {name: t.to(torch.bfloat16) if t.is_floating_point() else t
           for name, t in load_file(f"{source}/drafter.safetensors").items()}
save_checked_tensors(Path(out) / "drafter.safetensors", tensors)  # with the CRC of its bf16 bytes, as a save writes it
shutil.copy(f"{source}/drafter_config.json", out)
report = json.loads(open(f"{source}/warmup_report.json").read())
provenance = {"made_by": "benchmarks/gpu_prepare_drafter.sh", "rounds": commands, "weights": "bfloat16",
              "last_round_report": report}
open(f"{out}/provenance.json", "w").write(json.dumps(provenance, indent=1) + "\n")
EOF
chmod 644 "$out"/*  # safetensors writes its file owner-only
du -sh "$out"
