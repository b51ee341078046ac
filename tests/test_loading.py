"""Model loading from a local directory and from memory; bad sources get one clear error."""

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from conftest import random_prompts, tiny_model
from tlt.errors import ModelLoadError
from tlt.models import LeanForward, load_model, save_model_dir


def test_directory_round_trip_keeps_weights_and_outputs(tmp_path, arch):
    model = tiny_model(arch, tie_word_embeddings=True)
    save_model_dir(model, None, tmp_path)
    assert (tmp_path / "model.safetensors").exists() and not list(tmp_path.glob("*.bin"))
    loaded = load_model(tmp_path, device="cpu")
    prompt = torch.tensor([random_prompts([6])[0]])
    with torch.no_grad():
        assert torch.allclose(loaded.model(prompt).logits, model(prompt).logits, atol=1e-6)
    assert loaded.spec.model_type == arch
    assert loaded.model.lm_head.weight.data_ptr() == loaded.model.model.embed_tokens.weight.data_ptr()


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 256}


@pytest.mark.parametrize("saver", ["run's final", "cached default"])
@pytest.mark.parametrize("scaling", [None, YARN])
def test_a_saved_policy_names_its_rope_and_dtype_as_transformers_4_reads_them(tmp_path, scaling, saver):
    """A run's final/ is what users serve with vLLM or SGLang. Transformers 5 writes RoPE only as rope_parameters
    and the dtype as dtype; read by transformers 4, such a config has rope_theta 10,000 (Qwen2.5's is 1e6) and
    no scaling (found by QA). Both spellings are written, and transformers 5 reads the file back as it was."""
    import json

    from transformers import AutoConfig

    from tlt.rl.checkpoint import save_final_model

    model = tiny_model("qwen2", rope_theta=1e6, **({"rope_scaling": dict(scaling)} if scaling else {}))
    if saver == "run's final":
        save_final_model(model, None, tmp_path / "final")
        tmp_path = tmp_path / "final"
    else:
        save_model_dir(model, None, tmp_path)
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["rope_theta"] == 1e6 and written.get("torch_dtype") == written.get("dtype")
    assert written.get("rope_scaling") == scaling
    assert AutoConfig.from_pretrained(tmp_path).rope_parameters == model.config.rope_parameters


def test_in_memory_model_is_used_as_is():
    model = tiny_model("qwen3")
    loaded = load_model(model, device="cpu")
    assert loaded.model is model
    assert LeanForward(loaded.model).lm_head.weight is model.lm_head.weight


def test_unknown_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="model path not found"):
        load_model(tmp_path / "nope")


def test_directory_without_config_or_weights(tmp_path):
    with pytest.raises(ModelLoadError, match="config.json"):
        load_model(tmp_path)
    tiny_model().config.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="safetensors"):
        load_model(tmp_path)


def test_a_run_directory_given_as_a_model_names_its_final_policy(tmp_path):
    """A run's directory holds a config.json (tlt's sections): transformers said "Unrecognized model" (QA)."""
    import json

    from tlt.rl.config import TrainConfig

    (tmp_path / "config.json").write_text(json.dumps(TrainConfig().to_dict()))
    with pytest.raises(ModelLoadError, match="is a tlt run's directory, not a model: its trained policy is in its "
                                             "final/ once the run ends"):
        load_model(tmp_path)
    save_model_dir(tiny_model(), None, tmp_path / "final")
    with pytest.raises(ModelLoadError, match=f"its trained policy is {tmp_path / 'final'}"):
        load_model(tmp_path)
    load_model(tmp_path / "final")  # control: the model it names loads


def test_non_gguf_file_is_rejected(tmp_path):
    path = tmp_path / "weights.bin"
    path.write_bytes(b"\0")
    with pytest.raises(ModelLoadError, match="not a .gguf"):
        load_model(path)


def test_unsupported_architecture(tmp_path):
    gpt2 = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50))
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(gpt2)
    gpt2.save_pretrained(tmp_path)
    with pytest.raises(ModelLoadError, match="unsupported architecture 'gpt2'"):
        load_model(tmp_path)


def test_sliding_window_is_refused():
    model = tiny_model("qwen2", use_sliding_window=True, sliding_window=16)
    with pytest.raises(ModelLoadError, match="sliding"):
        load_model(model)


def test_a_directory_missing_a_weight_is_refused_not_filled_at_random(tmp_path):
    """transformers fills a weight the files lack with random values and only prints a report: a partial copy
    (or the config of another model's files, e.g. a drafter export written over it) trained a half-random model.
    A tied pair may be stored under either name."""
    from safetensors.torch import load_file, save_file

    untied = tmp_path / "untied"
    save_model_dir(tiny_model("llama"), None, untied)
    weights = load_file(str(untied / "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "lm_head.weight"}, str(untied / "model.safetensors"),
              metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=r"lack 1 of the \d+ weights .*\(lm_head.weight\)"):
        load_model(untied)
    model, tied = tiny_model("llama", tie_word_embeddings=True), tmp_path / "tied"
    save_model_dir(model, None, tied)
    weights = load_file(str(tied / "model.safetensors"))
    head = weights.pop("model.embed_tokens.weight", None)
    weights["lm_head.weight"] = model.lm_head.weight.detach().clone() if head is None else head
    save_file(weights, str(tied / "model.safetensors"), metadata={"format": "pt"})
    prompt = torch.tensor([random_prompts([6])[0]])
    with torch.no_grad():
        assert torch.allclose(load_model(tied, device="cpu").model(prompt).logits, model(prompt).logits, atol=1e-6)


def test_a_base_model_file_without_the_model_prefix_still_loads(tmp_path):
    """transformers adds the "model." prefix a base model's file leaves out: the completeness check does too."""
    from safetensors.torch import save_file

    model = tiny_model("llama", tie_word_embeddings=True)
    save_model_dir(model, None, tmp_path)
    base = {k[len("model."):]: v.clone() for k, v in model.state_dict().items() if k.startswith("model.")}
    save_file(base, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    prompt = torch.tensor([random_prompts([6])[0]])
    with torch.no_grad():
        assert torch.allclose(load_model(tmp_path, device="cpu").model(prompt).logits, model(prompt).logits, atol=1e-6)


def test_a_tokenizer_larger_than_the_models_vocabulary_is_refused_naming_both(tmp_path):
    """It failed at the first prompt as "requests[0]: prompt token id out of range [0, 200)", naming neither
    the tokenizer nor the model (found by review)."""
    from test_verify import byte_tokenizer

    save_model_dir(tiny_model("llama", vocab_size=200, eos_token_id=199), byte_tokenizer(), tmp_path)
    with pytest.raises(ModelLoadError, match=r"its tokenizer has 257 tokens but the model's vocab_size is 200"):
        load_model(tmp_path, device="cpu")


@pytest.mark.parametrize("file,auto_map", [
    ("config.json", {"AutoConfig": "custom.CustomConfig", "AutoModelForCausalLM": "custom.CustomModel"}),
    ("tokenizer_config.json", {"AutoTokenizer": ["custom.CustomTokenizer", None]})])
def test_code_a_model_directory_names_never_runs(tmp_path, file, auto_map):
    """A directory whose config or tokenizer config maps to its own Python module (`auto_map`): refused in one line
    naming the file, and the module is never imported (transformers asked "run the custom code? [y/N]" on the
    terminal, and ran it on "y": found by a CLI trial)."""
    import json

    from test_verify import byte_tokenizer

    save_model_dir(tiny_model("llama", vocab_size=257), byte_tokenizer(), tmp_path)
    ran = tmp_path / "RAN"
    (tmp_path / "custom.py").write_text(f"open({str(ran)!r}, 'w').close()\n")
    data = json.loads((tmp_path / file).read_text())
    data["auto_map"] = auto_map
    if file == "config.json":
        data["model_type"] = "custom"  # a type transformers has no class of: only the module could read it
    else:
        data["tokenizer_class"] = "CustomTokenizer"
    (tmp_path / file).write_text(json.dumps(data))
    with pytest.raises(ModelLoadError, match=f"{file} names custom code .*tlt never runs code"):
        load_model(tmp_path, device="cpu")
    assert not ran.exists()


def test_a_folder_named_like_the_default_model_is_the_users(tmp_path, monkeypatch):
    """`--model SmolLM2-135M-Instruct` where such a folder exists: the folder, not tlt's cached default (a user
    who cloned the model there trained tlt's dequantized copy instead, silently: found by a CLI trial)."""
    from test_verify import byte_tokenizer

    from tlt.models.loading import is_default_source

    save_model_dir(tiny_model("llama", vocab_size=257), byte_tokenizer(), tmp_path / "SmolLM2-135M-Instruct")
    monkeypatch.chdir(tmp_path)
    assert not is_default_source("SmolLM2-135M-Instruct") and is_default_source("smollm2")
    assert load_model("SmolLM2-135M-Instruct", device="cpu").spec.num_layers == 2
