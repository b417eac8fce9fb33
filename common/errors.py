"""The one user-facing error type: a bad configuration value, said in one sentence."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user-facing configuration error: the key, the bad value and what is allowed."""

    def __init__(self, key: str, value: object, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r}: {allowed}")

    def prefixed(self, prefix: str) -> ConfigError:
        """The same error with the key qualified by its parent (`steps` -> `train.steps`)."""
        return ConfigError(f"{prefix}.{self.key}" if prefix else self.key, self.value, self.allowed)
