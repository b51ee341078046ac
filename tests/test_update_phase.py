"""The cheaper update phase: no old-log-prob forward with one update per step, chunked head log-probs.

Each check compares against the way the phase ran before (a separate no-grad old-log-prob pass and the full
[B, L, V] logits), written out here as the reference, on tiny random models and a fixed rollout.
"""

import dataclasses

import pytest
import torch

from conftest import tiny_model
from tlt.drafter.buffer import FeatureBuffer
from tlt.models import LoadedModel, ModelSpec
from tlt.rl.actor import ActorOutput, ChunkedTokenLogprobs, PackedSamples, token_logprobs
from tlt.rl import phases
from tlt.rl.config import load_config
from tlt.rl.phases import no_grad_logprobs
from tlt.rl.rewards import Reward
from tlt.rl.trainer import GRPOTrainer
from tlt.tasks.example import TaskExample
from tlt.tasks.synthetic import IdTokenizer, share_of_target


def full_vocabulary_logprobs(model, batch: PackedSamples, temperature: float = 1.0, *, want_hidden=False,
                             want_entropy=False):
    """The actor pass as it was: the head over every position at once, log-softmax, gather."""
    hidden = model.get_decoder()(input_ids=batch.input_ids, attention_mask=batch.attention_mask,
                                 use_cache=False).last_hidden_state
    logits = model.get_output_embeddings()(hidden[:, :-1]).float()
    if temperature not in (0, 1):
        logits = logits / temperature
    all_logprobs = logits.log_softmax(-1)
    logprobs = all_logprobs.gather(-1, batch.input_ids[:, 1:, None])[..., 0]
    entropy = -(all_logprobs.exp() * all_logprobs).sum(-1).detach() * batch.response_mask if want_entropy else None
    return ActorOutput(logprobs * batch.response_mask, hidden.detach() if want_hidden else None, entropy)


class VariedPromptTask:
    """Prompts of 2-7 ids, so micro-batches mix prompt lengths and padding (the answer token is 5)."""

    def sample(self, count, seed):
        generator = torch.Generator().manual_seed(seed)
        return [TaskExample(f"p{i}", "5", {"ids": torch.randint(6, 16, (2 + (seed + i) % 6,),
                                                                generator=generator).tolist()})
                for i in range(count)]

    def prompt_ids(self, example):
        return example.meta["ids"]


def make_trainer(tmp_path, **overrides):
    model = tiny_model("llama", vocab_size=16, seed=0, tie_word_embeddings=True)
    loaded = LoadedModel(model, IdTokenizer(), ModelSpec.from_config(model.config), "tiny")
    settings = {"run.speculative": "off", "rollout.prompts_per_step": 3, "rollout.samples_per_prompt": 4,
                "rollout.max_new_tokens": 9, "rollout.temperature": 0.8, "optim.lr": 0.05,
                "optim.micro_batch_size": 5, "run.out_dir": str(tmp_path), "run.tensorboard": False, **overrides}
    trainer = GRPOTrainer(load_config(None, [f"{k}={v}" for k, v in settings.items()]), loaded=loaded,
                          task=VariedPromptTask(), reward=Reward(share_of_target))
    # SGD: the update is the gradient itself, so equal updates mean equal gradients (Adam's first step is
    # ~lr * sign(grad), which turns rounding noise of near-zero gradients into full-size differences)
    trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=1.0)
    return trainer


@pytest.fixture(scope="module")
def rollout(tmp_path_factory):
    """One fixed rollout (12 samples of varied lengths) that every trainer below learns from."""
    trainer = make_trainer(tmp_path_factory.mktemp("rollout"))
    examples = trainer.task.sample(3, seed=trainer.step_seed())
    result = trainer.rollout(examples)
    assert len({len(s.token_ids) for s in result.samples}) > 1  # responses of several lengths
    return examples, result


def parameters(trainer):
    return [p.detach().clone() for p in trainer.model.parameters()]


# -- the chunked head ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("chunk", [1, 4, 10_000])
def test_chunked_logprobs_and_gradients_equal_the_full_vocabulary_softmax(temperature, chunk):
    model = tiny_model("qwen2", vocab_size=97, tie_word_embeddings=True).train()
    batch = PackedSamples.build([[5, 6, 7, 8], [9, 10]], [[11, 12, 13], [14, 15, 16, 17, 18]], pad_id=0)
    weights = torch.randn(batch.response_mask.shape, generator=torch.Generator().manual_seed(1))
    results = []
    for fn in (token_logprobs, full_vocabulary_logprobs):
        model.zero_grad()
        kwargs = {"chunk_tokens": chunk} if fn is token_logprobs else {}
        out = fn(model, batch, temperature, want_entropy=True, **kwargs)
        loss = (out.logprobs * weights).sum()
        loss.backward()
        results.append((out.logprobs.detach(), loss.item(), {n: p.grad.clone() for n, p in model.named_parameters()},
                        out.entropy))
    (chunked, loss, grads, entropy), (full, full_loss, full_grads, full_entropy) = results
    assert torch.allclose(chunked, full, atol=1e-5)
    assert not entropy.requires_grad and torch.allclose(entropy, full_entropy, atol=1e-5)
    assert (entropy[batch.response_mask] > 0).all() and (entropy[~batch.response_mask] == 0).all()
    assert (chunked[~batch.response_mask] == 0).all()  # no prompt or padding position gets a log-prob
    assert loss == pytest.approx(full_loss, abs=1e-5)
    for name, grad in grads.items():
        assert torch.allclose(grad, full_grads[name], atol=1e-5), name


def test_response_positions_are_the_masks_set_positions_in_its_order_also_after_masking_rows():
    """token_logprobs indexes with positions made from the host lengths (a boolean mask's count is a device read):
    they must be exactly the mask's, in its row-major order, for every selection and after rows are masked
    (grpo.mask_truncated); the log-probs and entropies stay 0 off the mask."""
    from conftest import random_prompts

    prompts = random_prompts([5, 1, 7, 3], vocab_size=97, seed=1)
    responses = random_prompts([4, 6, 1, 9], vocab_size=97, seed=2)
    packed = PackedSamples.build(prompts, responses, pad_id=0)
    packed.mask_responses([2])
    for view in (packed, packed.select([3, 0, 2]), packed.select([1])):
        rows, columns = view.response_positions()
        assert torch.equal(torch.stack([rows, columns], 1), view.response_mask.nonzero())
    assert packed.select([3, 0, 2]).masked_rows == {2}
    out = token_logprobs(tiny_model("llama"), packed, want_entropy=True)
    off = ~packed.response_mask
    assert bool((out.logprobs[off] == 0).all()) and bool((out.entropy[off] == 0).all())
    assert bool((out.logprobs[packed.response_mask] < 0).all())


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_chunked_head_gradients_pass_gradcheck_with_a_bias(temperature):
    generator = torch.Generator().manual_seed(0)
    states, weight, bias = (torch.randn(*shape, dtype=torch.float64, generator=generator, requires_grad=True)
                            for shape in ((7, 5), (11, 5), (11,)))
    targets = torch.randint(0, 11, (7,), generator=generator)
    assert torch.autograd.gradcheck(
        lambda s, w, b: ChunkedTokenLogprobs.apply(s, w, b, targets, temperature, 3)[0], (states, weight, bias))


def head_under_bf16_autocast(device: str, tokens: int, vocab: int, chunk: int, chunked: bool) -> tuple:
    """Log-probs and gradients of a [tokens, 64] x [vocab, 64] head under bf16 autocast, the backward outside it
    (as the update phase runs them): chunked (tlt's), or plain autograd of the fp32 head. Logits ~19, SmolLM2's."""
    generator = torch.Generator(device=device).manual_seed(0)
    states = (3 * torch.randn(tokens, 64, device=device, generator=generator)).requires_grad_()
    weight = torch.randn(vocab, 64, device=device, generator=generator).requires_grad_()
    targets = torch.randint(0, vocab, (tokens,), device=device, generator=generator)
    upstream = torch.randn(tokens, device=device, generator=generator)
    with torch.autocast(device, dtype=torch.bfloat16):
        if chunked:
            out, _ = ChunkedTokenLogprobs.apply(states, weight, None, targets, 1.0, chunk)
        else:
            with torch.autocast(device, enabled=False):
                logits = torch.nn.functional.linear(states, weight)
            out = logits.log_softmax(-1).gather(-1, targets[:, None])[:, 0]
    (out * upstream).sum().backward()
    return out.detach(), states.grad, weight.grad


def test_chunked_head_under_bf16_autocast_is_the_fp32_head_with_its_gradients():
    """On CUDA training autocasts to bf16 (optim.autocast=auto). The head runs in its weights' dtype anyway (the
    rollout samples from an fp32 lm_head: the PPO ratio compares the same head), in the forward and in the
    backward, which runs outside the caller's autocast block: recomputing a chunk's logits in fp32 there, against
    the logsumexp of the forward's bf16 logits, put the policy gradient ~12% off (found by review)."""
    mine, reference = (head_under_bf16_autocast("cpu", 256, 4096, 64, chunked) for chunked in (True, False))
    for got, want in zip(mine, reference):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


# -- skipping the old-log-prob pass ----------------------------------------------------------------------------

def old_update_phase(trainer, examples, rollout, monkeypatch):
    """The phase as it ran before: score with a separate no-grad old-log-prob pass, full-vocabulary logits."""
    monkeypatch.setattr("tlt.rl.phases.token_logprobs", full_vocabulary_logprobs)
    batch = trainer.score(examples, rollout)
    batch.old_logprobs = no_grad_logprobs(trainer.replica, trainer.model, batch.packed, trainer.step)
    batch.features_done = None  # that pass fed the buffer
    stats = trainer.update(batch)
    monkeypatch.undo()
    return batch, stats


def test_skipping_the_old_pass_keeps_the_loss_and_the_update(tmp_path, rollout, monkeypatch):
    examples, result = rollout
    new = make_trainer(tmp_path / "new")
    batch = new.score(examples, result)
    assert batch.old_logprobs is None  # one update per step: no old-log-prob forward
    new_stats = new.update(batch)
    old = make_trainer(tmp_path / "old")
    start = parameters(old)
    _, old_stats = old_update_phase(old, examples, result, monkeypatch)
    assert new_stats["loss"] == pytest.approx(old_stats["loss"], abs=1e-5)
    assert new_stats["ratio_mean"] == 1.0 and new_stats["clip_fraction"] == 0.0  # on-policy: ratio exactly 1
    assert old_stats["ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    moved = [(a - s).abs().max() for a, s in zip(parameters(new), start)]
    assert max(moved) > 1e-3  # the detached old log-probs still carry the policy gradient
    for a, b in zip(parameters(new), parameters(old)):
        assert torch.allclose(a, b, atol=1e-5)


def test_kl_reference_pass_still_runs_without_the_old_pass(tmp_path, rollout, monkeypatch):
    examples, result = rollout
    overrides = {"grpo.kl_coef": 0.1}
    new, old = make_trainer(tmp_path / "new", **overrides), make_trainer(tmp_path / "old", **overrides)
    for trainer in (new, old):  # a reference that differs from the policy, so the KL term is not zero
        with torch.no_grad():
            for param in trainer.reference.parameters():
                param.add_(0.05 * torch.randn(param.shape, generator=torch.Generator().manual_seed(2)))
    batch = new.score(examples, result)
    assert batch.old_logprobs is None and batch.ref_logprobs is not None
    new_stats = new.update(batch)
    _, old_stats = old_update_phase(old, examples, result, monkeypatch)
    assert new_stats["kl"] > 1e-4 and new_stats["kl"] == pytest.approx(old_stats["kl"], abs=1e-5)
    assert new_stats["loss"] == pytest.approx(old_stats["loss"], abs=1e-5)
    for a, b in zip(parameters(new), parameters(old)):
        assert torch.allclose(a, b, atol=1e-5)


def test_several_updates_per_step_still_compute_the_old_logprobs(tmp_path, rollout):
    examples, result = rollout
    trainer = make_trainer(tmp_path, **{"grpo.updates_per_step": 2, "optim.lr": 0.05})
    batch = trainer.score(examples, result)
    assert batch.old_logprobs is not None
    with torch.no_grad():
        expected = full_vocabulary_logprobs(trainer.model, batch.packed, 0.8).logprobs
    assert torch.allclose(batch.old_logprobs * batch.packed.response_mask, expected, atol=1e-5)
    stats = trainer.update(batch)
    # The second pass sees the policy the first one moved: its ratio leaves 1 (it would stay exactly 1 if the
    # update took its own log-probs as the old ones).
    assert abs(stats["ratio_mean"] - 1.0) > 1e-4


def test_the_importance_level_reaches_the_update_from_its_second_pass_on(tmp_path, rollout):
    """grpo.importance_level=sequence (GSPO) changes the update once a pass's ratio leaves 1: the same
    trainer moves its weights otherwise with two passes a step, identically with one (control: the key took
    effect at all only where it should)."""
    examples, result = rollout
    moved = {}
    for passes in (1, 2):
        for level in ("token", "sequence"):
            trainer = make_trainer(tmp_path / f"{passes}-{level}", **{"grpo.updates_per_step": passes,
                                                                       "optim.lr": 0.05,
                                                                       "grpo.importance_level": level})
            trainer.update(trainer.score(examples, result))
            moved[passes, level] = [p.detach().clone() for p in parameters(trainer)]
    assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(moved[1, "token"], moved[1, "sequence"]))
    assert not all(torch.allclose(a, b, atol=1e-6) for a, b in zip(moved[2, "token"], moved[2, "sequence"]))


def test_update_metrics_do_not_move_with_micro_batch_size_nor_add_up_over_passes(tmp_path, rollout, kl=0.1):
    """The logged loss summed the update passes (2 passes: twice the loss), and clip_fraction, ratio_mean and kl
    were unweighted means over micro-batches, so they changed with optim.micro_batch_size (found by review).
    One pass: the loss equals the full-batch loss whatever the micro-batch size; the per-token metrics too."""
    examples, result = rollout
    stats = {}
    for micro, passes in ((1, 1), (5, 1), (12, 1), (5, 2)):
        # dapo: a token mean, whose on-policy loss is not 0 as a sequence mean of zero-mean advantages is
        trainer = make_trainer(tmp_path / f"{micro}-{passes}", **{"optim.micro_batch_size": micro,
                                                                  "grpo.updates_per_step": passes,
                                                                  "grpo.kl_coef": kl, "grpo.loss": "dapo"})
        trainer.optimizer = torch.optim.SGD(trainer.model.parameters(), lr=0.0)  # every pass sees one policy
        stats[micro, passes] = trainer.update(trainer.score(examples, result))
    assert abs(stats[12, 1]["loss"]) > 1e-4
    for micro, passes in ((1, 1), (5, 1), (5, 2)):
        for key in ("loss", "ratio_mean", "clip_fraction", "tokens", "kl"):
            assert stats[micro, passes][key] == pytest.approx(stats[12, 1][key], rel=1e-5, abs=1e-7), (micro, key)


def test_a_batch_without_old_logprobs_refuses_several_updates(tmp_path, rollout):
    examples, result = rollout
    trainer = make_trainer(tmp_path)
    batch = trainer.score(examples, result)
    several = make_trainer(tmp_path / "several", **{"grpo.updates_per_step": 3})
    with pytest.raises(ValueError, match="one update per step"):
        several.update(batch)


def test_micro_batches_group_rows_of_similar_length(tmp_path, rollout):
    examples, result = rollout
    trainer = make_trainer(tmp_path)
    packed = trainer.score(examples, result).packed
    groups = trainer.micro_batches(packed)
    order = [row for group in groups for row in group]
    assert sorted(order) == list(range(len(result.samples))) and [len(g) for g in groups] == [5, 5, 2]
    lengths = [packed.prompt_lengths[r] + packed.response_lengths[r] for r in order]
    assert lengths == sorted(lengths, reverse=True)  # longest first: less padding per micro-batch


def test_micro_batches_under_a_token_budget_fill_it_longest_first(tmp_path, rollout):
    examples, result = rollout
    trainer = make_trainer(tmp_path)
    packed = trainer.score(examples, result).packed
    lengths = [p + r for p, r in zip(packed.prompt_lengths, packed.response_lengths)]
    for budget in (1, max(lengths), 2 * max(lengths) + 1, 3 * min(lengths), 10**9):
        config = dataclasses.replace(trainer.config, optim=dataclasses.replace(trainer.config.optim,
                                                                                micro_batch_tokens=budget))
        groups = phases.micro_batches(config, packed)
        order = [row for group in groups for row in group]
        assert sorted(order) == list(range(len(lengths)))
        assert [lengths[r] for r in order] == sorted(lengths, reverse=True)
        for group, following in zip(groups, groups[1:] + [None]):
            padded = len(group) * max(lengths[r] for r in group)
            assert padded <= budget or len(group) == 1  # (a row longer than the budget goes alone)
            if following is not None:  # greedy: the next row would not have fit
                assert (len(group) + 1) * lengths[group[0]] > budget
    assert len(groups) == 1  # the last budget takes them all


def test_the_automatic_token_budget_is_the_configured_worst_case_on_cuda_only():
    from tlt.rl.config import load_config

    config = load_config(None, ["optim.micro_batch_size=4", "rollout.max_new_tokens=100"])
    assert config.optim.micro_batch_tokens == "auto"
    assert phases.micro_batch_token_budget(config, [7, 30, 12], "cuda") == 4 * (30 + 100)
    assert phases.micro_batch_token_budget(config, [7, 30, 12], "cpu") is None  # micro_batch_size rows
    off = load_config(None, ["optim.micro_batch_tokens=0"])
    assert phases.micro_batch_token_budget(off, [7], "cuda") is None
    assert phases.micro_batch_token_budget(load_config(None, ["optim.micro_batch_tokens=512"]), [7], "cpu") == 512


# -- the drafter's features ------------------------------------------------------------------------------------

def buffer_after(trainer, examples, result, *, early_micro_batches=0, updates=1):
    trainer.feature_buffer = FeatureBuffer(max_tokens=100_000)
    batch = trainer.score(examples, result)
    if early_micro_batches:  # an idle worker's spot training starts with part of its shard's features
        calls = iter(range(10**6))
        assert trainer.collect_features(batch, lambda: next(calls) >= early_micro_batches) == early_micro_batches
    if updates == 1:
        trainer.update(batch)
    return list(trainer.feature_buffer.entries)


def test_feature_buffer_is_the_same_whichever_forward_fills_it(tmp_path, rollout):
    """Before: the old-log-prob pass filled the buffer (what updates_per_step > 1 still does). Now: the update's
    forward, or an idle worker's decoder-only pass for the first micro-batches and the update for the rest."""
    examples, result = rollout
    before = buffer_after(make_trainer(tmp_path / "a", **{"grpo.updates_per_step": 2}), examples, result,
                          updates=2)
    from_update = buffer_after(make_trainer(tmp_path / "b"), examples, result)
    split = buffer_after(make_trainer(tmp_path / "c"), examples, result, early_micro_batches=1)
    all_early = buffer_after(make_trainer(tmp_path / "d"), examples, result, early_micro_batches=3)
    assert len(before) == len(result.samples)
    for entries in (from_update, split, all_early):
        assert len(entries) == len(before)
        for got, want in zip(entries, before):
            assert torch.equal(got.tokens, want.tokens) and got.step == want.step
            assert torch.allclose(got.features, want.features, atol=1e-6)


def test_a_worker_hands_every_feature_to_the_hub(tmp_path):
    """Two in-process workers: the idle one's features reach the hub during spot training, the last one's
    after its update; together every sample of the step, once."""
    from test_distributed import make_controller

    controller = make_controller(tmp_path)
    try:
        metrics = controller.train_step()
        _, entries = controller.backend.hub.features_since(0)
    finally:
        controller.close()
    assert metrics["spot_train_steps"] > 0
    assert len(entries) == 8 and {e.step for e in entries} == {0}  # 4 prompts x 2 samples, step 0
    assert sorted(len(e.tokens) for e in entries)[:4] == [2, 2, 2, 2]  # the short shard: prompt end + EOS


def test_a_non_finite_gradient_skips_the_update_instead_of_poisoning_the_weights(tmp_path, rollout, monkeypatch):
    """A NaN reached every weight in one update, and the checkpoint after it (found by review): the update is now
    skipped, said in the step's metrics, and the weights stay as they were."""
    import tlt.rl.phases as phases

    examples, result = rollout
    trainer = make_trainer(tmp_path)
    batch = trainer.score(examples, result)
    start = parameters(trainer)
    backward = phases._micro_batch_backward

    def poisoned(replica, *args, **kwargs):
        stats = backward(replica, *args, **kwargs)
        next(p for p in replica.model.parameters() if p.grad is not None).grad[0] = float("nan")
        return stats

    monkeypatch.setattr(phases, "_micro_batch_backward", poisoned)
    stats = trainer.update(batch)
    assert stats["skipped_updates"] == 1
    assert all(torch.equal(a, b) for a, b in zip(parameters(trainer), start))
    assert all(torch.isfinite(p).all() for p in trainer.model.parameters())


def test_a_prompt_too_long_for_the_context_is_named_by_its_record(tmp_path):
    """The engine said "requests[0]: prompt of 400 tokens ...", naming no dataset record (found by review)."""
    from tlt.errors import RequestError
    from tlt.rl.phases import rollout

    trainer = make_trainer(tmp_path)
    example = TaskExample("long", "1", {"ids": [5] * 250, "source": "data/long.jsonl", "line": 6})
    with pytest.raises(RequestError, match=r"data/long\.jsonl, line 6: prompt of 250 tokens \+ "
                                           r"max_new_tokens 9 = 259 exceeds the model's context of 256"):
        rollout(trainer.replica, [example], 1)


def test_workers_update_metrics_merge_into_the_steps():
    """The distributed driver logged worker 0's update metrics: half the loss with two workers, and its shard's
    clip fraction. Each worker's loss is its shard's share of the global loss: they add; per-token metrics
    weigh by tokens; the gradient norm is of the all-reduced gradient, the same on every worker."""
    from tlt.rl.phases import merge_worker_updates

    workers = [{"loss": 0.25, "tokens": 30.0, "clip_fraction": 0.1, "ratio_mean": 1.0, "grad_norm": 2.0},
               {"loss": -0.5, "tokens": 10.0, "clip_fraction": 0.5, "ratio_mean": 1.2, "grad_norm": 2.0}]
    merged = merge_worker_updates(workers)
    assert merged == pytest.approx({"loss": -0.25, "tokens": 40.0, "clip_fraction": 0.2, "ratio_mean": 1.05,
                                    "grad_norm": 2.0})


def test_the_policys_dropout_is_disabled_for_rl(caplog):
    """Old log-probs come from an eval-mode forward and the update from a train-mode one: with the model's
    attention_dropout on, the first pass's ratio was 0.98-1.0 before any update (found by review). Negative
    control: two train-mode forwards differ before, not after."""
    from tlt.rl.optim import disable_dropout

    model = tiny_model("qwen2", attention_dropout=0.3).train()
    ids = torch.tensor([[3, 5, 7, 9, 11, 2]])
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, model(ids).logits)
        assert disable_dropout(model) and not disable_dropout(model)  # on once, then off
        assert torch.equal(model(ids).logits, model(ids).logits)
        assert torch.equal(model(ids).logits, model.eval()(ids).logits)


def test_an_update_that_may_not_fit_in_memory_says_so_first(tmp_path, rollout, monkeypatch, caplog):
    """A CLI trial's 8k-token prompt had its CPU update killed by the system's out-of-memory killer, silently: the
    update now warns first when its largest micro-batch's activations (estimated) pass the free memory, naming the
    settings that need less, once per shape; the step still runs. Control: enough free memory, no warning."""
    from tlt.rl import update_memory

    examples, result = rollout
    trainer = make_trainer(tmp_path, **{"optim.micro_batch_size": 12})
    batch = trainer.score(examples, result)
    longest = max(len(s.prompt_ids) + len(s.token_ids) for s in result.samples)
    estimate = update_memory.activation_bytes(trainer.model.config, 12 * longest, element_size=4, checkpointed=False)
    monkeypatch.setattr(update_memory, "WARNED", set())
    monkeypatch.setattr(update_memory, "available_bytes", lambda device: estimate)
    trainer.update(batch)
    assert "may run out" not in caplog.text  # it fits, just
    monkeypatch.setattr(update_memory, "available_bytes", lambda device: estimate - 1)
    trainer.update(batch)
    trainer.update(batch)
    warnings = [r.getMessage() for r in caplog.records if "may run out of memory" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert f"12 row(s) of {longest} tokens" in warnings[0] and "optim.grad_checkpointing=true" in warnings[0]


def test_the_activation_estimate_follows_the_measured_rule():
    """The rule the warning uses: SmolLM2-135M's shape, 4,096 fp32 tokens at 1.57 MB a token by the rule
    (measured 1.77 MB a token with the weights' gradients); half with gradient checkpointing."""
    from transformers import LlamaConfig

    from tlt.rl.update_memory import activation_bytes

    config = LlamaConfig(hidden_size=576, intermediate_size=1536, num_hidden_layers=30)
    full = activation_bytes(config, 4096, element_size=4, checkpointed=False)
    assert full == 30 * (12 * 576 + 4 * 1536) * 4 * 4096
    assert activation_bytes(config, 4096, element_size=4, checkpointed=True) == full // 2
    assert activation_bytes(config, 4096, element_size=2, checkpointed=False) == full // 2
