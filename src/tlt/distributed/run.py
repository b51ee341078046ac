"""`tlt train`: the run loop around a driver (DistributedGRPO, or a GRPOTrainer given in code) — progress, a
metrics line per step, the timeline, checkpoints, resume."""

from __future__ import annotations

import shlex
from pathlib import Path

from rich.console import Console

from tlt.distributed.controller import DistributedGRPO
from tlt.distributed.placement import resolve
from tlt.drafter.export import EXPORTABLE, drafter_model_type
from tlt.files import write_whole
from tlt.metrics.logger import open_metrics_logger
from tlt.interrupts import held_interrupts
from tlt.metrics.timeline import drop_timelines_after, save_timeline
from tlt.rl.checkpoint import checkpoint_step, latest_checkpoint, prune_checkpoints, read_state
from tlt.rl.config import TrainConfig, validate
from tlt.rl.optim import decay_steps, trains_past_its_decay
from tlt.rl.preflight import preflight
from tlt.rl.rewards import RewardError
from tlt.rl.run_checkpoint import FINAL_DRAFTER_DIR
from tlt.rl.run_dir import (check_before_holding, config_text_to_keep, discard_replaced, hold_run_dir,
                            prepare_run_dir, restore_replaced)

METRICS_LINE = ("step {step:>3}  reward {reward_mean:.3f}  acc {accuracy:.3f}  len p50/p90/max "
                "{response_len_p50:.0f}/{response_len_p90:.0f}/{response_len_max}  rollout {rollout_s:.1f}s  "
                "train {train_s:.1f}s  {rollout_tok_s:.0f} tok/s")
EVAL_LINE = "      held-out acc {eval_accuracy:.3f}  reward {eval_reward_mean:.3f}  (greedy, {eval_s:.1f}s)"
# the drafter's trainer: idle workers (spot training) with several, a thread beside the tail with one
WORKERS_LINE = ("      idle {idle_fraction:.0%}  {trainer} {share:.0%} ({spot_train_steps} drafter {noun})  "
                "drafter v{v}  {speculation}")
# Steps in a row whose every reward call failed before the run stops: a broken reward function (a wrong
# signature, a string returned) gives all-zero rewards, so the run would spend its compute learning nothing
FAILED_REWARD_STEPS = 3
IDLE_LINE = "      idle {idle_fraction:.0%}  (no drafter: run.speculative=off)"


def train(config: TrainConfig, *, resume: bool = False, overwrite: bool = False, console: Console | None = None,
          trainer=None):
    """Run config.run.steps RL steps (continuing from the latest checkpoint with resume=True; overwrite=True
    replaces a run already in run.out_dir). The run directory is checked before the policy loads."""
    # soft_wrap: a step line stays one line in logs and pipes (rich wraps at 80 columns off a terminal);
    # markup off: a path with brackets in it ("runs/[a]") is printed as it is
    console = console or Console(soft_wrap=True, markup=False)
    validate(config)  # a config built in code gets the same checks as one from the command line
    owned = trainer is None
    dataset = None
    if owned:
        placed, placement, notes = resolve(config)  # this machine's devices: workers that cannot be placed fail here
        dataset = preflight(config)  # before --overwrite deletes anything
        for note in notes:
            console.print(f"note: {note}")
    # (the resume refusal's advice, optim.decay_steps set to the old run's, extends a run this way)
    if trains_past_its_decay(config.optim, config.run.steps):
        console.print(f"note: optim.schedule=cosine reaches lr 0 at step {decay_steps(config.optim, config.run.steps)}"
                      f" (optim.decay_steps) and optim.min_lr_ratio=0: steps after it do not train")
    run_dir = Path(config.run.out_dir)
    check_before_holding(run_dir, resume, overwrite)
    with hold_run_dir(run_dir):  # another `tlt train` on this directory is refused until this one ends
        checkpoint = prepare_run_dir(run_dir, config.to_dict(), resume=resume, overwrite=overwrite, dataset=dataset)
        if owned and checkpoint is not None and (note := _workers_changed(checkpoint, placed.run.workers)):
            console.print(f"note: {note}")
        try:
            with console.status(f"loading the policy ({placement.describe() if owned else 'given trainer'})"):
                # config.json keeps the config as given (e.g. workers=auto)
                trainer = trainer or DistributedGRPO(placed, placement=placement)
                trainer.progress = console.is_terminal
            final = None
            try:
                history = _loop(config, trainer, run_dir, checkpoint, console)
                final = trainer.save_final(run_dir / "final")
            except KeyboardInterrupt:
                if owned:  # in-process workers: a checkpoint a thread is still writing lands first, and the
                    # message names it (Ray's actors are killed: a checkpoint cut short is never the latest)
                    trainer.close()
                    owned = False  # closed: not again below
                saved = latest_checkpoint(run_dir)
                if saved is not None:
                    prune_checkpoints(run_dir, config.run.keep_checkpoints)
                console.print(f"interrupted after {trainer.step} completed step(s): " + (
                    f"`tlt train ... --resume` continues from {saved.name}" if saved else "no checkpoint was saved"))
                if final is None and (run_dir / "final").is_dir():  # a resumed run's: this one's is not saved
                    console.print(f"note: {run_dir / 'final'} holds the policy (and drafter) an earlier segment of "
                                  f"the run ended with, not step {trainer.step}'s; a --resume that finishes the run "
                                  f"replaces it")
                raise
            finally:
                if owned:
                    trainer.close()
        except BaseException:
            if latest_checkpoint(run_dir) is not None:  # (its first checkpoint may land as it is interrupted)
                discard_replaced(run_dir)
            elif restore_replaced(run_dir):
                console.print(f"note: the run ended before its first checkpoint: the run it was replacing "
                              f"(--overwrite) is back in {run_dir}")
            raise
        discard_replaced(run_dir)  # a run of zero steps saves no checkpoint, only its final policy
    # the commands suggested are quoted for a shell: a path may hold spaces
    console.print(f"run saved in {run_dir} (final policy: {final}); see it with: "
                  f"tlt report {shlex.quote(str(run_dir))}")
    drafter = Path(final) / FINAL_DRAFTER_DIR
    if drafter.is_dir():
        serving = (f"for vLLM / SGLang: tlt drafter export {shlex.quote(str(drafter))} --model "
                   f"{shlex.quote(str(final))} --out DIR; "
                   if drafter_model_type(drafter) in EXPORTABLE else "")  # their EAGLE loaders read Llama drafters
        console.print(f"its drafter: {drafter} ({serving}to go on training it: "
                      f"{shlex.quote(f'run.drafter={drafter}')})")
    elif isinstance(trainer, DistributedGRPO) and trainer.config.run.speculative != "off":  # as placed (resolve
        # may have turned it off, and said why); GRPOTrainer saves none
        why = ("SD was off: no arm pays on this device, run.gate=auto" if history and history[-1].get("sd/gate") == 0
               else "no spot-training step ran: a short run, or no worker idle in the tail")
        console.print(f"no drafter in {final}: the run's drafter never trained ({why}) and run.drafter gave none")
    return history


def _workers_changed(checkpoint: Path, workers: int) -> str | None:
    """A resumed run placed on another number of workers than its checkpoint's (run.workers=auto on another
    machine, or after the CPU default went from 2 to 1) goes on correctly, but its samples are drawn and sharded
    otherwise than the steps before: said, not refused."""
    saved = read_state(checkpoint).get("workers")
    if not isinstance(saved, int) or saved == workers:
        return None
    return (f"{checkpoint.name} was written by a run of {saved} worker(s); it goes on with {workers} (set "
            f"run.workers={saved} to keep its layout)")


def _workers_line(metrics: dict, version: int) -> str:
    lone = metrics.get("workers", 1) == 1
    return WORKERS_LINE.format(v=version, trainer="tail-train" if lone else "spot-train",
                               share=metrics["tail_train_share" if lone else "spot_train_share"],
                               noun="step" if metrics["spot_train_steps"] == 1 else "steps",
                               speculation=_speculation_text(metrics), **metrics)


def _speculation_text(metrics: dict) -> str:
    """How much of the rollout speculated, and its τ (tokens per row per SD step); the starting drafter of a run
    without run.drafter is untrained and serves no step (rollout/engine.py, `set_drafter`)."""
    share, tau = metrics.get("sd/sd_step_share"), metrics.get("sd/tau")
    if metrics.get("sd/gate") == 0:
        return "SD off: no arm pays on this device (run.gate=auto)"
    if tau is None and metrics.get("drafter_trained") is False:
        return "SD waited for a trained drafter"
    if tau is None:
        return "SD in 0% of decode steps" if share is not None else ""
    return f"SD in {share:.0%} of decode steps, τ {tau:.2f}"


def _loop(config, trainer, run_dir: Path, checkpoint: Path | None, console):
    resumed_at = None if checkpoint is None else checkpoint_step(checkpoint)
    logger = open_metrics_logger(run_dir, config, resumed_at=resumed_at)
    try:
        return _steps(config, trainer, run_dir, checkpoint, console, logger)
    finally:
        logger.close()  # wandb marks an interrupted run as such


def _steps(config, trainer, run_dir: Path, checkpoint: Path | None, console, logger):
    if checkpoint is not None:
        trainer.resume(checkpoint)
        logger.truncate_after(trainer.step)
        drop_timelines_after(run_dir, trainer.step)
        console.print(f"resumed from {checkpoint.name} (step {trainer.step})")
        drafter = read_state(checkpoint).get("drafter")
        if getattr(trainer, "config", config).run.speculative == "off" and drafter and drafter.get("trained", True):
            console.print(f"note: SD is off: the run's drafter (v{drafter.get('version')} in {checkpoint.name}) is "
                          f"kept as it is in this run's checkpoints and final/, for a --resume with SD on to go on "
                          f"training")
        if trainer.step >= config.run.steps:  # config.json keeps the run's own run.steps
            console.print(f"note: the run is at step {trainer.step} and run.steps={config.run.steps}: nothing to "
                          f"train (raise run.steps to go on)")
            return []
    # Whole or not at all: --resume compares the config it is given with this one.
    text = config_text_to_keep(run_dir, config.to_dict())
    write_whole(run_dir / "config.json", lambda path: path.write_text(text))
    history, failed_steps = [], 0
    status = _PhaseStatus(console)
    trainer.on_phase = status
    while trainer.step < config.run.steps:
        try:
            metrics = trainer.train_step()
        finally:
            status.stop()
        # the step's metrics, timeline and checkpoint all written before a stop
        notice = f"tlt: stopping once step {trainer.step} is logged (and checkpointed, when one is due)"
        with held_interrupts(notice):
            failed_steps = _finish_step(config, trainer, run_dir, console, logger, metrics, failed_steps)
        history.append(metrics)
        if failed_steps >= FAILED_REWARD_STEPS:
            raise RewardError(f"the reward function {config.task.reward} failed on every sample of {failed_steps} "
                              f"steps in a row (its first error is in the log): a bug in it, not hard samples; "
                              f"fix it and continue with --resume")
    return history


def _finish_step(config, trainer, run_dir: Path, console, logger, metrics: dict, failed_steps: int) -> int:
    """Log, print and (when due) checkpoint the step just trained; returns the steps in a row whose every reward
    failed."""
    logger.log(trainer.step, metrics)
    console.print(METRICS_LINE.format(step=trainer.step, **metrics))
    if metrics.get("reward_failures"):
        samples = config.rollout.prompts_per_step * config.rollout.samples_per_prompt
        console.print(f"      warning: the reward function failed on {metrics['reward_failures']} of {samples} "
                      f"samples (scored 0)")
        failed_steps = failed_steps + 1 if metrics["reward_failures"] >= samples else 0
    else:
        failed_steps = 0
    if metrics.get("train/tokens") == 0:  # (only grpo.mask_truncated can leave none)
        console.print(f"      warning: every response was cut at rollout.max_new_tokens="
                      f"{config.rollout.max_new_tokens} and grpo.mask_truncated drops them: this step trained "
                      f"on 0 tokens (raise the budget, or set grpo.mask_truncated=false)")
    if "eval_accuracy" in metrics:
        console.print(EVAL_LINE.format(**metrics))
    if getattr(trainer, "last_timeline", None) is not None:
        save_timeline(run_dir, trainer.last_timeline)
        version = metrics.get("drafter_version")
        console.print(_workers_line(metrics, version) if version is not None else IDLE_LINE.format(**metrics))
    every = config.run.checkpoint_every
    if (every and trainer.step % every == 0) or trainer.step == config.run.steps:
        trainer.save(run_dir)
        discard_replaced(run_dir)  # the new run can be resumed now: the one --overwrite replaced goes
        prune_checkpoints(run_dir, config.run.keep_checkpoints)
    return failed_steps


class _PhaseStatus:
    """A spinner naming the step's phase after the rollout bar closes (terminals only: logs get step lines)."""

    def __init__(self, console: Console):
        self.console, self.live = console, None

    def __call__(self, text: str) -> None:
        if not self.console.is_terminal:
            return
        if self.live is None:
            self.live = self.console.status(text)
            self.live.start()
        else:
            self.live.update(text)

    def stop(self) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
