#!/usr/bin/env bash
# Run on your own machine, from the project's root, after ../shared/gpu/prepare.sh: wheels for TRL's GRPOTrainer
# (benchmarks/e2e.py --trl-only, the `trl` phase of benchmarks/gpu_session.sh), which the GPU image lacks, into
# .gpu/trl (~3 MiB, so that it fits beside the model's second half in one call's 64 MiB; pandas, 12 MiB, is left
# out: the GPU image has it, /work/.library/device/KINDS.md). TRL is
# pinned to the version whose defaults benchmarks/trl_baseline.py was checked against (they move between releases).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
mkdir -p .gpu/trl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/trl \
  'trl==1.16.0' 'datasets>=4.7' dill multiprocess xxhash fsspec python-dateutil pytz tzdata
du -sh .gpu/trl
