"""DrafterTrainer: fits the EAGLE drafter to the current policy's features; preemptible.

loss = w_feat * SmoothL1(ĥ_{t+1}, f_{t+1}) + w_ce * H(softmax(lm_head(f_{t+1})), softmax(lm_head(ĥ_{t+1})))
The feature term keeps the drafter in the target's hidden space (it feeds on its own outputs when drafting deeper),
the soft cross-entropy aligns what matters for acceptance: the token distribution. `train_until(stop)` checks its
stop signal between optimizer steps, so it yields a worker within one step of being asked.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

from tlt.drafter.buffer import FeatureBuffer, FeatureEntry, PackedPairs, pack_pairs, pad_rows
from tlt.drafter.step_graph import MicroStepGraph
from tlt.drafter.unroll import MAX_UNROLL, level_valid, unrolled_levels
from tlt.device_values import metrics_to_host
from tlt.errors import first_line
from tlt.files import load_checked_tensors, save_checked_tensors, write_whole
from tlt.models.eagle import DrafterError
from tlt.optimizer_state import flatten_optimizer, unflatten_optimizer

log = logging.getLogger(__name__)

# Packed rows per micro-step: 2 on the CPU, where one is tens of milliseconds and a stop request waits for it. On
# CUDA one is a few milliseconds and its launches are what a spot-training thread takes the GIL from the decode
# loop for, so as many rows as keep a micro-step's logits within CUDA_LOGITS_PER_MICRO_STEP (8 rows of 256 pairs
# over the default 8,192-token draft vocabulary, ~1 GB of activations; 1 row over a 49k or 152k vocabulary,
# whose logits and their softmaxes would otherwise take gigabytes beside the rollout).
CPU_ROWS_PER_MICRO_STEP = 2
CUDA_LOGITS_PER_MICRO_STEP = 8 * 256 * 8192
CUDA_MAX_ROWS_PER_MICRO_STEP = 8

OPTIMIZER_FILE = "drafter_optimizer.safetensors"
TRAINER_FILE = "drafter_trainer.json"  # optimizer steps and the optimizer state's layout


@dataclass(frozen=True)
class DrafterTrainConfig:
    lr: float = 1e-3
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 0.5
    feature_weight: float = 1.0     # SmoothL1 on the predicted hidden state
    ce_weight: float = 0.1          # soft cross-entropy against the target's token distribution (forward KL:
                                    # q-sampling accepts 1 - TV(p, q), so the whole distribution matters)
    temperature: float = 1.0        # the rollout temperature: p and q are compared as the sampler processes them
    feature_noise: float = 0.0      # uniform noise on input features (EAGLE's robustness trick), as a fraction
    entries_per_step: int = 8       # samples drawn from the buffer per optimizer step
    row_length: int = 256           # pairs per packed row
    rows_per_micro_step: int | None = None  # packed rows per forward/backward; a stop request is honored between
                                            # them. None: by device and draft vocabulary (`rows_per_micro_step`)
    seed: int = 0
    warmup_steps: int = 0           # a fresh optimizer's lr ramps up linearly over its first steps: AdamW's first
                                    # updates are ~lr per weight whatever the gradient (no second moment yet), a
                                    # kick that costs a warmed drafter acceptance (benchmarks/drafter_adaptation.py).
                                    # Moments loaded from a drafter directory carry on without a ramp
    cuda_graph: bool = False        # on CUDA, each micro-step one replayed graph (drafter/step_graph.py): a few
                                    # launches instead of ~170 (not with feature_noise; ignored on the CPU)
    unroll: int = 1                 # levels of drafting trained per pair (drafter/unroll.py): 1 = teacher forcing;
                                    # l > 1 also feeds the drafter its own features, as its deeper drafts are
    unroll_decay: float = 1.0       # level l's loss weighs unroll_decay ** (l - 1) (the total is normalized)

    def __post_init__(self):
        if not (isinstance(self.unroll, int) and 1 <= self.unroll <= MAX_UNROLL):
            raise ValueError(f"DrafterTrainConfig.unroll must be an integer from 1 to {MAX_UNROLL}, got "
                             f"{self.unroll!r}")
        if not 0 <= self.unroll_decay < math.inf:
            raise ValueError(f"DrafterTrainConfig.unroll_decay must be a finite number >= 0, got {self.unroll_decay}")


class DrafterTrainer:
    def __init__(self, drafter, buffer: FeatureBuffer, config: DrafterTrainConfig = DrafterTrainConfig()):
        self.drafter, self.buffer, self.config = drafter, buffer, config
        params = [p for p in drafter.parameters() if p.requires_grad]
        # fused on CUDA: one kernel for every parameter's update, where foreach launches several
        fused = bool(params) and all(p.is_cuda for p in params)
        self.optimizer = torch.optim.AdamW(params, lr=config.lr, betas=config.betas,
                                           weight_decay=config.weight_decay, fused=fused or None)
        self.steps = 0
        self._moment_steps = 0  # optimizer steps behind the optimizer's moments (the lr ramp's clock)
        self._noise_generators: dict[str, torch.Generator] = {}  # by device: noise drawn where the features are
        self._micro_step_graph: MicroStepGraph | None = None  # (`cuda_graph`) captured on first use
        self._graph_failure: str | None = None  # why a capture failed (then eager for good)

    # -- training ---------------------------------------------------------------------------------------------

    def train_steps(self, count: int) -> list[dict]:
        return [self._step() for _ in range(count)]

    def train_until(self, stop: Callable[[], bool], max_steps: int) -> list[dict]:
        """Train until stop() is true or max_steps are done. stop() is checked between micro-steps too: a step
        it interrupts is dropped (no optimizer update), so a worker is released within one micro-step."""
        history = []
        while len(history) < max_steps and not stop():
            record = self._step(stop)
            if record is None:
                break
            history.append(record)
        return history

    def _step(self, stop: Callable[[], bool] | None = None) -> dict | None:
        """One optimizer step over `entries_per_step` buffer entries, accumulated over micro-steps of a few
        packed rows; every pair weighs 1 / (the step's pairs) in each micro-step's loss, so the accumulated
        gradient is the whole batch's. One host read per step (the metrics, at its end): the weights come from
        the packed rows on the host, and on CUDA the step's launches are all a spot-training thread needs the
        GIL for (each read held the decode loop's next step back: drafter/tail_trainer.py). With
        `cuda_graph` a micro-step is one replayed graph (drafter/step_graph.py)."""
        started = time.perf_counter()
        self.drafter.train()
        size = max(1, self._rows_per_micro_step())
        chunks = self._micro_batches(self.buffer.sample(self.config.entries_per_step), size)
        graph = self._graph(size, *chunks[0]) if chunks else None
        # a graph writes into the gradients it was captured with: they are zeroed, never dropped
        self.optimizer.zero_grad(set_to_none=graph is None)
        sums: dict = {}
        for rows, row_weights in chunks:
            if stop is not None and stop():
                self.optimizer.zero_grad(set_to_none=graph is None)
                self.drafter.eval()
                return None
            if graph is not None:
                graph.run(rows, row_weights)
                continue
            loss, parts = self.loss(*self._to_device(rows, row_weights))
            loss.backward()
            for key, value in parts.items():
                sums[key] = value if key not in sums else sums[key] + value
        if graph is not None:
            sums = graph.sums
        if self.config.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), self.config.grad_clip)
        self._optimizer_step()
        self.drafter.eval()
        self.steps += 1
        return {**finish_metrics(metrics_to_host([sums])[0]), "step": self.steps,
                "step_s": time.perf_counter() - started}

    def _optimizer_step(self) -> None:
        """One AdamW step, its lr scaled by the fresh-optimizer ramp (`warmup_steps`) on top of whatever lr the
        groups hold (a caller's schedule, e.g. the warm-up's cosine, composes with it)."""
        ramp = self.config.warmup_steps
        scale = (self._moment_steps + 1) / ramp if self._moment_steps < ramp else 1.0
        base = [group["lr"] for group in self.optimizer.param_groups]
        for group, lr in zip(self.optimizer.param_groups, base):
            group["lr"] = lr * scale
        try:
            self.optimizer.step()
        finally:
            for group, lr in zip(self.optimizer.param_groups, base):
                group["lr"] = lr
        self._moment_steps += 1

    def _micro_batches(self, entries: list[FeatureEntry], size: int) -> list[tuple[PackedPairs, torch.Tensor]]:
        """The entries packed into rows, weighted (1 / the step's pairs; 0 at padding) and cut into micro-batches
        of `size` rows (padded to `size` for a graph), those without a pair left out: all on the host."""
        packed = pack_pairs(entries, self.config.row_length)
        weights = packed.valid.float() / max(1, int(packed.valid.sum()))
        chunks = _row_chunks(packed, weights, size, pad=self._graph_wanted())
        return [(rows, row_weights) for rows, row_weights in chunks if bool(rows.valid.any())]

    def _graph_wanted(self) -> bool:
        """A captured micro-step: asked for, on CUDA, without feature noise (a replay would repeat its draws),
        and not given up on after a failed capture."""
        return (self.config.cuda_graph and self.drafter.fc.weight.device.type == "cuda"
                and not self.config.feature_noise and self._graph_failure is None)

    def _graph(self, rows: int, first_rows: PackedPairs, first_weights: torch.Tensor) -> MicroStepGraph | None:
        """The captured micro-step for `rows` rows, ready for a step (captured with the step's first rows on
        first use: before the step's gradients are zeroed), or None: eager. A capture that fails leaves the
        trainer eager for good, said once (training goes on, only slower)."""
        if not self._graph_wanted():
            return None
        if self._micro_step_graph is None or not self._micro_step_graph.fits(rows):
            self._micro_step_graph = MicroStepGraph(self, rows, self.config.row_length)
        try:
            self._micro_step_graph.start_step(first_rows, first_weights)
        except Exception as error:  # noqa: BLE001 - whatever stops a capture, the eager step still trains
            self._graph_failure, self._micro_step_graph = first_line(error), None
            log.warning("the drafter's micro-step could not be captured as a CUDA graph (%s): it trains eagerly",
                        self._graph_failure)
            self.optimizer.zero_grad(set_to_none=True)  # whatever the warm-up runs left
            return None
        return self._micro_step_graph

    def _rows_per_micro_step(self) -> int:
        if self.config.rows_per_micro_step is not None:
            return self.config.rows_per_micro_step
        mapping = self.drafter.draft_to_target
        vocab = self.drafter.config.vocab_size if mapping is None else mapping.shape[0]
        # each unrolled level computes its own logits over the rows
        pairs = self.config.row_length * self.config.unroll
        return rows_per_micro_step(self.drafter.fc.weight.device.type, pairs, vocab)

    def _noise_generator(self, device: torch.device) -> torch.Generator:
        """The feature noise's generator on `device`, seeded from the config (on a GPU, noise drawn on the host
        was copied from pageable memory every micro-step: a sync)."""
        key = str(device)
        if key not in self._noise_generators:
            self._noise_generators[key] = torch.Generator(device=device).manual_seed(self.config.seed)
        return self._noise_generators[key]

    def loss(self, batch: PackedPairs, weights: torch.Tensor, *, noise: bool = True):
        """(loss, metrics) over packed rows; weights [R, L]: each pair's weight in both (0 at padding), so
        that they are weighted sums: means when the weights of the step's pairs sum to 1. Every pair is
        computed, padding too (finite: zero features), and nothing is indexed by the real pairs: fixed shapes,
        no host read, what a CUDA graph captures. With `unroll` > 1 the loss averages the levels'
        (drafter/unroll.py); the metrics are level 1's (teacher-forced), plus the deepest level's acceptance."""
        cfg = self.config
        features = batch.input_features
        if noise and cfg.feature_noise > 0:  # training only: a held-out score is of the drafter as it serves
            scale = features.abs().mean() * cfg.feature_noise
            uniform = torch.rand(features.shape, generator=self._noise_generator(features.device),
                                 device=features.device, dtype=features.dtype)
            features = features + (uniform * 2 - 1) * scale
        scale = 1.0 / cfg.temperature if cfg.temperature > 0 else 1.0  # greedy rollouts: the untempered p
        with torch.no_grad():  # what every level targets
            target_probs = torch.softmax(self.drafter.draft_logits(batch.target_features) * scale, dim=-1)
        levels = cfg.unroll
        total, norm, parts = 0.0, 0.0, {}
        for level, hidden in unrolled_levels(self.drafter, batch, features, levels):
            level_weights = weights * level_valid(batch.attention_mask, batch.valid, level)
            level_loss, level_parts = self._level_loss(hidden, batch.target_features, target_probs, level_weights,
                                                       scale)
            factor = cfg.unroll_decay ** (level - 1)
            total, norm = total + factor * level_loss, norm + factor
            if level == 1:
                parts = level_parts
            elif level == levels:  # sums over its scored pairs: `finish_metrics` divides by their weight
                parts.update(accept_q_deepest=level_parts["accept_q"], deepest_weight=level_weights.sum())
        loss = total / norm
        # tensors, not floats: each float() was a host read per micro-step (see _step)
        return loss, {**parts, "loss": loss.detach()}

    def _level_loss(self, predicted, target_features, target_probs, weights, scale: float):
        """One level's (loss, metrics): SmoothL1 to the target's features + `ce_weight` soft cross-entropy to its
        token distribution, and depth-1 acceptance (over the draft vocabulary) under each rule: target-only
        accepts the drafted token with p(argmax q), q-sampling with sum_x min(p(x), q(x))."""
        def weighted(per_pair: torch.Tensor) -> torch.Tensor:  # in fp32 whatever the drafter's dtype
            return (per_pair.float() * weights).sum()
        feature_loss = weighted(F.smooth_l1_loss(predicted, target_features, reduction="none").mean(-1))
        draft_logits = self.drafter.draft_logits(predicted)
        ce = weighted(-(target_probs * torch.log_softmax(draft_logits * scale, dim=-1)).sum(-1))
        loss = self.config.feature_weight * feature_loss + self.config.ce_weight * ce
        with torch.no_grad():
            drafted = draft_logits.argmax(-1)
            agreement = weighted(drafted == target_probs.argmax(-1))
            accept_target = weighted(target_probs.gather(-1, drafted[..., None])[..., 0])
            accept_q = weighted(torch.minimum(target_probs, torch.softmax(draft_logits.detach() * scale, -1)).sum(-1))
        return loss, {"feature_loss": feature_loss.detach(), "ce": ce.detach(), "top1": agreement,
                      "accept_target_only": accept_target, "accept_q": accept_q}

    # -- evaluation -------------------------------------------------------------------------------------------

    @torch.no_grad()
    def evaluate(self, entries: list[FeatureEntry]) -> dict:
        """Held-out loss, top-1 agreement and depth-1 acceptance under each rule, all teacher-forced (the drafter
        fed the target's own features). Top-1 agreement is NOT an acceptance rate at T > 0: at T = 1 a token that
        matches the target's argmax is still accepted only with probability p(token). For the τ these predict,
        deeper drafts included, see tlt.drafter.chain."""
        if not entries:
            raise ValueError("DrafterTrainer.evaluate: no feature entries to evaluate on")
        self.drafter.eval()
        packed = pack_pairs(entries, self.config.row_length)
        weights = packed.valid.float() / max(1, int(packed.valid.sum()))
        return finish_metrics(metrics_to_host([self.loss(*self._to_device(packed, weights), noise=False)[1]])[0])

    def _to_device(self, batch: PackedPairs, weights: torch.Tensor) -> tuple[PackedPairs, torch.Tensor]:
        """The packed rows and their weights on the drafter's device and dtype. To CUDA through pinned memory,
        asynchronously: a copy from pageable memory holds the calling thread until it lands."""
        device, dtype = self.drafter.fc.weight.device, self.drafter.fc.weight.dtype
        pinned = device.type == "cuda"

        def move(tensor: torch.Tensor, to_dtype=None) -> torch.Tensor:
            moved = tensor.pin_memory().to(device, non_blocking=True) if pinned else tensor.to(device)
            return moved if to_dtype is None else moved.to(to_dtype)  # converted on the device
        return (PackedPairs(move(batch.input_tokens), move(batch.input_features, dtype),
                            move(batch.target_features, dtype), move(batch.positions), move(batch.attention_mask),
                            move(batch.valid)),
                move(weights))

    # -- checkpoints ------------------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        """Drafter weights + config (its own layers only) and the optimizer state, all safetensors/JSON."""
        self.drafter.save(directory)
        save_trainer_state(directory, {"optimizer": self.optimizer.state_dict(), "steps": self.steps})

    @staticmethod
    def has_saved_state(directory: str | Path) -> bool:
        """Whether `directory` holds a trainer's state as `save` writes it (both files)."""
        return (Path(directory) / OPTIMIZER_FILE).exists() and (Path(directory) / TRAINER_FILE).exists()

    def load_optimizer(self, directory: str | Path, state: dict | None = None) -> None:
        """The optimizer moments and step count `save` wrote to `directory` (`state`: as `saved_state` read them)."""
        state = self.saved_state(directory) if state is None else state
        try:
            self.optimizer.load_state_dict(state["optimizer"])
            _check_moment_shapes(self.optimizer)
        except (ValueError, KeyError, RuntimeError) as error:
            raise DrafterError(f"{directory}: its optimizer state does not fit the drafter "
                               f"({first_line(error)})") from None
        # the moments and step count carry on; the hyperparameters are this trainer's (load_state_dict brought
        # the saved run's lr, betas and weight decay, and run.drafter_lr was silently ignored), and so is the
        # kernel choice: it brought the saver's fused/foreach too (a state saved on the CPU turned a CUDA
        # trainer's fused AdamW off for the rest of the run)
        kernels = {key: self.optimizer.defaults[key] for key in ("fused", "foreach")}
        for group in self.optimizer.param_groups:
            group.update(lr=self.config.lr, betas=self.config.betas, weight_decay=self.config.weight_decay,
                         **kernels)
        _place_step_counts(self.optimizer)
        self.steps = self._moment_steps = state["steps"]

    @staticmethod
    def saved_state(directory: str | Path) -> dict:
        """{"optimizer": state dict, "steps": optimizer steps} as `save` wrote them; a damaged file (cut short,
        not JSON) is a DrafterError naming it."""
        import json

        directory = Path(directory)
        try:
            state = json.loads((directory / TRAINER_FILE).read_text())
            optimizer = unflatten_optimizer(load_checked_tensors(directory / OPTIMIZER_FILE), state["optimizer"])
            return {"optimizer": optimizer, "steps": state["steps"]}
        except Exception as error:  # noqa: BLE001 - bad JSON, missing keys, a safetensors file cut short
            raise DrafterError(f"{directory}: cannot read the drafter's optimizer state ({OPTIMIZER_FILE}, "
                               f"{TRAINER_FILE}): {type(error).__name__}: {first_line(error)}") from None


def finish_metrics(metrics: dict) -> dict:
    """A step's (or evaluation's) summed metrics as means: the deepest unrolled level's acceptance is summed over
    its scored pairs only, so it is divided by their weight."""
    weight = metrics.pop("deepest_weight", None)
    if weight is not None:
        metrics["accept_q_deepest"] = metrics["accept_q_deepest"] / weight if weight > 0 else float("nan")
    return metrics


def _place_step_counts(optimizer: torch.optim.Optimizer) -> None:
    """Each parameter's step count where its group's kernel reads it: on the parameter's device for fused (or
    capturable) AdamW, a host scalar otherwise (load_state_dict placed it by the saver's choice)."""
    for group in optimizer.param_groups:
        on_device = bool(group.get("fused")) or bool(group.get("capturable"))
        for param in group["params"]:
            state = optimizer.state.get(param, {})
            if torch.is_tensor(state.get("step")):
                device = param.device if on_device else torch.device("cpu")
                state["step"] = state["step"].to(device=device, dtype=torch.float32)


def _check_moment_shapes(optimizer: torch.optim.Optimizer) -> None:
    """torch matches a saved optimizer state to the parameters by count only: moments of a drafter of another
    shape loaded, and the first step failed after the warm-up's sampling."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            for name, moment in optimizer.state.get(param, {}).items():
                if torch.is_tensor(moment) and moment.dim() > 0 and moment.shape != param.shape:
                    raise ValueError(f"its {name} has shape {tuple(moment.shape)} for a parameter of shape "
                                     f"{tuple(param.shape)}")


def save_trainer_state(directory: str | Path, state: dict) -> None:
    """A trainer's {"optimizer": state dict, "steps": optimizer steps} as `DrafterTrainer.save` writes it: a
    drafter directory with it seeds the next run's spot training (or `tlt drafter warmup --init`) where it stopped."""
    import json

    directory = Path(directory)
    tensors, meta = flatten_optimizer(state["optimizer"])
    save_checked_tensors(directory / OPTIMIZER_FILE, tensors)  # (flipped bytes loaded silently: QA)
    text = json.dumps({"steps": state["steps"], "optimizer": meta})
    write_whole(directory / TRAINER_FILE, lambda path: path.write_text(text))


def rows_per_micro_step(device_type: str, row_length: int, draft_vocab: int) -> int:
    """Packed rows per micro-step by default (see CUDA_LOGITS_PER_MICRO_STEP)."""
    if device_type != "cuda":
        return CPU_ROWS_PER_MICRO_STEP
    fits = CUDA_LOGITS_PER_MICRO_STEP // max(1, row_length * draft_vocab)
    return max(1, min(CUDA_MAX_ROWS_PER_MICRO_STEP, fits))


def _row_chunks(batch: PackedPairs, weights: torch.Tensor, size: int, *, pad: bool = False):
    """(the next `size` rows, their weights) over the batch; pad: the last chunk too has `size` rows (padding
    rows of weight 0: a captured graph's shapes)."""
    size = max(1, size)
    for start in range(0, batch.valid.shape[0], size):
        part = slice(start, start + size)
        rows = PackedPairs(batch.input_tokens[part], batch.input_features[part], batch.target_features[part],
                           batch.positions[part], batch.attention_mask[part], batch.valid[part])
        row_weights = weights[part]
        if pad and row_weights.shape[0] < size:
            rows = pad_rows(rows, size)
            row_weights = torch.cat((row_weights, row_weights.new_zeros(size - row_weights.shape[0],
                                                                        row_weights.shape[1])))
        yield rows, row_weights
