"""Load a supported causal LM (Llama, Qwen2, Qwen3) and its tokenizer, never from a model hub.

Sources: the default model (None or "smollm2"), a local Hugging Face directory (config.json + safetensors),
a .gguf file (dequantized by transformers), or an in-memory transformers causal LM.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from tlt.errors import ModelLoadError
from tlt.models.default_model import default_model_dir, rebuild_default_model
from tlt.models.model_files import (
    check_weights,
    load_gguf,
    load_hf_dir,
    read_gguf_config,
    read_hf_config,
)
from tlt.models.spec import ModelSpec, check_supported

DEFAULT_MODEL_ALIASES = ("smollm2", "default", "SmolLM2-135M-Instruct")

log = logging.getLogger(__name__)


@dataclass
class LoadedModel:
    model: torch.nn.Module          # a transformers *ForCausalLM, eval mode
    tokenizer: object | None        # a transformers tokenizer (None for an in-memory model given without one)
    spec: ModelSpec
    source: str

    @property
    def eos_token_ids(self) -> list[int]:
        return eos_token_ids(self.model, self.tokenizer)


def pick_device(device=None) -> torch.device:
    if device is not None:
        return torch.device(device)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def load_model(source=None, *, tokenizer=None, device=None, dtype: torch.dtype = torch.float32) -> LoadedModel:
    """Load a model from any supported source. Raises ModelLoadError with one clear message on bad input."""
    if isinstance(source, torch.nn.Module):
        check_supported(getattr(source, "config", None))
        model, label = source, f"in-memory {type(source).__name__}"
    else:
        model, tokenizer, label = _load_from_path(source)
        check_tokenizer_fits(tokenizer, model.config, label)
    model = model.to(device=pick_device(device), dtype=dtype).eval()
    return LoadedModel(model, tokenizer, ModelSpec.from_config(model.config), label)


def check_tokenizer_fits(tokenizer, config, label: str) -> None:
    """Every id the tokenizer can produce must have a row in the model's embedding: a larger tokenizer (another
    model's, or a vocabulary resized without the model) failed later as "prompt token id out of range", naming
    neither file (found by review). A smaller one is common (embeddings padded to a multiple of 64 or 128)."""
    size = len(tokenizer) if tokenizer is not None else 0
    if size > config.vocab_size:
        raise ModelLoadError(f"{label}: its tokenizer has {size} tokens but the model's vocab_size is "
                             f"{config.vocab_size}: the tokenizer is not this model's (or was resized without it)")


def _load_from_path(source):
    path = _checked_default_model() if is_default_source(source) else check_model_path(source)
    if path.is_file():
        model, tokenizer = load_gguf(path)
        return model, tokenizer, str(path)
    return (*load_hf_dir(path), str(path))


def _checked_default_model() -> Path:
    """The cached default model, checked as a user's directory is, and rebuilt from its GGUF when damaged (a file
    cut short or deleted). The cache is tlt's own and its conversion deterministic, so a rebuild loses nothing;
    the raw load error ("incomplete metadata, file not fully covered") named no way out (found by a CLI trial)."""
    path = default_model_dir()
    try:
        return check_model_path(path)
    except ModelLoadError as error:
        log.warning("the cached default model is damaged (%s): rebuilding it from its GGUF", error)
    rebuild_default_model(path)
    return check_model_path(path)


def is_default_source(source) -> bool:
    # an existing path of that name wins (a clone in ./SmolLM2-135M-Instruct is the user's, not tlt's dequantized copy)
    return source is None or (str(source) in DEFAULT_MODEL_ALIASES and not Path(str(source)).expanduser().exists())


def check_model_path(source) -> Path:
    """The cheap checks of a user-given model path, before anything loads: it exists, and is a .gguf file or a
    Hugging Face directory (config.json of a supported family, complete safetensors weights of its shapes)."""
    path = Path(source).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model path not found: {source} (expected a Hugging Face model directory, "
                             f"a .gguf file, or 'smollm2' for the default model)")
    if path.is_file():
        if path.suffix != ".gguf":
            raise ModelLoadError(f"{path} is a file but not a .gguf; give a model directory or a .gguf file")
        read_gguf_config(path)  # the header only: a broken file fails here, before any worker starts
        return path
    config = read_hf_config(path)
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no .safetensors weights (tlt never loads pickled checkpoints)")
    check_weights(path, config)
    return path


def eos_token_ids(model, tokenizer) -> list[int]:
    """Stop tokens: the generation config's EOS ids (may be a list) plus the tokenizer's EOS."""
    ids: list[int] = []
    generation = getattr(model, "generation_config", None)
    for value in (getattr(generation, "eos_token_id", None), getattr(model.config, "eos_token_id", None),
                  getattr(tokenizer, "eos_token_id", None)):
        for token in value if isinstance(value, (list, tuple)) else [value]:
            if token is not None and int(token) not in ids:
                ids.append(int(token))
    return ids
