"""Export for vLLM/SGLang: the layout their EAGLE loaders read, and a lossless round trip."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_model
from tlt.drafter.export import ExportError, export_eagle, import_eagle
from tlt.models.eagle import EagleDrafter


@pytest.mark.parametrize("target,architecture", [("vllm", "LlamaForCausalLM"), ("sglang", "LlamaForCausalLMEagle")])
def test_round_trip_and_layout(tmp_path, target, architecture):
    model = tiny_model("llama", rope_theta=100_000.0)  # SmolLM2's
    torch.manual_seed(1)
    drafter = EagleDrafter(model.config, draft_vocab=torch.arange(40)).attach(model)
    export_eagle(drafter, tmp_path, target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["num_hidden_layers"] == 1
    # the loaders read transformers 4's spellings (rope_theta defaulted to 10,000 without it; found by review)
    assert config["rope_theta"] == model.config.rope_parameters["rope_theta"] != 10_000
    assert config["torch_dtype"] == config["dtype"] and "rope_scaling" not in config
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert {"fc.weight", "fc.bias", "layers.0.self_attn.q_proj.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.post_attention_layernorm.weight"} <= names
    assert not any("embed_tokens" in n or "lm_head" in n or "input_layernorm" in n for n in names)
    mode = lambda name: (tmp_path / name).stat().st_mode & 0o777
    assert mode("model.safetensors") == mode("config.json")  # not safetensors' own 0600: vLLM may be another user
    back = import_eagle(tmp_path, model)
    tokens, features = torch.randint(0, 97, (2, 5)), torch.randn(2, 5, 64)
    positions = torch.arange(5).expand(2, 5)
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool)).expand(2, 5, 5)
    with torch.no_grad():
        assert torch.allclose(back(tokens, features, positions, mask), drafter(tokens, features, positions, mask),
                              atol=1e-5)


def test_non_llama_drafters_are_refused(tmp_path):
    with pytest.raises(ExportError, match="Llama"):
        export_eagle(EagleDrafter(tiny_model("qwen3").config), tmp_path)


def test_export_refuses_to_replace_a_model_directory_unless_told(tmp_path, capsys):
    """`--out` pointing at a model directory (the target's own, say) replaced its config.json and weights with
    the one-layer draft's without a word: the model was lost. Checked before the model loads."""
    from test_bad_input import model_dir
    from tlt.cli import main

    model = model_dir(tmp_path)
    weights = (model / "model.safetensors").read_bytes()
    drafter = tmp_path / "drafter"
    EagleDrafter(tiny_model("llama", vocab_size=257).config).save(drafter)
    assert main(["drafter", "export", str(drafter), "--model", str(model), "--out", str(model)]) == 2
    err = capsys.readouterr().err
    assert "already holds config.json and model.safetensors" in err and "--overwrite" in err, err
    assert (model / "model.safetensors").read_bytes() == weights
    out = tmp_path / "eagle"
    for flags in ([], ["--overwrite"]):  # an earlier export is replaced when asked
        assert main(["drafter", "export", str(drafter), "--model", str(model), "--out", str(out), *flags]) == 0
    assert "draft vocabulary" not in capsys.readouterr().out
    EagleDrafter(tiny_model("llama", vocab_size=257).config, draft_vocab=torch.arange(40)).save(drafter)
    assert main(["drafter", "export", str(drafter), "--model", str(model), "--out", str(out), "--overwrite"]) == 0
    assert "note: its draft vocabulary (40 of 257 tokens) is not exported" in capsys.readouterr().out  # said, not silent
    (tmp_path / "file").write_text("x")
    with pytest.raises(ExportError, match="is a file"):
        export_eagle(EagleDrafter(tiny_model("llama").config), tmp_path / "file")


def test_export_without_model_names_the_default_it_loaded(tmp_path, monkeypatch, capsys):
    """Without --model the shape error never said the default smollm2 had been loaded (found by review)."""
    import tlt.models
    from tlt.cli import main
    from tlt.models import LoadedModel, ModelSpec

    other = tiny_model("llama", vocab_size=257, hidden_size=32, intermediate_size=64)
    monkeypatch.setattr(tlt.models, "load_model", lambda *a, **k: LoadedModel(other, None, ModelSpec.from_config(
        other.config), "smollm2"))  # a stand-in for the default model: another shape
    EagleDrafter(tiny_model("llama", vocab_size=257).config).save(tmp_path / "drafter")
    assert main(["drafter", "export", str(tmp_path / "drafter"), "--out", str(tmp_path / "eagle")]) == 2
    err = capsys.readouterr().err
    assert "do not fit the target's" in err and "no --model: the default smollm2 was loaded; pass --model" in err
    assert main(["drafter", "export", str(tmp_path / "nothing"), "--out", str(tmp_path / "eagle")]) == 2
    assert "is not a tlt drafter" in capsys.readouterr().err  # before any model loads
