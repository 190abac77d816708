"""Loading the frozen model that hosts cartridges, and naming it by a fingerprint.

A model comes from a packaged one by name (the default SmolLM2-135M-Instruct, or
Gemma 3 270M: GGUFs inside PyPI packages, converted once into safetensors, see
`packaged.py`), a local HF directory, a GGUF file, or a hub id already in the local
cache. Nothing is ever downloaded.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cartridges.core.attention import use_grouped_sdpa
from cartridges.core.errors import ModelError
from cartridges.core.packaged import DEFAULT_MODEL, PACKAGED, ensure_packaged, read_gguf
from cartridges.core.speed import DtypeChoice, choose_dtype, dtype_name, model_shape, threads_record

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Config fields that change what the weights compute; volatile bookkeeping is left out
# so a GGUF load and its converted directory share one fingerprint.
_SEMANTIC_CONFIG_KEYS = (
    "model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
    "num_attention_heads", "num_key_value_heads", "head_dim", "rope_theta", "rope_parameters",
    "rope_scaling", "rms_norm_eps", "max_position_embeddings", "tie_word_embeddings",
    "sliding_window", "layer_types", "final_logit_softcapping", "attn_logit_softcapping",
    "hidden_act", "attention_bias", "mlp_bias",
)


@dataclass
class LoadedModel:
    """A frozen causal LM, its tokenizer, and facts the engine needs about it."""

    model: torch.nn.Module
    tokenizer: object
    name: str
    load_seconds: float = 0.0
    dtype_reason: str = "set by the caller"
    _fingerprint: dict | None = field(default=None, repr=False)

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        return next(self.model.parameters()).dtype

    def dtype_record(self) -> dict:
        """The dtype the model runs in and why, and the threads: run summaries and `--json` carry them."""
        return {**DtypeChoice(self.dtype, self.dtype_reason).record(), **threads_record()}

    @property
    def fingerprint(self) -> dict:
        if self._fingerprint is None:
            self._fingerprint = model_fingerprint(self.model, self.tokenizer)
        return self._fingerprint

    @property
    def compute_id(self) -> str:
        """The fingerprint id plus the dtype: what stage artifacts computed by this model depend on."""
        return fingerprint_id({**self.fingerprint, "dtype": dtype_name(self.dtype)})

    @property
    def context_length(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048) or 2048)


def _from_dir_or_hub(spec: str, dtype: torch.dtype | None):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    kwargs: dict = {"local_files_only": True}
    if dtype is not None:
        kwargs["dtype"] = dtype
    where = "directory" if Path(spec).is_dir() else "hub id (offline, local cache only)"
    try:
        config = AutoConfig.from_pretrained(spec, local_files_only=True)
    except Exception as exc:
        raise ModelError(f"{spec}: cannot load model from {where} ({one_line(exc)})") from exc
    reason = config_reason(config)
    if reason:  # refused before any weights are read
        raise ModelError(f"{spec} ({config.model_type}): cannot host cartridges: {reason}")
    try:
        model = AutoModelForCausalLM.from_pretrained(spec, **kwargs)
        tokenizer = AutoTokenizer.from_pretrained(spec, local_files_only=True)
    except Exception as exc:
        raise ModelError(f"{spec}: cannot load model from {where} ({one_line(exc)})") from exc
    return model, tokenizer


def pick_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        return torch.device(device)
    except RuntimeError as exc:
        raise ModelError(f"--device {device}: {exc}") from exc


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    """`--dtype` as given: None or 'auto' (the fastest on this machine, `speed.choose_dtype`), or a
    name in DTYPES."""
    if name is None or isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return None
    if name not in DTYPES:
        raise ModelError(f"--dtype {name}: choose auto or one of {', '.join(DTYPES)}")
    return DTYPES[name]


def load_model(
    spec: str | None = None, device: str | None = None, dtype: torch.dtype | str | None = None
) -> LoadedModel:
    """Load and freeze a model. `spec` is None or a packaged name, a directory, a .gguf file or a hub id."""
    start = time.perf_counter()
    dev = pick_device(device)
    requested = parse_dtype(dtype)
    dtype = requested or torch.float32  # auto: weights load in float32, the probe then decides
    if spec in (None, "", "default"):
        spec = DEFAULT_MODEL
    if spec in PACKAGED:
        name = spec
        model, tokenizer = _from_dir_or_hub(str(ensure_packaged(spec)), dtype)
    elif spec.endswith(".gguf"):
        path = Path(spec)
        if not path.is_file():
            raise ModelError(f"{spec}: no such GGUF file")
        name = path.stem
        model, tokenizer = read_gguf(path)
    else:
        if not Path(spec).exists() and ("/" not in spec or spec.startswith((".", "/"))):
            raise ModelError(f"{spec}: no such model directory")
        name = Path(spec).name or spec
        model, tokenizer = _from_dir_or_hub(spec, dtype)
    choice = DtypeChoice(requested, "requested") if requested else choose_dtype(dev, model_shape(model.config))
    model = model.to(device=dev, dtype=choice.dtype)
    return LoadedModel(
        model=freeze(model, name), tokenizer=tokenizer, name=name,
        load_seconds=time.perf_counter() - start, dtype_reason=choice.reason,
    )


def wrap(model: torch.nn.Module, tokenizer: object, name: str = "custom") -> LoadedModel:
    """Host an in-memory model (tests build tiny random ones from a config)."""
    return LoadedModel(model=freeze(model, name), tokenizer=tokenizer, name=name)


def freeze(model: torch.nn.Module, name: str | None = None) -> torch.nn.Module:
    """Only cartridge rows train: every weight is frozen and the model is in eval mode."""
    model.requires_grad_(False)
    model.eval()
    check_supported(model, name)
    use_grouped_sdpa(model)
    return model


# Layer kinds whose attention reads an ordinary per-layer K/V cache through a mask.
HOSTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def check_supported(model: torch.nn.Module, name: str | None = None) -> None:
    """Refuse, in one line naming the model and the reason, a model whose cache the engine cannot host."""
    reason = unsupported_reason(model)
    if reason:
        label = f"{name} ({type(model).__name__})" if name else type(model).__name__
        raise ModelError(f"{label}: cannot host cartridges: {reason}")


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why a cartridge cannot enter this model's cache, or None when it can.

    A cartridge is per-layer K/V rows in a standard transformers cache read by causal
    self-attention; past what the config says, the model runs on two tokens and its
    cache is read.
    """
    return config_reason(model.config) or _cache_reason(model)


def config_reason(cfg) -> str | None:
    """What the config alone says against hosting a cartridge (checked before weights load too)."""
    if getattr(cfg, "is_encoder_decoder", False):
        return "an encoder-decoder model (a cartridge is a prefix of a decoder-only model's self-attention cache)"
    shared = getattr(cfg, "num_kv_shared_layers", 0) or getattr(cfg, "kv_shared_layers", 0)
    if shared:
        return f"shares KV across layers ({shared} layers); a cartridge needs independent K/V rows per layer"
    if getattr(cfg, "use_bidirectional_attention", False):
        return "its attention is bidirectional, so real tokens would not simply follow the prefix"
    other = sorted(set(getattr(cfg, "layer_types", None) or ()) - set(HOSTED_LAYER_TYPES))
    if other:
        return f"layer types {', '.join(other)} do not read a standard K/V cache through a mask"
    return None


def _cache_reason(model: torch.nn.Module) -> str | None:
    layers = getattr(model.config, "num_hidden_layers", None)
    try:
        rows = own_cache(model, torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device))
    except Exception as exc:  # any failure here means the forward does not take a standard cache
        return f"its forward does not fill a standard transformers cache ({type(exc).__name__}: {one_line(exc)})"
    standard = all(
        isinstance(t, torch.Tensor) and t.dim() == 4 and t.shape[2] == 2 for pair in rows for t in pair
    )
    if not rows or not standard or (layers is not None and len(rows) != layers):
        return (f"a non-standard cache ({len(rows)} entries for {layers} layers, not one "
                "[batch, heads, tokens, dim] K/V pair per layer)")
    return None


def one_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def cache_keyword(model: torch.nn.Module) -> str:
    """transformers renamed the forward's `past_key_values` to `cache`; support both."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def backbone(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack without the output head (so unsupervised rows are never projected)."""
    inner = getattr(model, model.base_model_prefix, None)
    if inner is None:
        raise ModelError(f"{type(model).__name__}: cannot find the decoder backbone")
    return inner


def project(model: torch.nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """Output head on selected hidden rows, with the model's logit soft-capping if any."""
    logits = model.get_output_embeddings()(hidden)
    cap = getattr(model.config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def read_cache(cache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per-layer (keys, values) of a cache, `[B, H, T, d]`, across cache API versions."""
    if hasattr(cache, "layers"):
        return [(layer.keys, layer.values) for layer in cache.layers]
    return list(zip(cache.key_cache, cache.value_cache, strict=True))


@torch.no_grad()
def own_cache(model: torch.nn.Module, input_ids: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """The cache rows the model itself writes for `input_ids` `[B, T]`: per layer `[B, H, T, d]`."""
    from transformers import DynamicCache

    cache = DynamicCache()
    target = backbone(model)
    target(input_ids=input_ids, use_cache=True, **{cache_keyword(target): cache})
    return read_cache(cache)


def probe_geometry(model: torch.nn.Module) -> list[list[int]]:
    """Per-layer `[kv_heads_k, head_dim_k, kv_heads_v, head_dim_v]`, read off a real cache."""
    device = next(model.parameters()).device
    rows = own_cache(model, torch.zeros(1, 1, dtype=torch.long, device=device))
    return [[k.shape[1], k.shape[3], v.shape[1], v.shape[3]] for k, v in rows]


def _hash(obj: object) -> str:
    blob = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def model_fingerprint(model: torch.nn.Module, tokenizer: object) -> dict:
    """Architecture, per-layer KV geometry, and hashes of config, tokenizer and weights."""
    cfg = model.config.to_dict()
    config_view = {k: cfg.get(k) for k in _SEMANTIC_CONFIG_KEYS if k in cfg}
    vocab = sorted(tokenizer.get_vocab().items()) if hasattr(tokenizer, "get_vocab") else []
    tok_view = {
        "vocab": vocab,
        "chat_template": getattr(tokenizer, "chat_template", None),
        "special": sorted(map(str, getattr(tokenizer, "all_special_tokens", []))),
    }
    emb = model.get_input_embeddings().weight
    # Rounded to bfloat16 first, so the same weights loaded in float32 or bfloat16 share one
    # fingerprint and a cartridge trained in one dtype serves in the other.
    sample = emb[: min(8, emb.shape[0])].detach().to(torch.bfloat16).float().cpu().numpy().tobytes()
    return {
        "architecture": type(model).__name__,
        "model_type": cfg.get("model_type"),
        "layers": probe_geometry(model),
        "config_hash": _hash(config_view),
        "tokenizer_hash": _hash(tok_view),
        "weights_hash": hashlib.sha256(sample).hexdigest()[:16],
    }


def fingerprint_id(fingerprint: dict) -> str:
    """A short stable id for a model fingerprint (stages put it in their configs)."""
    return _hash(fingerprint)
