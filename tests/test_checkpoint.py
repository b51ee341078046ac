"""Checkpoint files: tied embeddings resume whichever name of the pair safetensors kept, a checkpoint that lacks a
weight is refused, and the final policy is a Hugging Face model directory with its tokenizer."""

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig, PreTrainedTokenizerFast

from conftest import tiny_model
from tlt.rl.checkpoint import CheckpointError, load_checkpoint, save_checkpoint, save_final_model

EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def checkpoint_keeping(tmp_path, model, drop: str):
    """A checkpoint of `model` whose policy file lacks `drop` (as safetensors' dedup of a tied pair does)."""
    path = save_checkpoint(tmp_path, 1, model, torch.optim.AdamW(model.parameters()))
    weights = load_file(str(path / "policy.safetensors"))
    kept = {name: tensor.clone() for name, tensor in {**weights, **model.state_dict()}.items() if name != drop}
    save_file(kept, str(path / "policy.safetensors"))
    return path


@pytest.mark.parametrize("drop", [EMBED, HEAD])
def test_tied_embeddings_load_from_either_name_of_the_pair(tmp_path, drop):
    source, target = tiny_model(tie_word_embeddings=True), tiny_model(seed=1, tie_word_embeddings=True)
    path = checkpoint_keeping(tmp_path, source, drop)
    load_checkpoint(path, target, torch.optim.AdamW(target.parameters()))
    for name, tensor in source.state_dict().items():
        assert torch.equal(target.state_dict()[name], tensor), name
    assert target.lm_head.weight.data_ptr() == target.model.embed_tokens.weight.data_ptr()  # still one tensor


def test_an_untied_model_missing_its_head_is_refused(tmp_path):
    """The tie is read from the model's tensors, not guessed from names: an untied head must be in the file."""
    source, target = tiny_model(), tiny_model(seed=1)
    path = checkpoint_keeping(tmp_path, source, HEAD)
    with pytest.raises(CheckpointError, match=r"missing \['lm_head.weight'\]"):
        load_checkpoint(path, target, torch.optim.AdamW(target.parameters()))


def tiny_tokenizer(vocab_size=97):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<s>": 1, "<unk>": 2, "</s>": 3, **{f"w{i}": i for i in range(4, vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied-embeddings"])
def test_final_model_directory_loads_with_transformers(tmp_path, tied):
    model, tokenizer = tiny_model(tie_word_embeddings=tied), tiny_tokenizer()
    model.generation_config = GenerationConfig(eos_token_id=3, max_new_tokens=7)
    final = save_final_model(model, tokenizer, tmp_path / "final")
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in final.iterdir()}
    assert not list(final.glob("*.bin")) and not list(tmp_path.glob(".final-*"))  # no pickle, no staging left
    loaded = AutoModelForCausalLM.from_pretrained(final)
    for name, tensor in model.state_dict().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    assert loaded.generation_config.max_new_tokens == 7
    assert AutoTokenizer.from_pretrained(final)("w5 w9 w40").input_ids == tokenizer("w5 w9 w40").input_ids
