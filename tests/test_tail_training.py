"""Tail training: a lone worker trains its drafter beside its own rollout's long tail, on the rollout's features."""

import threading
import time

import pytest
import torch

from conftest import random_prompts, tiny_model
from test_distributed import make_controller
from tlt.drafter.buffer import FeatureBuffer
from tlt.drafter.tail_trainer import TailTrainer
from tlt.drafter.trainer import DrafterTrainConfig, DrafterTrainer
from tlt.errors import RequestError
from tlt.models.eagle import EagleDrafter
from tlt.rl.actor import PackedSamples, actor_hidden
from tlt.rl.config import ConfigError, load_config
from tlt.rollout.engine import RolloutEngine
from tlt.rollout.policy import FixedSpeculation
from tlt.rollout.request import Request, in_long_tail
from tlt.sampling import SamplingParams
from tlt.speculative.strategy import SpecStrategy


def collected_rollout(model, speculation, max_batch_size=3, collect=None):
    """A rollout with mixed sampling settings, more samples than rows (rows are reused) and EOS; returns the
    samples and every (tokens, features) pair the engine handed out, in order (also to `collect`, if given)."""
    torch.manual_seed(0)  # the untrained drafter: the same in every call
    engine = RolloutEngine(model, max_batch_size=max_batch_size, drafter=EagleDrafter(model.config),
                           speculation=speculation)
    params = [SamplingParams(temperature=0, max_new_tokens=12), SamplingParams(temperature=1.0, max_new_tokens=20,
              seed=1), SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=9, seed=2)]
    requests = [Request(p, n=2, params=params[i % 3]) for i, p in enumerate(random_prompts([4, 7, 2, 5], vocab_size=12))]
    handed = []

    def hand(tokens, features):
        handed.append((tokens.clone(), features.clone()))
        if collect is not None:
            collect(tokens, features)
    result = engine.generate(requests, collect_features=hand)
    return result.samples, handed


@pytest.mark.parametrize("speculation", [None, SpecStrategy.chain(3), SpecStrategy(3, 2, 6),
                                         SpecStrategy.chain(3, "q")], ids=["plain", "chain", "tree", "q-chain"])
def test_collected_features_are_the_policys_hidden_states(speculation):
    model = tiny_model("llama", vocab_size=12)  # small vocabulary: EOS comes early, inside speculated blocks too
    samples, handed = collected_rollout(model, speculation and FixedSpeculation(speculation, gate=8))
    assert len(handed) == len(samples) == 8
    by_tokens = {}
    for tokens, features in handed:
        by_tokens.setdefault(tuple(tokens.tolist()), []).append(features)
    stopped = 0
    for sample in samples:
        expected_tokens = [sample.prompt_ids[-1]] + sample.token_ids[:-1]
        features = by_tokens[tuple(expected_tokens)].pop()  # each sample handed exactly once
        packed = PackedSamples.build([list(sample.prompt_ids)], [sample.token_ids], 0)
        with torch.no_grad():
            hidden = actor_hidden(model, packed)[0]
        start = len(sample.prompt_ids) - 1
        reference = hidden[start:start + len(expected_tokens)]
        assert features.shape == reference.shape
        assert torch.allclose(features, reference, atol=1e-4), (features - reference).abs().max()
        stopped += sample.finish_reason == "stop"
    assert stopped > 0 and all(not rest for rest in by_tokens.values())


def test_collected_features_of_a_wrong_row_would_be_caught():
    """Negative control: the comparison above fails for features of another sample (same length)."""
    model = tiny_model("llama", vocab_size=12)
    samples, handed = collected_rollout(model, None)
    first, second = samples[0], next(s for s in samples[1:] if s.prompt_ids != samples[0].prompt_ids)
    packed = PackedSamples.build([list(second.prompt_ids)], [second.token_ids], 0)
    with torch.no_grad():
        hidden = actor_hidden(model, packed)[0]
    start = len(second.prompt_ids) - 1
    wrong = next(f for t, f in handed if t.tolist() == [first.prompt_ids[-1]] + first.token_ids[:-1])
    width = min(len(wrong), hidden.shape[0] - start)
    assert not torch.allclose(wrong[:width], hidden[start:start + width], atol=1e-4)


def test_collecting_features_needs_a_drafter():
    engine = RolloutEngine(tiny_model("llama"), max_batch_size=2)
    with pytest.raises(RequestError, match="collect_features needs an engine with a drafter"):
        engine.generate([Request([5, 6], params=SamplingParams(max_new_tokens=4))], collect_features=lambda t, f: None)


def test_the_long_tail_starts_when_nothing_waits_and_few_rows_run():
    assert in_long_tail(running=4, waiting=0, peak=16) and not in_long_tail(running=5, waiting=0, peak=16)
    assert not in_long_tail(running=1, waiting=3, peak=16)  # samples still queued: the batch refills
    assert in_long_tail(running=1, waiting=0, peak=2) and not in_long_tail(running=0, waiting=0, peak=8)


# -- the trainer thread ------------------------------------------------------------------------------------------

def tail_trainer(publish=None, publish_every=2):
    model = tiny_model("llama")
    drafter = EagleDrafter(model.config).attach(model)
    buffer = FeatureBuffer(100_000)
    trainer = DrafterTrainer(drafter, buffer, DrafterTrainConfig(entries_per_step=2, row_length=16))
    versions = []

    def default_publish(final):
        versions.append(("final" if final else "v", trainer.steps))
        return len(versions) - 1
    return TailTrainer(trainer, publish or default_publish, publish_every=publish_every, device="cpu"), versions


def feed(collect, count=4, length=12, hidden=64):
    generator = torch.Generator().manual_seed(0)
    for _ in range(count):
        collect(torch.randint(4, 90, (length,), generator=generator), torch.randn(length, hidden, generator=generator))


def test_tail_trainer_trains_on_collected_features_publishes_and_stops_on_request():
    tail, versions = tail_trainer()
    feed(tail.collect(step=3))
    tail.start()
    deadline = threading.Event()
    while tail.trainer.steps < 5 and not deadline.wait(0.01):
        pass
    report = tail.stop()
    assert not tail.running and report.error is None
    assert report.trained_steps == tail.trainer.steps >= 5
    assert versions[-1] == ("final", report.trained_steps)  # the last publish carries every step
    assert report.published == list(range(len(versions))) and len(versions) >= 2
    assert tail.buffer.steps() == [3] and report.started_s <= report.stop_asked_s <= report.ended_s
    assert report.stop_s == report.ended_s - report.stop_asked_s  # the wait for the last micro-step and publish


def test_tail_trainer_stopped_before_any_feature_trains_nothing_and_keeps_late_features():
    tail, versions = tail_trainer()
    tail.start()
    report = tail.stop()
    assert report.trained_steps == 0 and versions == [] and report.published == []
    feed(tail.collect(step=0), count=2)
    assert tail.stop().started_s is None  # never started: the queued features still reach the buffer
    assert len(tail.buffer) == 2


def test_the_tail_loads_its_starting_state_on_its_own_thread_before_it_trains():
    """The worker's `_spot_state` (the latest version and optimizer state into the training copy: copies to the
    device) ran in the decode loop when the tail began; it is `start(prepare=...)`'s now, on the trainer's
    thread, first."""
    tail, _ = tail_trainer()
    feed(tail.collect(step=1))
    seen = []
    tail.start(prepare=lambda: seen.append((threading.current_thread().name, tail.trainer.steps)))
    while tail.trainer.steps < 1 and tail.running:
        time.sleep(0.01)
    report = tail.stop()
    assert seen == [("tlt-tail-trainer", 0)] and report.error is None and report.trained_steps >= 1
    tail.start()  # a later tail without one: nothing left from the last
    assert tail._prepare is None
    tail.stop()


def test_features_queued_after_the_threads_last_drain_reach_the_buffer_at_stop():
    """The longest samples finish last, often after the training thread last looked at its queue: stop() drains
    what is left (it did only for a tail that never started; on CUDA they then waited through the update)."""
    tail, _ = tail_trainer()
    gate = threading.Event()
    tail.start(prepare=gate.wait)  # the thread is busy until the gate opens
    feed(tail.collect(step=4), count=3)
    threading.Timer(0.2, gate.set).start()
    report = tail.stop()  # the thread sees the stop as soon as its prepare returns, before any drain
    assert report.error is None and report.trained_steps == 0
    assert len(tail.buffer) == 3 and tail.buffer.steps() == [4]


def test_a_failing_prepare_trains_nothing_and_releases_the_rollout():
    def broken():
        raise RuntimeError("no version on the hub")
    tail, versions = tail_trainer()
    feed(tail.collect(step=0))
    tail.start(prepare=broken)
    tail._thread.join(timeout=60)
    report = tail.stop()
    assert report.error == "RuntimeError: no version on the hub"
    assert report.trained_steps == 0 and versions == [] and tail.trainer.steps == 0


def test_a_failing_tail_trainer_reports_the_error_and_releases_the_rollout():
    def broken(final):
        raise RuntimeError("hub is gone")
    tail, _ = tail_trainer(publish=broken, publish_every=1)
    feed(tail.collect(step=0))
    tail.start()
    tail._thread.join(timeout=60)  # it ends by itself: the error ends its loop
    report = tail.stop()
    assert report.error == "RuntimeError: hub is gone" and report.trained_steps >= 1
    assert report.stop_s == 0.0  # it had ended before the rollout asked it to stop


# -- a lone worker ------------------------------------------------------------------------------------------------

def test_one_worker_trains_its_drafter_in_its_own_tail_and_swaps_it_in(tmp_path):
    controller = make_controller(tmp_path, **{"run.workers": 1, "run.tail_training": "on",
                                              "rollout.max_new_tokens": 240})
    # Equal-work replay lengths shape the tail exactly: 6 samples of 12 tokens, then 2 of 240 decode alone.
    lengths = [12] * 6 + [240] * 2
    try:
        first = controller.train_step(lengths=lengths)
        second = controller.train_step(lengths=lengths)
        timeline = controller.last_timeline
    finally:
        controller.close()
    for metrics in (first, second):
        assert metrics["spot_train_errors"] == 0 and metrics["workers"] == 1
        # the short samples' features arrive as they finish; training starts in the tail and publishes
        assert metrics["spot_train_steps"] > 0 and metrics["drafter_versions"] and metrics["tail_train_share"] > 0
        assert 0 < metrics["tail_stop_s"] < metrics["tail_train_share"] * metrics["step_s"]
    assert second["drafter_version"] > first["drafter_version"] >= 1
    # the long samples were served by versions trained while they decoded
    assert first["samples_hot_swapped"] + second["samples_hot_swapped"] > 0
    overlays = timeline["workers"][0]["overlays"]
    assert [o["kind"] for o in overlays] == ["tail_train"]
    update_start = min(i["start"] for i in timeline["workers"][0]["intervals"] if i["kind"] == "update")
    assert overlays[0]["end"] <= update_start  # the thread stops with the rollout, before the update


def test_one_worker_without_a_drafter_needs_tail_training():
    with pytest.raises(ConfigError, match="with one worker run.tail_training auto or on"):
        load_config(None, ["run.workers=1", "run.speculative=adaptive", "run.tail_training=off"])
    for value in ("auto", "on"):  # auto: on, on every device
        config = load_config(None, ["run.workers=1", "run.speculative=adaptive", f"run.tail_training={value}"])
        assert config.run.tail_training == value
    with pytest.raises(ConfigError, match="run.tail_training must be one of auto, on, off"):
        load_config(None, ["run.tail_training=yes"])


@pytest.mark.parametrize("speculation", [None, SpecStrategy.chain(3)], ids=["plain", "chain"])
def test_the_tail_trainers_callback_keeps_each_samples_features_while_rows_are_reused(speculation):
    """TailTrainer.collect moved the tensors with .to("cpu"): on a CPU fp32 engine, views of the cache rows,
    which the engine gave to the next admitted samples before the training thread read them; 4 of 8 samples
    were stored with other samples' features (found by review). The queue must hold copies."""
    model = tiny_model("llama", vocab_size=12)
    trainer = DrafterTrainer(EagleDrafter(model.config).attach(model), FeatureBuffer(100_000))
    tail = TailTrainer(trainer, lambda final: 0, publish_every=1, device="cpu")
    _, handed = collected_rollout(model, speculation and FixedSpeculation(speculation, gate=8),
                                  collect=tail.collect(step=0))
    tail.stop()  # never started: drains what was queued into the buffer
    stored = list(tail.buffer.entries)
    assert len(stored) == len(handed) == 8
    for entry, (tokens, features) in zip(stored, handed):
        assert torch.equal(entry.tokens, tokens) and torch.equal(entry.features, features)


def test_a_cuda_tail_shortens_the_gil_switch_interval_while_it_trains_and_restores_it(caplog):
    """The decode loop needs the GIL back within a fraction of its ~2-3 ms step: while a CUDA tail trains, the
    switch interval is CUDA_SWITCH_INTERVAL_S, restored at stop() (also when the thread failed: here, no CUDA
    on this machine). A CPU tail leaves it alone."""
    import sys

    from tlt.drafter.tail_trainer import CUDA_SWITCH_INTERVAL_S

    before = sys.getswitchinterval()
    tail, _ = tail_trainer()
    tail.start()
    assert sys.getswitchinterval() == before
    tail.stop()
    tail.device = torch.device("cuda")
    tail.start()
    try:
        assert sys.getswitchinterval() == CUDA_SWITCH_INTERVAL_S
    finally:
        report = tail.stop()
    assert sys.getswitchinterval() == before
    if not torch.cuda.is_available():
        assert report.error is not None  # the side stream needs CUDA: the thread failed, the interval came back
