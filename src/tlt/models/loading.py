"""Load a supported causal LM (Llama, Qwen2, Qwen3) and its tokenizer, never from a model hub.

Sources: the default model (None or "smollm2"), a local Hugging Face directory (config.json + safetensors),
a .gguf file (dequantized by transformers), or an in-memory transformers causal LM.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from tlt.errors import ModelLoadError
from tlt.models.spec import ModelSpec, check_supported

DEFAULT_MODEL_ALIASES = ("smollm2", "default", "SmolLM2-135M-Instruct")


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
    model = model.to(device=pick_device(device), dtype=dtype).eval()
    return LoadedModel(model, tokenizer, ModelSpec.from_config(model.config), label)


def _load_from_path(source):
    from tlt.models.default_model import default_model_dir

    path = default_model_dir() if is_default_source(source) else check_model_path(source)
    if path.is_file():
        model, tokenizer = load_gguf(path)
        return model, tokenizer, str(path)
    return (*load_hf_dir(path), str(path))


def is_default_source(source) -> bool:
    return source is None or str(source) in DEFAULT_MODEL_ALIASES


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
        _read_gguf_config(path)  # the header only: a broken file fails here, before any worker starts
        return path
    config = _read_hf_config(path)
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no .safetensors weights (tlt never loads pickled checkpoints)")
    check_weights(path, config)
    return path


def check_weights(path: Path, config) -> None:
    """Header-only checks of a directory's .safetensors files: a truncated file (an interrupted copy) or weights
    saved for another config fail in a second, not deep inside from_pretrained (in every worker)."""
    expected = _expected_shapes(config)
    for file in sorted(path.glob("*.safetensors")):
        for name, shape in _stored_shapes(file).items():
            if name in expected and expected[name] != shape:
                raise ModelLoadError(f"cannot load the weights in {file}: {name} has shape {list(shape)}, but "
                                     f"{path / 'config.json'} needs {list(expected[name])} (another model's?)")


def _stored_shapes(file: Path) -> dict[str, tuple]:
    """Tensor shapes from a safetensors header (8-byte length, then JSON), once the file is known to hold every
    byte the header points at."""
    try:
        size = file.stat().st_size
        with open(file, "rb") as handle:
            length = int.from_bytes(handle.read(8), "little")
            header = handle.read(length) if size >= 8 and 8 + length <= size else None
    except OSError as error:
        raise ModelLoadError(f"cannot read {file}: {error.strerror}") from None
    if header is None:
        raise ModelLoadError(f"cannot load the weights in {file}: truncated, or not a safetensors file "
                             f"({size} bytes; its header claims {length})")
    try:
        tensors = json.loads(header)
        tensors.pop("__metadata__", None)
        end = max((entry["data_offsets"][1] for entry in tensors.values()), default=0)
        shapes = {name: tuple(entry["shape"]) for name, entry in tensors.items()}
    except (ValueError, KeyError, TypeError, IndexError, AttributeError) as error:
        raise ModelLoadError(f"cannot load the weights in {file}: not a safetensors file ({error})") from None
    if 8 + length + end > size:
        raise ModelLoadError(f"cannot load the weights in {file}: truncated ({size} bytes of {8 + length + end}); "
                             f"copy or download it again")
    return shapes


def _expected_shapes(config) -> dict[str, tuple]:
    """Parameter shapes of the model `config` describes, from a model on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 - an unusual config: skip the shape check, the load reports its own error
        return {}
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def _read_hf_config(path: Path):
    from transformers import AutoConfig

    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError, OSError) as error:  # bad JSON, unknown model_type, unreadable file
        raise ModelLoadError(f"cannot read {path / 'config.json'}: {_first_line(error)}") from None
    check_supported(config)
    return config


def load_hf_dir(path: Path):
    from transformers import AutoModelForCausalLM

    config = _read_hf_config(path)
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no .safetensors weights (tlt never loads pickled checkpoints)")
    tokenizer = _load_tokenizer(path)  # first: cheap, and a broken one then fails before the weights' progress bar
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, local_files_only=True,
                                                     use_safetensors=True, dtype=torch.float32)
    except Exception as error:  # noqa: BLE001 - safetensors and transformers raise many types for bad weights
        raise ModelLoadError(f"cannot load the weights in {path}: {_first_line(error)}") from None
    return model, tokenizer


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not _has_tokenizer(path):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - tokenizers and transformers raise many types for a broken file
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {_first_line(error)}") from None


def _first_line(error: Exception) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    return lines[0] if lines else type(error).__name__


def _read_gguf_config(path: Path):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except Exception as error:  # noqa: BLE001 - a truncated or foreign file fails in many ways (struct, ValueError...)
        raise ModelLoadError(f"cannot read GGUF {path}: {_first_line(error)}") from None
    check_supported(config)
    return config


def load_gguf(path: Path):
    """Read a GGUF with transformers' GGUF support, dequantized to fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    kwargs = dict(gguf_file=path.name, local_files_only=True)
    _read_gguf_config(path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    except Exception as error:  # noqa: BLE001 - a truncated or foreign GGUF fails in many ways
        raise ModelLoadError(f"cannot read GGUF {path}: {_first_line(error)}") from None
    return model, tokenizer


def save_model_dir(model, tokenizer, out: Path) -> None:
    """Write config + model.safetensors (+ tokenizer, generation config) loadable by `load_hf_dir`.

    transformers refuses save_pretrained on a GGUF-loaded model, so the state dict is written directly; tied
    weights are stored once.
    """
    from safetensors.torch import save_model

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are plain fp32 now
    config.save_pretrained(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


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


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
