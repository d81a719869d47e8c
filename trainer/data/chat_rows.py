"""The rows of `data=chat`, checked: a conversation (`messages`) or a prompt and its completion.

A row holds either `messages`, a list of `{"role", "content"}` (roles: system, user,
assistant, tool; other keys such as `tool_calls` pass through to the template), or `prompt`
and `completion`, each a string (a user message, an assistant message) or a message list.
Anything else is refused in one paragraph naming the file and line (`chat.jsonl:5`) and what
was expected. Keys whose value is null are dropped, as `apply_chat_template` drops them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from trainer.data.encoding import BadRecord

COLUMNS = ("messages", "prompt", "completion")
ROLES = ("system", "user", "assistant", "tool")
EXPECTED = (
    'data=chat reads rows of "messages" (a list of {"role", "content"}, roles '
    + ", ".join(ROLES)
    + ') or of "prompt" and "completion" (strings, or message lists)'
)
HINT = EXPECTED + "."  # said once after all the bad rows of a file


@dataclass
class Conversation:
    """A checked row: its messages and, for a prompt/completion row, how many of them are the
    prompt (None for a `messages` row)."""

    messages: list[dict[str, Any]]
    prompt_len: int | None = None


def _message(raw: Any, where: str, field: str, n: int, hint: str) -> dict[str, Any]:
    what = f"data.path: {where}: message {n} of {field!r}"
    if not isinstance(raw, dict):
        raise BadRecord(
            f"{what} is a {type(raw).__name__} ({repr(raw)[:60]}), not an object with "
            f'"role" and "content".',
            hint,
        )
    message = {k: v for k, v in raw.items() if v is not None}
    role = message.get("role")
    if role not in ROLES:
        raise BadRecord(
            f"{what} has role {role!r}; valid roles: {', '.join(ROLES)}."
            if "role" in message
            else f"{what} has no role (its keys: {', '.join(map(repr, raw)) or 'none'}).",
            hint,
        )
    content = message.get("content")
    if content is None and not message.get("tool_calls"):
        raise BadRecord(
            f"{what} ({role}) has no content (only an assistant message with tool_calls may "
            f"leave it out).",
            hint,
        )
    if content is not None and not isinstance(content, str):
        raise BadRecord(
            f"{what} ({role}) has content of type {type(content).__name__} "
            f"({repr(content)[:60]}); content must be a string.",
            hint,
        )
    return message


def message_list(
    value: Any, where: str, field: str, as_role: str | None, hint: str = HINT
) -> list[dict[str, Any]]:
    """The row's `field`, checked: a message list, or a string as one message of role
    `as_role` (None: a string is refused). `hint` says what rows are valid (data=chat's, or
    the reader's that shares these checks: data=preference)."""
    if isinstance(value, str) and as_role is not None:
        return [{"role": as_role, "content": value}]
    if not isinstance(value, list):
        kinds = "a list of messages" + ("" if as_role is None else " or a string")
        raise BadRecord(
            f"data.path: {where}: {field!r} is a {type(value).__name__} "
            f"({repr(value)[:60]}), expected {kinds}.",
            hint,
        )
    if not value:
        raise BadRecord(f"data.path: {where}: {field!r} is an empty list.", hint)
    return [_message(m, where, field, i, hint) for i, m in enumerate(value, 1)]


def conversation(record: dict[str, Any], where: str) -> Conversation:
    """The row `record` (its `COLUMNS` that it has) at `where` (`FILE:LINE`), checked."""
    record = {k: v for k, v in record.items() if v is not None}
    if "messages" in record:
        return Conversation(message_list(record["messages"], where, "messages", None))
    if "prompt" in record:
        if "completion" not in record:
            raise BadRecord(f'data.path: {where} has a "prompt" but no "completion".', HINT)
        prompt = message_list(record["prompt"], where, "prompt", "user")
        completion = message_list(record["completion"], where, "completion", "assistant")
        return Conversation(prompt + completion, len(prompt))
    raise BadRecord(
        f'data.path: {where} has neither "messages" nor "prompt" (its fields: '
        f"{', '.join(map(repr, record)) or 'none'}).",
        HINT,
    )
