"""Workers, spot training on the idle worker, mid-rollout drafter hot-swap, identical replicas — in-process."""

import threading

import pytest
import torch

from conftest import markov_model
from tlt.distributed.backends import WorkerError
from tlt.distributed.controller import DistributedGRPO
from tlt.models import LoadedModel, ModelSpec
from tlt.rl.config import load_config
from tlt.rl.rewards import Reward
from tlt.tasks.example import TaskExample
from tlt.tasks.synthetic import IdTokenizer

EOS, STOPPER, RUNNER = 3, 5, 7  # after STOPPER the model ends at once; after anything else it never ends


class ShortLongTask:
    """The first half of the prompts end in STOPPER (1-token responses), the rest run to max_new_tokens: with
    2 workers, worker 0 gets the short shard and sits idle while worker 1 decodes the long one."""

    def sample(self, count, seed):
        return [TaskExample(f"p{i}", "x", {"ids": [9, 10, STOPPER if i < count // 2 else RUNNER]})
                for i in range(count)]

    def prompt_ids(self, example):
        return example.meta["ids"]


def long_tail_model():
    model, transition = markov_model(16, sharpness=2.0, seed=1)
    with torch.no_grad():
        logits = transition.clone()
        logits[:, EOS] = -30.0
        logits[STOPPER, :] = -30.0
        logits[STOPPER, EOS] = 30.0
        model.lm_head.weight.copy_(logits.t() / 16 ** 0.5)
    return model


def make_controller(tmp_path, model=None, **overrides):
    model = long_tail_model() if model is None else model
    loaded = LoadedModel(model, IdTokenizer(eos_token_id=EOS), ModelSpec.from_config(model.config), "markov")
    settings = {"rollout.prompts_per_step": 4, "rollout.samples_per_prompt": 2, "rollout.max_new_tokens": 160,
                "optim.lr": 1e-3, "run.workers": 2, "run.backend": "inprocess", "run.speculative": "static",
                "run.strategy": "S3K1N3", "run.gate": 64, "run.publish_every": 2, "run.swap_poll_s": 0.0,
                "run.out_dir": str(tmp_path), "run.tensorboard": False,
                # 8 samples a step: the gate's held-out entries would leave too few to train on (tests of the
                # gate: test_publish_gate.py)
                "run.publish_gate": False, **overrides}
    config = load_config(None, [f"{k}={v}" for k, v in settings.items()])
    return DistributedGRPO(config, loaded=loaded, task=ShortLongTask(), reward=Reward(share_of_eights))


def share_of_eights(completion, example):
    tokens = completion.split()
    return sum(t == "8" for t in tokens) / len(tokens)


def test_idle_worker_trains_the_drafter_and_the_long_worker_swaps_it_in(tmp_path):
    controller = make_controller(tmp_path)
    try:
        metrics = controller.train_step()
        timeline = controller.last_timeline
        history = controller.backend.hub.history()
        state = controller.backend.hub.trainer_state()
        served = [sample.drafter_versions for sample in controller.last_rollout.samples]
    finally:
        controller.close()
    # a session's end publishes no second version of the weights its last chunk published (found by review),
    # and the hub still gets the trainer's state for the next session
    steps = [(entry["worker"], entry["trainer_steps"]) for entry in history[1:]]
    assert len(steps) == len(set(steps)) and state["steps"] == history[-1]["trainer_steps"]
    kinds = {w["worker"]: [i["kind"] for i in w["intervals"]] for w in timeline["workers"]}
    assert "spot_train" in kinds[0] and "spot_train" not in kinds[1]
    assert "rollout_sd" in kinds[1]
    assert metrics["spot_train_steps"] > 0 and metrics["drafter_versions"]
    # the untrained version 0 serves no step; the long shard's samples (of prompts 2 and 3) that outlived the
    # first trained version were served by several (one that ended before it: by none)
    assert all(0 not in versions for versions in served), served
    long_samples = metrics["drafter_versions_per_sample"][4:]
    assert max(long_samples) > 1, long_samples
    assert metrics["samples_hot_swapped"] == sum(count > 1 for count in long_samples)


def test_spot_training_adds_no_step_time_beyond_the_stop_latency(tmp_path):
    controller = make_controller(tmp_path)
    try:
        controller.train_step()
        timeline = controller.last_timeline
    finally:
        controller.close()
    assert_spot_training_ends_at_the_barrier(timeline)


def assert_spot_training_ends_at_the_barrier(timeline):
    """Spot training (worker 0) ends when the long worker (1) is ready for the update: no added step time."""
    by_worker = {w["worker"]: w["intervals"] for w in timeline["workers"]}
    tail_ready = max(i["end"] for i in by_worker[1] if i["kind"] == "logprobs")  # the step's critical path
    spot_end = max(i["end"] for i in by_worker[0] if i["kind"] == "spot_train")
    own_update = min(i["start"] for i in by_worker[0] if i["kind"] == "update")
    # ordering, not wall-clock thresholds (the stop latency is measured in benchmarks/spot_training.py): the
    # trainer used the whole tail (it stopped only once the long worker was ready) and stopped before its update
    assert tail_ready <= spot_end <= own_update


def test_policy_replicas_are_identical_after_every_update(tmp_path):
    controller = make_controller(tmp_path)
    try:
        before = controller.parameter_digests()
        for _ in range(2):
            controller.train_step()
            after = controller.parameter_digests()
            assert after[0] == after[1]
            assert after[0] != before[0]
            before = after
    finally:
        controller.close()


def test_spot_training_failure_keeps_the_last_good_drafter(tmp_path, monkeypatch):
    from tlt.drafter.trainer import DrafterTrainer

    def broken(self, stop=None):
        raise RuntimeError("injected drafter failure")

    monkeypatch.setattr(DrafterTrainer, "_step", broken)
    controller = make_controller(tmp_path)
    try:
        metrics = controller.train_step()
    finally:
        controller.close()
    assert metrics["spot_train_errors"] == 1
    assert metrics["drafter_versions"] == [] and metrics["drafter_version"] == 0
    assert metrics["sd/sd_step_share"] == 0  # version 0 never trained: it serves no step (τ ≈ 1 costs time)


def test_fewer_prompts_than_workers_is_an_error(tmp_path):
    from tlt.errors import TltError

    with pytest.raises(TltError, match="prompts_per_step"):
        make_controller(tmp_path, **{"rollout.prompts_per_step": 1})


def test_tail_time_share_counts_time_when_few_rows_are_left():
    from tlt.metrics.step import tail_time_share
    from tlt.rollout.request import StepTrace

    def trace(batches):  # one decode step per second with these batch sizes
        return [StepTrace("decode", b, b, 1.0, start_s=float(i)) for i, b in enumerate(batches)]

    # worker 0: 4 rows for 2 s; worker 1: 4 rows for 2 s, then 1 row for 6 s -> peak 8, tail (<= 2 rows) 6 of 8 s
    share = tail_time_share([(0.0, trace([4, 4])), (0.0, trace([4, 4, 1, 1, 1, 1, 1, 1]))])
    assert share == pytest.approx(6 / 8)
    assert tail_time_share([(0.0, trace([4, 4])), (0.0, trace([4, 4]))]) == 0.0
    # a peak of 3: the last row is the tail, as the engine's tail training sees it (in_long_tail), not no tail
    assert tail_time_share([(0.0, trace([3, 3, 1, 1]))]) == pytest.approx(2 / 4)


def test_hub_versions_features_and_the_trainer_lease():
    from tlt.distributed.hub import DrafterHub
    from tlt.drafter.buffer import FeatureEntry

    hub = DrafterHub(max_feature_tokens=10)
    assert hub.latest() == (-1, None)
    assert hub.publish({"w": torch.zeros(1)}, step=0, worker=0, trainer_steps=0) == 0
    assert hub.publish({"w": torch.ones(1)}, step=0, worker=1, trainer_steps=5) == 1
    assert hub.latest()[0] == 1 and [h["worker"] for h in hub.history()] == [0, 1]
    entry = FeatureEntry(torch.arange(4), torch.zeros(4, 2), 0)
    hub.add_features([entry, entry, entry])  # 12 tokens > 10: the oldest is evicted
    sequence, entries = hub.features_since(0)
    assert sequence == 3 and len(entries) == 2
    assert hub.features_since(sequence) == (3, [])
    assert not hub.acquire_trainer(0, 0)  # no step running
    hub.begin_step(0)
    assert hub.acquire_trainer(0, 1) and not hub.acquire_trainer(0, 0)  # one spot trainer per step
    assert not hub.should_stop(0)
    hub.stop(0)
    assert hub.should_stop(0)


def test_hot_swapping_drafters_every_step_keeps_greedy_output_identical():
    from conftest import random_prompts, tiny_model
    from tlt.models.eagle import EagleDrafter
    from tlt.rollout.engine import RolloutEngine
    from tlt.rollout.request import Request
    from tlt.sampling import SamplingParams
    from tlt.speculative.strategy import SpecStrategy

    model = tiny_model("llama")
    params = SamplingParams(temperature=0, max_new_tokens=24, stop_token_ids=())
    requests = [Request(p, params=params) for p in random_prompts([5, 9, 3])]
    plain = RolloutEngine(model).generate(requests)
    drafters = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        drafters.append(EagleDrafter(model.config))
    engine = RolloutEngine(model, drafter=drafters[0], speculation=SpecStrategy(3, 2, 6))
    calls = []

    def swap(engine):  # a new version before every decode step, alternating weights
        calls.append(len(calls))
        engine.set_drafter(drafters[len(calls) % 2], version=len(calls))

    swapped = engine.generate(requests, between_steps=swap)
    assert [s.token_ids for s in swapped.samples] == [s.token_ids for s in plain.samples]
    assert all(len(s.drafter_versions) > 3 for s in swapped.samples)


def test_a_warmed_drafter_starts_spot_training_with_its_optimizer_state(tmp_path):
    from tlt.drafter.buffer import FeatureBuffer
    from tlt.drafter.trainer import DrafterTrainer
    from tlt.models.eagle import EagleDrafter

    model = long_tail_model()
    drafter = EagleDrafter(model.config).attach(model)
    buffer = FeatureBuffer(1000)
    buffer.add(torch.randint(4, 16, (12,)), torch.randn(12, 16), 0)
    trainer = DrafterTrainer(drafter, buffer)
    trainer.train_steps(3)
    trainer.save(tmp_path / "drafter")
    controller = make_controller(tmp_path / "run", **{"run.drafter": str(tmp_path / "drafter")})
    try:
        state = controller.backend.hub.trainer_state()
        assert state is not None and state["steps"] == 3
        metrics = controller.train_step()
    finally:
        controller.close()
    assert metrics["spot_train_steps"] > 0


def test_a_steps_samples_do_not_depend_on_how_its_prompts_are_sharded(tmp_path):
    """Each worker numbered its prompts from 0, and a sample's random stream came from that number: worker r's
    k-th prompt drew worker 0's k-th stream, so one prompt on two workers got identical samples and run.workers
    (operational on --resume) changed the run (found by review). Speculation off: exact equality."""
    runs = {}
    for workers in (1, 2, 4):
        controller = make_controller(tmp_path / str(workers), **{"run.workers": workers, "run.speculative": "off"})
        try:
            controller.train_step()
            runs[workers] = [s.token_ids for s in controller.last_rollout.samples]
        finally:
            controller.close()
    assert runs[1] == runs[2] == runs[4]


@pytest.mark.parametrize("phase", ["rollout", "update"])
def test_a_worker_failing_mid_step_ends_the_step_at_once_naming_it(tmp_path, phase):
    """Found by review: a failed update left rank 0 in the gradient sum for 30 minutes, and the error then named
    rank 0 (BrokenBarrierError); a failed rollout while another worker spot-trained never ended: its spot
    training ran on, and closing the workers waited for it."""
    import time

    controller = make_controller(tmp_path)
    worker = controller.backend.workers[1]

    def boom(*args, **kwargs):
        if phase == "rollout":
            time.sleep(0.5)  # worker 0 finishes first and starts spot training
        raise RuntimeError(f"boom in {phase}")

    setattr(worker, phase, boom)
    started = time.perf_counter()
    closed = threading.Event()
    try:
        with pytest.raises(WorkerError, match=f"worker 1 failed during {phase} of RL step 1 .*boom in {phase}") as info:
            controller.train_step()
        assert "out of memory" not in str(info.value)  # the control of the test below
    finally:
        closer = threading.Thread(target=lambda: (controller.close(), closed.set()), daemon=True)
        closer.start()
        closer.join(60)
    assert closed.is_set(), "closing the workers hung"
    assert time.perf_counter() - started < 60


def test_a_failed_checkpoint_names_the_step_it_was_saving(tmp_path):
    """The step counter has moved on when a completed step is saved: a worker failing then was reported as
    failing "during save of RL step 2" while step 1 was being saved (found by QA)."""
    controller = make_controller(tmp_path)
    try:
        controller.train_step()

        def boom(*args, **kwargs):
            raise RuntimeError("disk gone")

        controller.backend.workers[1].speculation_state = boom
        with pytest.raises(WorkerError, match="worker 1 failed during save of RL step 1 .*disk gone"):
            controller.save(tmp_path / "run")
    finally:
        controller.close()


def test_a_dead_hub_actor_is_one_error_naming_the_hub(monkeypatch):
    """kill -9 of the Ray DrafterHub mid-step printed ~90 lines of Ray traceback, or blamed a worker (QA)."""
    ray = pytest.importorskip("ray")
    from tlt.distributed.hub import HubTimeout
    from tlt.distributed.worker import HubClient

    class Method:
        def remote(self, *args, **kwargs):
            return "an object ref"

    class DeadActor:
        latest_version = Method()

    def dead(ref, timeout=None):
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(ray, "get", dead)
    with pytest.raises(HubTimeout, match=r"the drafter hub \(a Ray actor\) died during latest_version\(\)"):
        HubClient(DeadActor()).latest_version()


def test_a_failing_worker_is_reported_even_when_the_hub_fails_too(tmp_path):
    """Stopping spot training after a worker failed called the hub, whose own error (dead with the worker)
    replaced the worker's (QA)."""
    controller = make_controller(tmp_path)
    worker = controller.backend.workers[1]

    def boom(*args, **kwargs):
        raise RuntimeError("boom in rollout")

    def hub_gone(*args, **kwargs):
        raise RuntimeError("hub gone")

    worker.rollout = boom
    controller.backend.hub.stop = hub_gone
    try:
        with pytest.raises(WorkerError, match="worker 1 failed during rollout of RL step 1 .*boom in rollout"):
            controller.train_step()
    finally:
        controller.close()


def test_a_worker_out_of_memory_is_told_what_needs_less(tmp_path):
    """A CLI trial's 8k-token prompt failed its update with the CPU allocator's message only: the error now names
    the settings that lower a step's memory (the allocators' messages and torch's OutOfMemoryError alike)."""
    from tlt.distributed.controller import _memory_hint

    controller = make_controller(tmp_path)

    def allocation_fails(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:124] . DefaultCPUAllocator: can't allocate memory: "
                           "you tried to allocate 25769803776 bytes. Error code 12 (Cannot allocate memory)")

    controller.backend.workers[1].update = allocation_fails
    try:
        with pytest.raises(WorkerError, match="during update .*can't allocate memory.* — out of memory: "
                                              "optim.grad_checkpointing=true"):
            controller.train_step()
    finally:
        controller.close()
    assert _memory_hint(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")) != ""
    assert _memory_hint(MemoryError()) != ""
    assert _memory_hint(RuntimeError("shape mismatch")) == ""


def test_each_workers_bandit_state_survives_a_resume(tmp_path):
    """Only rank 0's speculation policy state was checkpointed, and every worker resumed with it: the long-tail
    worker lost what its bandit had learned (found by review)."""
    adaptive = {"run.speculative": "adaptive", "run.gate": 64}
    controller = make_controller(tmp_path / "a", **adaptive)
    try:
        controller.train_step()
        before = [controller._call(r, "speculation_state") for r in range(2)]
        checkpoint = controller.save(tmp_path / "a")
    finally:
        controller.close()
    assert before[0] != before[1]  # the workers saw different batch sizes
    resumed = make_controller(tmp_path / "b", **adaptive)
    try:
        resumed.resume(checkpoint)
        assert [resumed._call(r, "speculation_state") for r in range(2)] == before
    finally:
        resumed.close()


def test_a_rank_the_checkpoint_never_had_borrows_rank_0s_bandit_but_not_its_totals(tmp_path):
    """Resumed with more workers (run.workers is operational), a new rank starts from rank 0's bandit state; its
    per-arm totals, which the step sums over workers, counted rank 0's history twice (found by review)."""
    from tlt.models.eagle import EagleDrafter

    EagleDrafter(long_tail_model().config).save(tmp_path / "drafter")
    settings = {"run.speculative": "adaptive", "run.gate": 64, "run.drafter": str(tmp_path / "drafter"),
                "run.tail_training": "off", "run.spot_training": False}
    lone = make_controller(tmp_path / "a", **settings, **{"run.workers": 1})
    try:
        lone.train_step()
        before = lone._call(0, "speculation_state")
        checkpoint = lone.save(tmp_path / "a")
    finally:
        lone.close()
    assert before["bandit"]["stats"]  # rank 0 has totals to borrow
    more = make_controller(tmp_path / "b", **settings)
    try:
        more.resume(checkpoint)
        states = [more._call(r, "speculation_state") for r in range(2)]
    finally:
        more.close()
    assert states[0] == before
    assert states[1]["bandit"]["stats"] == [] and states[1]["bandit"]["trials"] == before["bandit"]["trials"]


def test_data_parallel_workers_announce_the_gate_once(tmp_path, monkeypatch, caplog):
    """Every worker measures (or reads) the same cost curve and reaches the same verdict: rank 0 says it."""
    from test_cost_curve import synthetic
    from tlt.rl import replica

    monkeypatch.setattr(replica, "curve_for", lambda engine, arms: synthetic({a.name: [3.0] for a in arms}, (1,)))
    with caplog.at_level("INFO", logger="tlt.rl.replica"):
        controller = make_controller(tmp_path, **{"run.gate": "auto", "run.speculative": "adaptive"})
        controller.close()
    verdicts = [r for r in caplog.records if "no speculation arm is expected to pay" in r.getMessage()]
    assert len(verdicts) == 1


@pytest.mark.parametrize("workers,spot_training,collects", [(2, True, True), (2, False, False), (1, False, False),
                                                             (1, True, False)])  # one worker: nobody idle to train
def test_features_are_collected_only_when_idle_workers_train_on_them(tmp_path, workers, spot_training, collects):
    """A lone worker without tail training (or spot training off) copied every sample's features to the hub for
    nothing: the spot-training benchmark's frozen mode did that work and its spot mode did not (found by review)."""
    from tlt.models.eagle import EagleDrafter

    model = long_tail_model()
    EagleDrafter(model.config).attach(model).save(tmp_path / "drafter")
    controller = make_controller(tmp_path / "run", **{"run.drafter": str(tmp_path / "drafter"),
                                                       "run.workers": workers, "run.spot_training": spot_training,
                                                       "run.tail_training": "off", "rollout.max_new_tokens": 24})
    try:
        controller.train_step()
        hub = controller.backend.hub
        assert all((w.features is not None) == collects for w in controller.backend.workers)
        assert (hub.features_since(0)[1] != []) == collects
    finally:
        controller.close()


def test_host_work_between_decode_steps_is_rollout_time_not_idle():
    """A hot-swap or the tail trainer's start between decode steps, and its stop after the last one, are the
    rollout's work: inferred as idle gaps they inflated idle_fraction (found by review)."""
    from types import SimpleNamespace

    from tlt.metrics.timeline import WorkerTimeline, merge_step, time_shares
    from tlt.rollout.request import StepTrace

    steps = [StepTrace("decode", 4, 4, 1.0, start_s=0.0), StepTrace("decode", 4, 4, 1.0, start_s=1.2),  # swap
             StepTrace("decode", 1, 3, 0.5, start_s=2.2, mode="sd"), StepTrace("decode", 1, 1, 0.5, start_s=2.7)]
    timeline = WorkerTimeline(0)
    timeline.add_rollout(SimpleNamespace(steps=steps), wall_start=100.0, wall_end=103.5)  # tail stop: 0.3 s
    timeline.record("update", 103.5, 104.0)
    merged = merge_step(1, [timeline], 100.0, 104.0)
    assert [i["kind"] for i in merged["workers"][0]["intervals"]] == ["rollout", "rollout_sd", "rollout", "update"]
    shares = time_shares(merged)
    assert shares["idle"] == 0.0 and shares["rollout"] + shares["rollout_sd"] == pytest.approx(3.5 / 4)


def test_spot_training_takes_turns_with_collecting_its_shards_features(tmp_path, monkeypatch):
    """An idle worker collected all its shard's features before its first drafter step: a window about as long
    as the collection (2 CPU cores: the default demo's every step) trained nothing. It now trains between
    micro-batches. Here the window closes once the idle worker has collected 2 of its 4 micro-batches."""
    from tlt.distributed.hub import DrafterHub

    controller = make_controller(tmp_path, **{"optim.micro_batch_size": 1, "rollout.prompts_per_step": 4,
                                              "rollout.samples_per_prompt": 2})
    workers = controller.backend.workers
    original = DrafterHub.should_stop

    def closes_midway(hub, step):
        halfway = any(w._batch is not None and (w._batch.features_done or 0) >= 2 for w in workers)
        return original(hub, step) or halfway

    monkeypatch.setattr(DrafterHub, "should_stop", closes_midway)
    try:
        metrics = controller.train_step()
    finally:
        controller.close()
    assert metrics["spot_train_steps"] >= 2 and metrics["drafter_versions"]  # trained (and published) meanwhile


def test_spot_training_starts_on_the_features_earlier_steps_left_in_the_hub(tmp_path, monkeypatch):
    """From the second step on, the hub holds the features of earlier updates: the idle worker trains on them
    before it collects its own shard's (collecting first left no drafter step in the CPU demo's 1-2 s windows).
    In the first step there are none: it collects first."""
    from tlt.drafter.trainer import DrafterTrainer
    from tlt.rl import phases

    events = []
    collect, train = phases.collect_features, DrafterTrainer.train_until

    def recording_collect(*args, **kwargs):
        if "limit" in kwargs:  # spot training's turns (the update's forward collects through other code)
            events.append((controller.step, "collect"))
        return collect(*args, **kwargs)

    def recording_train(trainer, *args, **kwargs):
        events.append((controller.step, "train"))
        return train(trainer, *args, **kwargs)

    monkeypatch.setattr(phases, "collect_features", recording_collect)
    monkeypatch.setattr(DrafterTrainer, "train_until", recording_train)
    controller = make_controller(tmp_path)
    try:
        for _ in range(2):
            controller.train_step()
    finally:
        controller.close()
    first = {step: next(kind for s, kind in events if s == step) for step in (0, 1)}
    assert first == {0: "collect", 1: "train"}, events


@pytest.mark.parametrize("workers,threads,expected", [(1, 1, 1), (2, 1, 2), (1, 0, None)])
def test_in_process_workers_use_their_thread_budget(tmp_path, workers, threads, expected):
    """run.threads_per_worker was a Ray worker's only: the in-process backend (the CPU default since one worker
    became it) left torch's pool as it found it (found by review). Threads share the process's one pool."""
    import os

    torch.set_num_threads(1 if expected is None else 3)  # not what the run asks for
    controller = make_controller(tmp_path, **{"run.workers": workers, "run.threads_per_worker": threads,
                                              "run.speculative": "off"})
    try:
        assert torch.get_num_threads() == (expected or os.cpu_count())  # 0: cores // workers, per worker
    finally:
        controller.close()


def test_in_process_workers_freeze_what_they_built_until_the_backend_shuts_down(tmp_path):
    """A full garbage collection walked ~370,000 objects (~200 ms) after every update: the objects alive once
    the workers are built are frozen out of it, and thawed when the backend shuts down (a later run in the same
    process may collect them)."""
    import gc

    gc.unfreeze()
    controller = make_controller(tmp_path, **{"run.workers": 2, "run.speculative": "off"})
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        worker = controller.backend.workers[0]
        assert not any(obj is worker for obj in gc.get_objects())  # frozen objects are not tracked per generation
        controller.train_step()
        assert gc.get_freeze_count() <= frozen  # a step freezes nothing (refcounting may free frozen objects)
    finally:
        controller.close()
    assert gc.get_freeze_count() == 0


def test_ray_start_up_leaves_tlts_signal_handlers_in_place():
    """ray.init puts its own SIGTERM handler (sys.exit) in place of the CLI's, so a multi-worker run stopped by a
    scheduler exited 15 without saying what it saved (found by review). The start-up keeps the handlers (SIGTERM
    and SIGINT) as they were."""
    import signal

    from tlt.distributed.backends import _keeping_signal_handlers

    def tlts(signum, frame):
        raise AssertionError("not called here")

    before = {signum: signal.signal(signum, tlts) for signum in (signal.SIGTERM, signal.SIGINT)}
    try:
        with _keeping_signal_handlers():
            for signum in before:
                signal.signal(signum, lambda signum, frame: None)  # as ray.init does
        assert all(signal.getsignal(signum) is tlts for signum in before)
    finally:
        for signum, handler in before.items():
            signal.signal(signum, handler)


def test_a_spot_session_takes_this_runs_drafter_lr_and_leaves_the_hubs_saved_state_alone(tmp_path):
    """A session after a resume trained at the saved run's lr whatever run.drafter_lr said (the optimizer state
    was loaded without this run's hyperparameters), and in-process the hub's saved state was the live Adam
    moments, moving on with every later step (found by review)."""
    import copy

    controller = make_controller(tmp_path, **{"run.drafter_lr": 1e-4})
    try:
        controller.train_step()
        hub, worker = controller.backend.hub, controller.backend.workers[0]
        saved = copy.deepcopy(hub.trainer_state())
        for group in saved["optimizer"]["param_groups"]:
            group["lr"] = 1e-3  # as an earlier run with another run.drafter_lr saved it
        hub.keep_trainer_state(saved)
        _, trainer, _ = worker._spot_state()
        assert {group["lr"] for group in trainer.optimizer.param_groups} == {1e-4}
        moments = [state["exp_avg"] for state in trainer.optimizer.state.values()]
        kept = [state["exp_avg"] for state in hub.trainer_state()["optimizer"]["state"].values()]
        assert moments and not any(m.data_ptr() == k.data_ptr() for m in moments for k in kept)
    finally:
        controller.close()


def test_only_a_warmed_drafters_fresh_optimizer_ramps_its_lr(tmp_path):
    """AdamW's first steps kick every weight by ~lr: what a warmed drafter loses acceptance to, a random one
    nothing (run.drafter_lr_ramp)."""
    controller = make_controller(tmp_path, **{"run.drafter_lr_ramp": 7, "run.drafter_unroll": 2})
    try:
        hub, worker = controller.backend.hub, controller.backend.workers[0]
        version, weights = hub.latest()
        assert not hub.is_trained(version)  # no run.drafter: it starts untrained
        assert worker._spot_objects()[1].config.warmup_steps == 0
        assert worker._spot_objects()[1].config.unroll == 2  # the run's setting reaches spot and tail training
        hub.restore(version, weights, None, trained=True)  # as a run given a warmed drafter starts
        worker._spot = None
        assert worker._spot_objects()[1].config.warmup_steps == 7
    finally:
        controller.close()


def test_a_long_wait_for_workers_says_what_it_waits_for(tmp_path, monkeypatch, caplog):
    """A worker that hung (alive, stuck) left the driver silent for up to CALL_TIMEOUT_S, two hours (QA): every
    STILL_WAITING_S without an answer, the wait says which calls it waits for; the step then completes."""
    import time

    from tlt.distributed import controller as controller_module
    from tlt.distributed.worker import RolloutWorker

    original = RolloutWorker.rollout

    def slow(self, *args):
        if self.rank == 1:
            time.sleep(0.6)
        return original(self, *args)

    monkeypatch.setattr(RolloutWorker, "rollout", slow)
    monkeypatch.setattr(controller_module, "STILL_WAITING_S", 0.2)
    monkeypatch.setattr(controller_module, "STALL_CHECK_S", 0.1)
    controller = make_controller(tmp_path)
    try:
        with caplog.at_level("WARNING", logger="tlt.distributed.controller"):
            controller.train_step()
    finally:
        controller.close()
    assert "RL step 1: still waiting for rollout on worker 1" in caplog.text


def test_a_long_wait_for_one_worker_says_so_too(tmp_path, monkeypatch, caplog):
    """One worker's call (the checkpoint's save) was waited for without a word: a worker stopped mid-save
    (SIGSTOP) left the driver silent for two hours (found by a trial). It belongs to the step just completed."""
    import time

    from tlt.distributed import controller as controller_module
    from tlt.distributed.worker import RolloutWorker

    original = RolloutWorker.save

    def slow(self, *args):
        time.sleep(0.6)
        return original(self, *args)

    monkeypatch.setattr(RolloutWorker, "save", slow)
    monkeypatch.setattr(controller_module, "STILL_WAITING_S", 0.2)
    monkeypatch.setattr(controller_module, "STALL_CHECK_S", 0.1)
    controller = make_controller(tmp_path, **{"rollout.max_new_tokens": 8})
    try:
        controller.train_step()
        with caplog.at_level("WARNING", logger="tlt.distributed.controller"):
            assert controller.save(tmp_path / "run")
    finally:
        controller.close()
    assert "RL step 1: still waiting for save on worker 0" in caplog.text


@pytest.mark.parametrize("hangs", [True, False], ids=["hangs", "slow-but-decoding"])
def test_a_rollout_that_stops_decoding_ends_the_step(tmp_path, monkeypatch, hangs):
    """A worker that hangs mid-rollout (alive) was waited for up to CALL_TIMEOUT_S, two hours (QA): a rolling-out
    worker says every DECODING_SAID_EVERY_S that it decodes, and one silent for STALL_S ends the step, naming it.
    Control: a rollout slower in all than STALL_S, but decoding all along, completes."""
    import threading
    import time

    from tlt.distributed import controller as controller_module
    from tlt.distributed import worker as worker_module
    from tlt.distributed.worker import RolloutWorker

    released, original = threading.Event(), RolloutWorker._between_steps
    steps = {0: 0, 1: 0}

    def between_steps(self, engine):
        steps[self.rank] += 1
        if self.rank == 1 and steps[1] == 3 and hangs:
            released.wait(timeout=60)  # stuck (bounded: the test itself never hangs)
        elif self.rank == 1:
            time.sleep(0.02)
        return original(self, engine)

    monkeypatch.setattr(RolloutWorker, "_between_steps", between_steps)
    monkeypatch.setattr(worker_module, "DECODING_SAID_EVERY_S", 0.0)
    monkeypatch.setattr(controller_module, "STALL_S", 0.5)
    monkeypatch.setattr(controller_module, "STALL_CHECK_S", 0.1)
    controller = make_controller(tmp_path, **{"rollout.max_new_tokens": 48, "run.speculative": "off"})
    started = time.monotonic()
    try:
        if hangs:
            with pytest.raises(WorkerError, match=r"worker 1 has decoded nothing for \d+ min during the rollout of "
                                                  r"RL step 1: it hangs; nothing of this step was saved"):
                controller.train_step()
            assert time.monotonic() - started < 30
        else:
            controller.train_step()
            assert steps[1] * 0.02 > 0.5  # the rollout took longer than STALL_S in all
    finally:
        released.set()
        controller.close()
