"""Plain steps one step late (`ModelRunner.overlap_steps`, the graph path): step n + 1 launched from step n's
tokens on the device before they reach the host. Same samples as waiting for every step, through EOS stops,
budgets, admissions mid-rollout, mixed settings and speculative steps in between; no slot past a row's budget."""

import pytest
import torch
from conftest import markov_model, oracle_drafter, random_prompts

from tlt.rollout import in_flight
from tlt.rollout import model_runner as model_runner_module
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.graph_runner import GraphRunner
from tlt.rollout.policy import FixedSpeculation
from tlt.rollout.request import Request
from tlt.sampling import SamplingParams
from tlt.speculative.strategy import SpecStrategy

EOS = 3
SETTINGS = [SamplingParams(temperature=0, max_new_tokens=14), SamplingParams(temperature=1.0, max_new_tokens=23, seed=3),
            SamplingParams(temperature=0.7, top_k=4, max_new_tokens=9, seed=4),
            SamplingParams(temperature=1.3, top_p=0.9, max_new_tokens=31, seed=5)]


class SpeculatingFrom(FixedSpeculation):
    """Plain decode steps, then SD at step `first` and every third step after, whatever the batch size: the same
    steps in both modes (the overlapped engine retires a stopped row one step later, so a policy reading the batch
    size, or a row admitted then, would see other steps: other samples, as lossless)."""

    def __init__(self, strategy, first: int):
        super().__init__(strategy, gate=64)
        self.first, self.turn = first, 0

    def choose(self, batch_size):
        self.turn += 1
        return self.strategy if self.turn >= self.first and (self.turn - self.first) % 3 == 0 else None


def rollout(overlap: bool, sd_from: int | None = None):
    """12 samples of mixed settings. Plain: batch 4, rows admitted as others stop. sd_from: every row at once,
    SD steps from that step on."""
    model, _ = markov_model(16, sharpness=1.5, context=0.05)  # EOS (3) is one of 16 tokens: rows stop early
    speculation = None if sd_from is None else SpeculatingFrom(SpecStrategy(3, 2, 6), sd_from)
    engine = RolloutEngine(model, max_batch_size=4 if sd_from is None else 12, speculation=speculation,
                           max_tree_size=16, eos_token_ids=[EOS])
    engine.runner = GraphRunner(engine.forward, capture=False)
    if sd_from is not None:
        engine.set_drafter(oracle_drafter(model), version=1)  # recorded in each sample an SD step served
    engine.model_runner.overlap_steps = overlap
    prompts = random_prompts([3, 6, 2, 5, 4, 7], vocab_size=16, seed=11)
    requests = [Request(p, n=2, params=SETTINGS[i % len(SETTINGS)]) for i, p in enumerate(prompts)]
    return engine, engine.generate(requests)


def assert_same_samples(a, b):
    assert [s.token_ids for s in a.samples] == [s.token_ids for s in b.samples]
    assert [s.finish_reason for s in a.samples] == [s.finish_reason for s in b.samples]
    assert [s.drafter_versions for s in a.samples] == [s.drafter_versions for s in b.samples]
    for x, y in zip(a.samples, b.samples):
        assert x.logprobs == pytest.approx(y.logprobs, abs=1e-5)
    assert {s.finish_reason for s in a.samples} == {"stop", "length"}  # EOS stops (a dropped token each), budgets


def test_overlapped_plain_steps_sample_what_waiting_steps_sample():
    _, waited = rollout(False)
    engine, overlapped = rollout(True)
    assert engine.model_runner.overlapped_steps > 10
    assert_same_samples(overlapped, waited)
    # the steps' tokens are the tokens that landed (a stopped row's dropped extra one is not counted)
    assert sum(s.new_tokens for s in overlapped.steps) == overlapped.generated_tokens


def test_an_sd_step_after_an_overlapped_one_runs_no_row_that_stopped_in_it(monkeypatch):
    """The first SD step comes right after the plain step in which a row stops (found from a plain run): the
    overlapped engine learns of the stop only when it drains that plain step before the SD step. The stopped
    rows are retired first and the chosen arm then serves the rest, as a waiting engine does: no SD step runs a
    stopped row (it once took a whole row-step for nothing and lowered the arm's τ: found by review), the
    policy is asked once per step, and the samples are the waiting engine's."""
    _, plain = rollout(False, sd_from=10**9)
    stops = sorted({len(s.token_ids) - 1 for s in plain.samples if s.finish_reason == "stop"})
    served_stopped, held = [], []
    speculative_step = model_runner_module.ModelRunner.speculative_step
    decode = RolloutEngine._decode

    def recording(self, running, strategy, **kwargs):
        served_stopped.append(sum(s.finish_reason is not None for s in running))
        return speculative_step(self, running, strategy, **kwargs)

    def noting_held_arms(self, running, steps):
        decode(self, running, steps)
        held.append(self._held_arm is not None)

    monkeypatch.setattr(model_runner_module.ModelRunner, "speculative_step", recording)
    monkeypatch.setattr(RolloutEngine, "_decode", noting_held_arms)
    # The first stop whose plain step was still in flight when the SD step came (not drained at once because a
    # row stopped in the step before it, or a budget ended)
    for stop in (step for step in stops if step >= 2):
        held.clear()
        engine, overlapped = rollout(True, sd_from=stop + 1)
        if any(held):
            break
    else:
        pytest.fail(f"no stop among {stops} met an SD step while in flight")
    assert engine.model_runner.overlapped_steps > 0 and not any(served_stopped)
    _, waited = rollout(False, sd_from=stop + 1)
    assert_same_samples(overlapped, waited)


def test_the_comparison_fails_when_a_step_reads_stale_tokens(monkeypatch):
    """Negative control: launching step n + 1 from the host's tokens (step n - 1's, while n is in flight)."""
    _, waited = rollout(False)
    launch = model_runner_module.ModelRunner._launch_decode
    monkeypatch.setattr(model_runner_module.ModelRunner, "_launch_decode",
                        lambda self, running, previous: launch(self, running, None))
    _, stale = rollout(True)
    assert [s.token_ids for s in stale.samples] != [s.token_ids for s in waited.samples]


def test_no_overlapped_step_writes_past_a_rows_budget(monkeypatch):
    """The slot a launched step writes for each row stays inside what the row's prompt and budget reserve (the
    cache has nothing past it): a row whose next step is its last ends the lag before another is launched."""
    written = []
    decode = GraphRunner.decode

    def recording(self, ids, cache, *args, **kwargs):
        written.append(cache.lengths.clone())
        return decode(self, ids, cache, *args, **kwargs)

    monkeypatch.setattr(GraphRunner, "decode", recording)
    launched = []
    launch = model_runner_module.ModelRunner._launch_decode

    def keeping_rows(self, running, previous):
        launched.append([len(s.request.prompt_ids) + s.request.params.max_new_tokens for s in running])
        return launch(self, running, previous)

    monkeypatch.setattr(model_runner_module.ModelRunner, "_launch_decode", keeping_rows)
    engine, result = rollout(True)
    assert len(written) == len(launched) > 20
    for slots, limits in zip(written, launched):
        # feeding response token j writes slot prompt + j - 1; the last token fed is the budget's second-to-last
        assert all(int(slot) <= limit - 2 for slot, limit in zip(slots, limits))
    assert any(int(slot) == limit - 2 for slots, limits in zip(written, launched) for slot, limit in zip(slots, limits))


def test_a_row_that_stopped_takes_no_token_from_the_step_after():
    from tlt.rollout.sequence import Sequence

    seqs = [Sequence(index, 0, Request([1, 2], params=SamplingParams(max_new_tokens=4)), frozenset({7}),
                     torch.Generator()) for index in range(2)]
    seqs[1].finish_reason = "stop"  # stopped at the step before: the overlapped step's token is dropped
    host = torch.tensor([[5.0, -0.5], [7.0, -1.5]], dtype=torch.float64)
    in_flight.land_plain(in_flight.InFlight(seqs, host, host, None))
    assert seqs[0].tokens == [5] and seqs[0].logprobs == [-0.5] and seqs[1].tokens == []


@pytest.mark.parametrize("trained", [True, False], ids=["trained-drafter", "untrained-drafter"])
def test_plain_steps_overlap_below_the_gate_too_and_the_policy_times_each_step_once(trained):
    """Below its gate the adaptive policy weighs SD against plain steps by their times. Plain steps there once
    waited for their tokens while SD steps overlapped, which hid the host's work from SD's times only (found by
    review); both overlap now, an arm switch drains the step in flight first, and that step is timed as its
    launch plus the wait. Every landed plain token is observed once; timed observations are of one step each.
    Also while the drafter is untrained (no SD step at all)."""
    from tlt.rollout.policy import OFF, AdaptiveSpeculation, BatchSizeGate

    observed = []

    class Recording(AdaptiveSpeculation):
        def observe(self, batch_size, arm, emitted_tokens, wall_s, verify_steps=None, *, timed=True):
            observed.append((batch_size, arm, emitted_tokens, verify_steps, timed))
            super().observe(batch_size, arm, emitted_tokens, wall_s, verify_steps, timed=timed)

    model, _ = markov_model(16, sharpness=1.5, context=0.05)
    policy = Recording([SpecStrategy(3, 2, 6)], gate=BatchSizeGate(threshold=5))
    engine = RolloutEngine(model, max_batch_size=12, speculation=policy, max_tree_size=16, eos_token_ids=[EOS])
    engine.runner = GraphRunner(engine.forward, capture=False)
    engine.set_drafter(oracle_drafter(model), trained=trained)
    prompts = random_prompts([3, 6, 2, 5, 4, 7], vocab_size=16, seed=11)
    result = engine.generate([Request(p, n=2, params=SETTINGS[i % len(SETTINGS)]) for i, p in enumerate(prompts)])
    decode = [s for s in result.steps if s.kind == "decode"]
    assert sum(s.new_tokens for s in result.steps) == result.generated_tokens
    assert engine.model_runner.overlapped_steps > 0
    assert any(s.mode == "plain" and s.batch_size <= 5 and s.landed == 1 for s in decode)  # overlapped there
    plain = [o for o in observed if o[1] == OFF]
    assert sum(tokens for _, _, tokens, _, _ in plain) == sum(s.new_tokens for s in decode if s.mode == "plain")
    assert all(rows == batch for batch, arm, _, rows, timed in observed if timed)  # one step each
    assert any(arm != OFF for _, arm, *_ in observed) == trained
    # each plain step below the gate counted once in the arm's totals (a call that landed none once counted too)
    assert policy.bandit.stats[OFF].steps == sum(1 for s in decode if s.mode == "plain" and s.batch_size <= 5)
