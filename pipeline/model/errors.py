"""The one error type a model file can raise, so callers print one clear line."""


class ModelFileError(Exception):
    """A model file that cannot be served: not GGUF, unsupported, or incomplete."""


class BackendUnavailable(Exception):
    """A backend this machine cannot run (no torch, no C compiler): one clear line, never a fallback
    that would silently change the numbers a request was promised."""
