"""TRL's GRPOTrainer on the same model, task, reward, batch and sampling as a `tlt train` run: the peer most users
would pick, with its default transformers generation. Used by benchmarks/e2e.py.

Matched to tlt's defaults: per step 4 prompts x 4 samples (one generation batch of 16, one optimizer step over 4
micro-batches of 4), max 256 new tokens, T=1 with no top-k/top-p, lr 1e-5, betas (0.9, 0.99), grad clip 1.0,
no KL term, PPO clip 0.2, sequence-mean "grpo" loss and group-std scaled advantages; the prompts are exactly the
ones tlt draws for steps 0..K-1 (same seeds), in order. On a GPU, bf16 mixed precision (fp32 master weights), as
tlt's training autocast there; fp32 on the CPU, as tlt.
"""

from __future__ import annotations

import time

from transformers import TrainerCallback


def trl_step_times(model_dir: str, examples_per_step: list[list], reward, *, samples_per_prompt: int = 4,
                   max_new_tokens: int = 256, seed: int = 0, out_dir: str = "/tmp/tlt-trl-bench",
                   system_prompt: str | None = None, use_cpu: bool = True, log=print) -> list[dict]:
    """Run len(examples_per_step) TRL GRPO steps (on the CPU, or the GPU with use_cpu=False); returns per step
    {step_s, reward_mean, completion_len_mean}."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

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

    batch = prompts_per_step * samples_per_prompt
    config = GRPOConfig(
        output_dir=out_dir, per_device_train_batch_size=samples_per_prompt, gradient_accumulation_steps=
        batch // samples_per_prompt, num_generations=samples_per_prompt, max_completion_length=max_new_tokens,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=1e-5, adam_beta1=0.9, adam_beta2=0.99,
        weight_decay=0.0, max_grad_norm=1.0, beta=0.0, epsilon=0.2, loss_type="grpo", scale_rewards="group",
        num_iterations=1, max_steps=len(examples_per_step), shuffle_dataset=False, seed=seed, use_cpu=use_cpu,
        bf16=not use_cpu, logging_steps=1, save_strategy="no", report_to="none", disable_tqdm=True,
        lr_scheduler_type="constant", warmup_steps=0)
    timings = _StepClock(log)
    trainer = GRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir, dtype="float32"),
        processing_class=AutoTokenizer.from_pretrained(model_dir), reward_funcs=reward_fn, args=config,
        train_dataset=Dataset.from_list(rows), callbacks=[timings])
    trainer.train()
    return timings.steps


class _StepClock(TrainerCallback):
    """Wall time of each optimizer step (generation + update: the time between consecutive step ends), and the
    logged reward/length."""

    def __init__(self, log):
        self.steps: list[dict] = []
        self._log = log
        self._last = None

    def on_train_begin(self, args, state, control, **kwargs):
        self._last = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        now = time.perf_counter()
        self.steps.append({"step_s": now - self._last})
        self._last = now
        self._log(f"trl step {len(self.steps)}: {self.steps[-1]['step_s']:.1f}s")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and self.steps and "reward" in logs:
            self.steps[-1].update({"reward_mean": logs["reward"],
                                   "completion_len_mean": logs.get("completions/mean_length")})
