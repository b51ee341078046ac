#!/usr/bin/env bash
# The measurements that wait for a GPU, as phases of one script: each device call runs
# `. .gpu/env.sh && bash benchmarks/gpu_session.sh PHASE...`. Each phase is bounded by `timeout`, all of a call's
# phases together by BUDGET, and writes its JSON and log under $OUT (the device tool brings $OUT back: at most 8
# files of 16 MiB, so one or two phases per call). The benchmarks write their JSON as they go, with "complete": false
# until their last write: a phase killed at its limit still returns what it measured.
#
#   tests       pytest -m gpu (tiny models: graphs of the whole SD step, syncs per step, hot swap, tail training),
#               Inductor's compile test apart and last -> tests{,_compiled}.log, .xml (JUnit: outcomes and times)
#   drafter     warm a drafter on the GPU (WARM_PROMPTS, WARM_STEPS) into $DRAFTER, sent back
#   spec        benchmarks/speculative.py at T=1 on SPEC_BATCHES x SPEC_ARMS (batch 32: the largest gate a cost
#               curve gives; SD must not lose where it turns on)               -> speculative_h100.json (#13, #14)
#   spec-greedy the same greedy on SPEC_GREEDY_BATCHES, its results added to speculative_h100.json (#13)
#   adaptive    adaptive_buckets.py: the RL engine (run.speculative=adaptive, run.gate=auto) vs plain on one
#               long-tailed rollout (16 prompts, 1024 tokens, T=1), per batch bucket: SD never below plain where
#               the policy turns it on (#13)                           -> adaptive_buckets_h100.json
#   spec-diag   where an SD step's time goes: speculative.py at T=1, batches 1 and 4, with step statistics (median
#               step ms, slow steps, prefills) and torch.profiler tables of plain and S4K2N14q runs (top ops by
#               device and host time, the device's busy seconds)        -> speculative_h100_diag.json (#13, #14)
#   throughput  benchmarks/rollout_throughput.py on THROUGHPUT_BATCHES (1,64), also on the Triton kernels and with
#               rollout.compile=inductor (no eager engine: measured before)     -> rollout_throughput_h100.json (#13)
#   triton-tests  the fused Triton kernels' tests (rollout.kernels=triton) compiled for CUDA: test_triton_kernels.py
#               and test_gpu.py's (the statistical lossless test through graphs, bf16 tie-aware) -> tests_triton.log
#   triton      decode_step.py torch vs Triton (kernels per step, graph ms), speculative.py --kernels triton at T=0
#               and T=1, batches 1 and 4    -> decode_step_h100_triton.json, speculative_h100_triton{,_greedy}.json
#   kernels     decode_step.py: kernels per captured forward and their names, uncompiled / inductor / max-autotune
#                                                      -> decode_step_h100.json, decode_step_h100_autotune.json (#13)
#   spec-compiled  speculative.py with rollout.compile=inductor, T=0 and T=1, batches 1,4
#                                                                  -> speculative_h100_compiled{,_greedy}.json (#13)
#   tail        spot_training.py --lone-worker --drafter-graph --default-stream, overhead (greedy, 2 steps; eager
#               and graphed tail trainers, and decoding on the default stream, vs frozen) -> spot_training_h100.json
#   tail-tau    spot_training.py --lone-worker, tau vs frozen (TAU_STEPS steps) -> spot_training_tau_h100.json (#15)
#   update      update_cost.py: one policy update of 16 samples (~1,450 tokens) as a run does it (token budget),
#               in rows of 4 (the default before), with cuDNN's attention, with one shape repeated, with
#               micro-batch 16; a full GC                                       -> update_cost_h100.json (#15)
#   head        head_precision.py: the training head in fp32 (outside autocast) vs bf16, forward + backward of
#               16 x 1024 tokens at SmolLM2's head                               -> head_precision_h100.json
#   e2e         e2e.py --replay (equal work), seed 0                            -> e2e_replay_h100.json (#15)
#   e2e-natural e2e.py natural runs over SEEDS (one seed fits a call)           -> e2e_h100_seed<SEEDS>.json (#15)
#   trl         e2e.py --trl-only: TRL's GRPOTrainer, same prompts and settings -> e2e_trl_h100.json (#15); needs
#               .gpu/trl (bash benchmarks/gpu_trl_wheels.sh here) in the call's carry
# The RL phases (tail, tail-tau, e2e, e2e-natural, trl) run one unmeasured warm-up step per mode first (graph
# captures, the cost curve). Then, here: python benchmarks/e2e_merge.py --replay ... --natural ... --trl ...
# --spot ... --json benchmarks/results/e2e_h100.json joins the files, and python benchmarks/gpu_targets.py DIR...
# prints each issue's target beside what the files measured (for the closing notes). The first phase that loads the
# default model on a machine converts its GGUF first (`convert`, ~50 s there), outside the phase's own limit.
#
# A SESSION HAS 15 DEVICE MINUTES IN ALL (/work/.library/device/README.md: the machine's start, every call, the idle
# waits between calls and the give-back all count; a fresh machine needs 4 minutes left to start; a call is at most
# 10). The default model travels in two halves (../shared/gpu/README.md), so a session is one start and two or three
# calls on that machine, each issued the moment the last returns (30 s idle and it is gone). Pick the plan whose
# results benchmarks/results/ still lacks; each call's command is ready here, its limits fit the 15 minutes.
#
# Prepare here first (no device time, a few minutes): mkdir -p .git/info && bash ../shared/gpu/prepare.sh (plan C
#   also: bash benchmarks/gpu_trl_wheels.sh). Every call carries ".gpu/whl", ".gpu/env.sh", ".gpu/model.sha256"
#   plus what its line names. The warmed drafter travels in the working tree (benchmarks/drafters/, 8.4 MB). After
#   each call copy back what it sent ($OUT/cost_curves.tar -> .gpu/; $OUT/drafter/* if the drafter phase ran).
#
# Twelfth session (2026-11-28, an H200): `triton-tests tests`, `throughput spec`, `spec-greedy` ran (files
# *_h200.json, docs/benchmarks.md section 9 "Twelfth session"). The tests found every CUDA tail trainer training on
# nothing (fixed: tail_trainer.Arrival, indexed_device) and a negative control that is racy on a GPU (fixed). SD at
# T=1 batch 1 1.37x, greedy 1.56x; SD loses at batch >= 4 because its step grows ~1.3 ms from one row to four.
# NEXT (plan D, 15 minutes): 1. carry .gpu/a, timeout_s 150:
#        cp .gpu/a/part.aa /root/ && . .gpu/env.sh; BUDGET=130 bash benchmarks/gpu_session.sh tests-fixed
#   2. carry .gpu/b, at once, timeout_s = lease.budget_left_s - 60, BUDGET = that - 40 (about 450):
#        . .gpu/env.sh && BUDGET=<...> bash benchmarks/gpu_session.sh spec-diag adaptive
#   3. if >= 200 s are left, at once: . .gpu/env.sh && BUDGET=<left - 60> bash benchmarks/gpu_session.sh tail
#   then give_back. spec-diag says where the SD step's time goes (host between replays or a kernel: its
#   profiles); adaptive whether the RL engine's policy keeps SD off where it loses (#13); tail the fixed tail
#   trainer's overhead, eager and graphed (#15's 3%), now that it trains on data.
# Thirteenth session (2026-11-28, no GPU): the rows' settings and uniforms are kept while the rows stay
# (rollout/batch_rows.py; same random numbers): a plain step's host work 1.6x less at batch 1, 2x at 64 on the CPU
# (benchmarks/host_overhead.py). And plain steps above the speculation gate now run one step late (overlapped:
# step n+1 launched from step n's tokens on the device; docs/architecture.md), never run on CUDA: call 1's
# tests-fixed runs their GPU tests (-k overlapped), spec-diag profiles 1:plain beside 1:plain-waiting, and
# `throughput` (--also-waiting) times both when a call has room for it. Plan D otherwise unchanged.
# Fourteenth session (2026-11-28, no GPU): with a tail trainer the rollout decodes on a high-priority CUDA stream
# (tail_trainer.decoding_first, run.tail_decode_priority=true by default, never run on CUDA): call 1's tests-fixed
# runs its GPU tests (-k decoding_first, and the tail test checks the decode loop's stream); `tail` A/Bs it as a
# fourth mode (--default-stream: overhead_default_stream beside the default's overhead). If decoding on the
# default stream is no slower, say so and turn the default off. Plan D otherwise unchanged.
# Sixteenth session (2026-12-02, no GPU): speculative steps now overlap too (ModelRunner._speculative_overlapped:
# step n+1 launched from step n's last tokens and lengths on the device; docs/architecture.md), never run on
# CUDA. The twelfth session's SD speed-ups (1.37x T=1, 1.56x greedy at batch 1) were measured with neither plain
# nor SD steps overlapped; the thirteenth made plain steps overlap (above the gate), this one SD steps and plain
# steps below the gate too: both arms now do, at every batch size. Call 1's
# tests-fixed runs the new GPU test (-k overlapped); spec-diag's S4K2N14q profile shows the device's busy share.
# rollout.compile now traces without duck sizing (one compile fewer per process). Plan D otherwise unchanged.
# Seventeenth session (2026-12-02, no GPU): the drafter can train on its own features (DrafterTrainConfig.unroll,
# run.drafter_unroll, warmup --unroll; off by default): tests-fixed's captured_drafter_micro_step test now also
# captures three unrolled levels. A rollout that stops decoding for 30 min ends the step. Plan D unchanged.
# Eighteenth session (2026-12-02, no GPU): the SD targets left (#13 T=1 1.5x and greedy 2.5x, #14 2.0x) need a
# higher tau more than a cheaper step (a step costs 1.5-1.8 plain steps on the H200: tau / speed-up), and the
# warm-up is data-bound (each CPU round of fresh prompts lifted held-out acceptance ~0.03, docs/benchmarks.md
# section 3), while the device samples ~375x faster. New phase `drafter-more`: the committed drafter goes on
# with MORE_PROMPTS (2,048) fresh prompts and MORE_STEPS (2,000) steps, then serves the call's later phases.
# (Dry-run on the CPU with 4 prompts: rc 0, the drafter sent back in parts. Reading the target's middle layers
# too, as EAGLE-3 does, bought nothing at depth 1: benchmarks/drafter_aux_features.py, section 3.)
# Nineteenth session (2026-12-02, no GPU): greedy tau grows with the tree on the CPU (S10K4N60 3.88, S8K4N40 3.68,
# S6K3N20 3.26), so spec-greedy's arms take S8K4N40 in place of S6K2N12; feature noise or weight decay bought
# nothing (docs/benchmarks.md section 3). Plan E otherwise unchanged.
# NEXT (plan E, 15 minutes; plan D after it when a later session has the device again):
#   1. as plan D's call 1 (tests-fixed: the overlapped steps' CUDA tests first, correctness before speed).
#   2. carry .gpu/b, at once, timeout_s = lease.budget_left_s - 60, BUDGET = that - 40:
#        . .gpu/env.sh && SPEC_BATCHES=1 SPEC_GREEDY_BATCHES=1 SPEC_MIN_PROMPTS=24 BUDGET=<...> \
#          bash benchmarks/gpu_session.sh drafter-more spec spec-greedy
#      (copy $OUT/speculative_*.json back as speculative_<gpu>_more{,_greedy}.json beside the committed ones, and
#      $OUT/drafter/ to .gpu/drafter: a later call serves it with CARRIED=.gpu/drafter)
#   3. if >= 200 s are left: . .gpu/env.sh && CARRIED=.gpu/drafter BUDGET=<left - 60> bash benchmarks/gpu_session.sh
#      adaptive (carry .gpu/drafter too)
# Eleventh session (2026-11-28, no GPU): the drafter's capture now holds the process's capture lock beside the
# rollout's (tlt/capture_lock.py; a review found a device-wide sync at the decode loop's capture could invalidate
# it), a failed capture reports its own cause, and the tail test checks the tail-trained drafter's loss fell. If
# call 1's tail_graph test fails, its message names the capture error. spot_training.py runs the warmed drafter at
# --drafter-lr 1e-4 (the lr its warm-up ended at; 1e-3 cost held-out acceptance) with a 20-step lr ramp. The tau
# phase's expectation: ~1.0x at 10 steps (CPU: after 10 GRPO steps the warmed drafter's held-out acceptance rose,
# 0.636 -> 0.702, and training on the new policy's features added 0.003: docs/benchmarks.md section 7).
# Tenth session (2026-11-28, no GPU): the drafter's training micro-step can replay as one CUDA graph
# (run.drafter_cuda_graph, off by default until measured; drafter/step_graph.py): `tail` now runs it as a third
# mode (overhead_graph, spot_overhead_ratio_graph, overlap_slowdown_median_graph beside the eager spot mode), and
# call 1's tests check it (graph == eager trainer, capture beside the decode loop's replays, failed capture ->
# eager). If the graph mode meets #15's 3% and the eager one does not, turn the default on. The tau phase now
# runs q-sampling (S5K1q): target-only tau is capped near the target's top-1 mass whatever the drafter.
# Ninth session (2026-11-27, no GPU): the single-GPU tail trainer asks less of the decode loop (no host copy per
# finished sample, its starting state loaded on its thread, a drafter step without device reads until its end,
# 8-row micro-steps and fused AdamW on CUDA: tail_step_ops.json, 1180 -> 341 operations and 78 -> 0 reads a step),
# and the update's micro-batches take a token budget on CUDA (optim.micro_batch_tokens=auto). Neither has run on a
# GPU: `update tail` (plan B's call 3) measures both (update_cost's default vs rows_4; spot_training's phase_s
# places the spot mode's extra seconds), after call 1 `triton-tests tests` (tests: the new CUDA tail test).
# Eighth session (2026-11-27, no GPU): the rest of the SD step's bookkeeping fused (5 more draft_kernels launches,
# tree rows as views, RoPE from a table): S6K2q 501 -> 344 operations, S5K1q 418 -> 317, the decode forward
# 232 -> 224 (step_ops.json `eighth_session_kernels`; docs/benchmarks.md §9 "Eighth session"). None of it has run
# on a GPU. Next: the seventh session's plan below, unchanged (call 1 `triton-tests tests` first: the new kernels'
# tests compiled on CUDA and the lossless test through graphs on them), with `spec` at SPEC_ARMS including S5K1q
# and S6K2q, and `spec-greedy` on the q arms too (greedy rows of a q arm take the fused path).
# Seventh session (2026-11-27, an H200): plan T ran (81 + 17 tests passed; Triton step 1.06 ms at batch 1, SD 1.26x
# T=1; *_h200.json), then tail and update; the Triton kernels are now the CUDA default (rollout.kernels=auto).
# After the device calls (CPU-counted only): the drafter's norm folded, split attention merged in its own launch,
# the attention bias one kernel (decode forward 272 -> 232 operations; docs/benchmarks.md §9 "Seventh session").
# Next: call 1 `triton-tests tests` (the kernels and the whole GPU suite on the new default, never run on CUDA), call 2
# `throughput spec` (the step these cuts should bring to ~0.9 ms), then spec-greedy, then plan B.
# Sixth session (2026-11-27, no GPU): the SD step's drafting and q acceptance fused too (models/draft_kernels.py:
# S6K2q 842 -> see step_ops.json `sd_step_kernels`), the samplers read 16 blocks a step, top-k/top-p rows replay
# graphs (tests-fixed runs their GPU tests). Plan T below covers all of it; nothing of it has run on a GPU.
# Where it stands (2026-11-27, fifth session, no GPU): plan A ran (its files are in benchmarks/results/,
# docs/benchmarks.md §9 "Second H100 session"); plan B and C never have. Since then the fused Triton kernels
# (rollout.kernels=triton: the decode forward 752 -> 272 operations in step_ops.py, the norms folded into the
# GEMMs, a fused sampler; checked on the CPU under Triton's interpreter) have never run on a GPU. Next session:
# plan T, then plan B.
# Plan T, the Triton kernels (#13, #14): tests, the captured step's kernels and ms, SD on them.
#   1. carry .gpu/a, timeout_s 290 (no model needed: tiny models; each new kernel shape JIT-compiles, ~1-4 s):
#        cp .gpu/a/part.aa /root/ && . .gpu/env.sh; BUDGET=250 bash benchmarks/gpu_session.sh triton-tests tests-fixed
#   2. carry .gpu/b, at once, timeout_s = lease.budget_left_s - 60, BUDGET = that - 40 (about 460):
#        . .gpu/env.sh && BUDGET=460 bash benchmarks/gpu_session.sh triton throughput
#   then give_back. If the Triton step wins (decode_step_h100_triton.json: triton_graph_ms < graph_ms, and
#   the tests pass), make kernels="triton" the CUDA default (rollout.kernels=auto) before plan B measures e2e.
# Plan A, the engine (#13, #14): speculative_h100.json, rollout_throughput_h100.json, the GPU tests.
#   1. carry .gpu/a, timeout_s 220 (env.sh says the model is MISSING here: expected, its second half is call 2's):
#        cp .gpu/a/part.aa /root/ && . .gpu/env.sh; BUDGET=180 bash benchmarks/gpu_session.sh tests
#   2. carry .gpu/b, at once, sized from call 1's reply: timeout_s = lease.budget_left_s - 60, and
#      BUDGET = that timeout_s - 40 (about 480):
#        . .gpu/env.sh && BUDGET=480 bash benchmarks/gpu_session.sh spec throughput spec-greedy
#   then give_back (what is left is under the 4 minutes a new start needs).
#   Sized as: a start of ~1.5 min + call 1 (~3.5 min) + call 2 (~8.5 min) + the turns between them, about 14 of
#   the 15 minutes (device time that runs out mid-call loses the call's files: hence the sizing from the reply).
#   In call 2 the GGUF converts (~50 s), then spec <= 150 s (T=1: batches 1 and 4 first), throughput <= 170 s,
#   spec-greedy <= 100 s: what BUDGET leaves after the first two.
# Plan B, the RL step on equal work (#15): e2e_replay_h100.json, then spot training's overhead.
#   1. carry .gpu/a, timeout_s 60:               cp .gpu/a/part.aa /root/ && echo ok
#   2. carry .gpu/b, at once, timeout_s 500:      . .gpu/env.sh && BUDGET=460 bash ... e2e
#   3. at once, timeout_s = call 2's lease.budget_left_s - 60 (about 200), BUDGET = that timeout_s - 40:
#        . .gpu/env.sh && BUDGET=160 bash benchmarks/gpu_session.sh update tail
#   then give_back. (The machine still holds the model, the drafter and the cost curves of call 2; a phase cut by
#   its limit keeps the steps it finished: spot_overhead_ratio is written after each step.)
# Plan C, against TRL (#15): as B, with `trl` in call 2 (carry .gpu/b and .gpu/trl, ~55 MiB with the rest; bash
# benchmarks/gpu_trl_wheels.sh here; TRL loads slowest, so it gets the long call; both write step by step) and
# `e2e-natural` in call 3: speedup_vs_trl compares runs of one machine only.
# Then, as later sessions allow: tail-tau, kernels, spec-compiled, head, more e2e-natural SEEDS (kernels with
# spec-compiled in one call return 9 files: give them calls of their own).
#
# To reuse a call's cost curves in a later call (another machine measures them again), copy its
# cost_curves.tar into .gpu/ here and add ".gpu/cost_curves.tar" to that call's carry.
#
# The drafter. Phases that need one (spec, tail, tail-tau, e2e, e2e-natural) take $DRAFTER if this machine has it
# (the drafter phase warmed one), else $CARRIED (the committed one), else, with WARM_FALLBACK=1, warm a small one
# first within the same call (bounded; the phase then gets what is left of BUDGET). The `drafter` phase's drafter comes
# back in $OUT/drafter/: drafter_config.json and the weights in parts of 15 MiB (a file over 16 MiB does not come
# back; the SmolLM2 drafter is 16.8 MB in fp32). To reuse it in a later call, copy those files into .gpu/drafter/
# here and add ".gpu/drafter" to the call's carry with CARRIED=.gpu/drafter: the parts are joined there.
set -u
OUT=${OUT:-/tmp/out}
DRAFTER=${DRAFTER:-/root/drafter-smollm2}  # this machine's drafter (lost when the machine is given back)
CARRIED=${CARRIED:-benchmarks/drafters/smollm2-arithmetic}  # in the tree (or one a call sent back, carried in)
BUDGET=${BUDGET:-540}                      # seconds for all phases of this call (a call may run 600 in all)
SEEDS=${SEEDS:-0}                          # e2e-natural: the seeds of this call, e.g. SEEDS=1
TAU_STEPS=${TAU_STEPS:-10}                 # tail-tau: RL steps per mode (#15: after 10 RL steps)
TAU_TOKENS=${TAU_TOKENS:-512}              # tail-tau: max_new_tokens (1024 x 10 steps x 2 modes exceeds a call)
SPEC_BATCHES=${SPEC_BATCHES:-1,4,16,32}    # spec: batch sizes at T=1
SPEC_GREEDY_BATCHES=${SPEC_GREEDY_BATCHES:-1,4}  # spec-greedy: batch sizes
# spec, spec-greedy: prompts per batch size at least (batch 1: 8 prompts x 128 tokens). On 2026-11-27 batch 1 was
# one prompt: greedy τ 1.53 there, 1.51 on the CPU for the same prompt, 2.42 on the CPU's four (+~20 s a phase)
SPEC_MIN_PROMPTS=${SPEC_MIN_PROMPTS:-8}
THROUGHPUT_BATCHES=${THROUGHPUT_BATCHES:-1,64}     # throughput: batch sizes
# spec (T=1): target-only chain and tree, a q chain, q trees. S6K2q (22 nodes), batch 1 on the CPU with the
# committed drafter: tau 3.12 on one prompt set, 2.16 on another (S4K2q 2.52 / 2.18; docs/benchmarks.md §2), its
# verify too dear there to win; a GPU verifies 22 tokens for about the price of one
SPEC_ARMS=${SPEC_ARMS:-S3K1N3,S4K2N8,S5K1q,S4K2q,S6K2q}
# spec-greedy (T=0: argmax drafts): greedy tau at batch 1 on the CPU with the committed drafter: S5K1N5 2.42,
# S6K2N12 2.95, S6K3N20 3.26, S8K3N30 3.43, S8K4N40 3.68, S10K4N60 3.88 (4 x 128 tokens; the last three measured
# 2026-12-02, docs/benchmarks.md section 2); #13 asks >= 2.5x. On a launch-bound GPU a step costs about its
# drafting passes (one per depth) plus one verify, so S8K4N40 (+13% tau for 2 passes more than S6K3N20) replaces
# S6K2N12. The q arms draft the same argmax chains and trees for greedy rows through the fused kernels (eighth
# session: S5K1q / S6K2q steps of 317 / 344 operations)
SPEC_GREEDY_ARMS=${SPEC_GREEDY_ARMS:-S6K3N20,S8K4N40,S5K1q,S6K2q}
mkdir -p "$OUT"
deadline=$((SECONDS + BUDGET))
# The files carry the card they were measured on: *_h100.json on an H100, *_h200.json on an H200 (a plain device
# call may get either; the 2026-11-27 seventh session got an H200). gpu_targets.py --gpu h200 reads the latter.
GPU=${GPU:-$(python3 -c 'import re, torch; name = torch.cuda.get_device_name() if torch.cuda.is_available() else "nogpu"
print((re.findall(r"[A-Z]\d{2,3}", name) or [re.sub(r"\W+", "", name)])[0].lower())' 2>/dev/null || echo gpu)}
echo "== files named *_${GPU}.json"
# What the machine runs (~3 s): the cuDNN version matters for the attention kernels (graph_runner.CAPTURED_ATTENTION)
python3 -c 'import torch; print("== torch", torch.__version__, "cuda", torch.version.cuda, "cudnn",
torch.backends.cudnn.version(), torch.cuda.get_device_name() if torch.cuda.is_available() else "no GPU")' || true

# Cost curves (run.gate=auto measures one per device, model and arm set: up to ~90 s each) are cached on this
# machine and lost with it: a tarball an earlier call sent back, carried in at .gpu/cost_curves.tar, seeds the
# cache, and each call sends the cache back as $OUT/cost_curves.tar (one file: $OUT returns at most 8).
CURVES="${TLT_CACHE_DIR:-${TLT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tlt}}/cost_curves"  # as cost_curve.py
if [ -s .gpu/cost_curves.tar ]; then mkdir -p "$CURVES" && tar -xf .gpu/cost_curves.tar -C "$CURVES"; fi
trap 'ls "$CURVES"/*.json >/dev/null 2>&1 && tar -cf "$OUT/cost_curves.tar" -C "$CURVES" .' EXIT

run() {  # run NAME SECONDS CMD...: bounded by SECONDS and by what is left of BUDGET, logged to $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  local left=$((deadline - SECONDS))
  if [ "$limit" -gt "$left" ]; then limit=$left; fi
  if [ "$limit" -lt 30 ]; then
    echo "== $name skipped: ${left}s left of BUDGET=${BUDGET}s"
    return 124
  fi
  local started=$SECONDS
  timeout -k 10 "$limit" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "== $name rc=$rc $((SECONDS - started))s (limit ${limit}s)"
  tail -n 15 "$OUT/$name.log"
  return $rc
}

have_drafter() { [ -s "$DRAFTER/drafter.safetensors" ] && [ -s "$DRAFTER/drafter_config.json" ]; }

send_drafter() {  # $OUT/drafter/: the config, and the weights whole or (over 16 MiB) in 15 MiB parts
  have_drafter || return 1
  rm -rf "$OUT/drafter"
  mkdir -p "$OUT/drafter"
  cp "$DRAFTER/drafter_config.json" "$OUT/drafter/"
  if [ "$(stat -c %s "$DRAFTER/drafter.safetensors")" -gt $((16 * 1024 * 1024)) ]; then
    split -b 15M -a 1 "$DRAFTER/drafter.safetensors" "$OUT/drafter/drafter.safetensors.part-"
  else
    cp "$DRAFTER/drafter.safetensors" "$OUT/drafter/"
  fi
  echo "== drafter sent back: $(cd "$OUT/drafter" && ls | tr '\n' ' ')"
}

warm_drafter() {  # warm_drafter SECONDS PROMPTS STEPS [keep]: train a drafter into $DRAFTER; send it back unless keep
  run drafter "$1" python3 -m tlt.cli drafter warmup --out "$DRAFTER" --overwrite --prompts "$2" --steps "$3" \
    --lr-schedule cosine
  local rc=$?
  if [ $rc -ne 0 ] && have_drafter; then  # the warm-up saves every 60 s: a cut-short one still left a drafter
    echo "== drafter: the warm-up stopped (rc=$rc); its last save ($(grep -o '"steps": [0-9]*' \
      "$DRAFTER/drafter_trainer.json") optimizer steps) is what the phases get"
  fi
  [ "${4:-}" = keep ] || send_drafter
}

install_carried_drafter() {  # the drafter at $CARRIED is served: as it is, or its parts joined at $DRAFTER
  [ -s "$CARRIED/drafter_config.json" ] || return 1
  if [ -s "$CARRIED/drafter.safetensors" ]; then
    DRAFTER=$CARRIED
  else
    mkdir -p "$DRAFTER"
    cat "$CARRIED"/drafter.safetensors.part-* >"$DRAFTER/drafter.safetensors" 2>/dev/null
    cp "$CARRIED/drafter_config.json" "$DRAFTER/"
  fi
  have_drafter && echo "== drafter: $DRAFTER"
}

ensure_drafter() {  # this machine's drafter, else the carried copy, else (WARM_FALLBACK=1) one warmed now
  have_drafter && return 0
  install_carried_drafter && return 0
  if [ "${WARM_FALLBACK:-0}" != 1 ]; then  # 150 s of a 15-minute session, and 4 more files out of $OUT's 8
    echo "== no drafter on this machine nor at $CARRIED (bash benchmarks/gpu_prepare_drafter.sh rebuilds the" \
      "committed one; or WARM_FALLBACK=1 to warm a small one on the device first)"
    return 1
  fi
  warm_drafter 150 64 300 keep  # a small one, kept here: the phase that asked for it gets the rest of BUDGET
}

model_failed=0
ensure_model() {  # the default model's cached copy, converted from its GGUF once per machine (~50 s there)
  ls "${TLT_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tlt}"/models/*/tlt-cache.json >/dev/null 2>&1 && return 0  # as default_model.py
  [ $model_failed = 1 ] && return 1  # tried once in this call: the next phases skip instead of trying again
  run convert 150 python3 -c 'from tlt.models.default_model import default_model_dir; print(default_model_dir())' \
    || { model_failed=1; return 1; }
}

for phase in "$@"; do
  case $phase in
    drafter|spec|spec-greedy|spec-diag|adaptive|spec-compiled|throughput|kernels|head|tail|tail-tau|e2e|e2e-natural|trl|update|triton)
      if ! ensure_model; then echo "== $phase skipped: the default model did not convert"; continue; fi ;;
  esac
  case $phase in
    spec|spec-greedy|spec-diag|adaptive|spec-compiled|tail|tail-tau|e2e|e2e-natural|triton)
      if ! ensure_drafter; then echo "== $phase skipped: no drafter"; continue; fi ;;
  esac
  case $phase in
    tests)  # -v: a run its limit kills still logs each finished test's outcome; Inductor's compile test last
      run tests "${TESTS_LIMIT:-110}" python3 -m pytest -m gpu tests/test_gpu.py -v -rfE --durations=15 \
        -o faulthandler_timeout=100 -k "not compiled" --junitxml="$OUT/tests.xml"
      run tests_compiled 90 python3 -m pytest -m gpu tests/test_gpu.py -v -rfE -o faulthandler_timeout=80 \
        -k compiled --junitxml="$OUT/tests_compiled.xml" ;;
    update)
      run update 80 python3 benchmarks/update_cost.py --device cuda --json "$OUT/update_cost_${GPU}.json" ;;
    tests-fixed)  # what the 2026-11-28 H200 session's tests found, fixed on the CPU: the CUDA tail trainer (its
      # features were queued in another order than drained; set_device refused an unindexed "cuda") and the
      # split attention's stale-count control (racy on a GPU), with the drafter's captured micro-step beside them;
      # and the thirteenth session's overlapped plain steps (pinned copies and events: never run on CUDA), the
      # fourteenth's high-priority decode stream beside a tail trainer (decoding_first; the tail test checks it)
      run tests_fixed 110 python3 -m pytest tests/test_gpu.py tests/test_triton_kernels.py -v \
        -rfE -o faulthandler_timeout=100 \
        -k "tail or stale_arrival or captured_drafter_micro_step or overlapped or decoding_first" \
        --junitxml="$OUT/tests_fixed.xml" ;;
    drafter) warm_drafter 300 "${WARM_PROMPTS:-512}" "${WARM_STEPS:-1000}" ;;
    drafter-more)  # a fifth warm-up round where data is cheap: the committed drafter (four rounds, 1,280 prompts on
      # the CPU; data-bound: each round of fresh prompts lifted it, docs/benchmarks.md section 3) goes on with
      # MORE_PROMPTS fresh prompts (seed 4: none of its rounds'), then serves every phase after it in the call
      # ($DRAFTER) and comes back in $OUT/drafter/ (a warm-up cut at its limit saved its drafter within 60 s)
      run drafter_more 330 python3 -m tlt.cli drafter warmup --init "$CARRIED" --out "$DRAFTER" --overwrite \
        --seed 4 --prompts "${MORE_PROMPTS:-2048}" --steps "${MORE_STEPS:-2000}" --lr-schedule cosine \
        --eval-prompts "${MORE_EVAL_PROMPTS:-8}"
      send_drafter ;;
    spec)  # T=1: speculative_${GPU}.json is the file #13 and #14 need (spec-greedy adds its results to it)
      run spec_t1 150 python3 benchmarks/speculative.py --device cuda --drafter "$DRAFTER" --temperature 1 \
        --batches "$SPEC_BATCHES" --strategies "$SPEC_ARMS" --min-prompts "$SPEC_MIN_PROMPTS" --json "$OUT/speculative_${GPU}.json" \
        --png /tmp/speculative_${GPU}.png ;;
    spec-greedy)
      run spec_greedy 100 python3 benchmarks/speculative.py --device cuda --drafter "$DRAFTER" --temperature 0 \
        --batches "$SPEC_GREEDY_BATCHES" --strategies "$SPEC_GREEDY_ARMS" --min-prompts "$SPEC_MIN_PROMPTS" --json "$OUT/speculative_${GPU}_greedy.json" \
        --png /tmp/speculative_${GPU}_greedy.png
      [ -s "$OUT/speculative_${GPU}.json" ] && python3 benchmarks/speculative.py \
        --add-greedy-to "$OUT/speculative_${GPU}.json" --greedy-json "$OUT/speculative_${GPU}_greedy.json" ;;
    spec-diag)  # H200, 2026-11-28: an S4K2N14q step took ~2.7 ms at batch 1 and ~4.2 ms at batch 4 (from tok/s and
      # tau), a plain step ~1.45 ms at both: host-bound (the device idle between replays) or a kernel that grows?
      # (64 tokens a row: five profiled runs of ~250-400 kernels a step each, and the profiler's tables take time;
      # 1:plain-waiting is the plain step before overlapped steps: their tok/s and device-busy share side by side;
      # in order of need: a run cut at the limit keeps the profiles it finished)
      run spec_diag 180 python3 benchmarks/speculative.py --device cuda --drafter "$DRAFTER" --temperature 1 \
        --batches 1,4 --strategies S4K2N14q,S5K1q --min-prompts "$SPEC_MIN_PROMPTS" --max-new-tokens 64 \
        --profile 1:S4K2N14q --profile 4:S4K2N14q --profile 1:plain --profile 4:plain \
        --profile 1:plain-waiting --json "$OUT/speculative_${GPU}_diag.json" \
        --png /tmp/speculative_${GPU}_diag.png ;;
    adaptive)  # the cost curve (up to 90 s on a fresh machine: carry .gpu/cost_curves.tar), then 4 rollouts
      run adaptive 200 python3 benchmarks/adaptive_buckets.py --device cuda --drafter "$DRAFTER" --prompts 16 \
        --max-new-tokens 1024 --json "$OUT/adaptive_buckets_${GPU}.json" ;;
    throughput)
      # the batch-1 step and the batch-64 ratio are #13's targets (add 16 when a call has time for it); beside the
      # default engine the same engine with plain steps that wait for their tokens (overlap_speedup; torch's
      # kernels were timed in the twelfth session: --also-kernels torch)
      run throughput 230 python3 benchmarks/rollout_throughput.py --device cuda --batches "$THROUGHPUT_BATCHES" \
        --max-new-tokens 128 --also-waiting --compile inductor --skip-eager --json "$OUT/rollout_throughput_${GPU}.json" ;;
    triton-tests)  # tiny models only: runs before the default model is on the machine
      run tests_triton 170 python3 -m pytest tests/test_triton_kernels.py tests/test_gpu.py -v -rfE \
        -o faulthandler_timeout=160 -k "triton" --junitxml="$OUT/tests_triton.xml" ;;
    triton)  # each step bounded: a kernel that fails to build on the device fails its own step only
      run triton_step 90 python3 benchmarks/decode_step.py --batches 1,64 --json "$OUT/decode_step_${GPU}_triton.json"
      run triton_spec_greedy 100 python3 benchmarks/speculative.py --device cuda --drafter "$DRAFTER" --kernels triton \
        --temperature 0 --batches 1,4 --strategies S5K1N5,S6K2N12 --min-prompts "$SPEC_MIN_PROMPTS" \
        --json "$OUT/speculative_${GPU}_triton_greedy.json" --png /tmp/speculative_${GPU}_triton_greedy.png
      run triton_spec 130 python3 benchmarks/speculative.py --device cuda --drafter "$DRAFTER" --kernels triton \
        --temperature 1 --batches 1,4 --strategies S5K1q,S6K2q,S4K2N8 --min-prompts "$SPEC_MIN_PROMPTS" \
        --greedy-json "$OUT/speculative_${GPU}_triton_greedy.json" --json "$OUT/speculative_${GPU}_triton.json" \
        --png /tmp/speculative_${GPU}_triton.png ;;
    kernels)
      run kernels 240 python3 benchmarks/decode_step.py --compile --batches 1,64 --json "$OUT/decode_step_${GPU}.json"
      run kernels_autotune 280 python3 benchmarks/decode_step.py --compile --compile-mode max-autotune --batches 1 \
        --json "$OUT/decode_step_${GPU}_autotune.json" ;;
    spec-compiled)
      run spec_compiled_greedy 260 python3 benchmarks/speculative.py --device cuda --drafter "$DRAFTER" \
        --temperature 0 --compile inductor --batches 1,4 --strategies S3K1N3,S5K1q,S4K2N8,S4K2q \
        --json "$OUT/speculative_${GPU}_compiled_greedy.json" --png /tmp/speculative_${GPU}_compiled_greedy.png
      run spec_compiled_t1 260 python3 benchmarks/speculative.py --device cuda --drafter "$DRAFTER" \
        --temperature 1 --compile inductor --batches 1,4 --strategies S3K1N3,S5K1q,S4K2N8,S4K2q \
        --greedy-json "$OUT/speculative_${GPU}_compiled_greedy.json" --json "$OUT/speculative_${GPU}_compiled.json" \
        --png /tmp/speculative_${GPU}_compiled.png ;;
    head)
      run head 120 python3 benchmarks/head_precision.py --device cuda --json "$OUT/head_precision_${GPU}.json" ;;
    tail)
      run tail 540 python3 benchmarks/spot_training.py --lone-worker --device cuda --drafter "$DRAFTER" \
        --max-new-tokens 1024 --phases overhead --steps 2 --warmup-steps 1 --drafter-graph --default-stream \
        --json "$OUT/spot_training_${GPU}.json" ;;
    tail-tau)  # 10 RL steps per mode as #15 asks: at 1024 tokens they do not fit a call, at TAU_TOKENS they may
      run tail_tau 540 python3 benchmarks/spot_training.py --lone-worker --device cuda --drafter "$DRAFTER" \
        --max-new-tokens "$TAU_TOKENS" --phases tau --tau-steps "$TAU_STEPS" --warmup-steps 1 \
        --json "$OUT/spot_training_tau_${GPU}.json" ;;
    e2e)
      run e2e_replay 540 python3 benchmarks/e2e.py --device cuda --drafter "$DRAFTER" --replay --max-new-tokens 1024 \
        --prompts 4 --samples 4 --steps 3 --warmup-steps 1 --seeds 0 --json "$OUT/e2e_replay_${GPU}.json" ;;
    e2e-natural)
      # shellcheck disable=SC2086  # SEEDS is a list of seeds
      run e2e_natural 540 python3 benchmarks/e2e.py --device cuda --drafter "$DRAFTER" --skip-trl \
        --max-new-tokens 1024 --prompts 4 --samples 4 --steps 3 --warmup-steps 1 --seeds $SEEDS \
        --json "$OUT/e2e_${GPU}_seed$(echo $SEEDS | tr ' ' '-').json" ;;
    trl)
      if [ ! -d /tmp/site/trl ]; then
        ls .gpu/trl/*.whl >/dev/null 2>&1 || { echo "== trl skipped: no .gpu/trl wheels in the carry"; continue; }
        python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/trl/*.whl
      fi
      run trl 540 python3 benchmarks/e2e.py --device cuda --drafter none --trl-only --max-new-tokens 1024 \
        --prompts 4 --samples 4 --steps 3 --warmup-steps 1 --seeds 0 --json "$OUT/e2e_trl_${GPU}.json" ;;
    *) echo "unknown phase $phase (tests drafter spec spec-greedy spec-compiled kernels throughput head tail" \
         "tail-tau e2e e2e-natural trl update tests-fixed triton-tests triton)"; exit 2 ;;
  esac
done
