"""Training the drafter on a tiny target's features lowers its loss and raises τ measured by the SD engine."""

import copy
import time

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from conftest import markov_model, random_prompts
from tlt.drafter.buffer import FeatureBuffer, pack_pairs, pad_rows
from tlt.drafter.features import collect_features
from tlt.drafter.trainer import (CPU_ROWS_PER_MICRO_STEP, DrafterTrainConfig, DrafterTrainer,
                                 rows_per_micro_step)
from tlt.models import LeanForward
from tlt.models.eagle import DrafterError, EagleDrafter
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.request import Request
from tlt.sampling import SamplingParams
from tlt.speculative.strategy import SpecStrategy


def measured_tau(model, drafter, prompts):
    engine = RolloutEngine(model, max_batch_size=8, drafter=drafter, speculation=SpecStrategy(4, 2, 8),
                           max_tree_size=8)
    params = SamplingParams(temperature=1.0, max_new_tokens=24, stop_token_ids=(), seed=5)
    return engine.generate([Request(p, n=2, params=params) for p in prompts]).speculation_summary()["tau"]


@pytest.fixture(scope="module")
def setup():
    model, _ = markov_model(16, sharpness=3.0, context=0.05, seed=2)
    lean = LeanForward(model)
    engine = RolloutEngine(model, max_batch_size=16)
    prompts = random_prompts([4] * 16, vocab_size=16, seed=3)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, stop_token_ids=(), seed=1)
    result = engine.generate([Request(p, n=2, params=params) for p in prompts])
    buffer = FeatureBuffer(max_tokens=100_000)
    collect_features(lean, [list(s.prompt_ids) for s in result.samples], [s.token_ids for s in result.samples],
                     buffer, step=0)
    return model, buffer


def test_training_lowers_loss_and_raises_tau(setup):
    model, buffer = setup
    torch.manual_seed(0)
    drafter = EagleDrafter(model.config).attach(model)
    trainer = DrafterTrainer(drafter, buffer, DrafterTrainConfig(lr=3e-3, entries_per_step=8, row_length=64))
    train, held = buffer.split_holdout(0.2)
    held_prompts = random_prompts([4] * 4, vocab_size=16, seed=9)
    before, tau_before = trainer.evaluate(held), measured_tau(model, drafter, held_prompts)
    trainer.train_steps(150)
    after, tau_after = trainer.evaluate(held), measured_tau(model, drafter, held_prompts)
    assert after["loss"] < 0.5 * before["loss"]
    assert after["top1"] > before["top1"] + 0.3
    assert tau_after > tau_before + 0.8, (tau_before, tau_after)
    print(f"held-out loss {before['loss']:.3f} -> {after['loss']:.3f}, top1 {before['top1']:.2f} -> {after['top1']:.2f}, tau {tau_before:.2f} -> {tau_after:.2f}")


def test_train_until_stops_within_one_step(setup):
    model, buffer = setup
    trainer = DrafterTrainer(EagleDrafter(model.config).attach(model), buffer)
    deadline = time.perf_counter() + 0.3
    started = time.perf_counter()
    history = trainer.train_until(lambda: time.perf_counter() >= deadline, max_steps=10_000)
    overshoot = time.perf_counter() - deadline
    longest = max(h["step_s"] for h in history)
    assert 0 < len(history) < 10_000
    assert overshoot <= longest + 0.05  # at most the step in flight when the stop came
    assert time.perf_counter() - started < 5


def test_micro_steps_accumulate_the_whole_batch_gradient(setup):
    model, buffer = setup
    grads = []
    for rows in (1, 100):
        torch.manual_seed(0)
        drafter = EagleDrafter(model.config).attach(model)
        config = DrafterTrainConfig(entries_per_step=6, row_length=32, rows_per_micro_step=rows, grad_clip=0, seed=4)
        trainer = DrafterTrainer(drafter, buffer, config)
        trainer.buffer._rng.seed(11)  # the same entries for both
        trainer.optimizer.step = lambda: None  # keep the gradient for inspection
        trainer._step()
        grads.append(torch.cat([p.grad.reshape(-1) for p in drafter.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], atol=1e-6, rtol=1e-4)


class DeviceReads(TorchDispatchMode):
    """Counts the operations that, on CUDA, read the device back to the host (a sync): a tensor's value
    (float(), item(), int()), nonzero, and indexing by a boolean mask (it reads the mask's count)."""

    def __init__(self):
        super().__init__()
        self.reads = []
        self.on_host = False  # set while the trainer works on host tensors (packing, moving them to the device)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func)
        if self.on_host:
            return func(*args, **(kwargs or {}))
        boolean_index = name == "aten.index.Tensor" and any(
            torch.is_tensor(i) and i.dtype == torch.bool for i in args[1])
        if "_local_scalar_dense" in name or "nonzero" in name or boolean_index:
            self.reads.append(name)
        return func(*args, **(kwargs or {}))


def one_step_reads(trainer) -> list[str]:
    """The device reads of one optimizer step's micro-steps (the optimizer's own update left out: on the CPU,
    AdamW reads its step count, which CUDA's fused AdamW keeps on the device)."""
    trainer.optimizer.step = lambda: None

    def on_host(function):  # host work: the rows are packed, weighted and moved from host tensors
        def wrapped(*args):
            reads.on_host = True
            try:
                return function(*args)
            finally:
                reads.on_host = False
        return wrapped
    trainer._to_device, trainer._micro_batches = on_host(trainer._to_device), on_host(trainer._micro_batches)
    with DeviceReads() as reads:
        record = trainer._step()
    assert record is not None and record["loss"] > 0
    return reads.reads


def test_a_drafter_step_reads_nothing_from_the_device_until_its_metrics(setup):
    """On one GPU the drafter trains on a thread beside the decode loop, which waits for the GIL each time the
    thread holds it: a read per metric and micro-step (6) and the boolean masks' counts (3) were syncs that
    stalled the thread between its launches. The shares and valid positions now come from the host-side rows,
    the metrics are read once at the step's end (tolist, not dispatched). The real pairs are not indexed at all:
    the loss weighs every pair (0 at padding), which a CUDA graph also needs."""
    model, buffer = setup
    config = DrafterTrainConfig(entries_per_step=8, row_length=16, rows_per_micro_step=1)
    trainer = DrafterTrainer(EagleDrafter(model.config).attach(model), buffer, config)
    assert one_step_reads(trainer) == []

    class FloatMetrics(DrafterTrainer):  # negative control: a loss that reads its metrics as it goes
        def loss(self, batch, weights, *, noise=True):
            loss, parts = super().loss(batch, weights, noise=noise)
            return loss, {key: float(value) for key, value in parts.items()}
    control = FloatMetrics(EagleDrafter(model.config).attach(model), buffer, config)
    assert len(one_step_reads(control)) >= 6 * 2  # six metrics a micro-step, two micro-steps or more



def test_the_loss_weighted_over_every_pair_is_the_mean_over_the_real_pairs(setup):
    """The loss runs at every pair of the packed rows, padding too, weighted (0 at padding): fixed shapes for a
    CUDA graph. It must be the mean over the real pairs taken by indexing them (the formula before)."""
    model, buffer = setup
    torch.manual_seed(1)
    drafter = EagleDrafter(model.config).attach(model)
    trainer = DrafterTrainer(drafter, buffer, DrafterTrainConfig(row_length=16))
    packed = pack_pairs(buffer.sample(5), 16)
    valid = packed.valid
    assert not bool(valid.all())  # padding to leave out
    weights = valid.float() / valid.sum()
    loss, parts = trainer.loss(packed, weights, noise=False)
    predicted = drafter(packed.input_tokens, packed.input_features, packed.positions, packed.attention_mask)[valid]
    target = packed.target_features[valid]
    p = torch.softmax(drafter.draft_logits(target), -1)
    ce = -(p * torch.log_softmax(drafter.draft_logits(predicted), -1)).sum(-1).mean()
    expected = F.smooth_l1_loss(predicted, target) + trainer.config.ce_weight * ce
    assert torch.allclose(loss, expected, rtol=1e-5) and torch.allclose(parts["ce"], ce, rtol=1e-5)
    agreement = (drafter.draft_logits(predicted).argmax(-1) == p.argmax(-1)).float().mean()
    assert torch.allclose(parts["top1"], agreement)
    uniform = torch.full_like(weights, 1 / weights.numel())  # control: the padding weighed in
    assert not torch.allclose(trainer.loss(packed, uniform, noise=False)[0], expected, rtol=1e-3)


def test_padded_micro_steps_give_the_same_step(setup):
    """A captured micro-step has a fixed number of rows: the step's last chunk is padded with weightless rows.
    Gradient and metrics must be those of the unpadded chunks (checked on the CPU, eagerly)."""
    model, buffer = setup
    results = []
    for pad in (False, True):
        torch.manual_seed(0)
        drafter = EagleDrafter(model.config).attach(model)
        trainer = DrafterTrainer(drafter, buffer, DrafterTrainConfig(entries_per_step=5, row_length=16,
                                                                     rows_per_micro_step=3, grad_clip=0, seed=4))
        trainer.buffer._rng.seed(11)
        trainer.optimizer.step = lambda: None
        if pad:
            trainer._graph_wanted = lambda: True  # pads the chunks ...
            trainer._graph = lambda *args: None   # ... and runs them eagerly
        chunks = []
        original = trainer.loss
        trainer.loss = lambda rows, weights, **kw: (chunks.append(rows.valid.shape[0]), original(rows, weights))[1]
        record = trainer._step()
        results.append((torch.cat([q.grad.reshape(-1) for q in drafter.parameters() if q.grad is not None]),
                        record, chunks))
    (plain, plain_record, plain_rows), (padded, padded_record, padded_rows) = results
    assert padded_rows == [3] * len(padded_rows) and plain_rows[-1] < 3  # the last chunk was padded
    assert torch.allclose(plain, padded, atol=1e-7, rtol=1e-5)
    for key in ("loss", "ce", "top1", "accept_q"):
        assert padded_record[key] == pytest.approx(plain_record[key], rel=1e-5)


def test_pad_rows_adds_weightless_rows_that_attend_to_themselves(setup):
    _, buffer = setup
    packed = pack_pairs(buffer.sample(2), 16)
    padded = pad_rows(packed, packed.valid.shape[0] + 2)
    assert padded.valid.shape[0] == packed.valid.shape[0] + 2 and not bool(padded.valid[-2:].any())
    assert torch.equal(padded.attention_mask[-1], torch.eye(16, dtype=torch.bool))
    assert torch.equal(padded.input_features[:-2], packed.input_features)
    assert pad_rows(packed, 1) is packed


def test_cuda_graph_is_ignored_on_the_cpu(setup):
    """One config serves the GPU and the CPU machines: on the CPU the trainer stays eager."""
    model, buffer = setup
    trainer = DrafterTrainer(EagleDrafter(model.config).attach(model), buffer, DrafterTrainConfig(cuda_graph=True))
    assert not trainer._graph_wanted()
    assert trainer.train_steps(1)[0]["loss"] > 0 and trainer._micro_step_graph is None


def test_micro_steps_by_device_and_draft_vocabulary(setup):
    model, buffer = setup
    trainer = DrafterTrainer(EagleDrafter(model.config).attach(model), buffer)
    assert trainer._rows_per_micro_step() == CPU_ROWS_PER_MICRO_STEP == 2
    assert rows_per_micro_step("cuda", 256, 8192) == 8  # the default draft vocabulary
    assert rows_per_micro_step("cuda", 64, 8192) == 8  # (at most 8 however short the rows)
    assert rows_per_micro_step("cuda", 256, 16384) == 4
    assert rows_per_micro_step("cuda", 256, 49152) == rows_per_micro_step("cuda", 256, 151936) == 1
    assert DrafterTrainer(EagleDrafter(model.config).attach(model), buffer,
                          DrafterTrainConfig(rows_per_micro_step=5))._rows_per_micro_step() == 5


def test_a_loaded_optimizer_state_keeps_this_trainers_kernel_choice(setup, tmp_path):
    """torch's load_state_dict takes the saver's fused/foreach flags with its moments: a state saved by a CPU
    (foreach) trainer turned a CUDA trainer's fused AdamW off for the rest of the run (found by review). The
    fused trainer is made on the CPU here (torch's fused AdamW runs there too)."""
    model, buffer = setup
    saver = DrafterTrainer(EagleDrafter(model.config).attach(model), buffer, DrafterTrainConfig(row_length=16))
    saver.train_steps(1)
    saver.save(tmp_path)
    fused = DrafterTrainer(EagleDrafter(model.config).attach(model), buffer, DrafterTrainConfig(row_length=16))
    params = [p for p in fused.drafter.parameters() if p.requires_grad]
    fused.optimizer = torch.optim.AdamW(params, lr=1e-3, fused=True)
    raw = torch.optim.AdamW(params, lr=1e-3, fused=True)
    raw.load_state_dict(DrafterTrainer.saved_state(tmp_path)["optimizer"])
    assert not raw.param_groups[0]["fused"]  # what torch does alone
    fused.load_optimizer(tmp_path)
    assert all(group["fused"] for group in fused.optimizer.param_groups)
    steps = [fused.optimizer.state[p]["step"] for p in params]
    assert all(step.dtype == torch.float32 and step.device == p.device for step, p in zip(steps, params))
    fused.train_steps(1)  # the fused kernel takes the loaded moments
    assert float(fused.optimizer.state[params[0]]["step"]) == 2


def test_a_stop_inside_a_step_drops_it_without_an_update(setup):
    model, buffer = setup
    drafter = EagleDrafter(model.config).attach(model)
    trainer = DrafterTrainer(drafter, buffer, DrafterTrainConfig(entries_per_step=8, row_length=16,
                                                                 rows_per_micro_step=1))
    before = [p.detach().clone() for p in drafter.parameters()]
    checks = iter([False, False, True])  # before the step, first micro-step, then stop mid-step
    assert trainer.train_until(lambda: next(checks), max_steps=5) == []
    assert trainer.steps == 0
    assert all(torch.equal(a, b) for a, b in zip(before, drafter.parameters()))


def test_save_load_and_shape_mismatch(setup, tmp_path):
    model, buffer = setup
    drafter = EagleDrafter(model.config, draft_vocab=torch.arange(8)).attach(model)
    trainer = DrafterTrainer(drafter, buffer)
    trainer.train_steps(2)
    trainer.save(tmp_path / "d")
    names = set(__import__("safetensors.torch", fromlist=["load_file"]).load_file(
        str(tmp_path / "d" / "drafter.safetensors")))
    assert not any("embed" in n or "lm_head" in n for n in names)  # the target's tensors are never saved
    loaded = EagleDrafter.load(tmp_path / "d", model)
    for a, b in zip(loaded.parameters(), drafter.parameters()):
        assert torch.equal(a, b)
    resumed = DrafterTrainer(loaded, buffer)
    resumed.load_optimizer(tmp_path / "d")
    assert resumed.steps == 2
    other, _ = markov_model(8)
    with pytest.raises(DrafterError, match="do not fit"):
        EagleDrafter.load(tmp_path / "d", other)


def test_a_drafter_stored_in_bf16_loads_in_the_targets_dtype(setup, tmp_path):
    """benchmarks/gpu_prepare_drafter.sh carries a drafter's weights in bf16 (half the bytes); loading gives the
    target's dtype holding the rounded values, with the draft vocabulary's integer ids untouched."""
    from safetensors.torch import load_file, save_file

    model, _ = setup
    drafter = EagleDrafter(model.config, draft_vocab=torch.arange(8)).attach(model)
    drafter.save(tmp_path / "d")
    weights = tmp_path / "d" / "drafter.safetensors"
    rounded = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in load_file(str(weights)).items()}
    save_file(rounded, str(weights))
    loaded = EagleDrafter.load(tmp_path / "d", model)
    assert {p.dtype for p in loaded.parameters()} == {torch.float32}
    assert torch.equal(loaded.draft_to_target, torch.arange(8))
    for name, tensor in loaded.state_dict().items():
        assert torch.equal(tensor, rounded[name].to(tensor.dtype)), name


def test_evaluation_reports_acceptance_per_rule_not_just_agreement(setup):
    """An exact drafter (q = p) is accepted with probability 1 by q-sampling, but by the target-only rule only
    with the target's top-1 mass; its top-1 agreement is 1 either way, which is why agreement overstates τ."""
    from conftest import oracle_drafter

    model, transition = markov_model(16, sharpness=1.0, seed=1)
    engine = RolloutEngine(model, max_batch_size=16)
    params = SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=(), seed=1)
    result = engine.generate([Request(p, n=2, params=params) for p in random_prompts([4] * 8, vocab_size=16)])
    buffer = FeatureBuffer(max_tokens=100_000)
    collect_features(LeanForward(model), [list(s.prompt_ids) for s in result.samples],
                     [s.token_ids for s in result.samples], buffer, step=0)
    report = DrafterTrainer(oracle_drafter(model).attach(model), buffer).evaluate(list(buffer.entries))
    assert report["top1"] == 1.0
    assert report["accept_q"] == pytest.approx(1.0, abs=1e-5)
    top1_mass = torch.softmax(transition, -1).max(-1).values  # per current token
    assert 0.2 < report["accept_target_only"] < 0.95
    assert top1_mass.min() - 1e-5 <= report["accept_target_only"] <= top1_mass.max() + 1e-5


def greedy_chain_by_hand(transition, token: int, depth: int, temperature: float) -> torch.Tensor:
    """Reach probabilities of an exact drafter's greedy chain on a context-free Markov target, from `token`."""
    accepted = []
    for _ in range(depth):
        best = int(transition[token].argmax())
        accepted.append(1.0 if temperature == 0 else float(torch.softmax(transition[token] / temperature, -1)[best]))
        token = best
    return torch.tensor(accepted).cumprod(0)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_chain_tau_of_an_exact_drafter_by_hand(temperature):
    """At T = 0 an exact drafter's chain is always accepted (τ = depth + 1); at T = 1 depth d is reached with the
    product of the target's top-1 masses along the chain — far below what top-1 agreement (1.0) suggests."""
    from conftest import oracle_drafter
    from tlt.drafter.chain import chain_acceptance

    model, transition = markov_model(16, sharpness=1.0, seed=1)
    lean = LeanForward(model)
    prompts, responses = random_prompts([4, 6], vocab_size=16, seed=3), random_prompts([9, 5], vocab_size=16, seed=4)
    result = chain_acceptance(oracle_drafter(model).attach(lean), lean, prompts, responses, 4, temperature)
    # chains start at every pending response token but the last: the first response token .. the second-to-last
    expected = torch.stack([greedy_chain_by_hand(transition, token, 4, temperature)
                            for response in responses for token in response[:-1]])
    assert result.chains == 8 + 4
    assert result.reach_by_depth == pytest.approx(expected.mean(0).tolist(), abs=1e-5)
    assert result.tau == pytest.approx(1 + float(expected.mean(0).sum()), abs=1e-5)
    if temperature == 0:
        assert result.tau == 5.0
    else:
        assert 1.2 < result.tau < 2.5


def reference_reach(model, drafter, prompt, response, depth, temperature):
    """One chain at a time with plain forwards: the drafter's training forward on the explicit pairs, the target
    (transformers' own forward) on the explicit prefix + chain."""
    from tlt.models import KVCache

    sequence = prompt + response
    lean = LeanForward(model)
    features = lean(torch.tensor([sequence]), KVCache(lean.spec, 1, len(sequence)).rows(0, 1), logits_at=None).hidden[0]
    rows = []
    for start in range(len(prompt) - 1, len(sequence) - 2):  # pair j: pending token x_{j+1}
        tokens, feats, drafts = list(sequence[1:start + 2]), list(features[:start + 1]), []
        for _ in range(depth):
            count = len(tokens)
            hidden = drafter(torch.tensor([tokens]), torch.stack(feats)[None], torch.arange(count)[None],
                             torch.ones(count, count, dtype=torch.bool).tril()[None])[0, -1]
            drafts.append(int(drafter.to_target_ids(drafter.draft_logits(hidden).argmax(-1))))
            tokens.append(drafts[-1])
            feats.append(hidden)
        logits = model(torch.tensor([sequence[:start + 2] + drafts[:-1]])).logits[0, start + 1:].float()
        picked = logits.argmax(-1) == torch.tensor(drafts) if temperature == 0 else \
            torch.softmax(logits / temperature, -1).gather(1, torch.tensor(drafts)[:, None])[:, 0]
        rows.append(picked.float().cumprod(0))
    return torch.stack(rows)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_batched_chain_scoring_matches_one_chain_at_a_time(monkeypatch, temperature):
    """The one-forward layout (every chain masked to its own prefix, several passes of chains) against plain
    forwards: a target whose outputs depend on the prefix, a drafter whose attention matters, a draft vocabulary."""
    import tlt.drafter.chain
    from conftest import oracle_drafter
    from tlt.drafter.chain import chain_reach

    monkeypatch.setattr(tlt.drafter.chain, "BRANCHES_PER_PASS", 3)
    monkeypatch.setattr(tlt.drafter.chain, "LOGIT_ROWS", 5)
    model, _ = markov_model(16, sharpness=2.0, context=0.3, seed=2)
    exact = oracle_drafter(model)
    drafter = EagleDrafter(model.config, draft_vocab=torch.arange(4, 16))
    drafter.load_state_dict({**exact.state_dict(), "draft_to_target": drafter.draft_to_target})
    with torch.no_grad():
        drafter.layer.self_attn.o_proj.weight.normal_(0, 0.1, generator=torch.Generator().manual_seed(0))
    drafter.attach(model).eval()
    prompt, response = random_prompts([5, 10], vocab_size=16, seed=6)
    with torch.no_grad():
        expected = reference_reach(model, drafter, prompt, response, 3, temperature)
    got = chain_reach(drafter, LeanForward(model), prompt, response, 3, temperature)
    assert got.shape == (9, 3)
    assert 0 < float(got[:, 0].mean()) < 1 and float(got[:, 1].sum()) > 0  # not all-or-nothing: a real check
    if temperature == 0:
        assert torch.equal(got, expected)
    else:
        assert torch.allclose(got, expected, atol=1e-5)


def _markov_loaded():
    from tlt.models import LoadedModel, ModelSpec
    from tlt.tasks.synthetic import IdTokenizer

    model, _ = markov_model(16, sharpness=2.0, context=0.05, seed=1)
    return LoadedModel(model, IdTokenizer(), ModelSpec.from_config(model.config), "markov")


def test_warmup_holds_out_whole_prompts_and_names_its_numbers(tmp_path, monkeypatch):
    import tlt.drafter.warmup as warmup_module
    from tlt.drafter.warmup import WarmupConfig, warmup
    from tlt.tasks.synthetic import TargetTokenTask

    loaded = _markov_loaded()
    calls = {"features": [], "chain": []}
    collect, chain = warmup_module.collect_features, warmup_module.chain_acceptance
    monkeypatch.setattr(warmup_module, "collect_features", lambda target, prompts, responses, *a, **k: (
        calls["features"].append((prompts, responses)) or collect(target, prompts, responses, *a, **k)))
    monkeypatch.setattr(warmup_module, "chain_acceptance", lambda drafter, target, prompts, responses, *a: (
        calls["chain"].append((prompts, responses)) or chain(drafter, target, prompts, responses, *a)))
    config = WarmupConfig(prompts=10, samples_per_prompt=2, eval_prompts=2, max_new_tokens=12, steps=20,
                          draft_vocab=0, eval_strategy=SpecStrategy.chain(3))
    lines = []
    report = warmup(loaded, TargetTokenTask(vocab_size=16), tmp_path / "drafter", config, log=lines.append)
    (train_prompts, _), (held_prompts, held_responses) = calls["features"]
    assert calls["chain"] == [(held_prompts, held_responses)]  # the chain τ is scored on the held-out responses
    assert len(held_prompts) == 2 and len({tuple(p) for p in held_prompts}) == 1  # both samples of one prompt
    assert len(train_prompts) == 18 and tuple(held_prompts[0]) not in {tuple(p) for p in train_prompts}
    chain_report = report["held_out_chain"]
    assert (report["held_out_prompts"], report["held_out_responses"], chain_report["depth"]) == (1, 2, 3)
    assert chain_report["chains"] == sum(len(r) - 1 for r in held_responses)
    assert chain_report["tau"] == pytest.approx(1 + sum(chain_report["reach_by_depth"]))
    text = "\n".join(lines)
    for label in ("never trained on", "top-1 agreement with the target's argmax (teacher-forced)",
                  "not an acceptance rate at T=1.0", "target-only E[p(argmax q)]",
                  "predicted τ of a greedy depth-3 chain, target-only rule, T=1.0",
                  "measured τ of SD in the engine (S3K1N3, target-only rule, T=1.0, batch 1"):
        assert label in text, label


def test_a_warmup_without_eval_prompts_skips_the_measured_tau_and_says_so(tmp_path, monkeypatch):
    """On tiny settings most of a warm-up went into its measured τ (8 held-out prompts at batch 1, found by a CLI
    trial): --eval-prompts 0 skips it, and the summary says it was not measured (not "every response ended at
    its first token"). The control: one eval prompt runs the engine once."""
    import tlt.drafter.warmup as warmup_module
    from tlt.drafter.warmup import WarmupConfig, warmup
    from tlt.tasks.synthetic import TargetTokenTask

    loaded = _markov_loaded()
    measured = []
    original = warmup_module.RolloutEngine.generate
    monkeypatch.setattr(warmup_module.RolloutEngine, "generate", lambda self, requests, **k: (
        measured.append(self.speculation is not None) or original(self, requests, **k)))
    for eval_prompts in (0, 1):
        config = WarmupConfig(prompts=4, samples_per_prompt=2, eval_prompts=eval_prompts, max_new_tokens=8, steps=3,
                              draft_vocab=0, eval_strategy=SpecStrategy.chain(2))
        lines = []
        report = warmup(loaded, TargetTokenTask(vocab_size=16), tmp_path / f"drafter-{eval_prompts}", config,
                        log=lines.append)
        text = "\n".join(lines)
        if eval_prompts == 0:
            assert measured == [False] and report["measured_tau"] is None  # the sampling only
            assert "not measured (--eval-prompts 0)" in text and "measuring τ" not in text
        else:
            assert measured == [False, False, True] and report["measured_tau"] is not None
            assert "not measured" not in text


def test_warmup_goes_on_from_an_earlier_drafter_with_its_optimizer(tmp_path):
    import json

    from tlt.drafter.warmup import WarmupConfig, warmup
    from tlt.tasks.synthetic import TargetTokenTask

    loaded, task = _markov_loaded(), TargetTokenTask(vocab_size=16)
    small = dict(prompts=6, samples_per_prompt=1, eval_prompts=1, max_new_tokens=8, draft_vocab=12,
                 eval_strategy=SpecStrategy.chain(2))
    first = warmup(loaded, task, tmp_path / "a", WarmupConfig(steps=4, **small), log=lambda line: None)
    before = EagleDrafter.load(tmp_path / "a", loaded.model)
    second = warmup(loaded, task, tmp_path / "b", WarmupConfig(steps=3, seed=1, init=str(tmp_path / "a"),
                                                               lr_schedule="cosine", **small), log=lambda line: None)
    after = EagleDrafter.load(tmp_path / "b", loaded.model)
    assert torch.equal(before.draft_to_target, after.draft_to_target)  # the vocabulary is the earlier drafter's
    assert not torch.equal(before.fc.weight, after.fc.weight)          # and training went on from its weights
    assert json.loads((tmp_path / "b" / "drafter_trainer.json").read_text())["steps"] == 7  # optimizer carried on
    assert (first["init"], second["init"], second["lr_schedule"]) == (None, str(tmp_path / "a"), "cosine")


def _interrupted_warmup(tmp_path, monkeypatch, at_step: int, steps: int):
    """A small warm-up whose optimizer step `at_step` + 1 is cut by a KeyboardInterrupt: (loaded, out, log lines)."""
    from tlt.drafter.trainer import DrafterTrainer
    from tlt.drafter.warmup import WarmupConfig, warmup
    from tlt.tasks.synthetic import TargetTokenTask

    step = DrafterTrainer.train_steps

    def interrupted(trainer, count):
        if trainer.steps == at_step:
            raise KeyboardInterrupt
        return step(trainer, count)

    monkeypatch.setattr(DrafterTrainer, "train_steps", interrupted)
    small = dict(prompts=6, samples_per_prompt=1, eval_prompts=1, max_new_tokens=8, draft_vocab=12,
                 eval_strategy=SpecStrategy.chain(2))
    loaded, out, lines = _markov_loaded(), tmp_path / "drafter", []
    with pytest.raises(KeyboardInterrupt):
        warmup(loaded, TargetTokenTask(vocab_size=16), out, WarmupConfig(steps=steps, **small), log=lines.append)
    return loaded, out, lines


def test_a_killed_warmup_keeps_the_drafter_of_its_last_save(tmp_path, monkeypatch):
    """A warm-up saved only at its end: killed at a time limit (the GPU session's), it left nothing. It saves as it
    trains; `--init` goes on from the save, optimizer steps included."""
    import json

    import tlt.drafter.warmup as warmup_module

    monkeypatch.setattr(warmup_module, "SAVE_EVERY_S", 0.0)
    loaded, out, lines = _interrupted_warmup(tmp_path, monkeypatch, at_step=4, steps=10)
    assert json.loads((out / "drafter_trainer.json").read_text())["steps"] == 4
    assert f"interrupted: the drafter after 4 optimizer step(s) is saved in {out}" in lines[-1]
    assert EagleDrafter.load(out, loaded.model).draft_vocab_size == 12
    assert not (out / "warmup_report.json").exists()  # a finished warm-up's mark


def test_a_warmup_stopped_while_it_measures_keeps_its_trained_drafter(tmp_path, monkeypatch):
    """Stopped while it scored the held-out chains (after all its steps), a warm-up saved nothing (QA): the
    drafter is saved when its training ends. Control: the last step's weights are the ones saved."""
    import json

    import tlt.drafter.warmup as warmup_module
    from tlt.drafter.warmup import WarmupConfig, warmup
    from tlt.tasks.synthetic import TargetTokenTask

    def stopped(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(warmup_module, "chain_acceptance", stopped)
    small = dict(prompts=6, samples_per_prompt=1, eval_prompts=1, max_new_tokens=8, draft_vocab=12,
                 eval_strategy=SpecStrategy.chain(2))
    loaded, out, lines = _markov_loaded(), tmp_path / "drafter", []
    with pytest.raises(KeyboardInterrupt):
        warmup(loaded, TargetTokenTask(vocab_size=16), out, WarmupConfig(steps=3, **small), log=lines.append)
    assert json.loads((out / "drafter_trainer.json").read_text())["steps"] == 3
    assert f"interrupted while measuring: the trained drafter (3 optimizer steps) is saved in {out}" in lines[-1]
    assert EagleDrafter.load(out, loaded.model).draft_vocab_size == 12
    assert not (out / "warmup_report.json").exists()


def test_warmup_refuses_an_init_drafter_of_another_vocabulary_before_sampling(tmp_path, monkeypatch):
    from tlt.drafter.warmup import WarmupConfig, warmup
    from tlt.errors import TltError
    from tlt.tasks.synthetic import TargetTokenTask

    loaded = _markov_loaded()
    EagleDrafter(loaded.model.config, torch.arange(10)).attach(loaded.model).save(tmp_path / "a")
    monkeypatch.setattr(RolloutEngine, "generate", lambda *a, **k: pytest.fail("sampled before checking --init"))
    with pytest.raises(TltError, match=r"draft vocabulary of 10 tokens, not the 12 asked for: pass --draft-vocab 10"):
        warmup(loaded, TargetTokenTask(vocab_size=16), tmp_path / "b",
               WarmupConfig(prompts=4, draft_vocab=12, init=str(tmp_path / "a")), log=lambda line: None)
    from tlt.drafter.warmup import initial_drafter

    config = WarmupConfig(prompts=4, init=str(tmp_path / "a"))  # --draft-vocab not given: the drafter's own
    assert initial_drafter(loaded, loaded.model, config)[0].draft_vocab_size == 10
    with pytest.raises(TltError, match="lr_schedule must be 'constant' or 'cosine', got 'linear'"):
        WarmupConfig(lr_schedule="linear")


def test_warmup_refuses_an_out_directory_holding_a_drafter_before_sampling(tmp_path, monkeypatch):
    from tlt.drafter.warmup import WarmupConfig, warmup
    from tlt.errors import TltError
    from tlt.tasks.synthetic import TargetTokenTask

    loaded = _markov_loaded()
    EagleDrafter(loaded.model.config).attach(loaded.model).save(tmp_path / "a")
    monkeypatch.setattr(RolloutEngine, "generate", lambda *a, **k: pytest.fail("sampled before checking --out"))
    with pytest.raises(TltError, match=r"already holds a drafter: pass --overwrite to replace it, --init .* to go on"):
        warmup(loaded, TargetTokenTask(vocab_size=16), tmp_path / "a", WarmupConfig(prompts=4), log=lambda line: None)


@pytest.mark.parametrize("settings,train,message", [
    ({"steps": -1}, {}, "--steps must be >= 1"), ({"draft_vocab": -5}, {}, "--draft-vocab must be >= 0"),
    ({}, {"lr": 0.0}, "--lr must be a finite number > 0"), ({}, {"ce_weight": -1.0}, "--ce-weight must be"),
    ({"draft_vocab": 1}, {}, "--draft-vocab 1 is smaller than the 2 children per node of S4K2N14q"),
    ({}, {}, "is a file, not a directory"), ({"init": "damaged"}, {}, "cannot read the drafter's optimizer state")])
def test_warmup_refuses_bad_settings_and_outs_before_sampling(tmp_path, monkeypatch, settings, train, message):
    """These trained nothing (steps -1, lr 0), the wrong thing (a negative ce weight maximizes the cross-entropy)
    or the full vocabulary (draft_vocab -5) without a word; an --out that is a file, or an --init whose optimizer
    state is cut short, failed with a traceback only after the minutes of sampling."""
    from tlt.drafter.trainer import DrafterTrainConfig, DrafterTrainer
    from tlt.drafter.warmup import WarmupConfig, warmup
    from tlt.errors import TltError
    from tlt.tasks.synthetic import TargetTokenTask

    loaded = _markov_loaded()
    out = tmp_path / "out"
    if message.endswith("not a directory"):
        out.write_text("x")
    if "init" in settings:
        DrafterTrainer(EagleDrafter(loaded.model.config).attach(loaded.model), None).save(tmp_path / "damaged")
        (tmp_path / "damaged" / "drafter_optimizer.safetensors").write_bytes(b"\x08")
        settings = {"init": str(tmp_path / "damaged"), "draft_vocab": 0}
    monkeypatch.setattr(RolloutEngine, "generate", lambda *a, **k: pytest.fail("sampled before checking"))
    with pytest.raises(TltError, match=message):
        warmup(loaded, TargetTokenTask(vocab_size=16), out, WarmupConfig(prompts=4, **settings),
               DrafterTrainConfig(**train), log=lambda line: None)


def test_a_drafter_save_killed_midway_leaves_the_previous_one_whole(tmp_path, monkeypatch):
    """`tlt drafter warmup --init DIR --out DIR` saves over the drafter it went on from: the files were written
    in place, so a save killed midway left drafter.safetensors cut short and the drafter was lost."""
    from pathlib import Path

    from tlt.drafter.trainer import DrafterTrainer

    loaded = _markov_loaded()
    drafter = EagleDrafter(loaded.model.config).attach(loaded.model)
    DrafterTrainer(drafter, None).save(tmp_path)
    before = {name: tensor.clone() for name, tensor in drafter.state_dict().items()}
    with torch.no_grad():
        drafter.fc.weight.add_(1.0)
    def killed(path, data):  # the weights' write (drafter.safetensors, CRC and all, is one payload)
        with open(path, "wb") as handle:
            handle.write(data[:100])  # the bytes written so far
        raise KeyboardInterrupt

    monkeypatch.setattr(Path, "write_bytes", killed)
    with pytest.raises(KeyboardInterrupt):
        DrafterTrainer(drafter, None).save(tmp_path)
    monkeypatch.undo()
    back = EagleDrafter.load(tmp_path, loaded.model)
    assert all(torch.equal(back.state_dict()[name], tensor) for name, tensor in before.items())
    assert DrafterTrainer.saved_state(tmp_path)["steps"] == 0
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".")) == []  # no partial file left


@pytest.mark.parametrize("flags,message", [(["--prompts", "1"], "at least 2 prompts"),
                                           (["--steps", "0"], "--steps must be >= 1"),
                                           (["--out", "FILE"], "is a file, not a directory"),
                                           (["--eval-prompts", "-1"], "--eval-prompts must be >= 0")])
def test_cli_warmup_refuses_bad_flags_before_loading_the_model(tmp_path, monkeypatch, capsys, flags, message):
    """They were checked only once the model had loaded (the default model's first load takes a minute)."""
    import tlt.models
    from tlt.cli import main

    (tmp_path / "FILE").write_text("x")
    flags = [str(tmp_path / "FILE") if flag == "FILE" else flag for flag in flags]
    monkeypatch.setattr(tlt.models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    out = [] if "--out" in flags else ["--out", str(tmp_path / "drafter")]
    assert main(["drafter", "warmup", *out, *flags]) == 2
    assert message in capsys.readouterr().err


def test_cli_warmup_refuses_a_dataset_smaller_than_its_prompts_before_loading_the_model(tmp_path, monkeypatch, capsys):
    """A 20-record dataset with the default --prompts 64 left τ's measurement no prompt: "no requests to generate",
    after the sampling, with a drafter already in --out (found by helper-24's adversarial pass)."""
    import json

    import tlt.models
    from tlt.cli import main

    data = tmp_path / "d20.jsonl"
    data.write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(20)))
    monkeypatch.setattr(tlt.models, "load_model", lambda *a, **k: pytest.fail("loaded the model first"))
    assert main(["drafter", "warmup", "--data", str(data), "--out", str(tmp_path / "d")]) == 2
    assert ("the dataset has 20 record(s); --prompts 64 and the 8 prompts that measure τ need 72: lower --prompts "
            "to at most 12") in capsys.readouterr().err
    assert not (tmp_path / "d").exists()
    data.write_text("".join(json.dumps({"question": f"{i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(9)))
    assert main(["drafter", "warmup", "--data", str(data), "--out", str(tmp_path / "d"), "--prompts", "2"]) == 2
    # no --prompts would do (it is at least 2): the advice was "lower --prompts to at most 1" (found by review)
    assert "the dataset has 9 record(s); a warm-up needs at least 10: 2 training prompts" in capsys.readouterr().err
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")
    assert main(["drafter", "warmup", "--out", str(model_dir)]) == 2
    assert "holds a config.json (a model's directory?)" in capsys.readouterr().err


def test_a_drafters_saved_optimizer_state_carries_its_moments_not_its_hyperparameters(tmp_path):
    """load_optimizer brought back the saved run's lr, betas and weight decay: run.drafter_lr was ignored when
    run.drafter held a warm-up's state (found by review). Moments of a drafter of another shape (torch matches
    by count only) loaded, and the first step failed after the sampling: refused at load."""
    model = markov_model(16, sharpness=1.5, seed=1)[0]
    old = DrafterTrainer(EagleDrafter(model.config).attach(model), FeatureBuffer(1000),
                         DrafterTrainConfig(lr=1e-4, betas=(0.8, 0.99), weight_decay=0.1))
    old.optimizer.step()  # (no gradients: state stays empty; give it moments)
    for param in old.drafter.parameters():
        old.optimizer.state[param] = {"step": torch.tensor(7.0), "exp_avg": torch.ones_like(param),
                                      "exp_avg_sq": torch.ones_like(param)}
    old.steps = 7
    old.save(tmp_path / "d")
    new = DrafterTrainer(EagleDrafter(model.config).attach(model), FeatureBuffer(1000), DrafterTrainConfig(lr=5e-3))
    new.load_optimizer(tmp_path / "d")
    group = new.optimizer.param_groups[0]
    assert (group["lr"], group["betas"], group["weight_decay"], new.steps) == (5e-3, (0.9, 0.95), 0.0, 7)
    assert torch.equal(new.optimizer.state[new.drafter.fc.weight]["exp_avg"], torch.ones_like(new.drafter.fc.weight))
    wide = markov_model(16, sharpness=1.5, seed=1)[0]
    wide.config.intermediate_size *= 2
    other = DrafterTrainer(EagleDrafter(wide.config), FeatureBuffer(1000))
    with pytest.raises(DrafterError, match="optimizer state does not fit the drafter .*exp_avg(_sq)? has shape"):
        other.load_optimizer(tmp_path / "d")


def test_held_out_scores_leave_the_training_feature_noise_out():
    """evaluate() added the training's feature noise to the held-out features (found by review)."""
    from tlt.drafter.buffer import FeatureEntry

    model = markov_model(16, sharpness=1.5, seed=1)[0]
    drafter = EagleDrafter(model.config).attach(model)
    entries = [FeatureEntry(torch.randint(0, 16, (12,)), torch.randn(12, model.config.hidden_size), 0)]
    clean = DrafterTrainer(drafter, FeatureBuffer(1000)).evaluate(entries)
    noisy = DrafterTrainer(drafter, FeatureBuffer(1000), DrafterTrainConfig(feature_noise=0.5)).evaluate(entries)
    assert noisy == clean
    with pytest.raises(ValueError, match="no feature entries"):  # a shape error from deep inside the drafter before
        DrafterTrainer(drafter, FeatureBuffer(1000)).evaluate([])


def test_a_drafter_whose_weights_lost_their_draft_vocabulary_is_refused(tmp_path):
    """It loaded as a full-vocabulary drafter: every draft index then named another token (found by review)."""
    from safetensors.torch import load_file, save_file

    model = markov_model(16, sharpness=1.5, seed=1)[0]
    EagleDrafter(model.config, draft_vocab=torch.arange(8)).save(tmp_path)
    weights = load_file(str(tmp_path / "drafter.safetensors"))
    del weights["draft_to_target"]
    save_file(weights, str(tmp_path / "drafter.safetensors"))
    with pytest.raises(DrafterError, match="its config has a draft vocabulary of 8 tokens, its weights none"):
        EagleDrafter.load(tmp_path, model)


def test_cli_warmup_takes_the_runs_task_from_its_config(tmp_path, monkeypatch):
    """--data read a file with the default field names and no system prompt: a drafter warmed for a run with a
    system prompt (or other fields, or an hf dataset) learned other prompts than the run's (found by review)."""
    import json

    import tlt.drafter.warmup
    from test_bad_input import model_dir
    from tlt.cli import main

    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"problem": f"{i} + 1?", "solution": str(i + 1)}) + "\n" for i in range(30)))
    config = tmp_path / "run.yaml"
    config.write_text(f"model:\n  path: {model_dir(tmp_path)}\ntask:\n  name: jsonl\n  path: {data}\n"
                      f"  prompt_field: problem\n  answer_field: solution\n  system_prompt: Be brief.\n"
                      f"  eval_size: 4\n")
    seen = {}
    monkeypatch.setattr(tlt.drafter.warmup, "warmup", lambda loaded, task, *a, **k: seen.update(task=task))
    assert main(["drafter", "warmup", "--config", str(config), "--out", str(tmp_path / "d"), "--prompts", "8"]) == 0
    task = seen["task"]
    assert task.system_prompt == "Be brief." and len(task.eval_examples) == 4
    drawn = {e.prompt for e in task.sample(26, seed=0)}
    assert drawn == {f"{i} + 1?" for i in range(26)}  # the run's training records, never its held-out ones
    assert main(["drafter", "warmup", "--config", str(config), "--data", str(data), "--out", str(tmp_path / "e")]) == 2


@pytest.mark.parametrize("arch,layer", [("llama", None), ("qwen2", None), ("qwen3", None), ("qwen3", "qwen3")])
def test_the_function_training_fits_is_the_one_serving_runs(arch, layer):
    """Spot training fits EagleDrafter.forward (the HF layer, packed rows restarting at position 0); speculative
    decoding runs EagleDrafter.step (the lean layer, the row's absolute positions, the fused serving copy). Both
    must compute one function, or training would improve another drafter than the one that serves. A Qwen3
    target's drafter has a Llama layer (head_dim 32: not hidden / heads), or Qwen3's in one saved before."""
    from conftest import tiny_model

    model = tiny_model(arch, **({"head_dim": 32} if arch == "qwen3" else {}))
    lean = LeanForward(model)
    torch.manual_seed(1)
    drafter = EagleDrafter(model.config, layer=layer).attach(lean)
    assert hasattr(drafter.layer.self_attn, "q_norm") == (layer == "qwen3")
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.05)  # not the initialization's symmetric weights
    length = 10
    tokens = torch.randint(4, 90, (1, length))
    features = torch.randn(1, length, model.config.hidden_size)
    positions = torch.arange(length)[None]
    trained = drafter(tokens, features, positions, torch.tril(torch.ones(length, length, dtype=torch.bool))[None])
    for serving in (drafter, drafter.inference_copy(lean)):
        rows = serving.new_cache(1, 64).rows(0, 1)
        with torch.no_grad():
            served = serving.step(tokens, features, rows, positions + 37)
        torch.testing.assert_close(served, trained.detach(), atol=1e-5, rtol=1e-5)


def test_ctrl_c_in_the_first_minute_of_a_warmup_keeps_its_steps(tmp_path, monkeypatch):
    """A warm-up saved on a timer only (SAVE_EVERY_S): Ctrl-C in its first minute kept nothing (found by review)."""
    from tlt.drafter.trainer import DrafterTrainer

    loaded, out, _ = _interrupted_warmup(tmp_path, monkeypatch, at_step=2, steps=100)
    assert DrafterTrainer.saved_state(out)["steps"] == 2
    assert EagleDrafter.load(out, loaded.model).draft_vocab_size == 12


def _first_step_moves(model, buffer, tmp_path=None, **config) -> list[float]:
    """How far each of a fresh trainer's (or one loaded from `tmp_path`) first 3 steps moves the weights (max |Δ|),
    from the same initial drafter and the same batches."""
    torch.manual_seed(4)
    trainer = DrafterTrainer(EagleDrafter(model.config).attach(model), copy.deepcopy(buffer),  # same batches
                             DrafterTrainConfig(lr=1e-3, row_length=16, seed=3, **config))
    if tmp_path is not None:
        trainer.load_optimizer(tmp_path)
    moves = []
    for _ in range(3):
        before = [p.detach().clone() for p in trainer.drafter.parameters()]
        trainer.train_steps(1)
        moves.append(max(float((p - b).abs().max()) for p, b in zip(trainer.drafter.parameters(), before)))
        assert trainer.optimizer.param_groups[0]["lr"] == 1e-3  # the ramp scales a step, never the group's lr
    return moves


def test_a_fresh_optimizer_ramps_its_lr_and_loaded_moments_do_not(setup, tmp_path):
    """AdamW's first update moves every weight by ~lr whatever its gradient: on a warmed drafter that kick cost
    held-out acceptance (benchmarks/drafter_adaptation.py). With warmup_steps=4 the first steps are 1/4, 2/4, 3/4
    of it; moments loaded from a drafter directory have had their first steps and carry on at the full lr."""
    model, buffer = setup
    plain = _first_step_moves(model, buffer)
    ramped = _first_step_moves(model, buffer, warmup_steps=4)
    assert ramped[0] == pytest.approx(plain[0] / 4, rel=1e-3)  # Adam's first step: lr * sign-like, scaled
    assert ramped[1] < plain[1] and ramped[2] < plain[2]
    saver = DrafterTrainer(EagleDrafter(model.config).attach(model), buffer, DrafterTrainConfig(row_length=16))
    saver.train_steps(5)
    saver.save(tmp_path)
    loaded_ramped = _first_step_moves(model, buffer, tmp_path, warmup_steps=4)
    loaded_plain = _first_step_moves(model, buffer, tmp_path)
    assert loaded_ramped == pytest.approx(loaded_plain, rel=1e-6)
