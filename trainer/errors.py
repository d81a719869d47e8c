"""User-facing errors: one paragraph, naming the key or file and what would be valid."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (config, data, checkpoint). Printed without a traceback."""


class ConfigError(UserError):
    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"invalid config `{key}`: {message}")
        self.key = key


def require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(key, message)
