"""The command line as a user meets it: --version, defaults in --help, and the thread count it picks."""

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
                                              (["drafter", "warmup"], ["(default: 300)", "(default: 8192)"]),
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
