"""Model files on disk: Hugging Face directories (config.json + safetensors + tokenizer) and GGUF files.

Reading (with the cheap checks that run before any weight loads), dequantizing a GGUF into a transformers model,
and writing a model directory. No policy about which source to load: that is `loading.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tlt.errors import ModelLoadError, first_line
from tlt.files import share_as_umask
from tlt.models.spec import check_supported


def check_weights(path: Path, config) -> None:
    """Header-only checks of a directory's .safetensors files: a truncated file (an interrupted copy) or weights
    saved for another config fail in a second, not deep inside from_pretrained (in every worker)."""
    expected, tied, prefix = _expected_shapes(config)
    stored = set()
    for file in sorted(path.glob("*.safetensors")):
        for name, shape in _stored_shapes(file).items():
            if name in expected and expected[name] != shape:
                raise ModelLoadError(f"cannot load the weights in {file}: {name} has shape {list(shape)}, but "
                                     f"{path / 'config.json'} needs {list(expected[name])} (another model's?)")
            stored.add(name)
            stored.add(prefix + name)  # a base model's file names its weights without "model." (transformers adds it)
    # transformers fills a weight missing from the files with random values (a report on stderr, no error)
    missing = [name for name in expected if name not in stored and not tied.get(name, set()) & stored]
    if missing:
        named = ", ".join(missing[:3]) + (", ..." if len(missing) > 3 else "")
        raise ModelLoadError(f"the .safetensors files in {path} lack {len(missing)} of the {len(expected)} weights "
                             f"{path / 'config.json'} needs ({named}): an incomplete copy, or another model's?")


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


def _expected_shapes(config) -> tuple[dict[str, tuple], dict[str, set[str]], str]:
    """Parameter shapes of the model `config` describes, from a model on the meta device (no memory); its tied
    weights: name -> the names it shares a tensor with (a file may hold either name of a tied pair); and the
    base model's prefix ("model.")."""
    from transformers import AutoModelForCausalLM

    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:
        return {}, {}, ""
    tied = {}
    for name, source in (getattr(model, "all_tied_weights_keys", None) or {}).items():
        tied.setdefault(name, set()).add(source)
        tied.setdefault(source, set()).add(name)
    prefix = f"{model.base_model_prefix}." if getattr(model, "base_model_prefix", "") else ""
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}, tied, prefix


def read_hf_config(path: Path):
    from transformers import AutoConfig

    if not (path / "config.json").exists():
        raise ModelLoadError(f"{path} has no config.json: not a Hugging Face model directory")
    _refuse_a_run_directory(path)
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (ValueError, KeyError, OSError) as error:  # bad JSON, unknown model_type, unreadable file
        raise ModelLoadError(custom_code_error(path / "config.json", error)
                             or f"cannot read {path / 'config.json'}: {first_line(error)}") from None
    check_supported(config)
    return config


def _refuse_a_run_directory(path: Path) -> None:
    """A tlt run's directory (its config.json a mapping of sections, where a model's has scalars) given as a
    model: transformers said only "Unrecognized model ... Should have a `model_type` key" (QA)."""
    try:
        saved = json.loads((path / "config.json").read_text())
    except (OSError, ValueError):
        return  # transformers names what is wrong with it
    if isinstance(saved, dict) and saved and all(isinstance(v, dict) for v in saved.values()):
        trained = path / "final"
        raise ModelLoadError(f"{path} is a tlt run's directory, not a model: its trained policy is "
                             f"{trained if trained.is_dir() else 'in its final/ once the run ends'}")


def load_hf_dir(path: Path):
    from transformers import AutoModelForCausalLM

    config = read_hf_config(path)
    if not list(path.glob("*.safetensors")):
        raise ModelLoadError(f"{path} has no .safetensors weights (tlt never loads pickled checkpoints)")
    tokenizer = _load_tokenizer(path)  # first: cheap, and a broken one then fails before the weights' progress bar
    try:
        model = AutoModelForCausalLM.from_pretrained(path, config=config, local_files_only=True,
                                                     use_safetensors=True, dtype=torch.float32,
                                                     trust_remote_code=False)
    except Exception as error:
        raise ModelLoadError(f"cannot load the weights in {path}: {first_line(error)}") from None
    return model, tokenizer


def _load_tokenizer(path: Path):
    from transformers import AutoTokenizer

    if not _has_tokenizer(path):
        return None
    try:
        return AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as error:
        reason = custom_code_error(path / "tokenizer_config.json", error)
        if reason:
            raise ModelLoadError(reason) from None
        if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer.model", "vocab.json")):
            raise ModelLoadError(f"cannot load the tokenizer in {path}: it has a tokenizer_config.json but no "
                                 f"tokenizer.json (nor tokenizer.model or vocab.json); copy the model's tokenizer "
                                 f"files there") from None
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {first_line(error)}") from None


def custom_code_error(file: Path, error: Exception) -> str | None:
    """One line for a file whose `auto_map` names code of the model's own (transformers' refusal, under
    trust_remote_code=False, points at the Hub and an option tlt does not have); None for any other error."""
    if "trust_remote_code" not in str(error):
        return None
    return (f"{file} names custom code (auto_map): tlt never runs code from a model directory; use a model of a "
            f"supported architecture (Llama, Qwen2, Qwen3) with transformers' own classes")


def read_gguf_config(path: Path):
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True,
                                            trust_remote_code=False)
    except Exception as error:
        raise ModelLoadError(gguf_error(path, error)) from None
    check_supported(config)
    return config


def load_gguf(path: Path):
    """Read a GGUF with transformers' GGUF support, dequantized to fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    kwargs = dict(gguf_file=path.name, local_files_only=True, trust_remote_code=False)
    config = read_gguf_config(path)  # given to the model: each read of a GGUF's header parses all of it (seconds)
    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, config=config, dtype=torch.float32, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, **kwargs)
    except Exception as error:
        raise ModelLoadError(gguf_error(path, error)) from None
    return model, tokenizer


def gguf_error(path: Path, error: Exception) -> str:
    """One line for a GGUF that does not read. The GGUF reader maps tensors over the file, so one cut short
    fails as a numpy reshape or mmap error: said as what it likely is."""
    reason = first_line(error)
    if any(word in reason for word in ("reshape", "mmap", "buffer is smaller", "beyond the end", "requires a buffer")):
        reason += f" (the file, {path.stat().st_size} bytes, is likely cut short: download or copy it again)"
    return f"cannot read GGUF {path}: {reason}"


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
    if not getattr(config, "architectures", None):
        config.architectures = [type(model).__name__]  # a GGUF-loaded config has none: vLLM then cannot serve it
    config.save_pretrained(out)
    add_legacy_keys(out)
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.save_pretrained(out)
    save_model(model, str(out / "model.safetensors"), metadata={"format": "pt"})
    share_as_umask(out / "model.safetensors")
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def add_legacy_keys(directory: Path) -> None:
    """Rewrite a model directory's config.json with `with_legacy_keys`: the engines that serve a saved policy
    may run transformers 4."""
    path = Path(directory) / "config.json"
    path.write_text(json.dumps(with_legacy_keys(json.loads(path.read_text())), indent=2, sort_keys=True) + "\n")


def with_legacy_keys(config: dict) -> dict:
    """Transformers 5 writes RoPE as `rope_parameters` and the dtype as `dtype`; vLLM and SGLang on transformers 4
    read a config's (a policy's, an EAGLE draft's) `rope_theta` (defaulting to 10,000: SmolLM2's is 100,000),
    `rope_scaling` and `torch_dtype`, as transformers 4 writes them. Both spellings, then, each reader taking its
    own (transformers 5 reads such a config back as it was: tested)."""
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if "rope_scaling" not in config and rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {key: value for key, value in rope.items() if key != "rope_theta"}
    if "torch_dtype" not in config and "dtype" in config:
        config["torch_dtype"] = config["dtype"]
    return config


def _has_tokenizer(path: Path) -> bool:
    return any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model"))
