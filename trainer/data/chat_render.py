"""Conversations rendered with a chat template, and which characters of the rendering are
supervised (`data.train_on`).

- With `{% generation %}` markers in the template (and `train_on=assistant|last_assistant`),
  the supervised characters are the marked ones, as `apply_chat_template(...,
  return_assistant_tokens_mask=True)` finds them.
- Without markers, the prefix method: each assistant turn's prefix is rendered with
  `add_generation_prompt=True`, and the turn through its end (`add_generation_prompt=False`);
  both must be prefixes of the whole conversation's rendering (a template that rewrites
  earlier turns, e.g. dropping past reasoning, is refused in one paragraph naming
  `data.chat_template`). The supervised characters are the turn after its generation prompt
  up to its end-of-turn token: trailing whitespace that the template writes between turns is
  glue the model never generates, and is left out.
- `completion`: everything after the prompt rendered with its generation prompt (the same
  check), trailing whitespace left out; `all`: every character.

Which tokens those characters are is trainer/data/chat_encode.py's (`token_mask`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from trainer.config.errors import UserError
from trainer.data.chat_rows import Conversation
from trainer.data.encoding import BadRecord

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

TRAIN_ON = ("assistant", "last_assistant", "completion", "all")
MARKERS = re.compile(r"\{%-?\s*generation\s*-?%\}")
Span = tuple[int, int]


class TemplateRefused(BadRecord):
    """The chat template cannot tell the supervised tokens apart (not prefix-preserving)."""

    of_row = False  # about the template: reported at once, not as one of the bad rows


def chat_template(
    tok: PreTrainedTokenizerFast, template_file: str | None, tokenizer_path: str | Path
) -> str:
    """`data.chat_template`'s file, else the tokenizer's own template."""
    if template_file:
        p = Path(template_file).expanduser()
        try:
            return p.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(
                f"data.chat_template: {template_file} cannot be read ({exc}); it names a Jinja "
                "file (a chat template)"
            ) from None
    template = tok.chat_template
    if isinstance(template, dict):  # named templates: the default one
        template = template.get("default")
    if not isinstance(template, str) or not template.strip():
        raise UserError(
            f"data.chat_template: the tokenizer {tokenizer_path} has no chat template; pass "
            "data.chat_template=FILE (a Jinja chat template), or a tokenizer that carries one "
            "(data.tokenizer=DIR)"
        )
    return template


@dataclass
class Renderer:
    """Renders conversations with `template` and finds their supervised characters.

    `special`: the tokenizer's special tokens by name (bos_token, eos_token, ...), which
    templates read. `origin`: which key chose the template, for errors."""

    template: str
    special: dict[str, Any]
    origin: str = "data.chat_template"

    def __post_init__(self) -> None:
        self.markers = bool(MARKERS.search(self.template))

    def apply_template(
        self, convs: list[list[dict[str, Any]]], generation_prompt: bool, where: str
    ) -> tuple[list[str], list[list[Span]]]:
        """The template applied to message lists `convs`: their texts (and the generation
        markers' spans); a template error as a `BadRecord` naming the row."""
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            texts, spans = render_jinja_template(
                conversations=convs,
                chat_template=self.template,
                add_generation_prompt=generation_prompt,
                return_assistant_tokens_mask=self.markers,
                **self.special,
            )
        except Exception as exc:  # the template's own raise_exception, or a Jinja error
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise BadRecord(
                f"data.path: {where}: the chat template ({self.origin}) rejects this message "
                f"list: {first[:300]}. Fix the row, or use a template that accepts it "
                "(data.chat_template=FILE)."
            ) from None
        return texts, (spans or [[] for _ in texts])

    def supervised(self, conv: Conversation, train_on: str, where: str) -> tuple[str, list[Span]]:
        """The conversation's rendering and its supervised character spans."""
        messages = conv.messages
        (full,), (marked,) = self.apply_template([messages], False, where)
        if train_on == "all":
            return full, [(0, len(full))]
        if train_on == "completion":
            if conv.prompt_len is None:
                raise BadRecord(
                    f"data.train_on: completion supervises the completion of prompt/completion "
                    f"rows; {where} is a row of messages (use train_on=assistant or "
                    "last_assistant for those, or leave data.train_on unset)"
                )
            prefix = self._prefix(messages[: conv.prompt_len], full, where, "its prompt")
            return full, [(len(prefix), len(full.rstrip()))]
        if self.markers:
            return full, marked[-1:] if train_on == "last_assistant" else marked
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if train_on == "last_assistant":
            turns = turns[-1:]
        return full, [self._turn(messages, i, full, where) for i in turns]

    def _prefix(self, head: list[dict[str, Any]], full: str, where: str, what: str) -> str:
        (prefix,), _ = self.apply_template([head], True, where)
        if not full.startswith(prefix):
            raise self._refuse(where, what, prefix, full, "with add_generation_prompt=True")
        return prefix

    def _turn(self, messages: list[dict[str, Any]], i: int, full: str, where: str) -> Span:
        """The characters of assistant message i after its generation prompt, through its
        end-of-turn token."""
        prefix = self._prefix(messages[:i], full, where, f"message {i + 1} (assistant)")
        if i + 1 == len(messages):
            through = full
        else:
            (through,), _ = self.apply_template([messages[: i + 1]], False, where)
            if not full.startswith(through):
                raise self._refuse(where, f"message {i + 1} (assistant)", through, full, "")
        if not through.startswith(prefix) or len(through) <= len(prefix):
            raise self._refuse(where, f"message {i + 1} (assistant)", prefix, through, "")
        return len(prefix), max(len(prefix) + 1, len(through.rstrip()))

    def _refuse(self, where: str, what: str, part: str, whole: str, how: str) -> TemplateRefused:
        at = next((k for k, (a, b) in enumerate(zip(part, whole)) if a != b), len(whole))
        return TemplateRefused(
            f"{self.origin}: the chat template is not prefix-preserving, so cumulus cannot tell "
            f"which tokens are supervised: the conversation at {where}, rendered up to "
            f"{what} {how}, is not the start of its whole rendering (they differ from "
            f"character {at}: {part[at : at + 40]!r} vs {whole[at : at + 40]!r}). Templates "
            "that rewrite earlier turns (dropping past reasoning, say) need "
            "{% generation %}...{% endgeneration %} markers around each assistant message's "
            "content and end-of-turn token; pass such a template with "
            "data.chat_template=FILE."
        )


def default_train_on(conv: Conversation) -> str:
    """`assistant` for rows of messages, `completion` for prompt/completion rows."""
    return "assistant" if conv.prompt_len is None else "completion"
