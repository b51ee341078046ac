#!/usr/bin/env bash
# Run on your own machine, from the project's root, after ../shared/gpu/prepare.sh: wheels for TRL's GRPOTrainer
# (benchmarks/e2e.py --trl-only, the `trl` phase of benchmarks/gpu_session.sh), which the GPU image lacks, into
# .gpu/trl (~15 MiB; carried only on the call that runs TRL: with .gpu/a the carry would pass 64 MiB). TRL is
# pinned to the version whose defaults benchmarks/trl_baseline.py was checked against (they move between releases).
set -euo pipefail
root=$(git rev-parse --show-toplevel); cd "$root"
mkdir -p .gpu/trl
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .gpu/trl \
  'trl==1.16.0' 'datasets>=4.7' pandas dill multiprocess xxhash fsspec python-dateutil pytz tzdata
du -sh .gpu/trl
