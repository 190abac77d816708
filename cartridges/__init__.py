"""Cartridges: trained KV-cache prefixes hosted inside a frozen causal LM."""

from cartridges.cartridge import Cartridge, compose_rows
from cartridges.errors import (
    CartridgeError,
    CartridgeFileError,
    CorpusError,
    GeometryError,
    ModelError,
)
from cartridges.models import LoadedModel, load_model

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
