"""TRL's GRPOTrainer on the same model, task, reward, batch and sampling as a `tlt train` run, with TRL's default
generation: transformers `generate` (no vLLM, no static cache, no CUDA graphs). TRL's docs point GRPO users who
need speed to vLLM (`use_vllm=True`), which neither of our machines can install: every number against TRL here is
against TRL with transformers generation, and is named so. Used by benchmarks/e2e.py.

Matched to tlt's defaults (each checked against TRL 1.16.0's resolved GRPOConfig):
per step 4 prompts x 4 samples (one generation batch of 16, one optimizer step over micro-batches of tlt's
`optim.micro_batch_size`), max 256 new tokens, T=1 with no top-k/top-p, lr 1e-5, betas (0.9, 0.99), grad clip
1.0, no KL term, PPO clip 0.2, sequence-mean "grpo" loss and group-std scaled advantages, no gradient
checkpointing (TRL turns it on by default; tlt's `optim.grad_checkpointing` is off); the prompts are exactly the
ones tlt draws for steps 0..K-1 (same seeds), in order. On a GPU, bf16 mixed precision (fp32 master weights), as
tlt's training autocast there; fp32 on the CPU, as tlt. Differences left as TRL's defaults: its advantages divide
by the sample std (n - 1; tlt: the population std), its micro-batches are padded to the generation batch's
longest completion, and it computes token entropies in every training forward. Attention: torch's default choice
(cuDNN's first for masked bf16 attention on Hopper), where tlt turns cuDNN's off (it builds a plan for every new
shape); `environment.cudnn_sdp` of a results file says what tlt's modes ran with.
"""

from __future__ import annotations

import time

from transformers import TrainerCallback


def trl_step_times(model_dir: str, examples_per_step: list[list], reward, *, samples_per_prompt: int = 4,
                   max_new_tokens: int = 256, seed: int = 0, out_dir: str = "/tmp/tlt-trl-bench",
                   system_prompt: str | None = None, use_cpu: bool = True, micro_batch_size: int | None = None,
                   log=print, on_step=None) -> list[dict]:
    """Run len(examples_per_step) TRL GRPO steps (on the CPU, or the GPU with use_cpu=False); returns per step
    {step_s, rollout_s, reward_mean, completion_len_mean, completion_len_max}. on_step(steps so far), if given, is
    called after each step and after each step's log: a run killed at its time limit keeps what it measured."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOTrainer

    rows = []
    for examples in examples_per_step:
        for example in examples:
            messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + \
                [{"role": "user", "content": example.prompt}]
            rows.append({"prompt": messages, "answer": example.answer})
    prompts_per_step = len(examples_per_step[0])

    def reward_fn(completions, answer, **kwargs):
        from tlt.tasks.example import TaskExample

        texts = [c[0]["content"] if isinstance(c, list) else c for c in completions]
        return reward.score(texts, [TaskExample("", a) for a in answer]).rewards

    config = grpo_config(prompts_per_step * samples_per_prompt, samples_per_prompt, micro_batch_size or
                         samples_per_prompt, max_new_tokens, len(examples_per_step), seed=seed, use_cpu=use_cpu,
                         out_dir=out_dir)
    timings = _StepClock(log, synchronize=not use_cpu, on_step=on_step)
    # TRL as its users run it: torch's default attention choice (cuDNN first on Hopper), also when tlt's engines
    # ran earlier in this process and turned cuDNN's attention off (attention.keep_cudnn_attention_out)
    import torch

    torch.backends.cuda.enable_cudnn_sdp(True)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32"),
        processing_class=AutoTokenizer.from_pretrained(model_dir), reward_funcs=reward_fn, args=config,
        train_dataset=Dataset.from_list(rows), callbacks=[timings])
    timings.time_generation(trainer)
    trainer.train()
    return timings.steps


def grpo_config(batch: int, samples_per_prompt: int, micro_batch_size: int, max_new_tokens: int, steps: int, *,
                seed: int = 0, use_cpu: bool = True, out_dir: str = "/tmp/tlt-trl-bench"):
    """The GRPOConfig of a tlt run's step: `batch` completions in groups of `samples_per_prompt`, generated once
    and learned from in one optimizer step over micro-batches of `micro_batch_size`."""
    import dataclasses

    from trl import GRPOConfig

    # transformers 5 renamed it (the old name still works there, with a warning); the GPU image may run 4.x
    names = {field.name for field in dataclasses.fields(GRPOConfig)}
    no_checkpointing = {"activation_checkpointing" if "activation_checkpointing" in names
                        else "gradient_checkpointing": False}
    if batch % micro_batch_size:
        raise ValueError(f"the step's {batch} completions do not split into micro-batches of {micro_batch_size}")
    config = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=micro_batch_size,
        gradient_accumulation_steps=batch // micro_batch_size, num_generations=samples_per_prompt,
        max_completion_length=max_new_tokens, temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-5,
        adam_beta1=0.9, adam_beta2=0.99, weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2,
        loss_type="grpo", scale_rewards="group", num_iterations=1, max_steps=steps, shuffle_dataset=False,
        seed=seed, use_cpu=use_cpu, bf16=not use_cpu, logging_steps=1, save_strategy="no", report_to="none",
        disable_tqdm=True, lr_scheduler_type="constant", warmup_steps=0, **no_checkpointing)
    if config.generation_batch_size != batch:
        raise ValueError(f"TRL would generate {config.generation_batch_size} completions per step, tlt {batch}")
    return config


def versions() -> dict:
    """The library versions whose defaults the TRL run depends on."""
    import accelerate
    import transformers
    import trl

    return {"trl": trl.__version__, "transformers": transformers.__version__, "accelerate": accelerate.__version__}


class _StepClock(TrainerCallback):
    """Wall time of each optimizer step (generation + update: the time between consecutive step ends; on a GPU
    after a synchronize, so a step's queued kernels are its own), the time its generation took (`rollout_s`), and
    the logged reward and completion lengths. The logging of step k runs after its step end: billed to step k+1."""

    def __init__(self, log, synchronize: bool = False, on_step=None):
        self.steps: list[dict] = []
        self._log = log
        self._on_step = on_step or (lambda steps: None)
        self._last = None
        self._synchronize = synchronize
        self._generation_s = 0.0

    def time_generation(self, trainer) -> None:
        """Wrap the trainer's generation (a private method: its name in TRL 1.x) to time it; without it, no
        rollout_s."""
        generate = getattr(trainer, "_generate_single_turn", None)
        if generate is None:
            self._log("note: this TRL has no _generate_single_turn: TRL's rollout time is not recorded")
            return

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return generate(*args, **kwargs)
            finally:
                self._sync()
                self._generation_s += time.perf_counter() - start

        trainer._generate_single_turn = timed

    def _hand_on(self) -> None:
        """The steps so far to on_step (our file write), its time kept off the next step's clock: TRL is billed
        for TRL's work only."""
        started = time.perf_counter()
        self._on_step(self.steps)
        if self._last is not None:
            self._last += time.perf_counter() - started

    def _sync(self) -> None:
        if self._synchronize:
            import torch

            torch.cuda.synchronize()

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self._sync()
        now = time.perf_counter()
        step = {"step_s": now - self._last}
        if self._generation_s:
            step["rollout_s"] = self._generation_s
        self.steps.append(step)
        self._last, self._generation_s = now, 0.0
        self._log(f"trl step {len(self.steps)}: {step['step_s']:.1f}s")
        self._hand_on()

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and self.steps and "reward" in logs:
            self.steps[-1].update({"reward_mean": logs["reward"],
                                   "completion_len_mean": logs.get("completions/mean_length"),
                                   "completion_len_max": logs.get("completions/max_length")})
            self._hand_on()
