from tlt.metrics.logger import MetricsLogger, read_metrics


def test_jsonl_lines_and_truncation(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    for step in (1, 2, 3):
        logger.log(step, {"reward_mean": step / 10, "note": "text is kept in JSONL only"})
    logger.truncate_after(2)  # what a resumed run does before re-running step 3
    logger.close()
    assert [(m["step"], m["reward_mean"]) for m in read_metrics(tmp_path)] == [(1, 0.1), (2, 0.2)]
    assert not (tmp_path / "tensorboard").exists()


def test_tensorboard_scalars(tmp_path):
    # a plain import: `make test` installs the tensorboard extra, so a broken or missing one fails here rather
    # than skipping the only test that reads the scalars back
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    logger = MetricsLogger(tmp_path, tensorboard=True)
    for step in (1, 2):
        logger.log(step, {"reward_mean": step / 10, "note": "not a scalar", "flag": True})
    logger.close()
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert events.Tags()["scalars"] == ["reward_mean"]
    assert [(e.step, round(e.value, 6)) for e in events.Scalars("reward_mean")] == [(1, 0.1), (2, 0.2)]
