"""The one error of finding and loading a model."""


class ModelLoadError(RuntimeError):
    """The configured model cannot be found or loaded; the message says which and why, in one line."""
