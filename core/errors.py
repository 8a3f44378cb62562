"""The errors core raises about its configuration and its model. Pure Python.

`ConfigError` carries the name of the field at fault (an `EngineConfig` or `SamplingParams` field, or "model"), so
a caller names its own option for it without reading the message.
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A configuration value core cannot use. `str()` is the message alone (it starts with the field's name where
    that reads well); `field` names the field; `value`, where given, is the value at fault."""

    def __init__(self, field: str, message: str, value: object = None) -> None:
        self.field = field
        self.value = value
        super().__init__(message)

    def named(self, name: str) -> str:
        """The message with the field called `name` (a command-line option, say): "--max-tokens must be >= 1"."""
        message = str(self)
        if message.startswith(self.field):
            return name + message[len(self.field):]
        return f"{name}{'' if self.value is None else f' {self.value}'}: {message}"


class UnsupportedModel(ConfigError):
    """A model conveyor does not compute as it is defined (an architecture, an attention feature, a cache that is
    not plain K/V), or that is not a whole causal language model: refused before any record runs (a usage error,
    exit 2). The message names the model, its architecture and the feature."""

    def __init__(self, message: str) -> None:
        super().__init__("model", message)


class ModelLoadError(RuntimeError):
    """The model could not be found or loaded; the message says which and what to do."""


def failure(what: str, e: BaseException) -> str:
    """One line saying what raised while a step processed one request's data."""
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{what} failed: {type(e).__name__}" + (f": {text}" if text else "")


def failed_while_running(why: str) -> str:
    """The error of a request that `why` (a `failure`) ended while it ran."""
    return f"the request failed while it ran ({why}); the other requests went on"
