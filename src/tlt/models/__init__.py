"""Model loading, the lean batched forward over a KV cache, and (later) the EAGLE drafter."""

from tlt.models.kv_cache import CacheRows, KVCache
from tlt.models.lean_forward import ForwardOutput, LeanForward
from tlt.models.loading import LoadedModel, load_model
from tlt.models.model_files import save_model_dir
from tlt.models.spec import SUPPORTED_ARCHITECTURES, ModelSpec

__all__ = ["CacheRows", "ForwardOutput", "KVCache", "LeanForward", "LoadedModel", "ModelSpec",
           "SUPPORTED_ARCHITECTURES", "load_model", "save_model_dir"]
