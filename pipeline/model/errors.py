"""The one error type a model file can raise, so callers print one clear line."""


class ModelFileError(Exception):
    """A model file that cannot be served: not GGUF, unsupported, or incomplete."""
