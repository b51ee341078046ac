"""The README's Python snippet runs as written (on a tiny model standing in for the default one)."""

import re
from pathlib import Path

import tlt.models
from conftest import tiny_model
from test_verify import byte_tokenizer
from tlt.models.eagle import EagleDrafter
from tlt.models.loading import load_model

README = Path(__file__).resolve().parents[1] / "README.md"


def generate_snippet() -> str:
    section = README.read_text().split("## Generate", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_generate_snippet_runs_as_written(monkeypatch, capsys):
    model = tiny_model("llama", vocab_size=257, eos_token_id=256, max_position_embeddings=512)
    tiny = load_model(model)
    tiny.tokenizer = byte_tokenizer()
    monkeypatch.setattr(tlt.models, "load_model", lambda *args, **kwargs: tiny)
    loads = []  # the snippet's drafter is the committed SmolLM2 one: an untrained one of the tiny model's shapes

    def load(cls, directory, target):
        loads.append(directory)
        return cls(target.config).attach(target)
    monkeypatch.setattr(EagleDrafter, "load", classmethod(load))
    exec(compile(generate_snippet(), str(README), "exec"), {})
    assert all((README.parent / directory / "drafter.safetensors").is_file() for directory in loads) and loads
    out = capsys.readouterr().out
    assert out.count("length") + out.count("stop") >= 8  # one line per sample
    assert "'tau'" in out
