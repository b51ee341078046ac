"""Placement: how many workers, on which devices, how much GPU each Ray actor asks for, which collective; the
`run.workers`/`run.gpus_per_worker` config; bounded waits. All on CPU: GPUs are told to the planner, or faked."""

import math
import re
import time

import pytest

from tlt.distributed.placement import Placement, PlacementError, check_ray_resources, plan, resolve
from tlt.rl.config import ConfigError, load_config
from tlt.rl.config_checks import tail_training_active

SHARES = (1.0, 0.5, 0.34)


def expected_workers(workers, gpus, share):
    """The rule, written independently of the planner: None when it cannot be placed."""
    if gpus == 0:
        return 1 if workers == "auto" else workers  # one worker per device: the CPU is one
    per_gpu = int(1 / share + 1e-9)  # 1, 2, 2 (0.34: three would need 1.02 GPUs)
    count = gpus * per_gpu if workers == "auto" else workers
    return count if count <= gpus * per_gpu else None


@pytest.mark.parametrize("gpus", [0, 1, 2, 4])
@pytest.mark.parametrize("workers", ["auto", 1, 2, 3])
@pytest.mark.parametrize("share", SHARES)
@pytest.mark.parametrize("backend", ["auto", "ray", "inprocess"])
def test_plan_on_every_machine(gpus, workers, share, backend):
    device = "cuda" if gpus else "cpu"
    want = expected_workers(workers, gpus, share)
    if want is None:
        with pytest.raises(PlacementError, match="run.workers=.*run.gpus_per_worker") as caught:
            plan(workers, device=device, gpus=gpus, gpus_per_worker=share, backend=backend, ray_installed=True)
        assert_suggestions_fit(str(caught.value), gpus, backend)
        return
    placed = plan(workers, device=device, gpus=gpus, gpus_per_worker=share, backend=backend, ray_installed=True)
    assert placed.workers == want and len(placed.devices) == want
    assert placed.backend == (("ray" if want > 1 else "inprocess") if backend == "auto" else backend)
    if gpus == 0:
        assert placed.devices == ("cpu",) * want and placed.gpus_per_worker == 0
        assert placed.collective == ("none" if want == 1 else "gloo" if placed.backend == "ray" else "threads")
        return
    assert placed.gpus_per_worker == share and placed.gpus == min(gpus, want)
    if placed.backend == "ray":  # Ray picks each actor's GPU; the actor sees it as `cuda`
        assert placed.devices == ("cuda",) * want
        assert want * share <= gpus + 1e-9
        # NCCL only when every worker holds a whole GPU of its own; fractional actors may share one: gloo
        assert placed.collective == ("none" if want == 1 else "nccl" if share == 1 else "gloo")
    else:
        counts = [placed.devices.count(f"cuda:{g}") for g in range(gpus)]
        assert sum(counts) == want and max(counts) <= int(1 / share + 1e-9)  # never more per GPU than asked
        assert max(counts) - min(counts) <= 1  # spread evenly
        assert placed.collective == ("none" if want == 1 else "threads")


def assert_suggestions_fit(message, gpus, backend):
    """Both ways out the error names do place the workers."""
    asked = int(re.search(r"run\.workers=(\d+) with", message).group(1))
    fewer = int(re.search(r"set run\.workers=(\d+)", message).group(1))
    plan(fewer, device="cuda", gpus=gpus, gpus_per_worker=float(re.search(
        r"run\.gpus_per_worker=([\d.]+) needs", message).group(1)), backend=backend, ray_installed=True)
    share = float(re.search(r"or run\.gpus_per_worker=([\d.]+) to put", message).group(1))
    assert plan(asked, device="cuda", gpus=gpus, gpus_per_worker=share, backend=backend,
                ray_installed=True).workers == asked


def test_one_gpu_defaults_to_one_worker_and_refuses_a_second_without_a_fraction():
    placed = plan("auto", device="cuda", gpus=1, ray_installed=True)
    assert (placed.workers, placed.backend, placed.devices, placed.collective) == (1, "inprocess", ("cuda:0",), "none")
    with pytest.raises(PlacementError, match="run.workers=2 .* this machine has 1 GPU.*set run.workers=1 .*"
                                             "run.gpus_per_worker=0.5 to put 2 workers on each GPU"):
        plan(2, device="cuda", gpus=1, backend="inprocess")
    packed = plan(2, device="cuda", gpus=1, gpus_per_worker=0.5, backend="inprocess")
    assert packed.devices == ("cuda:0", "cuda:0")  # asked for: two replicas share the GPU
    assert plan("auto", device="cuda", gpus=1, gpus_per_worker=0.5, ray_installed=True).workers == 2


def test_cpu_is_one_worker_and_ignores_the_gpu_share():
    assert plan("auto", device="cpu", gpus=0, ray_installed=True) == plan(1, device="cpu", gpus=0)
    assert plan("auto", device="cpu", gpus=0).backend == "inprocess" and plan(1, device="cpu", gpus=0).workers == 1
    assert plan(2, device="cpu", gpus=0, ray_installed=True).backend == "ray"
    assert plan(2, device="cpu", gpus=0, ray_installed=False).backend == "inprocess"
    assert plan("auto", device="cpu", gpus=4, gpus_per_worker=0.25).gpus_per_worker == 0  # model.device=cpu on GPUs
    assert plan(5, device="cpu", gpus=0).workers == 5


def test_auto_never_asks_for_more_workers_than_prompts():
    assert plan("auto", device="cuda", gpus=4, at_most=1).workers == 1
    assert plan("auto", device="cuda", gpus=4, at_most=2).workers == 2
    assert plan(3, device="cpu", gpus=0, at_most=1).workers == 3  # explicit: the controller names the conflict


def test_a_pinned_gpu_holds_every_in_process_worker_and_is_refused_on_ray():
    placed = plan("auto", device="cuda:1", gpus=2, ray_installed=True)
    assert (placed.workers, placed.backend, placed.devices) == (1, "inprocess", ("cuda:1",))
    assert plan(2, device="cuda:1", gpus=2, gpus_per_worker=0.5).devices == ("cuda:1", "cuda:1")
    with pytest.raises(PlacementError, match="model.device=cuda:1 is one device"):
        plan(2, device="cuda:1", gpus=2)
    with pytest.raises(PlacementError, match="pins one GPU.*run.backend=inprocess"):
        plan(2, device="cuda:1", gpus=2, gpus_per_worker=0.5, backend="ray")
    with pytest.raises(PlacementError, match="has 2 GPU"):
        plan(1, device="cuda:2", gpus=2)


@pytest.mark.parametrize("kwargs,expected", [
    ({"workers": 1, "device": "cuda", "gpus": 0}, "no CUDA GPU is visible.*model.device=cpu"),
    ({"workers": 0, "device": "cpu", "gpus": 0}, "run.workers must be an integer >= 1 \\(or auto\\)"),
    ({"workers": "two", "device": "cpu", "gpus": 0}, "run.workers must be"),
    ({"workers": 1, "device": "cpu", "gpus": 0, "gpus_per_worker": 0}, "run.gpus_per_worker must be in \\(0, 1\\]"),
    ({"workers": 1, "device": "cpu", "gpus": 0, "gpus_per_worker": 2}, "run.gpus_per_worker must be in"),
    ({"workers": 1, "device": "cpu", "gpus": 0, "backend": "mpi"}, "run.backend must be one of")])
def test_bad_requests_are_one_clear_error(kwargs, expected):
    workers = kwargs.pop("workers")
    with pytest.raises(PlacementError, match=expected):
        plan(workers, **kwargs)


def test_other_accelerators_are_one_device():
    placed = plan("auto", device="mps", gpus=0, ray_installed=True)
    assert (placed.workers, placed.devices, placed.gpus_per_worker) == (1, ("mps",), 0.0)
    with pytest.raises(PlacementError, match="model.device=mps is one device"):
        plan(2, device="mps", gpus=0)


# -- Ray's free resources -----------------------------------------------------------------------------------------

def ray_placement(workers=2, share=1.0):
    return Placement(workers, "ray", "cuda", workers, share, ("cuda",) * workers, "nccl")


def test_ray_resource_check_names_what_the_cluster_lacks():
    check_ray_resources(ray_placement(2, 0.5), 1, {"CPU": 2.0, "GPU": 1.0})
    with pytest.raises(PlacementError, match="cluster has 1 GPU.*need 2 .*run.workers=2 x run.gpus_per_worker=1"):
        check_ray_resources(ray_placement(2), 1, {"CPU": 8.0, "GPU": 1.0})
    with pytest.raises(PlacementError, match="cluster has 0 GPU"):
        check_ray_resources(ray_placement(1), 1, {"CPU": 8.0})  # torch sees a GPU, Ray none
    with pytest.raises(PlacementError, match="cluster has 3 CPU.*need 4 .*run.threads_per_worker=2"):
        check_ray_resources(ray_placement(2), 2, {"CPU": 3.0, "GPU": 2.0})


# -- the config -------------------------------------------------------------------------------------------------

def test_workers_default_to_auto_and_take_integers_or_auto(tmp_path):
    assert load_config().run.workers == "auto"
    assert load_config(None, ["run.workers=3"]).run.workers == 3
    assert load_config(None, ["run.workers=auto"]).run.workers == "auto"
    (tmp_path / "c.yaml").write_text("run:\n  workers: 2\n  gpus_per_worker: 0.5\n")
    config = load_config(tmp_path / "c.yaml")
    assert (config.run.workers, config.run.gpus_per_worker) == (2, 0.5)


@pytest.mark.parametrize("override,expected", [
    ("run.workers=two", "run.workers must be an integer >= 1 \\(or auto\\), got 'two'"),
    ("run.workers=0", "run.workers must be an integer >= 1"), ("run.workers=true", "run.workers expects int or str"),
    ("run.gpus_per_worker=0", "run.gpus_per_worker must be in \\(0, 1\\]"),
    ("run.gpus_per_worker=1.5", "run.gpus_per_worker must be in"),
    ("run.workers=1 run.tail_training=off", "run.speculative=adaptive needs run.drafter")])
def test_bad_worker_settings(override, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, override.split())


def fake_gpus(monkeypatch, count):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: count > 0)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)


def test_resolve_on_the_cpu_machine_is_one_worker_that_trains_its_drafter_in_its_own_tail(monkeypatch):
    """One worker per device, the CPU too (docs/benchmarks.md section 12: one worker on both cores beat two)."""
    fake_gpus(monkeypatch, 0)
    config, placed, notes = resolve(load_config())
    assert config.run.workers == 1 == placed.workers and placed.device == "cpu" and notes == []
    assert config.run.speculative == "adaptive" and config.run.backend == "inprocess"
    assert tail_training_active(config.run, placed.workers)
    config, placed, _ = resolve(load_config(None, ["run.workers=2"]))  # spot training on the idle one, as asked
    assert placed.workers == 2 and not tail_training_active(config.run, placed.workers)


def test_resolve_on_one_gpu_is_one_worker_that_trains_its_drafter_in_its_own_tail(monkeypatch):
    fake_gpus(monkeypatch, 1)
    config, placed, notes = resolve(load_config())
    assert (config.run.workers, config.run.backend, placed.devices) == (1, "inprocess", ("cuda:0",))
    assert config.run.speculative == "adaptive" and notes == []  # run.tail_training=auto: on, on CUDA
    assert tail_training_active(config.run, placed.workers)
    config, _, notes = resolve(load_config(None, ["run.tail_training=off"]))  # nobody would train the drafter
    assert config.run.speculative == "off" and "decodes without speculation" in notes[0]
    config, _, notes = resolve(load_config(None, ["run.drafter=some/dir", "run.tail_training=off"]))
    assert config.run.speculative == "adaptive" and notes == []
    with pytest.raises(PlacementError, match="run.gpus_per_worker=0.5 to put 2 workers"):
        resolve(load_config(None, ["run.workers=2"]))
    config, placed, _ = resolve(load_config(None, ["run.gpus_per_worker=0.5"]))
    assert config.run.workers == 2 and placed.gpus_per_worker == 0.5
    assert resolve(load_config(None, ["model.device=cpu"]))[1].devices == ("cpu",)  # CPU on a GPU machine


def test_tlt_train_refuses_an_unplaceable_config_before_anything_loads(tmp_path, monkeypatch, capfd):
    from tlt.cli import main

    fake_gpus(monkeypatch, 1)
    code = main(["train", f"run.out_dir={tmp_path / 'run'}", f"model.path={tmp_path / 'nope'}", "run.workers=3"])
    err = [line for line in capfd.readouterr().err.splitlines() if line.strip()]
    assert code == 2 and len(err) == 1 and "run.workers=3 with run.gpus_per_worker=1 needs 3 GPU(s)" in err[0], err
    assert not (tmp_path / "run").exists()


# -- bounded waits ------------------------------------------------------------------------------------------------

def test_a_worker_that_never_answers_is_an_error_naming_the_calls(tmp_path, monkeypatch):
    from test_distributed import make_controller

    from tlt.distributed import backends
    from tlt.distributed.backends import WorkerError
    from tlt.distributed.worker import RolloutWorker

    original = RolloutWorker.rollout

    def stuck(self, *args):
        if self.rank == 1:
            time.sleep(3)
        return original(self, *args)

    monkeypatch.setattr(RolloutWorker, "rollout", stuck)
    controller = make_controller(tmp_path, **{"run.speculative": "off", "rollout.max_new_tokens": 4})
    monkeypatch.setattr(backends, "CALL_TIMEOUT_S", 1.0)
    started = time.perf_counter()
    try:
        with pytest.raises(WorkerError, match="RL step 1: no worker answered .*within 1 s.* rollout on worker 1"):
            controller.train_step()
        assert time.perf_counter() - started < 2.9
    finally:
        controller.close()


def test_unflatten_keeps_each_gradient_on_its_parameters_device():
    import torch

    from tlt.distributed.collective import ThreadReducer, unflatten_into

    params = [torch.nn.Parameter(torch.zeros(2, 3)), torch.nn.Parameter(torch.zeros(4))]
    unflatten_into(params, torch.arange(10.0))
    assert params[0].grad.tolist() == [[0, 1, 2], [3, 4, 5]] and params[1].grad.tolist() == [6, 7, 8, 9]
    assert math.isclose(ThreadReducer(2, timeout_s=0.1)._barrier._timeout, 0.1)
