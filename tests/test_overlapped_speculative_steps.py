"""Speculative steps one step late (`ModelRunner._speculative_overlapped`, the graph path): step n + 1 launched from
step n's results on the device (each row's last token and committed length) before they reach the host. Same
samples as waiting for every step: greedy, T=1, top-k/top-p rows in one batch, target-only and q-sampling arms,
EOS stops and budgets inside accepted paths, rows admitted mid-rollout, a drafter swapped in mid-rollout; no
step starts past what a row's budget reserves; and a control that shows the comparison can fail."""

import pytest
import torch
from conftest import markov_model, oracle_drafter, random_prompts
from test_overlapped_steps import EOS, assert_same_samples
from test_q_sampling import noisy_drafter

from tlt.rollout import in_flight
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.graph_runner import GraphRunner
from tlt.rollout.policy import FixedSpeculation
from tlt.rollout.request import Request
from tlt.sampling import SamplingParams
from tlt.speculative.strategy import SpecStrategy

# budgets a few paths long: rows stop at them, inside accepted paths, as well as at EOS
SETTINGS = [SamplingParams(temperature=0, max_new_tokens=9), SamplingParams(temperature=1.0, max_new_tokens=40, seed=3),
            SamplingParams(temperature=0.7, top_k=4, max_new_tokens=7, seed=4),
            SamplingParams(temperature=1.3, top_p=0.9, max_new_tokens=33, seed=5)]
ARMS = [SpecStrategy(3, 2, 6), SpecStrategy.chain(4, "q"), SpecStrategy(3, 2, 10, "q")]


def rollout(overlap: bool, strategy: SpecStrategy, *, batch: int = 4, between_steps=None):
    """12 samples of mixed settings, `batch` rows at a time (rows admitted as others stop), every step
    speculative with `strategy` and a drafter that is often wrong (varied accepted lengths)."""
    model, _ = markov_model(32, sharpness=1.5, context=0.05)  # EOS (3) is one of 32 tokens
    engine = RolloutEngine(model, max_batch_size=batch, speculation=FixedSpeculation(strategy), max_tree_size=16,
                           eos_token_ids=[EOS])
    engine.runner = GraphRunner(engine.forward, capture=False)
    engine.set_drafter(noisy_drafter(model, 0.3), version=1)
    engine.model_runner.overlap_steps = overlap
    prompts = random_prompts([3, 6, 2, 5, 4, 7], vocab_size=32, seed=11)
    requests = [Request(p, n=2, params=SETTINGS[i % len(SETTINGS)]) for i, p in enumerate(prompts)]
    return engine, engine.generate(requests, between_steps=between_steps)


@pytest.mark.parametrize("strategy", ARMS, ids=str)
def test_overlapped_speculative_steps_sample_what_waiting_steps_sample(strategy):
    _, waited = rollout(False, strategy)
    engine, overlapped = rollout(True, strategy)
    assert engine.model_runner.overlapped_steps > 5
    assert_same_samples(overlapped, waited)
    # every landed token is counted once, to the call that landed it (the lag's end included)
    assert sum(s.new_tokens for s in overlapped.steps) == overlapped.generated_tokens
    assert sum(s.landed for s in overlapped.steps if s.mode == "sd") == len([s for s in overlapped.steps
                                                                             if s.mode == "sd"])
    hist = [sum(s.accepted_hist[d] for s in overlapped.steps if s.mode == "sd") for d in range(strategy.depth + 1)]
    assert sum(hist) == sum(s.batch_size for s in overlapped.steps if s.mode == "sd")  # each row-step once
    # τ counts the row-steps spent on rows that had stopped (the step after a stop): at most the waiting τ
    assert overlapped.speculation_summary()["tau"] <= waited.speculation_summary()["tau"]


def test_the_comparison_fails_when_a_step_starts_from_a_stale_token(monkeypatch):
    """Negative control: step n + 1 fed each row's first emitted token of step n instead of its last."""
    strategy = ARMS[0]
    _, waited = rollout(False, strategy)
    following = in_flight.SpeculativeInFlight.following

    def stale(self, longest):
        pending, start = following(self, longest)
        return self.packed[:, 0].long(), start

    monkeypatch.setattr(in_flight.SpeculativeInFlight, "following", stale)
    _, wrong = rollout(True, strategy)
    assert [s.token_ids for s in wrong.samples] != [s.token_ids for s in waited.samples]


def test_no_overlapped_speculative_step_starts_past_a_rows_budget(monkeypatch):
    """Each launch's committed lengths (the host's, or the device's when it follows a step in flight) leave
    the row's last budgeted token unfed, as a waiting step does: the cache reserves a tree past that and
    nothing more. A row near its budget ends the lag before a step could take it past."""
    launches = []
    launch = GraphRunner.launch_speculative

    def recording(self, decoder, cache, pending, settings, uniforms, strategy, after=None):
        committed = cache.lengths if after is None else after.committed
        launches.append((committed.clone(), after is not None))
        if after is not None:  # the span's bound: the longest row's length, at most one deepest path above it
            longest = int(committed.max())
            assert longest <= after.longest <= longest + strategy.depth + 1, (longest, after.longest)
        return launch(self, decoder, cache, pending, settings, uniforms, strategy, after)

    monkeypatch.setattr(GraphRunner, "launch_speculative", recording)
    limits = []
    launch_rows = in_flight.SpeculativeInFlight.__init__

    def keeping_limits(self, seqs, *args, **kwargs):
        limits.append([len(s.request.prompt_ids) + s.request.params.max_new_tokens for s in seqs])
        launch_rows(self, seqs, *args, **kwargs)

    monkeypatch.setattr(in_flight.SpeculativeInFlight, "__init__", keeping_limits)
    rollout(True, SpecStrategy.chain(4, "q"), batch=1)  # one row: long runs of overlapped steps (the bound once
    # grew by depth + 1 a step: found by review)
    assert len(launches) == len(limits) > 20 and any(follows for _, follows in launches)
    for (committed, _), row_limits in zip(launches, limits):
        assert all(int(length) <= limit - 2 for length, limit in zip(committed, row_limits))


def test_a_drafter_swapped_in_while_a_step_is_in_flight_is_rebuilt_as_when_waiting():
    """A hot swap between steps (the RL worker's `between_steps`): the step in flight drafted from the old
    drafter's state, so the next step starts from the host with the new drafter's state rebuilt from the
    cached features, as a waiting engine's does: same samples at T=1, and a rebuild counted."""
    model, _ = markov_model(32, sharpness=1.5, context=0.05)  # the model `rollout` builds
    swapped = noisy_drafter(model, 0.1, seed=5)
    strategy = SpecStrategy(3, 2, 10, "q")
    results = []
    for overlap in (False, True):
        calls = []
        results.append(rollout(overlap, strategy, between_steps=lambda e, calls=calls: swap_at(e, calls, swapped)))
    (_, waited), (engine, overlapped) = results
    assert engine.model_runner.overlapped_steps > 5
    assert_same_samples(overlapped, waited)
    assert {v for s in overlapped.samples for v in s.drafter_versions} == {1, 2}


def swap_at(engine, calls: list, drafter, step: int = 8) -> None:
    calls.append(None)
    if len(calls) == step:
        engine.set_drafter(drafter, version=2)


def test_an_oracle_drafter_overlaps_every_step_between_admissions():
    """With a drafter the target always accepts and no row stopping early, a single row's steps all overlap
    but its first and those near its budget."""
    model, _ = markov_model(16, sharpness=1.5)
    engine = RolloutEngine(model, max_batch_size=1, speculation=FixedSpeculation(SpecStrategy.chain(3)),
                           max_tree_size=16, eos_token_ids=[])
    engine.runner = GraphRunner(engine.forward, capture=False)
    engine.set_drafter(oracle_drafter(model), version=1)
    result = engine.generate([Request([5, 6], params=SamplingParams(temperature=0, max_new_tokens=41))])
    steps = [s for s in result.steps if s.kind == "decode"]
    assert len(result.samples[0].token_ids) == 41
    assert all(s.new_tokens == 4 for s in steps[1:-2])  # τ = depth + 1, one step late
    assert engine.model_runner.overlapped_steps >= len(steps) - 3
    assert torch.tensor([s.landed for s in steps]).sum() == len(steps)


def test_the_policy_times_only_calls_that_land_one_step_and_counts_every_token_once():
    """What the speculation policy observes of overlapped steps: a call that lands exactly one step is timed
    (its wall time is the cycle); the first call of a lag (lands none) and the one that ends it (two) are not;
    every landed token and row-step is observed once."""
    observed = []

    class Recording(FixedSpeculation):
        def observe(self, batch_size, arm, emitted_tokens, wall_s, verify_steps, *, timed=True):
            observed.append((arm, emitted_tokens, verify_steps, timed))

    model, _ = markov_model(32, sharpness=1.5, context=0.05)
    strategy = SpecStrategy.chain(4, "q")
    engine = RolloutEngine(model, max_batch_size=4, speculation=Recording(strategy), max_tree_size=16,
                           eos_token_ids=[EOS])
    engine.runner = GraphRunner(engine.forward, capture=False)
    engine.set_drafter(noisy_drafter(model, 0.3), version=1)
    prompts = random_prompts([3, 6, 2, 5, 4, 7], vocab_size=32, seed=11)
    result = engine.generate([Request(p, n=2, params=SETTINGS[i % len(SETTINGS)]) for i, p in enumerate(prompts)])
    sd = [s for s in result.steps if s.mode == "sd"]
    assert sum(tokens for _, tokens, _, _ in observed) == sum(s.new_tokens for s in sd)
    assert sum(rows for _, _, rows, _ in observed) == sum(s.batch_size for s in sd)  # each row-step once
    # timed: calls of one landed step (less those that built a graph or rebuilt a drafter state)
    timed = [(tokens, rows) for _, tokens, rows, timed in observed if timed]
    assert 0 < len(timed) <= sum(s.landed == 1 for s in sd)
    one_step = {(s.new_tokens, s.batch_size) for s in sd if s.landed == 1}
    assert set(timed) <= one_step
    assert len(observed) == len(sd)  # no drain apart: a lag ends within the call in which a row stops


def test_an_arm_tried_for_one_step_is_timed_when_its_step_is_drained():
    """A speculative step between plain ones (ε-exploration tries an arm so): its call launches it and lands
    nothing; the drain before the next step lands it, and the policy observes it there, timed, with the launch
    and the wait as its time (what a waiting step costs). Without that, such an arm was never timed."""
    observed = []

    class EveryOtherStep(FixedSpeculation):
        turn = 0

        def choose(self, batch_size):
            self.turn += 1
            return self.strategy if self.turn % 2 else "off"

        def observe(self, batch_size, arm, emitted_tokens, wall_s, verify_steps, *, timed=True):
            observed.append((arm, emitted_tokens, wall_s, verify_steps, timed))

    model, _ = markov_model(32, sharpness=1.5, context=0.05)
    engine = RolloutEngine(model, max_batch_size=4, speculation=EveryOtherStep(ARMS[0]), max_tree_size=16,
                           eos_token_ids=[EOS])
    engine.runner = GraphRunner(engine.forward, capture=False)
    engine.set_drafter(noisy_drafter(model, 0.3), version=1)
    prompts = random_prompts([3, 6, 2, 5], vocab_size=32, seed=11)
    result = engine.generate([Request(p, params=SETTINGS[i % len(SETTINGS)]) for i, p in enumerate(prompts)])
    sd = [s for s in result.steps if s.mode == "sd"]
    drained = [o for o in observed if o[0] == ARMS[0] and o[3] > 0]  # the SD steps' landings
    assert len(drained) == len(sd) > 5
    timed = [o for o in drained if o[4]]
    # (warm-ups count the plain steps' graph builds too: the bound is loose; the control, untimed drains, gives 0)
    assert len(timed) >= max(len(sd) - engine.model_runner.warmups, len(sd) // 2)
    assert all(wall > 0 for _, _, wall, _, _ in timed)
    assert sum(tokens for _, tokens, *_ in drained) == sum(s.new_tokens for s in sd)


def test_traces_hold_each_step_once_through_arm_switches_and_overlap_turned_off():
    """Every call's trace counts the steps whose tokens it holds (`landed`), drained ones included: an arm
    switch ending a run of overlapped steps once left two steps' tokens under landed=1 (found by review). And
    overlap turned off between steps drains through the engine: those tokens were appended but in no trace."""
    from tlt.rollout.policy import OFF

    class ThreeThenOff(FixedSpeculation):
        calls = 0

        def choose(self, batch_size):
            self.calls += 1
            return OFF if self.calls % 4 == 0 else self.strategy

    model, _ = markov_model(32, sharpness=1.5, context=0.05)
    engine = RolloutEngine(model, max_batch_size=1, speculation=ThreeThenOff(SpecStrategy.chain(3)), max_tree_size=16,
                           eos_token_ids=[])
    engine.runner = GraphRunner(engine.forward, capture=False)
    engine.set_drafter(oracle_drafter(model), version=1)

    def overlap_off_at_the_ninth_call(e, calls=[]):
        calls.append(None)
        e.model_runner.overlap_steps = len(calls) < 9

    result = engine.generate([Request([5, 6], params=SamplingParams(temperature=1.0, max_new_tokens=60, seed=1))],
                             between_steps=overlap_off_at_the_ninth_call)
    sd = [s for s in result.steps if s.mode == "sd"]
    assert sum(s.landed for s in sd) == len(sd)
    assert sum(s.new_tokens for s in result.steps) == result.generated_tokens == 60
    for s in sd:  # an oracle drafter: every row-step emits depth + 1 tokens, budget allowing
        assert s.new_tokens <= 4 * s.landed and sum(s.accepted_hist) == s.landed
