import pytest

from tlt.metrics.logger import MetricsLogger, read_metrics


def test_jsonl_lines_truncation_and_tensorboard(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=True)
    for step in (1, 2, 3):
        logger.log(step, {"reward_mean": step / 10, "note": "text is kept in JSONL only"})
    logger.truncate_after(2)  # what a resumed run does before re-running step 3
    logger.close()
    assert [m["step"] for m in read_metrics(tmp_path)] == [1, 2]
    if pytest.importorskip("tensorboard"):
        assert list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
