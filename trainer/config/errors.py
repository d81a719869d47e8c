"""User-facing errors: one paragraph, naming the key or file and what would be valid."""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user (config, data, checkpoint). Printed without a traceback."""

    # True when every rank raises the same error (rank 0 alone prints it).
    all_ranks = False
    # True when the error was printed where it arose, on the rank that `printed` it.
    quiet = False
    printed = False

    def __init__(self, message: str, *, all_ranks: bool | None = None) -> None:
        super().__init__(message)
        if all_ranks is not None:
            self.all_ranks = all_ranks


class ConfigError(UserError):
    all_ranks = True

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"invalid config `{key}`: {message}")
        self.key = key


def require(condition: bool, key: str, message: str) -> None:
    if not condition:
        raise ConfigError(key, message)
