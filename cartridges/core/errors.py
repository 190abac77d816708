"""User-facing errors: one small hierarchy, caught once at the CLI edge."""


class CartridgeError(Exception):
    """A problem the user can fix; the message names the input and what is wrong."""


class ModelError(CartridgeError):
    """The model cannot be found, loaded, or hosted by the engine."""


class CorpusError(CartridgeError):
    """A corpus file or text is unusable (missing, binary, empty, too short...)."""


class CartridgeFileError(CartridgeError):
    """A cartridge file is truncated, corrupted, or of an unknown format."""


class GeometryError(CartridgeError):
    """A cartridge does not fit a model, or parts of a composition disagree."""


class FleetError(CartridgeError):
    """A fleet directory is missing, corrupted, or does not match the model or documents."""
