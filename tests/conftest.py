"""Tiny random models built from configs: no network, no model hub, a few hundred KB each."""

import pytest
import torch
from transformers import (LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config,
                          Qwen3ForCausalLM)

ARCHITECTURES = {
    "llama": (LlamaConfig, LlamaForCausalLM),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM),
    "qwen3": (Qwen3Config, Qwen3ForCausalLM),
}
EOS = 3


def tiny_model(arch: str = "llama", *, vocab_size: int = 97, seed: int = 0, layers: int = 2, **overrides):
    """A random fp32 causal LM of the given family; token 3 is EOS."""
    config_cls, model_cls = ARCHITECTURES[arch]
    settings = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
                    bos_token_id=1, eos_token_id=EOS, pad_token_id=0, tie_word_embeddings=False)
    settings.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**settings)).eval()
    if arch == "qwen2":  # Qwen2 has q/k/v biases: make them non-zero so they are exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.1)
    return model


@pytest.fixture(params=sorted(ARCHITECTURES))
def arch(request):
    return request.param


def random_prompts(lengths, vocab_size=97, seed=0):
    generator = torch.Generator().manual_seed(seed)
    # ids >= 4 keep prompts free of the special tokens (0 pad, 1 bos, 3 eos)
    return [torch.randint(4, vocab_size, (n,), generator=generator).tolist() for n in lengths]
