#!/usr/bin/env bash
# Run on your own machine, from the project's root, before a GPU session: warm a drafter for the default model on
# this CPU and put its bf16 copy in .gpu/drafter, for the first device call to carry (benchmarks/gpu_session.sh
# `boot`). A session has 15 device minutes: warming on the device would take minutes of them, warming here takes
# none (~35 min of this machine on 2 cores, while the session prepares other things).
#
#   bash benchmarks/gpu_prepare_drafter.sh [DIR]     # DIR: the fp32 drafter (default .gpu/drafter-fp32); a DIR
#                                                    # that already holds one is only converted again
#
# Why bf16: the call that carries the model's first half (47 MiB) may carry 64 MiB in all, and the fp32 drafter is
# 16.8 MB; the GPU engine serves the drafter in the rollout's bf16 anyway. The weights are the fp32 drafter's,
# rounded once; its AdamW state stays here. PROMPTS and STEPS set the warm-up (docs/benchmarks.md §3: the warm-up is
# data-bound; 256 prompts x 1,000 steps is drafter A of that section).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
fp32=${1:-.gpu/drafter-fp32}
grep -qx '/.gpu/' .git/info/exclude 2>/dev/null || { mkdir -p .git/info && echo '/.gpu/' >> .git/info/exclude; }
python=${PYTHON:-.venv/bin/python}
if [ ! -s "$fp32/drafter.safetensors" ]; then
  "$python" -m tlt.cli drafter warmup --out "$fp32" --prompts "${PROMPTS:-256}" --steps "${STEPS:-1000}" \
    --lr-schedule cosine
fi
rm -rf .gpu/drafter && mkdir -p .gpu/drafter
"$python" - "$fp32" .gpu/drafter <<'EOF'
import shutil
import sys

import torch
from safetensors.torch import load_file, save_file

source, out = sys.argv[1:]
tensors = {name: t.to(torch.bfloat16) if t.is_floating_point() else t
           for name, t in load_file(f"{source}/drafter.safetensors").items()}
save_file(tensors, f"{out}/drafter.safetensors", metadata={"format": "pt"})
shutil.copy(f"{source}/drafter_config.json", out)
EOF
du -sh .gpu/drafter
echo "ready: carry .gpu/drafter in the first device call (benchmarks/gpu_session.sh boot)"
