"""The one user-facing error type: a bad configuration value, said in one sentence; and the two
checks every config schema makes with it."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user-facing configuration error: the key, the bad value and what is allowed."""

    def __init__(self, key: str, value: object, allowed: str):
        self.key, self.value, self.allowed = key, value, allowed
        super().__init__(f"{key}={value!r}: {allowed}")

    def prefixed(self, prefix: str) -> ConfigError:
        """The same error with the key qualified by its parent (`steps` -> `train.steps`)."""
        return ConfigError(f"{prefix}.{self.key}" if prefix else self.key, self.value, self.allowed)


def at_least(key: str, value: int | float | None, low: float, what: str = "an integer") -> None:
    """`key` must be `what` >= `low` (None: not set, nothing to check)."""
    if value is not None and value < low:
        raise ConfigError(key, value, f"must be {what} >= {low:g}")


def one_of(key: str, value: object, options: tuple[str, ...] | list[str]) -> None:
    """`key` must be one of `options`."""
    if value not in options:
        raise ConfigError(key, value, f"must be one of {', '.join(options)}")


class ContractError(ValueError):
    """A model that does not declare what a strategy needs (training/contract/): the message says
    what to declare."""
