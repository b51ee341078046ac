"""What a speculative step costs on this device relative to a plain one, by batch size: the gate and the arms.

SD pays at batch B when an arm's acceptance length τ exceeds t_sd(B, arm) / t_plain(B): every row emits τ tokens
per step instead of 1. That ratio is a property of the device: on 2 CPU cores a 9-token verify costs 1.1x a plain
step at batch 1 and 3.3x at batch 16 (docs/benchmarks.md), while a GPU verifies 16-32 tokens per row for about the
price of one up to a much larger batch. So instead of a gate tuned on one machine, the engine measures whole steps
(plain, and every arm's SD step through the same runner the rollout uses) at a few batch sizes, once per (device,
model shape, rollout dtype, arms), caches the curve as JSON, and derives:

- the gate: the largest measured batch at which some arm is expected to pay (cost < `EXPECTED_TAU` plain steps,
  the cost made monotone in the batch size so that noise cannot reopen the gate at a large batch);
- the arms: those expected to pay at batch 1 (an arm too expensive even there can only lose).

The bandit still learns per batch bucket below the gate from the real τ: the curve only bounds where it looks.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import math
import os
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tlt.models.default_model import cache_root
from tlt.models.kv_cache import KVCache
from tlt.rollout.graph_runner import batch_bucket, cache_capacity
from tlt.rollout.model_runner import sampler_of
from tlt.sampling import RowSampling, SamplingParams, sample_next
from tlt.speculative.decoder import SpeculativeDecoder
from tlt.speculative.strategy import SpecStrategy
from tlt.threads import cpu_model

EXPECTED_TAU = 2.5   # what a warmed drafter reaches at T = 1 with q-sampling (τ 2.3-2.5, docs/benchmarks.md): an
                     # optimistic bound on purpose, since the bandit then prunes arms with the τ it measures
BATCHES = (1, 2, 4, 8, 16, 32)
CONTEXT = 256        # committed tokens per row while timing (a mid-length response)
MEASURE_REPEATS = 3
MEASURE_BUDGET_S = 90.0  # a start-up cost paid once per device and model: bounded even on a loaded machine
TRUNCATED_KEPT_S = 600.0  # how long a truncated curve serves (workers starting together; not the next run)
log = logging.getLogger(__name__)


@dataclass
class CostCurve:
    """Seconds per decode step, plain and per arm (by name), at each measured batch size."""

    device: str
    plain_s: dict[int, float]
    step_s: dict[str, dict[int, float]]
    measured_s: float = 0.0                              # how long measuring took
    notes: dict = field(default_factory=dict)

    @property
    def batches(self) -> list[int]:
        return sorted(self.plain_s)

    def ratio(self, arm: str, batch: int) -> float:
        """An SD step of `arm` in plain steps at this batch, as measured (inf where it was not measured)."""
        step = self.step_s.get(arm, {}).get(batch)
        return float("inf") if step is None else step / self.plain_s[batch]

    def cost(self, arm: str, batch: int) -> float:
        """The ratio made monotone in the batch size (the most it was at this batch or any smaller one): SD
        only gets relatively dearer as the batch grows, so a cheap reading at a large batch is noise."""
        return max(self.ratio(arm, b) for b in self.batches if b <= batch)

    def gate(self, tau: float = EXPECTED_TAU) -> int:
        """The largest measured batch at which some arm costs less than `tau` plain steps (0: never speculate)."""
        paying = [b for b in self.batches if min((self.cost(arm, b) for arm in self.step_s), default=tau) < tau]
        return max(paying, default=0)

    def arms(self, tau: float = EXPECTED_TAU) -> list[str]:
        """Arms that can pay somewhere: cheaper than `tau` plain steps at the smallest batch."""
        first = self.batches[0]
        return [arm for arm in self.step_s if self.cost(arm, first) < tau]

    def summary(self, tau: float = EXPECTED_TAU) -> dict:
        """For the run's metrics: the derived gate and arms, and every arm's cost ratio by batch."""
        return {"device": self.device, "gate": self.gate(tau), "arms": self.arms(tau), "expected_tau": tau,
                "ratio": {arm: {str(b): round(self.ratio(arm, b), 3) for b in self.batches if b in steps}
                          for arm, steps in self.step_s.items()},
                "measured_s": round(self.measured_s, 2)}

    def to_dict(self) -> dict:
        return {"device": self.device, "plain_s": {str(b): s for b, s in self.plain_s.items()},
                "step_s": {arm: {str(b): s for b, s in steps.items()} for arm, steps in self.step_s.items()},
                "measured_s": self.measured_s, "notes": self.notes}

    @classmethod
    def from_dict(cls, data: dict) -> "CostCurve":
        """ValueError for a curve no gate can come from (a cache file that parses but is wrong: no plain step,
        a time of 0, an arm timed at a batch without a plain time failed in every later run; found by review)."""
        curve = cls(data["device"], {int(b): float(s) for b, s in data["plain_s"].items()},
                    {arm: {int(b): float(s) for b, s in steps.items()} for arm, steps in data["step_s"].items()},
                    float(data.get("measured_s", 0.0)), dict(data.get("notes", {})))
        times = [*curve.plain_s.values(), *(s for steps in curve.step_s.values() for s in steps.values())]
        if not curve.plain_s or not all(math.isfinite(t) and t > 0 for t in times):
            raise ValueError("a cost curve needs positive, finite step times and at least one plain step")
        if any(batch not in curve.plain_s for steps in curve.step_s.values() for batch in steps):
            raise ValueError("a cost curve's arm was timed at a batch without a plain step time")
        return curve


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"cpu x{torch.get_num_threads()}"


def curve_for(engine, strategies: list[SpecStrategy], *, cache_dir: str | Path | None = None,
              batches=BATCHES) -> CostCurve:
    """The engine's curve from the cache, or measured now and cached. The key covers what changes the costs:
    the device, the model's shape and rollout dtype, the runner (graphs or eager; compiled; its kernels), the arms
    and the batches."""
    path = Path(cache_dir or default_cache_dir()) / f"{curve_key(engine, strategies, batches)}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(path.with_suffix(".lock")):  # workers starting together: one measures, the others read it
        if path.exists():
            try:
                cached = CostCurve.from_dict(json.loads(path.read_text()))
                # a curve cut by its time budget (a loaded machine) serves the workers starting with it, not later
                # runs: it would cap their gate at its last batch for good (found by review)
                if not cached.notes.get("truncated") or time.time() - path.stat().st_mtime < TRUNCATED_KEPT_S:
                    return cached
            except (ValueError, KeyError, TypeError):
                pass  # a damaged cache file is measured again and replaced
        curve = measure(engine, strategies, batches)
        if curve.notes.get("truncated"):
            log.warning("the cost curve was cut after batch %d by its %g s budget (a busy machine?): a run that "
                        "starts after %g min measures it again", max(curve.batches, default=0), MEASURE_BUDGET_S,
                        TRUNCATED_KEPT_S / 60)
        staged = path.with_suffix(".tmp")
        staged.write_text(json.dumps(curve.to_dict(), indent=1))
        staged.replace(path)
    return curve


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """An advisory lock across processes and threads (each open() is its own lock holder)."""
    with open(lock_path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def default_cache_dir() -> Path:
    """TLT_CACHE_DIR/cost_curves, else beside the default model's cache (`default_model.cache_root`)."""
    if os.environ.get("TLT_CACHE_DIR"):
        return Path(os.environ["TLT_CACHE_DIR"]) / "cost_curves"
    return cache_root() / "cost_curves"


def curve_key(engine, strategies: list[SpecStrategy], batches) -> str:
    spec = engine.spec
    # the drafter's draft vocabulary sizes its head, a large part of a draft pass (3.2x the drafting time at 8,192
    # tokens against SmolLM2's 49,152: benchmarks §11): a curve measured with one does not price the other
    drafter = engine.spec_decoder.drafter if engine.spec_decoder is not None else None
    parts = [device_name(engine.device), spec.model_type, spec.num_layers, spec.hidden_size, spec.vocab_size,
             str(engine.forward.dtype), engine.runner is not None, torch.__version__, linear_kind(engine.forward),
             sorted(s.name for s in strategies), list(batches), CONTEXT,
             None if drafter is None else drafter.draft_vocab_size]
    if engine.device.type == "cpu":
        parts.append(cpu_model())
    compile_mode = getattr(engine.forward, "compile_mode", None)
    if compile_mode is not None:  # only then: the keys of uncompiled engines stay what they were
        parts.append(compile_mode)
    if drafter is not None and drafter.config.model_type != spec.model_type:
        # a Qwen3 target's drafter has a Llama layer (no q/k norm kernels) since 2026-12-02: not the old curve's
        parts.append(f"drafter_layer={drafter.config.model_type}")
    kernels = getattr(engine.forward, "kernels", "torch")
    if kernels != "torch":  # likewise: the Triton kernels' costs are their own
        parts.append(f"kernels={kernels}")
    digest = hashlib.sha256(json.dumps(parts, default=str).encode()).hexdigest()[:16]
    slug = "".join(c if c.isalnum() else "-" for c in device_name(engine.device)).strip("-").lower()
    return f"{slug}-{digest}"


def linear_kind(forward) -> str:
    """Which linear the forward runs (e.g. packed oneDNN on CPU): a new kind changes the costs, so the key too."""
    linear = forward.linear
    return getattr(linear, "__name__", type(linear).__name__)


@torch.no_grad()
def measure(engine, strategies: list[SpecStrategy], batches=BATCHES, repeats: int = MEASURE_REPEATS,
            tau: float = EXPECTED_TAU, budget_s: float = MEASURE_BUDGET_S) -> CostCurve:
    """Time plain and SD steps at every batch size on scratch buffers (random KV; a random drafter costs what a trained
    one does: the arm and the draft vocabulary fix the shapes). Plain and SD steps alternate and each arm keeps the
    median of its paired ratios, so load that drifts while measuring (other processes) cancels. An arm is no longer
    timed past the batch where it stops paying, measuring ends when none pays, or when `budget_s` of timed steps has
    passed (warm-ups, i.e. graph captures and compiles, are not charged: with rollout.compile they take tens of
    seconds per arm on the first batch, which would otherwise end the measurement there)."""
    with sampler_of(engine.forward):  # the draws the engine's own steps make (the fused sampler on Triton kernels)
        return _measure(engine, strategies, batches, repeats, tau, budget_s)


def _measure(engine, strategies: list[SpecStrategy], batches, repeats: int, tau: float, budget_s: float) -> CostCurve:
    if engine.spec_decoder is None:
        raise ValueError("measuring SD costs needs an engine with a drafter")
    started = time.perf_counter()
    plain, steps = {}, {s.name: {} for s in strategies}
    live = [s for s in strategies if s.branching <= engine.spec_decoder.drafter.draft_vocab_size]
    tree = max(s.cache_slots for s in strategies)
    truncated = False
    warmups = 0.0  # one-off work (graph capture; compiling, with rollout.compile): not charged to the budget
    for batch in batches:
        if not live or time.perf_counter() - started - warmups > budget_s:
            truncated = bool(live)
            break
        scratch = _Scratch(engine, batch, tree)
        plain_times, ratios = [], {s.name: [] for s in live}
        for strategy in live:
            warmups += _timed(scratch.sd_step, engine.device, strategy)  # warm-up (graph capture)
        warmups += _timed(scratch.plain_step, engine.device)
        for _ in range(repeats):
            for strategy in live:
                before = _timed(scratch.plain_step, engine.device)
                ratios[strategy.name].append(_timed(scratch.sd_step, engine.device, strategy) / before)
                plain_times.append(before)
        scratch.release()
        plain[batch] = statistics.median(plain_times)
        for strategy in live:
            steps[strategy.name][batch] = statistics.median(ratios[strategy.name]) * plain[batch]
        curve = CostCurve("", plain, steps)
        live = [s for s in live if curve.cost(s.name, batch) < tau]
    return CostCurve(device_name(engine.device), plain, {k: v for k, v in steps.items() if v},
                     time.perf_counter() - started, {"context": CONTEXT, "repeats": repeats, "truncated": truncated,
                                                     "warmup_s": warmups})


class _Scratch:
    """A cache of `batch` rows holding CONTEXT committed tokens, and a drafter cache one pair behind (the
    steady state of speculation), reset after every timed step so each repeat does the same work."""

    def __init__(self, engine, batch: int, tree: int):
        self.engine, self.batch = engine, batch
        rows = batch if engine.runner is None else batch_bucket(batch, 1 << 30) or batch
        length = cache_capacity(CONTEXT + tree + 2, graphs=engine.runner is not None)  # as the rollout's cache
        self.cache = KVCache(engine.spec, rows, length, device=engine.device, dtype=engine.forward.dtype)
        self.cache.add_slot_data("tokens", dtype=torch.long)
        self.cache.add_slot_data("features", (engine.spec.hidden_size,), dtype=engine.forward.dtype)
        self.decoder = SpeculativeDecoder(engine.forward, engine.spec_decoder.drafter)
        self.decoder.allocate(rows, self.cache.max_len)
        self.rows = self.cache.rows(0, batch)
        self.settings = RowSampling.from_params([SamplingParams(temperature=1.0)] * batch, "cpu")
        self.ids = torch.randint(0, engine.spec.vocab_size, (batch, 1))
        self._reset()

    def _reset(self) -> None:
        self.cache.lengths[:self.batch] = CONTEXT
        self.decoder.cache.lengths[:self.batch] = CONTEXT - 1

    def plain_step(self) -> None:
        engine, uniforms = self.engine, torch.rand(self.batch, 1)
        if engine.runner is not None:  # as a rollout serving a drafter decodes: its inputs stored, one copy back
            engine.runner.decode(self.ids, self.rows, self.settings, uniforms, store_drafter_inputs=True).cpu()
        else:
            out = engine.forward(self.ids, self.rows, logits_at="all")
            sample_next(out.logits[:, 0], self.settings.to(engine.device), uniforms[:, 0])[0].cpu()

    def sd_step(self, strategy: SpecStrategy) -> None:
        engine = self.engine
        uniforms = torch.rand(self.batch, strategy.uniforms_per_row)
        pending = self.ids[:, 0]
        outcome = None
        if engine.runner is not None:
            outcome = engine.runner.speculative_step(self.decoder, self.rows, pending, self.settings, uniforms, strategy)
        if outcome is None:
            self.decoder.step(self.rows, pending.to(engine.device), self.settings.to(engine.device),
                              uniforms.to(engine.device), strategy)
        self._reset()

    def release(self) -> None:
        if self.engine.runner is not None:
            self.engine.runner.reset()  # its graphs point into this scratch cache


def _timed(step, device: torch.device, *args) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    started = time.perf_counter()
    step(*args)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - started
