"""What `python -m trainer.preview` shows of data=chat: the first training samples as text
with the supervised tokens marked and the boundaries between packed conversations, then one
JSON line of counts over the whole training split. Of data=preference: the first pairs, each
its prompt then the chosen and the rejected answer with their scored tokens marked, and one
JSON line of counts over the training pairs (`pair_summary`).

The counts read the per-conversation figures the tokenizer stored (trainer/data/chat_encode.py)
and, for conversations cut at `data.max_length`, their target masks: no row is assembled, so
thousands of conversations take well under a second once tokenized. The rows shown are the
`TextSequence`s training reads (trainer/data/sequence.py): their targets are the tokens the
loss predicts.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

from trainer.config.errors import UserError
from trainer.data.chat import ChatSamples
from trainer.data.preference import PreferenceSamples
from trainer.data.sequence import TextSequence

OPEN, CLOSE = "{+", "+}"  # around supervised text (wdiff's notation)


def summary(train: ChatSamples) -> dict[str, Any]:
    """`rows`, `samples` (conversations), `supervised_tokens` (targets: tokens predicted from
    the token before them), `tokens` (in rows, not padding), `padding_fraction` (of the rows'
    `max_length` positions, those no token fills) and `dropped` (conversations)."""
    sel, store = train.selection, train.store
    whole = np.diff(store.doc_offsets)[sel.docs]
    targets = store.doc_extra("targets")[sel.docs].copy()
    for i in np.flatnonzero(sel.lengths < whole):  # cut: count within the kept tokens
        a = int(store.doc_offsets[sel.docs[i]])
        targets[i] = int(store.read_extra("mask", a, a + int(sel.lengths[i])).sum())
    tokens = int(sel.lengths.sum())
    capacity = len(train) * train.max_length
    return {
        "rows": len(train),
        "samples": len(sel.docs),
        "supervised_tokens": int(targets.sum()),
        "tokens": tokens,
        "padding_fraction": 1.0 - tokens / capacity if capacity else 0.0,
        "dropped": int(sel.dropped),
    }


def runs(mask: np.ndarray) -> Iterator[tuple[int, int, bool]]:
    """(start, end, supervised) of each run of equal mask values."""
    if not len(mask):
        return
    edges = np.flatnonzero(np.diff(mask.astype(np.int8))) + 1
    bounds = [0, *edges.tolist(), len(mask)]
    for a, b in itertools.pairwise(bounds):
        yield a, b, bool(mask[a])


def marked(tokens: np.ndarray, targets: np.ndarray, decode: Callable[[list[int]], str]) -> str:
    """The text of `tokens`, its targets (the tokens the loss predicts) between {+ and +}."""
    parts = []
    for a, b, on in runs(targets):
        text = decode(tokens[a:b].tolist())
        parts.append(f"{OPEN}{text}{CLOSE}" if on else text)
    return "".join(parts)


def show_row(train: ChatSamples, row: int, decode: Callable[[list[int]], str]) -> str:
    seq = train.sequence(row)
    targets, convs = seq.targets(), seq.documents()
    lines = [
        f"=== row {row}: {len(convs)} conversation{'s' * (len(convs) != 1)}, "
        f"{len(seq.input_ids)} of {train.max_length} tokens, {int(targets.sum())} supervised ==="
    ]
    for k, conv in enumerate(convs, 1):
        if len(convs) > 1:
            n = conv.stop - conv.start
            lines.append(f"--- conversation {k} of {len(convs)} ({n} tokens) ---")
        lines.append(marked(seq.input_ids[conv], targets[conv], decode))
    return "\n".join(lines)


def first_rows(n_rows: int, seed: int, n: int) -> list[int]:
    """The rows training reads first: the start of the seeded epoch-0 permutation
    (trainer/data/loader.py)."""
    return np.random.default_rng([seed, 0]).permutation(n_rows)[:n].tolist()


def pair_summary(train: PreferenceSamples, max_length: int) -> dict[str, Any]:
    """`pairs`, `prompt_tokens` (of the chosen side, before its first scored token),
    `chosen_tokens` and `rejected_tokens` (the scored answer tokens, within the kept length),
    `tokens` (both sides, not padding), `padding_fraction` (of the pairs' max_length positions:
    two rows each, or one packed) and `dropped` (pairs)."""
    sel = train.selection
    scored = np.zeros((len(train), 2), np.int64)
    prompt = 0
    for i in range(len(train)):
        for k, (_, mask) in enumerate(train.sides(i)):
            scored[i, k] = int(mask[1:].sum())  # position 0 is predicted from nothing
            if k == 0:
                prompt += int(np.argmax(mask)) if mask.any() else len(mask)
    tokens = int(sel.lengths.sum())
    capacity = len(train) * (1 if train.packed else 2) * max_length
    return {
        "pairs": len(train),
        "prompt_tokens": prompt,
        "chosen_tokens": int(scored[:, 0].sum()),
        "rejected_tokens": int(scored[:, 1].sum()),
        "tokens": tokens,
        "padding_fraction": 1.0 - tokens / capacity if capacity else 0.0,
        "dropped": int(sel.dropped),
    }


def show_pair(train: PreferenceSamples, i: int, decode: Callable[[list[int]], str]) -> str:
    """Pair `i`: its prompt (the chosen side's tokens before its first scored one), then each
    answer, the tokens the loss scores between {+ and +}."""
    sides = train.sides(i)
    rows = [TextSequence.from_documents([side]) for side in sides]
    starts = [int(np.argmax(r.targets())) if r.targets().any() else len(r.input_ids) for r in rows]
    counts = [int(r.targets().sum()) for r in rows]
    lines = [
        f"=== pair {i}: prompt {starts[0]} tokens; chosen {counts[0]} scored of "
        f"{len(rows[0].input_ids)} tokens, rejected {counts[1]} scored of "
        f"{len(rows[1].input_ids)} ===",
        "--- prompt ---",
        decode(rows[0].input_ids[: starts[0]].tolist()),
    ]
    for name, row, start in zip(("chosen", "rejected"), rows, starts):
        lines.append(f"--- {name} ---")
        lines.append(marked(row.input_ids[start:], row.targets()[start:], decode))
    return "\n".join(lines)


def preview(data: Any, seed: int, samples: int, target: str) -> tuple[str, dict[str, Any]]:
    """(the marked text of the first `samples` rows, the summary) of built data=chat data, or
    of the first pairs of data=preference."""
    train = data.train
    if isinstance(train, PreferenceSamples):
        head = (
            f"{data.description}\nscored text (the answer tokens whose log-probabilities the "
            f"loss sums) is between {OPEN} and {CLOSE}"
        )
        shown = [show_pair(train, i, data.decode) for i in first_rows(len(train), seed, samples)]
        return "\n".join([head, *shown]), pair_summary(train, int(data.seq_len))
    if not isinstance(train, ChatSamples):
        raise UserError(
            f"data: trainer.preview shows conversations of data=chat (rows of messages or "
            f"prompt/completion with their supervised tokens) and pairs of data=preference; "
            f"data._target_={target} is neither"
        )
    decode = data.decode
    head = (
        f"{data.description}\nsupervised text (the tokens the loss predicts) is between "
        f"{OPEN} and {CLOSE}"
    )
    shown = [show_row(train, r, decode) for r in first_rows(len(train), seed, samples)]
    return "\n".join([head, *shown]), summary(train)


def json_line(stats: dict[str, Any]) -> str:
    return json.dumps(stats)
