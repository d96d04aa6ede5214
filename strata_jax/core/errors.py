"""User-facing errors. Every message names the problem and what to do about it."""


class StrataError(Exception):
    """Base class: an error the user can act on (bad file, bad option, unsupported model)."""


class GGUFFormatError(StrataError):
    """The file is not a readable GGUF: bad magic, truncated, corrupt metadata."""


class UnsupportedArchitectureError(StrataError):
    """general.architecture names a model family strata-jax does not implement."""


class UnsupportedQuantTypeError(StrataError):
    """A tensor uses a GGML type without a dequantizer here."""


class MissingTensorError(StrataError):
    """A tensor the architecture needs is absent from the file."""


class TensorShapeError(StrataError):
    """A tensor's shape disagrees with the shape the metadata implies."""


class ConfigError(StrataError):
    """An option or request value is invalid."""


class HubError(StrataError):
    """A hub listing or download failed, or a downloaded file did not verify."""
