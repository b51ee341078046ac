"""Which decoder layer an EAGLE drafter runs, given its target's family.

A drafter's one layer need not be its target's: it reads the target's features, embedding and lm_head, and
rotates with the target's RoPE, so only the shapes (hidden size, heads, KV heads, head dim, vocabulary) must
agree. Llama and Qwen2 targets get their own family's layer (a Qwen2 layer exports as a Llama one with attention
biases, drafter/export.py). Qwen3 targets get a Llama layer: Qwen3's per-head q/k norms are modelled by no EAGLE-1
class of vLLM or SGLang, so a Qwen3 layer could never be served there, while the EAGLE drafters those engines serve
for Qwen3 (e.g. SpecForge's EAGLE-3 ones) are Llama layers. Drafters saved with a Qwen3 layer (before 2026-12-02)
still load and serve tlt's own rollouts.
"""

from __future__ import annotations

from tlt.models.spec import SUPPORTED_ARCHITECTURES

# target model_type -> the layer family a new drafter gets
NEW_DRAFTER_LAYER = {"llama": "llama", "qwen2": "qwen2", "qwen3": "llama"}
# Keys of a Qwen2/Qwen3 config that a Llama one lacks: their sliding window (tlt refuses a model that uses one).
# vLLM copies every key of a draft config onto its EAGLE config, and a `layer_types` list there is indexed by the
# target's layer count (an assertion at engine start); `dual_chunk_attention_config` is Qwen2.5-1M's chunked
# attention; `qkv_bias`, where a config carries it, overrides attention_bias for q/k/v in vLLM's LlamaAttention.
QWEN_ONLY_KEYS = ("use_sliding_window", "sliding_window", "max_window_layers", "layer_types",
                  "dual_chunk_attention_config", "qkv_bias")


def decoder_layer_class(model_type: str):
    """transformers' decoder layer class of a supported family."""
    if model_type == "llama":
        from transformers.models.llama.modeling_llama import LlamaDecoderLayer as layer
    elif model_type == "qwen2":
        from transformers.models.qwen2.modeling_qwen2 import Qwen2DecoderLayer as layer
    else:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3DecoderLayer as layer
    return layer


def new_drafter_config(target_config):
    """The config a new drafter's layer is built from: the target's own, or for a Qwen3 target the Llama config of
    the same shapes (head_dim kept: Qwen3's is not hidden / heads) and RoPE."""
    if NEW_DRAFTER_LAYER[target_config.model_type] == target_config.model_type:
        return target_config
    return as_llama_config(target_config.to_dict())


def layer_configs(target_config) -> list:
    """The configs a drafter of this target may have a layer of: the target family's own, then Llama's."""
    if target_config.model_type == "llama":
        return [target_config]
    return [target_config, as_llama_config(target_config.to_dict())]


def as_llama_config(settings: dict):
    """A LlamaConfig of a Qwen2/Qwen3 config's settings, without the keys a Llama config lacks."""
    from transformers import LlamaConfig

    kept = {key: value for key, value in without_qwen_keys(settings).items()
            if key not in ("model_type", "architectures", "transformers_version")}
    return LlamaConfig(**kept)


def without_qwen_keys(settings: dict) -> dict:
    """A Qwen2/Qwen3 config's settings less the keys a Llama config lacks (`QWEN_ONLY_KEYS`)."""
    return {key: value for key, value in settings.items() if key not in QWEN_ONLY_KEYS}


def fits_target(drafter_type: str, target_type: str) -> bool:
    """Whether a drafter layer of family `drafter_type` may serve a `target_type` target (shapes aside): its
    own family, or a Llama layer (what the engines' EAGLE classes serve for any target)."""
    return drafter_type == target_type or (drafter_type == "llama" and target_type in SUPPORTED_ARCHITECTURES)
