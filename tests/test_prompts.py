"""data=prompts (trainer/data/prompts.py): prompts from JSON Lines, Parquet and save_to_disk
give the same tokens, those of transformers' apply_chat_template with its generation prompt
(a string prompt as one user message); each row's other fields are kept, in order, for the
rewards; the tokens are cached (a second open reuses them); a micro-batch pads on the right
with each prompt's length and row; the completion's end tokens are the tokenizer's and the
template's end of turn. Bad input is one paragraph: a row without a prompt (its file and
line), a prompt longer than the context less max_new_tokens (or dropped and counted with
truncation=drop), max_new_tokens that leaves no room for any prompt, a group of one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.rl.grpo import GRPOTask
from tests.chat_support import TEMPLATE, make_tokenizer, write_jsonl
from tests.prompts_support import prompt_rows
from trainer.config.errors import UserError
from trainer.data.prompts import collate_prompts, prompts_data

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    root = tmp_path_factory.mktemp("prompts_tok")
    return root / "tok", make_tokenizer(root / "tok", TEMPLATE)


def open_prompts(path: Path, tok: Path, cache: Path, **kwargs: Any) -> Any:
    args = {"max_new_tokens": 16, "context": 128, "tokenize_workers": 1, "val_every_nth": 4}
    return prompts_data(str(path), tokenizer=str(tok), cache_dir=str(cache), **{**args, **kwargs})


def rendered(tok: Any, prompt: Any) -> list[int]:
    """The reference: transformers' own rendering of the prompt, generation prompt added."""
    messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
    return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]


def test_the_three_formats_give_the_template_s_tokens_and_keep_the_fields(
    tok_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    path, tok = tok_dir
    rows = prompt_rows(12, seed=3)
    as_messages = [{**r, "prompt": rendered_messages(r["prompt"])} for r in rows]
    files = {"jsonl": write_jsonl(tmp_path / "p.jsonl", rows), "parquet": tmp_path / "p.parquet"}
    pq.write_table(pa.Table.from_pylist(as_messages), files["parquet"])  # one type per column
    datasets.Dataset.from_list(as_messages).save_to_disk(str(tmp_path / "saved"))
    files["saved"] = tmp_path / "saved"
    for name, file in files.items():
        data = open_prompts(file, path, tmp_path / f"cache_{name}")
        source = rows if name == "jsonl" else as_messages
        seen = []
        for split in (data.train, data.val):
            for i in range(len(split)):
                row = split.row(i)
                assert split[i]["input_ids"].tolist() == rendered(tok, row["prompt"]), name
                seen.append(row)
        assert sorted(map(repr, seen)) == sorted(map(repr, source)), name
        assert data.train.fields == ["prompt", "answer", "level"]
    again = open_prompts(files["jsonl"], path, tmp_path / "cache_jsonl")
    assert "token cache reused" in again.description


def rendered_messages(prompt: Any) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt


def test_a_batch_pads_on_the_right_with_lengths_and_rows(
    tok_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    path, tok = tok_dir
    data = open_prompts(write_jsonl(tmp_path / "p.jsonl", prompt_rows(8)), path, tmp_path / "c")
    batch = collate_prompts([data.train[i] for i in range(3)])
    for k in range(3):
        n = int(batch["prompt_lengths"][k])
        assert batch["input_ids"][k, :n].tolist() == data.train[k]["input_ids"].tolist()
        assert batch["input_ids"][k, n:].eq(0).all()
    assert batch["index"].tolist() == [0, 1, 2]
    end = tok.convert_tokens_to_ids("<|im_end|>")
    assert data.train.end_ids == (end,)  # the eos and the template's end of turn: one token


def test_bad_prompts_are_one_paragraph(tok_dir: tuple[Path, Any], tmp_path: Path) -> None:
    path, _ = tok_dir
    rows = prompt_rows(8)
    bad = write_jsonl(tmp_path / "bad.jsonl", [*rows[:3], {"question": "no prompt"}, *rows[3:]])
    with pytest.raises(UserError) as err:
        open_prompts(bad, path, tmp_path / "c1")
    assert "bad.jsonl:4" in str(err.value) and '"prompt"' in str(err.value)

    long = [*rows, {"prompt": "what is " + "one two three " * 30, "answer": "0"}]
    long_file = write_jsonl(tmp_path / "long.jsonl", long)
    with pytest.raises(UserError) as err:
        open_prompts(long_file, path, tmp_path / "c2")
    text = str(err.value)
    assert text.startswith("data.path:") and "row 9" in text and "data.truncation=drop" in text
    assert "\n" not in text
    dropped = open_prompts(long_file, path, tmp_path / "c2", truncation="drop")
    assert dropped.train.dropped + dropped.val.dropped == 1
    assert len(dropped.train) + len(dropped.val) == len(rows)

    with pytest.raises(UserError, match=r"data\.max_new_tokens: 128 new tokens do not fit"):
        open_prompts(long_file, path, tmp_path / "c3", max_new_tokens=128)


def test_a_group_of_one_is_refused_naming_the_key() -> None:
    with pytest.raises(ValueError, match=r"^num_generations must be at least 2"):
        GRPOTask(max_new_tokens=8, num_generations=1)
