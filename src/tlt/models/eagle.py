"""EagleDrafter: a one-layer EAGLE-style drafter that reads the target's hidden states.

Input at position t: fc([embed(x_{t+1}); f_t]) where f_t is the target's final normed hidden state; one decoder
layer of the target's family with an identity input norm; no final norm; logits through the target's lm_head.
The embedding and lm_head are the target's own tensors: they are never parameters of the drafter, never saved,
exported or pushed with it (the reference code pushed them and overwrote the policy's embedding).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tlt.errors import TltError, first_line
from tlt.files import (DamagedFileError, load_checked_tensors, refuse_a_file_in_the_way, save_checked_tensors,
                       write_whole)
from tlt.models.attention import aligned_span, grouped_attention_bias, mask_capacity
from tlt.models.draft_tables import ChainTables, TreeTables
from tlt.models.drafter_layer import decoder_layer_class, fits_target, layer_configs, new_drafter_config
from tlt.models.kv_cache import CacheRows, KVCache
from tlt.models.loading import LoadedModel
from tlt.models.lean_forward import LeanForward
from tlt.models.rollout_copy import FusedLayer, fuse_layer
from tlt.models.spec import ModelSpec, check_supported

log = logging.getLogger(__name__)
WARNED_POSITIONS: set[tuple[str, str]] = set()  # (drafter's, target's) RoPE already warned about
WARNED_FAMILIES: set[tuple[str, str]] = set()  # (family a drafter was made for, target's) already warned about

CONFIG_FILE = "drafter_config.json"
WEIGHTS_FILE = "drafter.safetensors"


def inverse_vocabulary(draft_to_target: torch.Tensor, vocab: int) -> torch.Tensor:
    """[vocab] int32: each target token's index in the draft vocabulary `draft_to_target`, -1 outside it."""
    inverse = torch.full((vocab,), -1, dtype=torch.int32, device=draft_to_target.device)
    indices = torch.arange(draft_to_target.shape[0], dtype=torch.int32, device=draft_to_target.device)
    return inverse.index_copy_(0, draft_to_target, indices)


class DrafterError(TltError):
    """A drafter that does not fit its target, or a bad drafter file."""


class DrafterFileError(DrafterError):
    """A drafter directory whose files cannot be read, or disagree with each other (whatever the target)."""


def _checked_draft_vocab(draft_vocab, vocab_size: int) -> torch.Tensor:
    """The draft vocabulary as a long tensor of distinct target ids, or a DrafterError saying what is wrong."""
    ids = torch.as_tensor(draft_vocab)
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise DrafterError(f"draft vocabulary must be integer token ids, got {ids.dtype}")
    if ids.dim() != 1 or ids.numel() == 0:
        raise DrafterError(f"draft vocabulary must be a 1-D list of at least one token id, got shape "
                           f"{tuple(ids.shape)}")
    ids = ids.long()
    if int(ids.max()) >= vocab_size or int(ids.min()) < 0:
        raise DrafterError(f"draft vocabulary must be target token ids in [0, {vocab_size})")
    if int(ids.unique().numel()) != int(ids.numel()):
        # Two draft ids of one target token would be two siblings of one token: both acceptance rules assume a
        # node's children are distinct tokens, and would sample that token too often.
        raise DrafterError("draft vocabulary repeats token ids: each target token may appear once")
    return ids


def check_drafter_dir(directory: str | Path) -> Path:
    """The directory, if it holds a tlt drafter's two files (a cheap check before loading anything else)."""
    directory = Path(directory)
    if not is_drafter_dir(directory):
        raise DrafterError(f"{directory} is not a tlt drafter (needs {CONFIG_FILE} and {WEIGHTS_FILE})"
                           f"{drafter_inside(directory) or _an_export(directory)}")
    return directory


def _an_export(directory: Path) -> str:
    """A hint for an EAGLE draft directory (a `tlt drafter export`, or another's): tlt reads it back in code."""
    if (directory / "config.json").is_file() and (directory / "model.safetensors").is_file():
        return ("; it looks like an EAGLE draft for vLLM/SGLang (e.g. a `tlt drafter export`): serve the drafter "
                "it was exported from, or read it back with tlt.drafter.export.import_eagle(DIR, model).save(NEW)")
    return ""


def is_drafter_dir(directory: Path) -> bool:
    return (directory / CONFIG_FILE).is_file() and (directory / WEIGHTS_FILE).is_file()


def drafter_inside(directory: Path) -> str:
    """'; did you mean DIR/final/drafter?' when `directory` is a run directory (its last drafter is in
    final/drafter) or a run's final/ (its drafter/), else ''."""
    inside = next((directory / sub for sub in ("final/drafter", "drafter") if is_drafter_dir(directory / sub)), None)
    return f"; did you mean {inside}?" if inside is not None else ""


def read_target_config(directory: str | Path) -> dict:
    """The target's config a drafter directory was built for (drafter_config.json's target_config), read without
    loading anything; a DrafterFileError naming what is missing or damaged."""
    return read_drafter_meta(Path(directory))["target_config"]


def read_drafter_meta(directory: Path) -> dict:
    """drafter_config.json, checked for what loading reads: a JSON object whose target_config is an object with a
    model_type that transformers knows (each failure one line naming the key, not Python's KeyError)."""
    from transformers import CONFIG_MAPPING

    path = directory / CONFIG_FILE
    try:
        meta = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as error:
        raise DrafterFileError(f"{path}: cannot read it ({first_line(error)})") from None
    except ValueError as error:
        raise DrafterFileError(f"{path}: not valid JSON ({first_line(error)})") from None
    target = meta.get("target_config") if isinstance(meta, dict) else None
    if not isinstance(target, dict):
        raise DrafterFileError(f"{path}: no target_config object (the config of the model the drafter was made "
                               f"for); a drafter saved by tlt has one")
    model_type = target.get("model_type")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        what = "no model_type" if model_type is None else f"model_type {model_type!r}, which transformers does not know"
        raise DrafterFileError(f"{path}: target_config has {what}")
    return meta


class EagleDrafter(nn.Module):
    """A new drafter for a target of config `target_config` (its layer: `NEW_DRAFTER_LAYER`, models/drafter_layer.py).
    `layer` (a family, which must be the config's own) says the config is a drafter layer's, taken as it is: a
    drafter rebuilt from its own config (`like`, `load`), whose family may not be what a new one gets."""

    def __init__(self, target_config, draft_vocab: torch.Tensor | None = None, layer: str | None = None):
        super().__init__()
        if isinstance(target_config, nn.Module):  # EagleDrafter(model): its config was meant
            raise DrafterError(f"EagleDrafter takes the target's config (model.config), got a "
                               f"{type(target_config).__name__}")
        check_supported(target_config)
        if layer is not None and layer != target_config.model_type:
            raise DrafterError(f"EagleDrafter(layer={layer!r}) needs a {layer} config, got {target_config.model_type}")
        config = copy.deepcopy(target_config if layer is not None else new_drafter_config(target_config))
        config.num_hidden_layers = 1
        config._attn_implementation = "sdpa"  # the training forward runs the family's own layer: name its kernel
        if hasattr(config, "layer_types") and config.layer_types is not None:
            config.layer_types = config.layer_types[:1]
        self.config = config
        # the family of the target it drafts for, which its layer need not name (a Qwen3 target's is Llama's);
        # a rebuilt drafter's is set by whoever rebuilds it (like, for_weights, load), or by its first attach
        self.target_family: str | None = None if layer is not None else target_config.model_type
        hidden = config.hidden_size
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layer = decoder_layer_class(config.model_type)(config, layer_idx=0)
        self.layer.input_layernorm = nn.Identity()  # EAGLE: the fused input is not normalized again
        if draft_vocab is not None:
            self.register_buffer("draft_to_target", _checked_draft_vocab(draft_vocab, config.vocab_size))
        else:
            self.draft_to_target = None
        self._target: LeanForward | None = None
        self._head_cache: tuple | None = None
        self._fused_projections: FusedLayer | None = None  # an inference copy's q/k/v and gate/up GEMMs

    # -- the target's frozen tensors: referenced, never owned -------------------------------------------

    def attach(self, target) -> "EagleDrafter":
        """Bind to a target model (a transformers causal LM, a `LoadedModel` or a LeanForward): its embedding and
        lm_head, and its forward helpers."""
        if isinstance(target, LoadedModel):
            target = target.model
        if not isinstance(target, (LeanForward, nn.Module)):
            raise DrafterError(f"a drafter attaches to a transformers causal LM, a LoadedModel or a LeanForward, "
                               f"got {type(target).__name__}")
        lean = target if isinstance(target, LeanForward) else LeanForward(target)
        spec = ModelSpec.from_config(self.config)
        expected = (lean.spec.hidden_size, lean.spec.num_heads, lean.spec.num_kv_heads, lean.spec.head_dim,
                    lean.spec.vocab_size)
        found = (spec.hidden_size, spec.num_heads, spec.num_kv_heads, spec.head_dim, spec.vocab_size)
        if expected != found:
            raise DrafterError(f"drafter shapes (hidden, heads, kv heads, head dim, vocab) {found} do not fit "
                               f"the target's {expected}")
        if not fits_target(spec.model_type, lean.spec.model_type):
            raise DrafterError(f"a drafter with a {spec.model_type} layer does not fit a {lean.spec.model_type} "
                               f"target (its own family's layer or a Llama one does)")
        object.__setattr__(self, "_target", lean)  # a plain attribute: not a submodule, not in state_dict
        self.target_family = _checked_family(self.target_family, lean.spec.model_type)
        _warn_if_positions_differ(self.config, lean.decoder.config)
        return self.to(device=lean.device, dtype=lean.dtype)

    def inference_copy(self, target: LeanForward) -> "EagleDrafter":
        """A copy of this drafter's weights attached to `target` in its dtype (e.g. a bf16 rollout), leaving this
        one (maybe an fp32 drafter in training) as it is."""
        copy_ = self.like(self.draft_to_target).attach(target)
        # never trained: its q/k/v and gate/up projections become views of one weight each, one GEMM instead of
        # three and two per draft pass (as the rollout copy of the target). After attach, whose dtype or device
        # move would replace the views; before the weights load, which fill them.
        fused = copy_._fused_projections = fuse_layer(copy_.layer)
        # On the target's Triton kernels the post-attention norm's weight folds into gate/up, as in the target's
        # rollout copy (models/rollout_copy.py): the SiLU kernel normalizes, no norm kernels in a drafting pass
        # (~5 operations each). Not in fp16 (the un-normalized residual's range), not with MLP biases.
        fused.gate_up_norm_folded = (target.kernels == "triton" and target.dtype != torch.float16
                                     and fused.gate_up_weight is not None)
        copy_.load_serving_weights(self)
        return copy_

    @classmethod
    def for_weights(cls, target_config, weights: dict, draft_vocab: torch.Tensor | None = None) -> "EagleDrafter":
        """A new, unattached drafter for `target_config`'s target whose layer holds `weights`' names: the target
        family's or a Llama one. A checkpoint may hold either for a Qwen3 target (a new drafter's layer is Llama's
        since 2026-12-02, a run started before has Qwen3's), or a Llama layer given as run.drafter."""
        names = layer_weight_names(weights)
        for config in layer_configs(target_config):
            with torch.device("meta"):  # names only: no memory, no initialization (a large target's layer)
                empty = cls(config, None, layer=config.model_type)
            if layer_weight_names(empty.state_dict()) == names:
                drafter = cls(config, draft_vocab, layer=config.model_type)
                drafter.target_family = target_config.model_type
                return drafter
        own = layer_weight_names(empty.state_dict())
        raise DrafterError(f"these drafter weights fit no drafter layer of a {target_config.model_type} target "
                           f"(its family's or Llama's): not in a Llama layer {sorted(names - own)[:3]}, missing "
                           f"{sorted(own - names)[:3]}")

    def like(self, draft_vocab: torch.Tensor | None) -> "EagleDrafter":
        """A new, unattached drafter with this one's layer config (its family kept) over `draft_vocab`."""
        drafter = type(self)(self.config, draft_vocab, layer=self.config.model_type)
        drafter.target_family = self.target_family
        return drafter

    @torch.no_grad()
    def load_serving_weights(self, source: "EagleDrafter") -> None:
        """Load `source`'s weights into this drafter in place (captured graphs read its tensors: a hot swap
        keeps them). Into an inference copy with a folded post-attention norm, gate/up get W diag(g), computed
        at the source's precision and rounded once. The source must hold plain weights: a folded copy's gate/up
        already carry g (folding them again would scale by g twice)."""
        if source._fused_projections is not None and source._fused_projections.gate_up_norm_folded:
            raise DrafterError("load_serving_weights: the source is a serving copy with its norm folded in; load "
                               "from the drafter it was made from")
        self.load_state_dict(source.state_dict())
        fused = self._fused_projections
        if fused is not None and fused.gate_up_norm_folded:
            norm = source.layer.post_attention_layernorm.weight.detach()
            for name in ("gate_proj", "up_proj"):
                getattr(self.layer.mlp, name).weight.copy_(getattr(source.layer.mlp, name).weight.detach() * norm)

    @property
    def target(self) -> LeanForward:
        if self._target is None:
            raise DrafterError("the drafter is not attached to a target model: call attach(target)")
        return self._target

    @property
    def draft_vocab_size(self) -> int:
        return self.config.vocab_size if self.draft_to_target is None else self.draft_to_target.shape[0]

    def head_weight(self) -> torch.Tensor:
        """lm_head rows of the draft vocabulary. The slice is one buffer, re-copied in place only when the target's
        lm_head changed in place (a policy update, a rollout-copy refresh): a CUDA graph that read it stays valid."""
        weight = self.target.lm_head.weight
        if self.draft_to_target is None:
            return weight
        if self._head_cache is not None and torch.compiler.is_compiling():
            # Inside a compiled speculative step: the graph runner refreshed the slice just before it, and the
            # key below (a data-pointer comparison) would break the compiled graph at every drafter pass.
            return self._head_cache[1]
        key = (weight.data_ptr(), weight._version)
        if self._head_cache is None:
            self._head_cache = (key, weight.detach()[self.draft_to_target])
        elif self._head_cache[0] != key:
            buffer = self._head_cache[1]
            torch.index_select(weight.detach(), 0, self.draft_to_target, out=buffer)
            self._head_cache = (key, buffer)
        return self._head_cache[1]

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.draft_to_target is None else self.draft_to_target[draft_ids]

    def target_to_draft(self) -> torch.Tensor | None:
        """[V] int32: each target token's index in the draft vocabulary, -1 outside it (None: no draft vocabulary).
        Made once per device: a serving drafter's vocabulary never changes (a hot swap loads weights in place
        only into a drafter of the same vocabulary), so a captured step may read it."""
        if self.draft_to_target is None:
            return None
        inverse = self.__dict__.get("_target_to_draft")
        if inverse is None or inverse.device != self.draft_to_target.device:
            inverse = inverse_vocabulary(self.draft_to_target, self.config.vocab_size)
            if not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()):
                self.__dict__["_target_to_draft"] = inverse  # not memory a graph's pool owns
        return inverse

    # -- forward ------------------------------------------------------------------------------------------

    def fuse(self, tokens: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """fc([embed(x_{t+1}); f_t]) -> [B, T, H]."""
        # detached: training the drafter must never leave gradients on the target's (policy's) embedding
        fused = torch.cat([self.target.embed(tokens).detach(), features.to(self.fc.weight.dtype)], dim=-1)
        if torch.is_grad_enabled():
            return self.fc(fused)
        return self.target.linear(fused, self.fc.weight, None)  # the target's fast inference linear

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary; hidden [..., H]."""
        if torch.is_grad_enabled():
            return F.linear(hidden, self.head_weight().detach())  # the target's lm_head is not trained here
        flat = hidden.reshape(-1, hidden.shape[-1])  # 2-D: a 3-D input would turn into a slow batched matmul
        return self.target.project(flat, self.head_weight()).view(*hidden.shape[:-1], -1)

    def new_cache(self, max_rows: int, max_len: int) -> KVCache:
        lean = self.target
        return KVCache(lean.spec, max_rows, max_len, num_layers=1, device=lean.device, dtype=lean.dtype)

    @torch.no_grad()
    def step(self, tokens: torch.Tensor, features: torch.Tensor, cache: CacheRows, positions: torch.Tensor,
             new_token_mask: torch.Tensor | None = None, *, lengths: torch.Tensor | None = None,
             kv_len: int | None = None, tables: tuple | None = None) -> torch.Tensor:
        """Inference over T new pairs per row (KV written uncommitted at slots lengths + t); returns ĥ [B, T, H].

        lengths [B] (default: the cache's host lengths) and kv_len (default: the longest row + T) as in
        `LeanForward.run`: device lengths and a fixed kv_len make the step CUDA-graph safe. tables: (slots,
        bias, cos, sin) made ahead for this call (`ChainTables.at`), instead of from positions and lengths."""
        lean = self.target
        x = self.fuse(tokens, features)
        if tables is not None:
            return lean.layer(self.layer, 0, x, x, tables[2], tables[3], cache, tables[0], tables[1],
                              fused=self._fused_projections)
        num_new = tokens.shape[1]
        lengths = cache.lengths if lengths is None else lengths
        slots = lengths.to(x.device)[:, None] + torch.arange(num_new, device=x.device)[None, :]
        bias = lean.attention_bias(lengths, num_new, new_token_mask, kv_len, mask_capacity(cache), x.dtype)
        cos, sin = lean.rope(x, positions.to(x.device))
        return lean.layer(self.layer, 0, x, x, cos, sin, cache, slots, bias, fused=self._fused_projections)

    def tree_tables(self, cache: CacheRows, base: torch.Tensor, depth: int, k: int, kv_len: int | None) -> TreeTables:
        """A tree's drafting tables (`TreeTables`) for its depth - 1 passes of K new nodes each, over drafter
        cache rows whose committed lengths are base [B] (device); kv_len as in `step` (None: each pass's own span,
        read from the host)."""
        device = base.device
        nodes = (depth - 1) * k
        local = torch.arange(nodes, device=device)
        capacity = mask_capacity(cache)
        if kv_len is None:  # eager: each pass attends over its own span, as `step` would (host reads)
            longest = int(base.max())
            spans = [aligned_span(longest + (p + 1) * k, capacity) for p in range(depth - 1)]
        else:
            spans = [aligned_span(kv_len, capacity)] * (depth - 1)
        width = max(spans)
        slots = base[:, None] + local[None, :]
        dtype = self.fc.weight.dtype
        # every row starts as the committed slots (a row is filled before any pass reads it); the root's
        # children (rows 0 .. K - 1) also see themselves
        committed = torch.arange(width, device=device)[None, None, :] < base[:, None, None]   # [B, 1, S]
        bias = torch.full((base.shape[0], nodes, width), float("-inf"), dtype=dtype, device=device)
        bias.masked_fill_(committed, 0.0)
        bias[:, :k].scatter_(2, slots[:, :k, None], 0.0)
        # a node fed at local index i sits at slot base + i, at position base + its depth - 1 = base + i // K
        cos, sin = self.target.rope(torch.empty(0, dtype=dtype, device=device), base[:, None] + local[None, :] // k)
        lean = self.target
        return TreeTables(slots, cos, sin, bias, spans, lean.spec.num_heads // lean.spec.num_kv_heads,
                          lean._fused_kernels)

    def chain_tables(self, cache: CacheRows, base: torch.Tensor, passes: int, kv_len: int | None) -> "ChainTables":
        """What a chain's drafting passes need besides their pair, for all of them at once: pass p feeds one pair
        at slot and position base + p [B] and sees every slot up to it. One set of kernels per step instead of one
        per pass (a GPU step is launch-bound)."""
        device = base.device
        offsets = base[:, None] + torch.arange(passes, device=device)[None, :]              # [B, P]
        capacity = mask_capacity(cache)
        if kv_len is None:  # eager: each pass attends over its own span, as `step` would (host reads)
            spans = [aligned_span(int(offsets[:, p].max()) + 1, capacity) for p in range(passes)]
        else:
            spans = [aligned_span(kv_len, capacity)] * passes
        visible = torch.arange(max(spans), device=device)[None, None, None, :] <= offsets[:, None, :, None]
        dtype = self.fc.weight.dtype
        # each pass feeds one token, so no query groups to expand: passes sit where a forward's tokens would
        bias = grouped_attention_bias(visible, 1, dtype)                                  # [B, 1, P, S]
        cos, sin = self.target.rope(torch.empty(0, dtype=dtype, device=device), offsets)
        return ChainTables(offsets, bias, cos, sin, spans)

    def forward(self, tokens: torch.Tensor, features: torch.Tensor, positions: torch.Tensor,
                attention: torch.Tensor) -> torch.Tensor:
        """Training forward over packed pairs (grad enabled): attention [B, T, T] bool -> ĥ [B, T, H]."""
        x = self.fuse(tokens, features)
        cos, sin = self.target.decoder.rotary_emb(x, positions)
        bias = torch.zeros(attention.shape, dtype=x.dtype, device=x.device).masked_fill(~attention, float("-inf"))
        out = self.layer(x, attention_mask=bias[:, None], position_ids=positions, position_embeddings=(cos, sin))
        return out[0] if isinstance(out, tuple) else out

    # -- persistence ----------------------------------------------------------------------------------------

    def save(self, directory: str | Path) -> None:
        directory = Path(directory)
        refuse_a_file_in_the_way(directory, "drafter directory", DrafterError)  # (mkdir said "File exists": QA)
        directory.mkdir(parents=True, exist_ok=True)
        tensors = {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}
        save_checked_tensors(directory / WEIGHTS_FILE, tensors)
        text = json.dumps({
            "target_config": self.config.to_dict(),  # its layer's config (the name is older than the Llama layers)
            "target_family": self.target_family,
            "draft_vocab_size": None if self.draft_to_target is None else int(self.draft_to_target.shape[0]),
        }, indent=1)
        write_whole(directory / CONFIG_FILE, lambda path: path.write_text(text))

    @classmethod
    def load(cls, directory: str | Path, target) -> "EagleDrafter":
        from transformers import AutoConfig

        directory = check_drafter_dir(directory)
        meta = read_drafter_meta(directory)
        try:
            settings = dict(meta["target_config"])
            config = AutoConfig.for_model(settings.pop("model_type"), **settings)
            tensors = load_checked_tensors(directory / WEIGHTS_FILE)  # a file cut short fails here, saying so
        except DamagedFileError as error:
            raise DrafterFileError(f"{directory}: {error}") from None
        except Exception as error:  # noqa: BLE001 - bad JSON, missing keys, corrupt safetensors
            # first_line: transformers' config validation puts its reason on the line after "...validator X:"
            raise DrafterFileError(f"{directory}: cannot read the drafter ({type(error).__name__}: "
                               f"{first_line(error)})") from None
        vocab = tensors.get("draft_to_target")
        if "draft_vocab_size" in meta and meta["draft_vocab_size"] != (None if vocab is None else int(vocab.shape[0])):
            # a weights file without its draft vocabulary loaded as a full-vocabulary drafter, every draft wrong
            raise DrafterFileError(f"{directory}: its config has a draft vocabulary of {meta.get('draft_vocab_size')} "
                               f"tokens, its weights {'none' if vocab is None else int(vocab.shape[0])}")
        drafter = cls(config, vocab, layer=config.model_type)  # a drafter saved with a Qwen3 layer keeps it
        drafter.target_family = _saved_family(meta, directory)  # None if saved before 2026-12-02: its first target's
        drafter.attach(target)
        own = drafter.state_dict()
        unexpected = sorted(k for k in tensors if k not in own)
        reshaped = sorted(k for k, v in tensors.items() if k in own and own[k].shape != v.shape)
        missing = sorted(set(own) - set(tensors))
        if unexpected or reshaped or missing:
            found = [f"{what} {names[:3]}" for what, names in (("not in its config:", unexpected),
                     ("of another shape:", reshaped), ("missing:", missing)) if names]
            raise DrafterError(f"{directory}: drafter weights do not match its config ({'; '.join(found)})")
        drafter.load_state_dict(tensors)
        return drafter.to(device=drafter.target.device, dtype=drafter.target.dtype)


def layer_weight_names(weights: dict) -> set[str]:
    """A drafter state dict's weight names, less its draft vocabulary (a buffer, not a weight of the layer)."""
    return {name for name in weights if name != "draft_to_target"}


def _saved_family(meta: dict, directory: Path) -> str | None:
    """drafter_config.json's target_family: the family its drafter was made for, None if it does not say."""
    family = meta.get("target_family")
    if family is not None and not isinstance(family, str):
        raise DrafterFileError(f"{directory / CONFIG_FILE}: target_family is {family!r}, not a model type")
    return family


def _checked_family(made_for: str | None, target_family: str) -> str:
    """The family a drafter drafts for once attached to a `target_family` target. One made for another family
    whose shapes and vocabulary happen to fit (a Llama-layer drafter of a Qwen3 target on a Llama model) stays
    lossless but was trained on other features: said once per pair, and it keeps the family it was made for."""
    if made_for is None:
        return target_family
    if made_for != target_family and (made_for, target_family) not in WARNED_FAMILIES:
        WARNED_FAMILIES.add((made_for, target_family))
        log.warning("this drafter was made for a %s model and now drafts for a %s one: it stays lossless, but "
                    "was trained on another model's features and will be accepted less", made_for, target_family)
    return made_for


def _warn_if_positions_differ(drafter_config, target_config) -> None:
    """A drafter built for another target of the same shapes (e.g. another RoPE scaling) drafts with its target's
    RoPE, which is not what it was trained with: said once per pair (its export carries the target's)."""
    # as sorted JSON: equal settings whose keys a save wrote in another order are the same RoPE (found by QA)
    ours, theirs = (json.dumps(getattr(config, "rope_parameters", None) or getattr(config, "rope_theta", None),
                               sort_keys=True, default=str) for config in (drafter_config, target_config))
    if ours == theirs or (ours, theirs) in WARNED_POSITIONS:
        return
    WARNED_POSITIONS.add((ours, theirs))
    log.warning("the drafter was built for a target with RoPE %s; this target's is %s: it drafts (and is "
                "exported) with the target's. A drafter trained for another model is accepted less.", ours, theirs)
