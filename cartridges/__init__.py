"""Cartridges: trained KV-cache prefixes hosted inside a frozen causal LM."""

from cartridges.core.cartridge import Cartridge, compose_rows
from cartridges.core.errors import (
    CartridgeError,
    CartridgeFileError,
    CorpusError,
    GeometryError,
    ModelError,
)
from cartridges.core.models import LoadedModel, load_model

__all__ = [
    "Cartridge",
    "CartridgeError",
    "CartridgeFileError",
    "CorpusError",
    "GeometryError",
    "LoadedModel",
    "ModelError",
    "compose_rows",
    "load_model",
]
