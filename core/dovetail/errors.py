"""Exceptions raised by Dovetail; each message names what was wrong and the rule."""


class DovetailError(Exception):
    """Base class of every error Dovetail raises on purpose."""


class PluginError(DovetailError):
    """A plugin could not be loaded, or broke the contract."""


class SelectionError(DovetailError):
    """A platform, attention backend, quantization method or model could not be chosen."""


class ConfigError(DovetailError, ValueError):
    """An engine argument or configuration value is invalid."""


class ModelLoadError(DovetailError):
    """A model directory, its config or its weights could not be loaded."""


class RequestError(DovetailError, ValueError):
    """A request (prompt or sampling parameters) is invalid; the message names the field."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


class WorkerError(DovetailError):
    """A worker (one rank of the engine) died or failed; the engine cannot go on and stops."""

    def __init__(self, message: str, rank: int | None = None):
        super().__init__(message)
        self.rank = rank
