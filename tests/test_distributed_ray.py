"""The same step on Ray: two worker processes, gloo all-reduce, spot training, hot-swap, a killed worker."""

import json
import threading

import pytest

ray = pytest.importorskip("ray")

import conftest  # noqa: E402
import test_distributed  # noqa: E402
from test_distributed import assert_spot_training_ends_at_the_barrier, make_controller  # noqa: E402
from tlt.distributed.backends import WorkerError  # noqa: E402
from tlt.rl.checkpoint import latest_checkpoint  # noqa: E402
from tlt.rl.run import train  # noqa: E402

# Worker processes cannot import the tests directory: ship these modules' classes by value.
ray.cloudpickle.register_pickle_by_value(conftest)
ray.cloudpickle.register_pickle_by_value(test_distributed)


@pytest.fixture(scope="module", autouse=True)
def ray_cluster():
    if ray.is_initialized():  # a `tlt train` test earlier in this process started its own
        ray.shutdown()
    ray.init(num_cpus=2, include_dashboard=False, logging_level="ERROR")
    yield
    ray.shutdown()


def ray_controller(tmp_path, **overrides):
    return make_controller(tmp_path, **{"run.backend": "ray", **overrides})


def test_two_ray_workers_spot_train_hot_swap_and_stay_identical(tmp_path):
    controller = ray_controller(tmp_path)
    try:
        before = controller.parameter_digests()
        metrics = controller.train_step()
        after = controller.parameter_digests()
    finally:
        controller.close()
    assert after[0] == after[1] != before[0]
    kinds = {w["worker"]: {i["kind"] for i in w["intervals"]} for w in controller.last_timeline["workers"]}
    assert "spot_train" in kinds[0] and "rollout_sd" in kinds[1]
    assert metrics["spot_train_steps"] > 0
    assert all(count > 1 for count in metrics["drafter_versions_per_sample"][4:])
    assert_spot_training_ends_at_the_barrier(controller.last_timeline)


def test_a_killed_worker_is_a_clear_error_and_resume_loses_no_step(tmp_path):
    run = tmp_path / "run"
    first = ray_controller(run, **{"run.steps": 1})
    train(first.config, trainer=first)
    first.close()

    doomed = ray_controller(run, **{"run.steps": 2, "rollout.max_new_tokens": 240})
    killer = threading.Timer(0.4, doomed.backend.kill_worker, args=(1,))
    killer.start()
    with pytest.raises(WorkerError, match="worker 1 failed.*--resume"):
        doomed.train_step()
    killer.join()
    doomed.close()

    resumed = ray_controller(run, **{"run.steps": 2})
    try:
        train(resumed.config, resume=True, trainer=resumed)
    finally:
        resumed.close()
    steps = [json.loads(line)["step"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert (latest_checkpoint(run) / "drafter.safetensors").exists()
