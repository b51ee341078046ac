"""Export a tlt drafter as an EAGLE(-1) draft model that vLLM and SGLang load.

Layout matched by reading their loaders (not copying them): vllm-project/vllm
`vllm/model_executor/models/llama_eagle.py` at 00da923 (EagleLlamaForCausalLM) and sgl-project/sglang
`python/sglang/srt/models/llama_eagle.py` at 034b3be (LlamaForCausalLMEagle). Both read a Llama config with
`num_hidden_layers` = 1 and weights named `fc.weight` and `layers.0.<HF decoder layer names>` (they prefix
`model.` themselves), skip `embed_tokens`/`lm_head` (shared with the target), and drop layer 0's input norm.
SGLang's `fc` has a bias and vLLM's does not: a zero `fc.bias` is written (vLLM skips it, SGLang needs it).
Only the architecture name differs: SGLang resolves `LlamaForCausalLMEagle`; vLLM takes the draft's
`LlamaForCausalLM` config under `speculative_config={"method": "eagle", "model": DIR}`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from tlt.errors import TltError
from tlt.files import refuse_a_file_in_the_way, share_as_umask
from tlt.models.eagle import EagleDrafter

ARCHITECTURES = {"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}


class ExportError(TltError):
    """A drafter that cannot be written in the requested format."""


EXPORT_FILES = ("config.json", "model.safetensors")


def check_export_out(out: str | Path, overwrite: bool = False) -> None:
    """An --out the export may write: not a file, and (unless overwrite) holding none of the files it writes,
    e.g. a model directory, whose config and weights would be replaced by the one-layer draft's."""
    out = Path(out)
    refuse_a_file_in_the_way(out, "--out", ExportError)
    held = [name for name in EXPORT_FILES if (out / name).exists()]
    if held and not overwrite:
        raise ExportError(f"{out} already holds {' and '.join(held)} (a model or an earlier export): pass "
                          f"--overwrite to replace them, or another --out")


def export_eagle(drafter: EagleDrafter, out: str | Path, target: str = "vllm", overwrite: bool = False) -> Path:
    from safetensors.torch import save_file

    check_export_out(out, overwrite)
    if target not in ARCHITECTURES:
        raise ExportError(f"unknown export target {target!r}: one of {', '.join(ARCHITECTURES)}")
    if drafter.config.model_type != "llama":
        raise ExportError(f"the EAGLE loaders of vLLM and SGLang read Llama drafters; this one is "
                          f"{drafter.config.model_type!r}")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {"fc.weight": drafter.fc.weight.detach(), "fc.bias": torch.zeros(drafter.fc.weight.shape[0])}
    for name, tensor in drafter.layer.state_dict().items():
        tensors[f"layers.0.{name}"] = tensor.detach()
    save_file({k: v.cpu().contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    share_as_umask(out / "model.safetensors")  # the serving engine may run as another user
    config = drafter.config.to_dict()
    config.update(architectures=[ARCHITECTURES[target]], num_hidden_layers=1, tie_word_embeddings=False)
    config.pop("layer_types", None)
    (out / "config.json").write_text(json.dumps(_with_legacy_keys(config), indent=1))
    return out


def _with_legacy_keys(config: dict) -> dict:
    """Transformers 5 writes RoPE as `rope_parameters` and the dtype as `dtype`; the vLLM and SGLang EAGLE loaders
    read `rope_theta` (defaulting to 10,000: SmolLM2's is 100,000), `rope_scaling` and `torch_dtype`, as the
    transformers 4 they run on writes them. Both spellings, then, each reader taking its own."""
    rope = config.get("rope_parameters") or {}
    if "rope_theta" not in config and "rope_theta" in rope:
        config["rope_theta"] = rope["rope_theta"]
    if "rope_scaling" not in config and rope.get("rope_type", "default") != "default":
        config["rope_scaling"] = {key: value for key, value in rope.items() if key != "rope_theta"}
    if "torch_dtype" not in config and "dtype" in config:
        config["torch_dtype"] = config["dtype"]
    return config


def import_eagle(directory: str | Path, target_model) -> EagleDrafter:
    """Read an EAGLE-1 Llama draft directory (ours or a compatible one) back into an EagleDrafter."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    directory = Path(directory)
    config = LlamaConfig.from_pretrained(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    if "fc.bias" in tensors and bool(tensors["fc.bias"].abs().max() > 0):
        raise ExportError(f"{directory}: fc has a non-zero bias, which tlt's drafter does not model")
    drafter = EagleDrafter(config).attach(target_model)
    layer = {k[len("layers.0."):]: v for k, v in tensors.items() if k.startswith("layers.0.")}
    layer.pop("input_layernorm.weight", None)  # identity in EAGLE's first layer
    with torch.no_grad():  # in place and seen by version-keyed caches (a .data write would not be)
        drafter.fc.weight.copy_(tensors["fc.weight"])
    missing, unexpected = drafter.layer.load_state_dict(layer, strict=False)
    if missing or unexpected:
        raise ExportError(f"{directory}: layer weights do not fit (missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]})")
    return drafter
