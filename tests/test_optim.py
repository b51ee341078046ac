"""optim.*: the lr schedule (values, per-step logging, exact continuation on --resume), gradient checkpointing
(same gradients, training forward only) and the training forward's autocast."""

import copy
import dataclasses
import json
import math

import pytest
import torch

from conftest import random_prompts, tiny_model
from test_metrics_logger import fake_wandb
from tlt.models import LoadedModel, ModelSpec
from tlt.rl.actor import PackedSamples, token_logprobs
from tlt.rl.checkpoint import latest_checkpoint
from tlt.rl.config import ConfigError, load_config
from tlt.lr_schedule import lr_factor
from tlt.rl.optim import autocast_dtype, enable_grad_checkpointing, training_autocast
from tlt.rl.rewards import Reward
from tlt.distributed.run import train
from tlt.rl.run_dir import RunDirError, prepare_run_dir
from tlt.rl.trainer import GRPOTrainer
from tlt.tasks.synthetic import IdTokenizer, TargetTokenTask, share_of_target

LR = 0.01


def make_trainer(out_dir, seed=0, **overrides):
    model = tiny_model("llama", vocab_size=16, seed=seed)
    loaded = LoadedModel(model, IdTokenizer(), ModelSpec.from_config(model.config), "tiny")
    settings = ["run.speculative=off", "rollout.prompts_per_step=2", "rollout.samples_per_prompt=4",
                "rollout.max_new_tokens=5", f"optim.lr={LR}", "optim.micro_batch_size=8", f"run.out_dir={out_dir}",
                "run.logger=jsonl", *[f"{k}={v}" for k, v in overrides.items()]]
    return GRPOTrainer(load_config(None, settings), loaded=loaded, task=TargetTokenTask(5),
                       reward=Reward(share_of_target))


# -- the schedule ------------------------------------------------------------------------------------------------

def test_warmup_then_cosine_to_the_floor():
    factors = [lr_factor(k, schedule="cosine", warmup_steps=2, horizon=6, min_lr_ratio=0.1) for k in range(8)]
    assert factors[:3] == [0.5, 1.0, 1.0]  # linear warm-up, then the cosine starts at its top
    assert factors[4] == pytest.approx(0.1 + 0.9 * 0.5)  # half way through the decay
    assert all(a > b for a, b in zip(factors[2:6], factors[3:6]))
    assert factors[6:] == [pytest.approx(0.1)] * 2  # at and past the horizon: the floor
    constant = [lr_factor(k, schedule="constant", warmup_steps=3, horizon=6, min_lr_ratio=0.1) for k in range(5)]
    assert constant == pytest.approx([1 / 3, 2 / 3, 1, 1, 1])


@pytest.mark.parametrize("override,message", [
    ("optim.schedule=linear", "optim.schedule must be one of constant, cosine, got 'linear'"),
    ("optim.warmup_steps=-1", "optim.warmup_steps must be >= 0"),
    ("optim.min_lr_ratio=1.5", r"optim.min_lr_ratio must be in \[0, 1\]"),
    ("optim.autocast=fp16", "optim.autocast must be one of auto, bf16, off, got 'fp16'"),
    ("optim.decay_steps=-2", "optim.decay_steps must be >= 0"),
])
def test_bad_optim_values_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_a_warmup_as_long_as_the_cosine_is_refused():
    with pytest.raises(ConfigError, match=r"optim.warmup_steps=3 leaves no cosine decay within the 3 decay step\(s\) "
                                          r"\(run.steps\)"):
        load_config(None, ["optim.schedule=cosine", "optim.warmup_steps=3", "run.steps=3"])
    load_config(None, ["optim.schedule=cosine", "optim.warmup_steps=3", "run.steps=3", "optim.decay_steps=10"])
    load_config(None, ["optim.warmup_steps=3", "run.steps=3"])  # constant: a warm-up only, fine


@pytest.mark.parametrize("save_optimizer", [True, False], ids=["with-optimizer", "without-optimizer-state"])
def test_resume_continues_the_lr_sequence_exactly(tmp_path, monkeypatch, save_optimizer):
    """The schedule's state is in the checkpoint (even without the optimizer's): a run resumed after step 3 uses
    the lrs an uninterrupted run does, which are logged per step (metrics.jsonl and wandb)."""
    calls = fake_wandb(monkeypatch)
    settings = {"optim.schedule": "cosine", "optim.warmup_steps": 2, "optim.decay_steps": 5,
                "optim.min_lr_ratio": 0.2, "run.save_optimizer": save_optimizer, "run.logger": "jsonl,wandb"}
    full = make_trainer(tmp_path / "full", **settings, **{"run.steps": 5})
    expected = train(full.config, trainer=full)
    wanted = [LR * lr_factor(k, schedule="cosine", warmup_steps=2, horizon=5, min_lr_ratio=0.2) for k in range(5)]
    assert [m["lr"] for m in expected] == pytest.approx(wanted, rel=1e-12)
    assert [(step, data["lr"]) for step, data in calls["log"]] == [(k + 1, m["lr"]) for k, m in enumerate(expected)]
    assert "drafter_versions_per_sample" not in calls["log"][0][1] and calls["finish"] == 1

    partial = make_trainer(tmp_path / "resumed", **settings, **{"run.steps": 3})
    first = train(partial.config, trainer=partial)
    config = dataclasses.replace(partial.config, run=dataclasses.replace(partial.config.run, steps=5))
    fresh = make_trainer(tmp_path / "resumed", seed=9, **settings, **{"run.steps": 5})
    fresh.resume(latest_checkpoint(tmp_path / "resumed"))
    assert fresh.scheduler.state_dict() == partial.scheduler.state_dict()  # restored, not recounted
    rest = train(config, resume=True, trainer=fresh)
    assert [m["lr"] for m in first + rest] == [m["lr"] for m in expected]
    if save_optimizer:  # the updates too (a fresh Adam state would change them)
        assert rest[-1]["train/loss"] == pytest.approx(expected[-1]["train/loss"], rel=1e-5, abs=1e-6)
    inits = calls["init"]
    assert inits[2]["id"] == inits[1]["id"] != inits[0]["id"]  # the resumed run continues its wandb run
    assert inits[2]["resume"] == "allow" and inits[2]["dir"] == str(tmp_path / "resumed")
    assert inits[0]["project"] == "tlt-rl" and inits[0]["name"] == "full"
    assert inits[0]["config"]["optim"]["schedule"] == "cosine"


def test_resume_refuses_a_longer_run_that_would_stretch_the_cosine(tmp_path):
    """run.steps may change on --resume, but with optim.decay_steps=0 it is the cosine's length: the error says
    how to extend the run on the same schedule."""
    config = load_config(None, [f"run.out_dir={tmp_path}", "optim.schedule=cosine", "run.steps=4"]).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "step-000004").mkdir()
    (tmp_path / "step-000004" / "state.json").write_text("{}")
    longer = load_config(None, [f"run.out_dir={tmp_path}", "optim.schedule=cosine", "run.steps=8"]).to_dict()
    with pytest.raises(RunDirError, match=r"optim.decay_steps: 4 in the run, 8 now; its cosine schedule decays "
                                          r"over 4 steps: set optim.decay_steps to that"):
        prepare_run_dir(tmp_path, longer, resume=True, overwrite=False)
    kept = load_config(None, [f"run.out_dir={tmp_path}", "optim.schedule=cosine", "run.steps=8",
                              "optim.decay_steps=4"]).to_dict()
    assert prepare_run_dir(tmp_path, kept, resume=True, overwrite=False).name == "step-000004"
    other_logger = load_config(None, [f"run.out_dir={tmp_path}", "optim.schedule=cosine", "run.steps=4",
                                      "run.logger=jsonl", "optim.grad_checkpointing=true"]).to_dict()
    prepare_run_dir(tmp_path, other_logger, resume=True, overwrite=False)  # loggers and checkpointing may change
    warmer = load_config(None, [f"run.out_dir={tmp_path}", "optim.schedule=cosine", "run.steps=4",
                                "optim.warmup_steps=1"]).to_dict()
    with pytest.raises(RunDirError, match=r"\(optim.warmup_steps: 0 in the run, 1 now\)"):
        prepare_run_dir(tmp_path, warmer, resume=True, overwrite=False)


# -- gradient checkpointing -----------------------------------------------------------------------------------

def packed_batch():
    prompts = random_prompts([5, 3, 7], vocab_size=97, seed=1)
    responses = random_prompts([4, 6, 2], vocab_size=97, seed=2)
    return PackedSamples.build(prompts, responses, pad_id=0)


def gradients(model, batch):
    model.train()
    model.zero_grad(set_to_none=True)
    logprobs = token_logprobs(model, batch, temperature=0.7).logprobs
    (logprobs * batch.response_mask).sum().backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def test_grad_checkpointing_gives_the_same_gradients_and_recomputes_only_in_training():
    plain = tiny_model("llama", layers=3)
    checkpointed = copy.deepcopy(plain)
    enable_grad_checkpointing(checkpointed)
    calls = []
    checkpointed.model.layers[1].mlp.register_forward_pre_hook(lambda *args: calls.append(1))
    batch = packed_batch()
    expected, got = gradients(plain, batch), gradients(checkpointed, batch)
    assert len(calls) == 2  # the forward, then its recomputation in the backward (a pre-hook: the recomputation
    # stops once it has every saved tensor, before the module returns)
    for name, grad in expected.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-5, atol=1e-6, msg=name)
    calls.clear()
    checkpointed.eval()
    with torch.no_grad():  # the old-log-prob pass: no recomputation, no checkpoint bookkeeping
        token_logprobs(checkpointed, batch)
    assert len(calls) == 1


def test_the_trainer_turns_grad_checkpointing_on_when_asked(tmp_path):
    assert not make_trainer(tmp_path / "a").model.model.layers[0].gradient_checkpointing
    trainer = make_trainer(tmp_path / "b", **{"optim.grad_checkpointing": True})
    assert all(layer.gradient_checkpointing for layer in trainer.model.model.layers)
    assert math.isfinite(trainer.train_step()["train/loss"])


# -- autocast -------------------------------------------------------------------------------------------------

def test_autocast_auto_is_bf16_on_cuda_and_off_on_cpu(tmp_path):
    assert autocast_dtype("auto", torch.device("cpu")) is None
    assert autocast_dtype("auto", torch.device("cuda", 0)) is torch.bfloat16
    assert autocast_dtype("off", torch.device("cuda")) is None
    assert autocast_dtype("bf16", torch.device("cpu")) is torch.bfloat16
    assert make_trainer(tmp_path).autocast_dtype is None  # the default, on this CPU


def test_cudnn_attention_is_taken_out_on_cuda_only():
    """cuDNN builds an attention plan for every new micro-batch shape (~1 s a shape, forward and backward, on
    torch 2.11): a replica on CUDA takes it out of SDPA's backends; on the CPU nothing changes."""
    from tlt.models.attention import keep_cudnn_attention_out

    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        keep_cudnn_attention_out(torch.device("cpu"))
        assert torch.backends.cuda.cudnn_sdp_enabled()
        keep_cudnn_attention_out(torch.device("cuda", 0))
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)


def test_bf16_autocast_wraps_the_training_forward(tmp_path):
    """Asked for explicitly, bf16 autocast also runs on CPU: the log-probs stay fp32 tensors, close to the fp32
    ones but not equal (the matmuls ran in bf16), and a step trains."""
    model, batch = tiny_model(), packed_batch()
    with torch.no_grad():
        exact = token_logprobs(model, batch).logprobs
        with training_autocast(torch.bfloat16, torch.device("cpu")):
            autocast = token_logprobs(model, batch).logprobs
    assert autocast.dtype == torch.float32
    assert not torch.equal(autocast, exact)
    torch.testing.assert_close(autocast, exact, atol=0.1, rtol=0.05)
    trainer = make_trainer(tmp_path, **{"optim.autocast": "bf16"})
    assert trainer.autocast_dtype is torch.bfloat16
    assert math.isfinite(trainer.train_step()["train/loss"])


def test_an_rl_step_with_the_cuda_defaults_emulated_on_the_cpu(tmp_path):
    """What CUDA runs by default, forced on the CPU (bf16 rollout copy, bf16 autocast of the training forward),
    which CI's fp32 defaults never reach: the first PPO ratio is exactly 1 (old and new log-probs from the same
    forward), a step trains, the rollout copy decodes the updated policy, and a resumed run repeats the
    uninterrupted one exactly."""
    from test_trainer import make_trainer as make_tied_trainer  # (a tiny model with tied embeddings)

    settings = {"rollout.dtype": "bfloat16", "optim.autocast": "bf16"}
    trainer = make_tied_trainer(tmp_path / "a", tied=True, **settings)
    copy = trainer.engine.rollout_copy
    assert copy is not None and trainer.autocast_dtype is torch.bfloat16
    first = trainer.train_step()
    assert first["train/ratio_mean"] == 1.0 and math.isfinite(first["train/loss"])
    updated = {name: value.clone() for name, value in trainer.model.state_dict().items()}
    trainer.train_step()  # refreshes the copy from the updated master before it decodes (then updates again)
    for name, value in copy.model.state_dict().items():
        assert torch.equal(value, updated[name].to(value.dtype)), name
    expected = trainer.train_step()
    trainer.save(tmp_path / "a")
    resumed = make_tied_trainer(tmp_path / "b", tied=True, **settings)
    resumed.resume(latest_checkpoint(tmp_path / "a"))
    # the checkpoint holds steps 1-3: the next step of each must agree
    assert trainer.train_step()["train/loss"] == resumed.train_step()["train/loss"]
    assert expected["train/loss"] != 0.0


def test_weight_decay_skips_norms_and_biases_and_resumes_a_one_group_checkpoint(tmp_path):
    """Decay on matrices only (as the HF Trainer); a checkpoint saved when every parameter shared one group (before
    the split) resumes into the two groups with each parameter's Adam moments (found by review)."""
    from conftest import tiny_model
    from tlt.optimizer_state import fit_param_groups
    from tlt.rl.optim import build_optimizer

    model = tiny_model("qwen2", vocab_size=16)  # q/k/v biases and norm weights: 1-D
    optim = load_config(None, ["optim.weight_decay=0.1"]).optim
    optimizer = build_optimizer(model, optim)
    decayed, kept = optimizer.param_groups
    assert decayed["weight_decay"] == 0.1 and all(p.ndim == 2 for p in decayed["params"])
    assert kept["weight_decay"] == 0.0 and kept["params"] and all(p.ndim == 1 for p in kept["params"])
    assert len(build_optimizer(model, load_config(None, []).optim).param_groups) == 1

    old = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)  # the former single group
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    old.step()
    params = list(model.parameters())
    optimizer.load_state_dict(fit_param_groups(old.state_dict(), optimizer, params))
    for p in params:
        assert torch.equal(optimizer.state[p]["exp_avg"], old.state[p]["exp_avg"])
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    with pytest.raises(ValueError):  # the control: unfitted, torch refuses the saved state
        build_optimizer(model, optim).load_state_dict(old.state_dict())


@pytest.mark.parametrize("save_optimizer", [True, False])
def test_a_run_saved_with_one_param_group_resumes_and_trains(tmp_path, monkeypatch, save_optimizer):
    """End to end: the lr scheduler's state of such a checkpoint has one base lr; the first step after the resume
    failed (zip() argument 2 is shorter than argument 1; found by review)."""
    import tlt.rl.replica
    from test_trainer import make_trainer

    settings = {"optim.weight_decay": 0.1, "optim.schedule": "cosine", "run.steps": 4,
                "run.save_optimizer": save_optimizer}
    with monkeypatch.context() as patch:  # the optimizer as it was built before the split
        patch.setattr(tlt.rl.replica, "build_optimizer", lambda model, optim: torch.optim.AdamW(
            model.parameters(), lr=optim.lr, betas=optim.betas, weight_decay=optim.weight_decay))
        old = make_trainer(tmp_path / "old", **settings)
        assert len(old.optimizer.param_groups) == 1
        old.train_step()
        old.save(tmp_path / "old")
    resumed = make_trainer(tmp_path / "new", **settings)
    assert len(resumed.optimizer.param_groups) == 2
    resumed.resume(latest_checkpoint(tmp_path / "old"))
    metrics = resumed.train_step()
    assert math.isfinite(metrics["train/grad_norm"])
    assert [g["lr"] for g in resumed.optimizer.param_groups] == [metrics["lr"]] * 2


def test_resume_with_another_reward_function_says_to_keep_its_name(tmp_path):
    """A run stopped by a failing reward function says "fix it and continue with --resume"; resuming under the
    fixed function's new name was refused without saying how to go on (QA)."""
    config = load_config(None, [f"run.out_dir={tmp_path}", "task.reward=myrew:broken"]).to_dict()
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "step-000001").mkdir()
    (tmp_path / "step-000001" / "state.json").write_text("{}")
    fixed = load_config(None, [f"run.out_dir={tmp_path}", "task.reward=myrew:fixed"]).to_dict()
    with pytest.raises(RunDirError, match=r"a fixed reward function resumes under its old name, "
                                          r"task.reward=myrew:broken"):
        prepare_run_dir(tmp_path, fixed, resume=True, overwrite=False)
