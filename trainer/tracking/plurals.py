"""A count with its noun in the right number, for what the console and reports say."""

from __future__ import annotations


def counted(n: int, noun: str, plural: str | None = None) -> str:
    """`counted(1, "rank")` is "1 rank", `counted(2, "rank")` "2 ranks"; `plural` for a noun
    that does not take an s ("1 process", `counted(2, "process", "processes")`)."""
    return f"{n} {noun if n == 1 else plural or noun + 's'}"
