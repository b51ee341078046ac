"""What the lean forward needs to know about a supported decoder-only architecture."""

from __future__ import annotations

from dataclasses import dataclass

from tlt.errors import ModelLoadError

# The decoder families the lean forward runs (Qwen3's per-head q/k norms are read from each layer: a Qwen3
# target's drafter has a Llama layer, models/drafter_layer.py).
SUPPORTED_ARCHITECTURES = ("llama", "qwen2", "qwen3")


@dataclass(frozen=True)
class ModelSpec:
    """Shape facts of a Llama-family decoder, read once from its config."""

    model_type: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_positions: int
    rms_norm_eps: float
    hidden_act: str

    @property
    def kv_floats_per_token(self) -> int:
        """fp elements the KV cache holds per token across all layers (keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config) -> "ModelSpec":
        check_supported(config)
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            model_type=config.model_type,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            max_positions=config.max_position_embeddings,
            rms_norm_eps=config.rms_norm_eps,
            hidden_act=config.hidden_act,
        )


def check_supported(config) -> None:
    """Raise one clear error for architectures or options the lean forward does not implement."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_ARCHITECTURES:
        supported = ", ".join(sorted(SUPPORTED_ARCHITECTURES))
        raise ModelLoadError(f"unsupported architecture {model_type!r}: tlt supports {supported}")
    if getattr(config, "use_sliding_window", False):
        raise ModelLoadError(f"{model_type} with use_sliding_window=True is not supported (full attention only)")
    if getattr(config, "hidden_act", "silu") not in ("silu", "swish"):
        raise ModelLoadError(f"hidden_act={config.hidden_act!r} is not supported: the lean forward implements SiLU MLPs")
