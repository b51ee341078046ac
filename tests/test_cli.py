"""The command line as a user meets it: --version, defaults in --help, and the thread count it picks."""

import json

import pytest
import torch

import tlt
from tlt import threads
from tlt.cli import main


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0
    assert capsys.readouterr().out.strip() == f"tlt-rl {tlt.__version__}"


@pytest.mark.parametrize("command,expected", [(["generate"], ["(default: 0.7)", "(default: 128)"]),
                                              (["drafter", "warmup"], ["(default: 300)", "default: 8192 for a new drafter"]),
                                              (["verify"], ["(default: S4K2N8)", "(default: 0.001)"])])
def test_help_shows_defaults(capsys, command, expected):
    with pytest.raises(SystemExit):
        main(command + ["--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines
    for default in expected:
        assert default in text
    assert "(default: None)" not in text and "(default: False)" not in text


@pytest.mark.parametrize("load,expected", [(0.0, 2), (0.6, 1), (1.4, 1), (7.0, 1)])
def test_threads_leave_busy_cores_alone(monkeypatch, load, expected):
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    monkeypatch.setattr(threads.os, "getloadavg", lambda: (load, load, load))
    before = torch.get_num_threads()
    try:
        assert threads.pick_threads() == expected
        assert torch.get_num_threads() == expected
        assert threads.pick_threads(3) == 3  # an explicit request wins
    finally:
        torch.set_num_threads(before)


def test_more_threads_than_cores_is_said(monkeypatch, caplog):
    """--threads 999 on 2 cores ran ~10x slower without a word (found by review)."""
    monkeypatch.setattr(threads, "available_cores", lambda: 2)
    before = torch.get_num_threads()
    try:
        threads.pick_threads(2)
        assert "more than this machine" not in caplog.text
        threads.pick_threads(8)
        assert "--threads 8 is more than this machine's 2 cores" in caplog.text
    finally:
        torch.set_num_threads(before)


# -- tlt train --print-config / --config ------------------------------------------------------------------------

TRICKY = ["optim.schedule=cosine", "optim.warmup_steps=1", "optim.lr=3e-6", "run.logger=jsonl,wandb",
          "task.system_prompt=off", "task.name=hf", "task.path=data/gsm8k", "task.split=train[:10%]",
          "optim.betas=[0.8, 0.95]", "run.drafter=null"]


def test_print_config_is_the_full_resolved_config_and_loads_back_equal(tmp_path, monkeypatch, capsys):
    """Every section and key, overrides applied; nothing loaded, nothing written to run.out_dir."""
    import yaml

    from tlt.distributed import run
    from tlt.rl.config import TrainConfig, load_config

    monkeypatch.setattr(run, "train", lambda *args, **kwargs: pytest.fail("--print-config started a run"))
    out_dir = tmp_path / "never"
    overrides = TRICKY + [f"run.out_dir={out_dir}"]
    assert main(["train", "--print-config", *overrides]) == 0
    printed = capsys.readouterr().out
    assert list(yaml.safe_load(printed)) == list(TrainConfig().to_dict())
    assert all(key in yaml.safe_load(printed)[section] for section, keys in TrainConfig().to_dict().items()
               for key in keys)
    path = tmp_path / "printed.yaml"
    path.write_text(printed)
    expected = load_config(None, overrides)
    assert load_config(path) == expected
    assert expected.task.system_prompt == "off" and expected.optim.lr == 3e-6  # the tricky values survived
    assert not out_dir.exists()


def test_a_config_file_with_overrides_on_top_either_way(tmp_path, capsys):
    import yaml

    path = tmp_path / "mine.yaml"
    path.write_text("rollout:\n  max_new_tokens: 64\noptim:\n  lr: 1e-4\n")  # 1e-4: YAML 1.1 reads a string
    for argv in (["train", str(path)], ["train", "--config", str(path)]):
        assert main(argv + ["rollout.max_new_tokens=32", "--print-config"]) == 0
        printed = yaml.safe_load(capsys.readouterr().out)
        assert printed["rollout"]["max_new_tokens"] == 32 and printed["optim"]["lr"] == 1e-4


def test_options_may_sit_between_overrides(capsys):
    import yaml

    assert main(["train", "rollout.max_new_tokens=32", "--print-config", "run.steps=3", "optim.lr=2e-5"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert (printed["rollout"]["max_new_tokens"], printed["run"]["steps"], printed["optim"]["lr"]) == (32, 3, 2e-5)
    with pytest.raises(SystemExit):
        main(["report", "some/dir", "extra=1"])  # only `train` takes overrides
    assert "unrecognized arguments: extra=1" in capsys.readouterr().err


@pytest.mark.parametrize("argv,message", [
    (["a.yaml", "b.yaml"], "'b.yaml' is not a section.key=value override (the config file is a.yaml)"),
    (["run.steps=2", "b.yaml"], "'b.yaml' is not a section.key=value override (a config file goes first, or after "
                                "--config)"),
    (["--config", "missing.yaml"], "config file not found: missing.yaml"),
    # the last one alone was read (found by a trial)
    (["--config", "a.yaml", "--config", "b.yaml"], "--config given 2 times (a.yaml, b.yaml): give one YAML file, "
                                                   "and further settings as section.key=value overrides"),
    (["optim.schedule=linear"], "optim.schedule must be one of constant, cosine, got 'linear'"),
    (["run.steps=0"], "run.steps must be >= 1, got 0"),  # it trained nothing, then pointed at a report of nothing
    # each ran the built-in arithmetic task (a missing file unnoticed), or the dataset without a word
    (["task.path=data.jsonl"], "task.path is set, but task.name=arithmetic does not use it (a dataset: task.name="
                               "jsonl, parquet or hf)"),
    (["task.prompt_field=problem", "task.split=test"], "task.split, task.prompt_field are set, but task.name="
                                                       "arithmetic does not use them (a dataset: task.name=jsonl, "
                                                       "parquet or hf)"),
    (["task.name=jsonl", "task.path=d.jsonl", "task.split=test"], "task.split is set, but task.name=jsonl does not "
                                                                  "use it"),
    (["task.name=hf", "task.path=d", "task.max_operations=6"], "task.max_operations is set, but task.name=hf does "
                                                               "not use it"),
    (["optim.betas=0.9"], "optim.betas must be a list of 2 numbers (e.g. optim.betas=0.9,0.99), got 0.9"),
])
def test_bad_train_arguments_are_one_line(capsys, argv, message):
    assert main(["train", "--print-config", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.strip() == f"tlt: error: {message}" and captured.out == ""


def test_an_abbreviated_option_is_refused(capsys):
    """argparse took `--o` for --overwrite (which deletes a run) and `--res` for --resume (found by a trial)."""
    for abbreviated in ("--o", "--res", "--print"):
        with pytest.raises(SystemExit):
            main(["train", abbreviated])
        assert f"unrecognized arguments: {abbreviated}" in capsys.readouterr().err


@pytest.mark.parametrize("text,message", [
    ("run: [1\n", "not valid YAML (expected ',' or ']', but got '<stream end>' at line 2, column 1)"),
    (b"\xff\xfe\x00", "not a YAML config file (not UTF-8 text)"),
    ("run:\n  steps: 2\nrun:\n  seed: 5\n", "'run' is given twice in one mapping"),  # YAML keeps the last silently
    ("run:\n  steps: 2\n  steps: 5\n", "'steps' is given twice"),
    (None, "is a directory, not a YAML config file"),
])
def test_unreadable_config_files_are_one_line(tmp_path, capsys, text, message):
    """A config file YAML cannot read, or one whose key is given twice (the first would be dropped without a
    word), is one line naming the file, not a yaml/Unicode/IsADirectory traceback."""
    path = tmp_path / "run.yaml"
    if text is None:
        path.mkdir()
    else:
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
    assert main(["train", "--print-config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(f"tlt: error: {path}") and message in captured.err, captured.err
    assert len(captured.err.strip().splitlines()) == 1 and captured.out == ""


def test_an_override_yaml_cannot_read_is_one_line(capsys):
    assert main(["train", "--print-config", "rollout.max_new_tokens=[1"]) == 2
    assert capsys.readouterr().err.startswith("tlt: error: rollout.max_new_tokens=[1: not a value YAML can read")


def test_yaml_merge_keys_may_still_be_overridden(tmp_path, capsys):
    import yaml

    path = tmp_path / "run.yaml"
    path.write_text("optim:\n  <<: {lr: 0.002, warmup_steps: 1}\n  lr: 0.003\n")
    assert main(["train", "--print-config", str(path)]) == 0
    optim = yaml.safe_load(capsys.readouterr().out)["optim"]
    assert (optim["lr"], optim["warmup_steps"]) == (0.003, 1)


def _model_dir_and_drafter(tmp_path):
    from conftest import tiny_model
    from test_verify import byte_tokenizer
    from tlt.models.eagle import EagleDrafter
    from tlt.models.model_files import save_model_dir

    model = tiny_model("llama", vocab_size=257, eos_token_id=256, max_position_embeddings=512)
    save_model_dir(model, byte_tokenizer(), tmp_path / "model")
    EagleDrafter(model.config).attach(model).save(tmp_path / "drafter")
    return str(tmp_path / "model"), str(tmp_path / "drafter")


def test_generate_with_a_drafter_speculates_while_the_batch_is_within_the_gate(tmp_path, capsys):
    model, drafter = _model_dir_and_drafter(tmp_path)
    code = main(["generate", "--model", model, "--drafter", drafter, "--strategy", "S3K1q", "--gate", "6",
                 "-n", "3", "--max-new-tokens", "12", "--threads", "1", "hello", "a longer prompt here"])
    out = " ".join(capsys.readouterr().out.split())
    assert code == 0, out
    assert "speculative decoding (S3K1N3q, while ≤ 6 rows ran)" in out and "τ" in out
    assert "no step ran at ≤ 1 row" in out  # 6 rows drain to 4 of 12 tokens each: not to a tail (a trial)
    # a tree whose drafted frontier ((4 - 1) x 3 nodes) outnumbers the nodes it keeps (5) gets its cache slots
    code = main(["generate", "--model", model, "--drafter", drafter, "--strategy", "S4K3N5", "--gate", "6",
                 "-n", "2", "--max-new-tokens", "8", "--threads", "1", "hello"])
    err = capsys.readouterr().err
    assert code == 0, err
    # one row: every step was called "the long tail" (found by review)
    assert main(["generate", "--model", model, "-n", "1", "--max-new-tokens", "4", "--threads", "1", "hello"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "no long tail" in out and "speculative decoding targets" not in out
    # every response ended at its first token: no decode step, and the gate was blamed (QA)
    assert main(["generate", "--model", model, "--drafter", drafter, "--max-new-tokens", "1", "--threads", "1",
                 "hello"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "never ran: no decode step ran" in out and "--gate" not in out


@pytest.mark.parametrize("flags,message", [(["--strategy", "deep"], "strategy must look like"),
                                           (["--strategy", ""], "strategy must look like"),  # ran the default (QA)
                                           (["--strategy", "s4k2n8"], "case-sensitive: 'S4K2N8'"),  # a trial
                                           (["--gate", "0"], "--gate must be at least 1"),
                                           (["--drafter", "/nonexistent/drafter"], "is not a tlt drafter"),
                                           (["--no-drafter", "--strategy", "S3K1q"], "needs --drafter"),
                                           (["--compile", "inductor"], "needs a CUDA device"),
                                           (["--kernels", "triton"], "run on CUDA"),
                                           (["--threads", "-1"], "--threads must be >= 0"),
                                           (["--max-batch-size", "0"], "--max-batch-size must be >= 1"),
                                           # SamplingParams' field was named, not the flag (QA)
                                           (["--max-new-tokens", "0"], "--max-new-tokens must be an integer >= 1"),
                                           (["--top-k", "-2"], "--top-k must be an integer >= 0")])
def test_generate_refuses_bad_speculation_settings(tmp_path, capsys, monkeypatch, flags, message):
    import tlt.models

    if ("--compile" in flags or "--kernels" in flags) and torch.cuda.is_available():
        pytest.skip("compiling and the Triton kernels are allowed on CUDA")
    model, drafter = _model_dir_and_drafter(tmp_path)
    monkeypatch.setattr(tlt.models, "load_model", lambda *a, **k: pytest.fail("loaded the model before checking"))
    if "--no-drafter" in flags:
        flags = flags[1:]
    elif "--drafter" not in flags:
        flags = ["--drafter", drafter] + flags
    assert main(["generate", "--model", model, "--threads", "1", "--max-new-tokens", "4"] + flags) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


@pytest.mark.parametrize("command,flags,message", [
    ("generate", ["--top-k", "-1"], "--top-k must be"), ("generate", ["-n", "0"], "-n (samples per prompt)"),
    ("generate", ["--max-new-tokens", "0"], "--max-new-tokens must be"),
    ("generate", ["caf\udce9"], "prompt 1 is not valid UTF-8"),  # argv bytes that are not UTF-8 (a TypeError)
    ("verify", ["--top-p", "0"], "--top-p must be in (0, 1]"), ("verify", ["--prompts", "0"], "at least one prompt"),
    ("verify", ["--temperature", "0"], "--temperature must be at least 1e-05"),
    ("verify", ["--drafter", "/nonexistent/drafter"], "is not a tlt drafter")])
def test_generate_and_verify_refuse_bad_sampling_flags_before_loading_the_model(monkeypatch, capsys, command, flags,
                                                                                message):
    """Only the model's load (a minute for the default model's first) came before these errors."""
    import tlt.models

    monkeypatch.setattr(tlt.models, "load_model", lambda *a, **k: pytest.fail("loaded the model before checking"))
    assert main([command, "--threads", "1", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_betas_take_the_comma_form_like_the_loggers(capsys):
    """`optim.betas=0.9,0.99` was refused as not "a list of 2 numbers" (found by review)."""
    import yaml

    assert main(["train", "--print-config", "optim.betas=0.8,0.95"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["optim"]["betas"] == [0.8, 0.95]


def test_verify_json_written_as_a_directory_is_refused(tmp_path, capsys):
    """`--json out/` wrote a file named out (found by review)."""
    from tlt.files import check_writable
    from tlt.errors import TltError

    with pytest.raises(TltError, match="names a directory; give a file name"):
        check_writable(f"{tmp_path}/out/", "--json")
    assert not (tmp_path / "out").exists()
    check_writable(str(tmp_path / "out.json"), "--json")  # the control


def test_generate_marks_a_cut_prompt_or_response():
    """The prompt column was cut at 40 characters without a mark (found by a trial); the response had one."""
    from tlt.generate_cli import _shown

    assert _shown("x" * 40, 40) == "x" * 40
    assert _shown("x" * 41, 40) == "x" * 39 + "…"


def test_generate_names_the_long_tails_bound_in_rows_and_a_rollout_without_one():
    """With a peak of 2 rows, batch 1 was called "≤ 1/4 of the peak batch"; rows that all ended together were
    still "the long tail that speculative decoding targets" at 0 of 17 steps (found by a trial)."""
    from types import SimpleNamespace

    from rich.console import Console

    from tlt.generate_cli import _print_trace
    from tlt.rollout.request import RolloutResult, StepTrace

    def trace(batches):
        console = Console(record=True, width=400)
        steps = [StepTrace("decode", b, b, 0.01) for b in batches]
        samples = [SimpleNamespace(token_ids=[0])] * max(batches)
        _print_trace(console, RolloutResult(samples, steps, 1.0))
        return " ".join(console.export_text().split())

    drained = trace([2, 2, 1, 1, 1])
    assert "3 of 5 steps (60%) ran at ≤ 1 row (the long tail: a quarter of the peak batch of 2" in drained
    together = trace([8] * 17)
    assert "no step ran at ≤ 2 rows" in together and "the responses ended close together" in together
    assert "speculative decoding targets" not in together


def test_generate_writes_every_response_in_full_as_json(tmp_path, capsys):
    """The table shows 300 characters of a response; a trial could not see a long one whole: --json OUT."""
    model, _ = _model_dir_and_drafter(tmp_path)
    out = tmp_path / "out" / "gen.json"
    assert main(["generate", "--model", model, "-n", "2", "--max-new-tokens", "40", "--threads", "1",
                 "--json", str(out), "hello"]) == 0
    result = json.loads(out.read_text())
    assert len(result["samples"]) == 2 and result["params"]["max_new_tokens"] == 40
    assert sum(len(s["token_ids"]) for s in result["samples"]) == result["generated_tokens"]
    assert all(len(s["logprobs"]) == len(s["token_ids"]) and s["prompt"] == "hello" for s in result["samples"])
    assert main(["generate", "--model", model, "--json", str(tmp_path), "hello"]) == 2  # a directory: refused
    assert "is a directory" in capsys.readouterr().err
