#!/usr/bin/env bash
# The measurements that wait for a GPU, as phases of one script: a GPU session (../shared/gpu/README.md: ~30 device
# minutes, 10 per call) runs `. .gpu/env.sh && bash benchmarks/gpu_session.sh PHASE...` per call. Each phase is
# bounded by `timeout` and writes its JSON and log under $OUT (the device tool brings $OUT back).
#
#   tests      pytest -m gpu (tiny models: graphs of the whole SD step, syncs per step, hot swap, tail training)
#   drafter    warm a drafter on the GPU (needs the default model), kept in /root/drafter-smollm2
#   spec       benchmarks/speculative.py, greedy and T=1, batches 1,4,16       -> speculative_h100.json (#13, #14)
#   throughput benchmarks/rollout_throughput.py, batches 1,16,64               -> rollout_throughput_h100.json (#13)
#   tail       spot_training.py --lone-worker: overlap slowdown, tau vs frozen -> spot_training_h100.json (#15)
#   e2e        e2e.py --replay (equal work) then natural runs over 3 seeds     -> e2e_replay_h100.json, e2e_h100.json (#15)
set -u
OUT=${OUT:-/tmp/out}
DRAFTER=${DRAFTER:-/root/drafter-smollm2}
mkdir -p "$OUT"

run() {  # run NAME SECONDS CMD...: bounded, logged to $OUT/NAME.log, status line on stdout
  local name=$1 limit=$2
  shift 2
  local started=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - started))s"
  tail -n 15 "$OUT/$name.log"
}

for phase in "$@"; do
  case $phase in
    tests) run tests 540 python3 -m pytest -m gpu tests/test_gpu.py -x -q ;;
    drafter) run drafter 540 python3 -m tlt.cli drafter warmup --out "$DRAFTER" --prompts 64 --steps 300 ;;
    spec)
      run spec_greedy 270 python3 benchmarks/speculative.py --device cuda --drafter "$DRAFTER" --temperature 0 \
        --batches 1,4,16 --json "$OUT/speculative_h100_greedy.json"
      run spec_t1 270 python3 benchmarks/speculative.py --device cuda --drafter "$DRAFTER" --temperature 1 \
        --batches 1,4,16 --json "$OUT/speculative_h100.json" ;;
    throughput)
      run throughput 540 python3 benchmarks/rollout_throughput.py --device cuda --batches 1,16,64 \
        --max-new-tokens 128 --json "$OUT/rollout_throughput_h100.json" ;;
    tail)
      run tail 570 python3 benchmarks/spot_training.py --lone-worker --device cuda --drafter "$DRAFTER" \
        --max-new-tokens 1024 --steps 2 --tau-steps 10 --json "$OUT/spot_training_h100.json" ;;
    e2e)
      run e2e_replay 570 python3 benchmarks/e2e.py --device cuda --drafter "$DRAFTER" --replay --max-new-tokens 1024 \
        --prompts 4 --samples 4 --steps 3 --seeds 0 --json "$OUT/e2e_replay_h100.json" ;;
    e2e-natural)
      run e2e_natural 570 python3 benchmarks/e2e.py --device cuda --drafter "$DRAFTER" --skip-trl --max-new-tokens 1024 \
        --prompts 4 --samples 4 --steps 3 --seeds 0 1 2 --json "$OUT/e2e_h100.json" ;;
    *) echo "unknown phase $phase (tests drafter spec throughput tail e2e e2e-natural)"; exit 2 ;;
  esac
done
