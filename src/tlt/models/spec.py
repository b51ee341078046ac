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
    max_positions: int          # the context tlt serves: `context_positions`
    rms_norm_eps: float
    hidden_act: str
    context_note: str = ""      # why max_positions is below the config's max_position_embeddings, if it is

    @property
    def kv_floats_per_token(self) -> int:
        """fp elements the KV cache holds per token across all layers (keys and values)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim

    @classmethod
    def from_config(cls, config) -> "ModelSpec":
        check_supported(config)
        heads = config.num_attention_heads
        settings = config.to_dict()
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(
            model_type=config.model_type,
            num_layers=config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            hidden_size=config.hidden_size,
            vocab_size=config.vocab_size,
            max_positions=context_positions(settings),
            rms_norm_eps=config.rms_norm_eps,
            hidden_act=config.hidden_act,
            context_note=context_note(settings),
        )


def _longrope_span(settings: dict) -> int | None:
    """original_max_position_embeddings of a longrope config (transformers 5's rope_parameters or 4's
    rope_scaling), None for any other RoPE."""
    rope = settings.get("rope_parameters") or settings.get("rope_scaling") or {}
    if not isinstance(rope, dict) or (rope.get("rope_type") or rope.get("type")) != "longrope":
        return None
    # the top-level key first, as transformers reads a built model's (standardize_rope_params)
    span = settings.get("original_max_position_embeddings") or rope.get("original_max_position_embeddings")
    return span if isinstance(span, int) and span > 0 else None


def context_positions(settings: dict) -> int:
    """The positions tlt serves for a model of config `settings` (a config.json's keys): its
    max_position_embeddings, except for longrope, whose frequencies switch from its short factors to its long ones
    once a forward's longest position passes original_max_position_embeddings (transformers picks them per call,
    not per position): a row's tokens would then depend on its batch mates and on how deep its draft tree reaches,
    and the rollout's log-probs would not be those of the training forward over the whole sequence. Within the
    short span every forward uses the same frequencies, so that is the context served."""
    context = settings["max_position_embeddings"]
    span = _longrope_span(settings)
    return context if span is None else min(context, span)


def context_note(settings: dict) -> str:
    """For an error naming the context: why it is below max_position_embeddings, or ''."""
    if context_positions(settings) == settings["max_position_embeddings"]:
        return ""
    return (" (a longrope model's short span, original_max_position_embeddings: past it transformers picks its "
            "frequencies from the longest position of a forward, so a row's tokens would depend on its batch; "
            "tlt serves no longer sequences than that)")


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
