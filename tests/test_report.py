"""`tlt report`: an HTML page with tables and PNG figures from a hand-built run directory (no training)."""

import json
import re

import pytest

pytest.importorskip("matplotlib")

from tlt.cli import main  # noqa: E402
from tlt.errors import TltError  # noqa: E402
from tlt.metrics.figures import draw_timeline  # noqa: E402
from tlt.report import write_report  # noqa: E402
from tlt.rl.config import TrainConfig  # noqa: E402

TIMELINE = {"step": 3, "duration": 2.0, "workers": [
    {"worker": 0, "intervals": [{"kind": "rollout", "start": 0.0, "end": 1.5},
                                {"kind": "update", "start": 1.5, "end": 2.0}]},
    {"worker": 1, "intervals": [{"kind": "rollout_sd", "start": 0.0, "end": 0.6},
                                {"kind": "spot_train", "start": 0.6, "end": 1.2},
                                {"kind": "idle", "start": 1.2, "end": 1.5},
                                {"kind": "update", "start": 1.5, "end": 2.0}]}]}


def _metrics(step: int) -> dict:
    record = {"step": step, "reward_mean": 0.25 * step, "accuracy": 0.125 * step, "response_len_p50": 40 + step,
              "response_len_p90": 90 + step, "response_len_max": 120 + step, "rollout_s": 1.5, "train_s": 0.5,
              "rollout_tok_s": 321.5, "train/loss": 0.1, "sd/tau": 2.5 + step / 10, "sd/sd_step_share": 0.75,
              "sd/arm/<k4>/tau": 3.0, "drafter/pairs": 200000, "lr": 5e-7 * (3 - step),
              "train/entropy": 1.5 - step / 10, "train/grad_norm": 0.8, "train/rollout_kl": 2e-4}
    if step > 1:  # newer keys appear part-way, as in a resumed run on a newer version
        record.update({"idle_fraction": 0.15, "step_s": 2.0, "drafter_versions": [step]})
    return record


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    (run / "timeline").mkdir(parents=True)
    (run / "config.json").write_text(json.dumps(TrainConfig().to_dict()))
    (run / "metrics.jsonl").write_text("".join(json.dumps(_metrics(step)) + "\n" for step in (1, 2, 3)))
    (run / "timeline" / "step_0003.json").write_text(json.dumps(TIMELINE))
    return run


def test_report_page_tables_and_figures(run_dir):
    path = write_report(run_dir)
    assert path == run_dir / "report" / "index.html"
    page = path.read_text()
    for text in ("0.750", "0.375", "123", "93", "321.5", "2.80", "15.0%", "rollout", "grpo", "optim"):
        assert text in page
    assert "&lt;k4&gt;" in page and "<k4>" not in page  # metric names are escaped
    assert "200000" in page and "2e+05" not in page  # counts are written out
    steps = re.search(r"<h2>Steps</h2>(.*?)</table>", page).group(1)
    assert "<th>lr</th>" in steps and "<td>1e-06</td>" in steps and "<td>0</td>" in steps  # the schedule, lr 0 too
    images = re.findall(r"<img src='([^']+)'", page)
    assert {"curves_reward.png", "curves_length.png", "curves_time.png", "curves_tau.png", "curves_entropy.png",
            "curves_mismatch.png", "timeline_step_0003.png"} <= set(images)
    assert "<th>entropy</th>" in steps and "<td>1.300</td>" in steps and "<td>2.00e-04</td>" in steps
    for name in images:
        assert (path.parent / name).read_bytes().startswith(b"\x89PNG")


def test_report_skips_missing_keys(run_dir):
    (run_dir / "metrics.jsonl").write_text(json.dumps({"step": 1, "reward_mean": 0.5}) + "\n")
    page = write_report(run_dir, run_dir / "elsewhere").read_text()
    assert re.findall(r"<img src='([^']+)'", page) == ["curves_reward.png", "timeline_step_0003.png"]
    assert "idle" not in re.search(r"<h2>Steps</h2>(.*?)</table>", page).group(1)


def test_draw_timeline(tmp_path):
    path = draw_timeline(TIMELINE, tmp_path / "gantt.png")
    assert path.read_bytes().startswith(b"\x89PNG")


def test_missing_run_dir_and_metrics(tmp_path):
    with pytest.raises(TltError, match="nowhere"):
        write_report(tmp_path / "nowhere")
    with pytest.raises(TltError, match="metrics.jsonl: missing or empty"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").mkdir()
    with pytest.raises(TltError, match="metrics.jsonl is a directory"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").rmdir()
    (tmp_path / "metrics.jsonl").write_bytes(b"\xff\xfe")  # there, but not a record (found by QA)
    with pytest.raises(TltError, match="metrics.jsonl: holds no step record; is .* a `tlt train` run directory"):
        write_report(tmp_path)
    (tmp_path / "metrics.jsonl").unlink()
    (tmp_path / "config.json").write_text("{}")  # a run in its first step: it is one (found by QA)
    with pytest.raises(TltError, match="missing or empty: the run in .* has not finished its first step yet"):
        write_report(tmp_path)
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')  # a model's directory (runs/x/final)
    with pytest.raises(TltError, match="missing or empty; is .* a `tlt train` run directory"):
        write_report(tmp_path)


def test_a_run_set_aside_by_a_killed_overwrite_is_named_not_called_missing(tmp_path):
    """After a SIGKILL'd --overwrite the old run waits in RUN/.replaced (the next `tlt train` puts it back):
    "missing metrics.jsonl" told the user their run was gone (found by QA)."""
    (tmp_path / ".replaced").mkdir()
    (tmp_path / ".replaced" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(TltError, match="the run it was replacing is intact in .*\\.replaced.*puts it back"):
        write_report(tmp_path)


def test_an_out_that_cannot_be_made_is_one_line(run_dir):
    """/proc refuses new entries, as a read-only mount would: a traceback (found by QA)."""
    with pytest.raises(TltError, match="--out /proc/tlt-report: cannot create it"):
        write_report(run_dir, "/proc/tlt-report")


def test_cli_report(run_dir, capsys):
    assert main(["report", str(run_dir)]) == 0
    assert "index.html" in capsys.readouterr().out
    assert main(["report", str(run_dir / "missing")]) == 2


def test_held_out_accuracy_column_and_curve(run_dir, monkeypatch):
    """Held-out accuracy is measured only every task.eval_every steps: its column and curve show those steps."""
    from tlt.metrics import figures

    records = [_metrics(step) for step in (1, 2, 3)]
    records[1]["eval_accuracy"], records[2]["eval_accuracy"] = 0.4375, 0.5625
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    plotted = {}
    line_plot = figures._line_plot
    monkeypatch.setattr(figures, "_line_plot", lambda metrics, path, title, series: plotted.update(
        {label: figures._series(metrics, key) for key, label in series}) or line_plot(metrics, path, title, series))
    page = write_report(run_dir).read_text()
    steps = re.search(r"<h2>Steps</h2>(.*?)</table>", page).group(1)
    assert "held-out acc" in steps and "0.438" in steps and "0.562" in steps
    assert plotted["held-out accuracy (greedy)"] == ([2, 3], [0.4375, 0.5625])


def test_unreadable_config_and_timeline_files_are_noted_not_fatal(run_dir):
    """config.json and timeline/step_N.json are written in place: a run killed while writing one leaves it cut
    short. The report says so where the table or chart would be, instead of failing with a JSON traceback."""
    (run_dir / "config.json").write_text('{"model": {"path"')
    (run_dir / "timeline" / "step_0003.json").write_text("[1]")
    page = write_report(run_dir).read_text()
    assert "config.json is not a JSON object" in page and "step_0003.json is not readable" in page
    assert "<h2>Steps</h2>" in page


def test_a_file_as_run_dir_or_out_is_one_line(run_dir, tmp_path, capsys):
    """--out naming a file raised a FileExistsError traceback after the metrics were read."""
    (tmp_path / "file").write_text("x")
    assert main(["report", str(run_dir), "--out", str(tmp_path / "file")]) == 2
    assert main(["report", str(tmp_path / "file")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err == [f"tlt: error: --out {tmp_path / 'file'}: it, or a directory above it, is a file",
                   f"tlt: error: {tmp_path / 'file'}: a file, not a run directory"]


def test_out_holding_another_index_html_is_refused_and_tlts_own_is_replaced(run_dir, tmp_path):
    """`tlt report RUN --out DIR` replaced DIR/index.html whoever wrote it (found by review)."""
    from tlt.errors import TltError
    from tlt.report import write_report

    site = tmp_path / "site"
    site.mkdir()
    (site / "index.html").write_text("<html>precious</html>")
    with pytest.raises(TltError, match="already holds an index.html that tlt report did not write"):
        write_report(run_dir, site)
    assert (site / "index.html").read_text() == "<html>precious</html>"
    out = tmp_path / "ours"
    first = write_report(run_dir, out).read_text()
    assert write_report(run_dir, out).read_text() == first  # its own page: replaced again
    (run_dir / "report").mkdir(exist_ok=True)
    (run_dir / "report" / "index.html").write_text("<html>a report from before the marker</html>")
    assert "generator" in write_report(run_dir).read_text()  # RUN_DIR/report is tlt's own


@pytest.mark.parametrize("holds", ["model", "checkpoint", "run", "drafter"])
def test_out_inside_a_model_checkpoint_or_run_is_refused(run_dir, tmp_path, holds):
    """`tlt report RUN --out RUN/final` (or a checkpoint) wrote index.html and the PNGs among the policy's files
    (found by a CLI trial): refused, nothing written. A folder of unrelated files is the control."""
    from tlt.errors import TltError
    from tlt.report import write_report

    target = tmp_path / f"out-{holds}"
    target.mkdir()
    files = {"model": ["config.json", "model.safetensors"], "checkpoint": ["state.json"],
             "run": ["metrics.jsonl"], "drafter": ["drafter_config.json", "drafter.safetensors"]}[holds]
    for name in files:
        (target / name).write_text("{}")
    with pytest.raises(TltError, match=f"--out {target} holds a model, checkpoint or run .*{files[0]}"):
        write_report(run_dir, target)
    assert sorted(p.name for p in target.iterdir()) == sorted(files)
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "todo.txt").write_text("x")
    assert write_report(run_dir, tmp_path / "notes").is_file()


def test_a_step_without_speculative_steps_logs_no_tau():
    """τ is a mean over SD steps: a step with none logged 0.0, which the τ curve and table drew as a collapse
    (found by review). A step with one SD step logs its τ."""
    import torch

    from tlt.metrics.step import step_metrics
    from tlt.rollout.request import RolloutResult, SampleOutput, StepTrace

    samples = [SampleOutput(0, 0, (5,), [4, 6, 7], [0.0, 0.0, 0.0], "length")]
    plain = [StepTrace("prefill", 1, 1, 0.1), StepTrace("decode", 1, 1, 0.1), StepTrace("decode", 1, 1, 0.1)]
    sd = [StepTrace("prefill", 1, 1, 0.1), StepTrace("decode", 1, 2, 0.1, mode="sd", accepted_hist=(0, 1))]
    rewards = torch.ones(1)
    metrics = [step_metrics(RolloutResult(samples, steps, 0.3), rewards, rewards > 0, {}, 0.3, 0.1, 0)
               for steps in (plain, sd)]
    assert "sd/tau" not in metrics[0] and metrics[0]["sd/sd_step_share"] == 0.0
    assert metrics[1]["sd/tau"] == 2.0


def test_acceptance_by_depth_pools_arms_of_several_depths_without_inventing_rejections():
    """A 3-deep arm's row that accepted all 3 drafts went no deeper: pooled with a 5-deep arm's steps it was
    counted as rejected at depth 4 (0.5 where the 5-deep arm accepted 10 of 10; found by a trial). Each depth is
    now over the steps of arms that draft that deep; metrics.jsonl carries each depth's share."""
    import torch

    from tlt.metrics.step import step_metrics
    from tlt.rollout.request import RolloutResult, SampleOutput, StepTrace

    def sd(hist):  # rows that accepted 0, 1, ..., D draft tokens
        rows = sum(hist)
        emitted = sum(count * (accepted + 1) for accepted, count in enumerate(hist))
        return StepTrace("decode", rows, emitted, 0.1, mode="sd", accepted_hist=hist)

    steps = [sd((0, 0, 3, 10)), sd((0, 0, 0, 2, 0, 10))]   # S3: 13 rows, 10 took all 3; S5: 12 rows, 10 took all 5
    summary = RolloutResult([], steps, 1.0).speculation_summary()
    assert summary["acceptance_by_depth"] == [1.0, 1.0, 22 / 25, 10 / 12, 1.0]  # depth 3: 3 + 2 of 25 rejected
    samples = [SampleOutput(0, 0, (5,), [4, 6], [0.0, 0.0], "length")]
    metrics = step_metrics(RolloutResult(samples, steps, 1.0), torch.ones(1), torch.ones(1) > 0, {}, 1.0, 0.1, 0)
    assert metrics["sd/acceptance_d4"] == 10 / 12 and metrics["sd/acceptance_d5"] == 1.0


def test_a_run_without_speculative_steps_says_so_instead_of_a_table_of_zeros(run_dir):
    plain = {"step": 1, "reward_mean": 0.5, "sd/sd_step_share": 0.0, "sd/draft_s": 0.0, "sd/verify_s": 0.0}
    (run_dir / "metrics.jsonl").write_text(json.dumps(plain) + "\n")
    page = write_report(run_dir).read_text()
    assert "no speculative step ran" in page and "sd/draft_s" not in page


def test_a_timeline_of_another_shape_is_noted_not_fatal(run_dir):
    """A timeline JSON object of another shape (another tlt's, a hand-made one) raised KeyError from the drawing
    (found by review)."""
    (run_dir / "timeline" / "step_0003.json").write_text(json.dumps({"workers": [{"intervals": [{"start": 0}]}]}))
    page = write_report(run_dir).read_text()
    assert "is not a timeline this tlt can draw" in page and "<h2>Steps</h2>" in page


def test_the_sd_section_shows_the_latest_step_that_speculated(run_dir):
    """A last step whose batch never drained to the gate ran no speculative step: the section said "no
    speculative step ran" beside a table of the earlier steps' τ (found by review)."""
    plain = {"step": 4, "reward_mean": 0.5, "sd/sd_step_share": 0.0}
    with (run_dir / "metrics.jsonl").open("a") as metrics:
        metrics.write(json.dumps(plain) + "\n")
    page = write_report(run_dir).read_text()
    assert "Speculative decoding, step 3" in page and "no speculative step ran" not in page
