"""`data=chat`: masks, packing, document isolation, preview, bad rows, and the three defects
of issue #45 section 5 that touch it (a non-text field, the pretrained tokenizer, the export).

References are independent of the code under test: masks are transformers'
`apply_chat_template(..., return_assistant_tokens_mask=True)`; a packed conversation's logits
are the same conversation's run alone; counts are recomputed from transformers' tokenization.
The multi-rank exactness runs are in tests/test_chat_exact.py.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from engine.callbacks import CallbackList
from engine.distributed import DistInfo
from engine.numerics.precision import Precision
from engine.step import StepContext
from engine.steps.accumulate import AccumulateStep
from engine.tasks import CausalLMTask
from tests.chat_support import (
    LLAMA,
    PLAIN,
    TEMPLATE,
    conversations,
    pretrained,
    write_jsonl,
)
from tests.conftest import compose_config, train_in_process
from trainer.config.cli import to_config
from trainer.config.errors import UserError
from trainer.data.chat import ChatSamples, chat_data
from trainer.data.chat_encode import ChatEncoder, encode_one
from trainer.data.packing import pack
from trainer.run.assemble import build_data

transformers = pytest.importorskip("transformers")
MAX_LENGTH = 128


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Any]:
    """A tiny pretrained Llama with its tokenizer (ChatML with generation markers)."""
    return pretrained(tmp_path_factory.mktemp("chat"))


def reference_mask(tok: Any, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    out = tok.apply_chat_template(messages, return_dict=True, return_assistant_tokens_mask=True)
    return out["input_ids"], out["assistant_masks"]


# --------------------------------------------------------------------------- masks


def test_masks_equal_transformers_and_the_prefix_method_gives_the_same(
    model_dir: tuple[Path, Any],
) -> None:
    path, tok = model_dir
    marked = ChatEncoder(str(path), TEMPLATE, "data.chat_template", None)
    plain = ChatEncoder(str(path), PLAIN, "data.chat_template", None)
    for row in conversations(40, seed=3):
        ids, mask = encode_one(marked, row)
        want_ids, want_mask = reference_mask(tok, row["messages"])
        assert ids.tolist() == want_ids
        # The first token is predicted from nothing: it is never a target.
        assert mask[0] == 0 and mask[1:].tolist() == want_mask[1:]
        assert 0 < mask.sum() < len(mask)
        plain_ids, plain_mask = encode_one(plain, row)
        assert plain_ids.tolist() == want_ids and plain_mask.tolist() == mask.tolist()


def test_train_on_last_assistant_completion_and_all(model_dir: tuple[Path, Any]) -> None:
    path, tok = model_dir
    row = conversations(1, seed=5, max_turns=3)[0]
    while sum(m["role"] == "assistant" for m in row["messages"]) < 2:
        row = conversations(1, seed=len(row["messages"]) + 7, max_turns=3)[0]
    _, want = reference_mask(tok, row["messages"])
    runs = np.flatnonzero(np.diff([0, *want]) == 1)  # where each assistant span starts
    last = [0] * len(want)
    last[runs[-1] :] = want[runs[-1] :]
    for template in (TEMPLATE, PLAIN):
        enc = ChatEncoder(str(path), template, "data.chat_template", "last_assistant")
        assert encode_one(enc, row)[1].tolist()[1:] == last[1:]
        every = encode_one(ChatEncoder(str(path), template, "x", "all"), row)[1]
        assert every[1:].all() and every[0] == 0
    # prompt/completion rows (strings): the completion is the assistant message.
    qa = {"prompt": "what is the answer", "completion": "über café 東京"}
    messages = [{"role": "user", "content": qa["prompt"]}]
    messages.append({"role": "assistant", "content": qa["completion"]})
    want_ids, want = reference_mask(tok, messages)
    for template in (TEMPLATE, PLAIN):
        ids, mask = encode_one(ChatEncoder(str(path), template, "x", None), qa)
        assert ids.tolist() == want_ids and mask.tolist()[1:] == want[1:]
    with pytest.raises(UserError, match=r"data\.train_on: completion .*row:3"):
        encode_one(ChatEncoder(str(path), TEMPLATE, "x", "completion"), row, "row:3")


def test_a_template_that_rewrites_earlier_turns_is_refused(model_dir: tuple[Path, Any]) -> None:
    """A template that renders past assistant turns differently (as templates that drop past
    reasoning do) cannot be read by prefixes: one paragraph naming data.chat_template."""
    path, _ = model_dir
    rewrites = PLAIN.replace(
        "{%- if message['role'] == 'assistant' %}",
        "{%- if message['role'] == 'assistant' and not loop.last %}{{- '[past]<|im_end|>' }}"
        "{%- elif message['role'] == 'assistant' %}",
    )
    row = {"messages": conversations(1, seed=2, max_turns=1)[0]["messages"]}
    row["messages"] += [
        {"role": "user", "content": "and then"},
        {"role": "assistant", "content": "ok"},
    ]
    enc = ChatEncoder(str(path), rewrites, "data.chat_template", None)
    with pytest.raises(UserError) as err:
        encode_one(enc, row, "chat.jsonl:7")
    text = str(err.value)
    assert text.startswith("data.chat_template:") and "chat.jsonl:7" in text, text
    assert "prefix-preserving" in text and "{% generation %}" in text and "\n" not in text


def test_jsonl_parquet_and_save_to_disk_give_the_same_tokens_and_masks(
    model_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    """The same rows (messages, and prompt/completion rows beside them) from the three
    formats: one set of tokens and masks, those of each row encoded alone."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from trainer.data.chat import _source
    from trainer.data.shards import open_shards

    path, _ = model_dir
    rows: list[dict[str, Any]] = [dict(r) for r in conversations(10, seed=6)]
    rows += [{"prompt": "2+2?", "completion": "4"}, {"prompt": "über", "completion": "café"}]
    files = {"jsonl": write_jsonl(tmp_path / "c.jsonl", rows), "parquet": tmp_path / "c.parquet"}
    columns = {k: [r.get(k) for r in rows] for k in ("messages", "prompt", "completion")}
    pq.write_table(pa.table(columns), files["parquet"])  # missing fields are nulls
    datasets.Dataset.from_dict(columns).save_to_disk(str(tmp_path / "saved"))
    files["saved"] = tmp_path / "saved"
    encoder = ChatEncoder(str(path), TEMPLATE, "data.chat_template", None)
    want = [encode_one(encoder, row) for row in rows]

    for name, file in files.items():
        store = open_shards(_source(str(file)), None, str(tmp_path / name), 1, True, encoder)
        got = [
            (store.read(a, b).tolist(), store.read_extra("mask", a, b).tolist())
            for a, b in itertools.pairwise(store.doc_offsets.tolist())
        ]
        assert got == [(i.tolist(), m.tolist()) for i, m in want], name


# --------------------------------------------------------------------------- bad rows

ALTERNATE = (
    "{%- for message in messages %}{%- if loop.index0 > 0 and message['role'] == "
    "messages[loop.index0 - 1]['role'] %}{{- raise_exception('Conversation roles must "
    "alternate') }}{%- endif %}{%- endfor %}" + TEMPLATE
)
BAD_ROWS = {
    "neither": ({"text": "hello"}, r'neither "messages" nor "prompt".*\'text\''),
    "role": (
        {"messages": [{"role": "wizard", "content": "hi"}]},
        r"role 'wizard'; valid roles: system, user, assistant, tool",
    ),
    "content": (
        {"messages": [{"role": "user", "content": ["a", "b"]}]},
        r"content of type list .* content must be a string",
    ),
    "rejected": (
        {"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]},
        r"rejects this message list: Conversation roles must alternate",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_ROWS))
def test_a_bad_row_is_one_paragraph_naming_file_and_line_and_leaves_no_cache(
    case: str, model_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    bad, expected = BAD_ROWS[case]
    rows = [json.dumps(r) for r in conversations(30, seed=11, max_turns=1)]
    rows.insert(4, json.dumps(bad))  # line 5
    text = bad_file_error(rows, model_dir, tmp_path)
    assert "chat.jsonl:5" in text and "\n" not in text, text
    assert re.search(expected, text), text
    cache = tmp_path / "cache"
    assert not [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")]


def bad_file_error(lines: list[str], model_dir: tuple[Path, Any], tmp_path: Path) -> str:
    """The paragraph `chat_data` refuses `lines` (a chat.jsonl's) with, through 2 tokenizer
    workers and the alternate template, caching under tmp_path/cache."""
    data = tmp_path / "chat.jsonl"
    data.write_text("\n".join(lines) + "\n")
    template = tmp_path / "alternate.jinja"
    template.write_text(ALTERNATE)
    with pytest.raises(UserError) as err:
        chat_data(
            str(data),
            tokenizer=str(model_dir[0]),
            chat_template=str(template),
            max_length=MAX_LENGTH,
            tokenize_workers=2,
            cache_dir=str(tmp_path / "cache"),
        )
    return str(err.value)


def test_every_bad_row_is_named_in_one_paragraph_in_file_order(
    model_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    """Four bad rows and a line that is not JSON (last in the file): one paragraph naming each
    as FILE:LINE in file order, the rows' shared advice said once, with 2 tokenizer workers."""
    rows = [json.dumps(r) for r in conversations(30, seed=11, max_turns=1)]
    bad_lines = {5: "neither", 9: "role", 12: "content", 20: "rejected"}
    for line, case in bad_lines.items():
        rows[line - 1] = json.dumps(BAD_ROWS[case][0])
    rows[24] = '{"messages": [{"role": "user", "content": "hi"}'  # line 25: not JSON
    text = bad_file_error(rows, model_dir, tmp_path)
    assert "\n" not in text and text.startswith("data.path: 5 rows of"), text
    named = [int(n) for n in re.findall(r"chat\.jsonl:(\d+)", text)]
    assert named == [*bad_lines, 25], text
    for case in bad_lines.values():
        assert re.search(BAD_ROWS[case][1], text), (case, text)
    assert "chat.jsonl:25 is not JSON" in text and "line 25 of" not in text, text
    assert text.count("data=chat reads rows") == 1, text
    cache = tmp_path / "cache"
    assert not [p for p in cache.rglob("*") if p.is_file() and not p.name.endswith(".lock")]


def test_reading_stops_after_enough_bad_rows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """data=hf with a wrong data.text_field on every row of a file of many chunks: the reading
    stops once BadRows.STOP bad rows are found (a large corpus is not read to the end to say
    so), and the paragraph says there may be more."""
    from trainer.data import shards
    from trainer.data.hf import hf_data

    monkeypatch.setattr(shards, "CHUNK_BYTES", 200)  # about 8 rows a chunk
    monkeypatch.setattr(shards.BadRows, "STOP", 20)
    path = write_jsonl(tmp_path / "docs.jsonl", [{"body": f"row {i}"} for i in range(400)])
    with pytest.raises(UserError) as err:
        hf_data(str(path), cache_dir=str(tmp_path / "cache"), tokenize_workers=1)
    text = str(err.value)
    count = int(re.search(r"data.text_field: (\d+) or more rows of", text)[1])
    assert 20 <= count < 40 and "reading stopped there" in text and "\n" not in text, text
    assert text.count("has no field 'text'") == 10, text


def test_a_data_set_with_nothing_to_supervise_is_refused(
    model_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    path, _ = model_dir
    rows = [
        {"messages": [m for m in r["messages"] if m["role"] != "assistant"]}
        for r in conversations(12)
    ]
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(UserError, match=r"no conversation of .* has a supervised token") as err:
        chat_data(str(data), tokenizer=str(path), max_length=MAX_LENGTH, tokenize_workers=1)
    assert "12 have no supervised token" in str(err.value) or "no supervised" in str(err.value)


def test_the_main_process_loads_the_tokenizer_once(
    model_dir: tuple[Path, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Opening chat data loads the tokenizer once in this process (the real loader, counted):
    the encoder (its vocabulary, the workers it forks) uses that one. Each row's training
    sample and what trainer.preview shows of it are one `TextSequence`."""
    path, _ = model_dir
    loaded: list[str] = []
    real = transformers.AutoTokenizer.from_pretrained.__func__

    def counted(cls: Any, name: Any, *args: Any, **kwargs: Any) -> Any:
        loaded.append(str(name))
        return real(cls, name, *args, **kwargs)

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", classmethod(counted))
    data = write_jsonl(tmp_path / "chat.jsonl", conversations(20, seed=4, max_turns=1))
    splits = chat_data(
        str(data),
        tokenizer=str(path),
        max_length=MAX_LENGTH,
        tokenize_workers=1,
        cache_dir=str(tmp_path / "cache"),
    )
    assert loaded == [str(path)]
    from trainer.data.preview import show_row

    for row in range(3):
        labels = splits.train[row]["shift_labels"]
        shown = show_row(splits.train, row, splits.decode).splitlines()[0]
        assert f", {int((labels != -100).sum())} supervised ===" in shown, shown


# --------------------------------------------------------------------------- packing


def test_packing_keeps_every_document_whole_and_is_deterministic() -> None:
    rng = np.random.default_rng(0)
    lengths = rng.integers(5, 120, 3000)
    row_ptr, docs = pack(lengths, 128, seed=7, buffer=500)
    assert sorted(docs.tolist()) == list(range(len(lengths)))  # each exactly once, unsplit
    sums = np.add.reduceat(lengths[docs], row_ptr[:-1])
    assert sums.max() <= 128
    assert len(row_ptr) - 1 < len(lengths) * 0.6, "best fit packs several per row"
    assert abs(sums.sum() / ((len(row_ptr) - 1) * 128) - 1) < 0.05, "rows nearly full"
    again = pack(lengths, 128, seed=7, buffer=500)
    assert all(np.array_equal(a, b) for a, b in zip((row_ptr, docs), again))
    assert not np.array_equal(docs, pack(lengths, 128, seed=8, buffer=500)[1])


# --------------------------------------------------------------------------- isolation


PACKED = 256  # tokens per packed row: 3 or more conversations in some


def packed_rows(model_dir: tuple[Path, Any], tmp_path: Path) -> tuple[ChatSamples, Any]:
    path, _ = model_dir
    data = write_jsonl(tmp_path / "chat.jsonl", conversations(40, seed=4, max_turns=1))
    splits = chat_data(str(data), tokenizer=str(path), max_length=PACKED, tokenize_workers=1)
    return splits.train, splits.collate_fn


def build(kind: str, impl: str, path: Path, vocab: int) -> torch.nn.Module:
    from trainer.models.gpt import GPT
    from trainer.models.hf import causal_lm

    torch.manual_seed(0)
    if kind == "gpt":
        return GPT(vocab_size=vocab, block_size=PACKED, n_layer=2, n_head=2, n_embd=32)
    if kind == "llama" and impl == "flex_attention":  # its CUDA kernel: heads of 16 or more
        heads = {"num_attention_heads": 2, "num_key_value_heads": 1}
        model = causal_lm("llama", {**LLAMA, "vocab_size": vocab, **heads})
    elif kind == "llama":
        model = causal_lm(pretrained=str(path), config={})
    else:
        config = {"vocab_size": vocab, "n_positions": PACKED, "n_embd": 32, "n_layer": 2}
        model = causal_lm("gpt2", {**config, "n_head": 2, "use_cache": True})
    model.set_attn_implementation(impl)
    return model


def logits(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    inputs = {k: v for k, v in batch.items() if k != "shift_labels"}
    out = model(**inputs)
    return out if isinstance(out, torch.Tensor) else out.logits


def forward(model: torch.nn.Module, batch: dict[str, torch.Tensor], impl: str) -> torch.Tensor:
    """`logits`; under flex_attention, a kernel the compiler cannot build is an expected
    failure naming torch's version (torch 2.11 on an H200: a packed row compiles, the next
    shapes' dynamic recompile finds no kernel configuration), never a wrong logit."""
    try:
        return logits(model, batch)
    except Exception as exc:
        if impl == "flex_attention" and type(exc).__name__ == "InductorError":
            pytest.xfail(f"torch {torch.__version__} compiles no flex_attention kernel: {exc}")
        raise


MODELS = [
    ("gpt", "sdpa"),
    ("llama", "sdpa"),
    ("llama", "eager"),
    ("gpt2", "sdpa"),
    ("gpt2", "eager"),
    pytest.param(
        "llama",
        "flex_attention",
        marks=[
            pytest.mark.gpu,
            pytest.mark.skipif(not torch.cuda.is_available(), reason="flex_attention: CUDA"),
        ],
    ),
]


@pytest.mark.parametrize(("kind", "impl"), MODELS)
def test_packed_conversations_attend_only_to_themselves(
    kind: str, impl: str, model_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    """Perturbing the first conversation of a packed row leaves the others' logits bit for bit
    the same, and each conversation's logits are its own run alone (positions from 0)."""
    rows, collate = packed_rows(model_dir, tmp_path)
    row = next(r for r in range(len(rows)) if len(rows.conversations(r)) >= 3)
    convs = rows.conversations(row)
    model = build(kind, impl, model_dir[0], len(model_dir[1])).eval()
    device = "cuda" if impl == "flex_attention" else "cpu"
    model.to(device)
    batch = {k: v.to(device) for k, v in collate([rows[row]]).items()}
    assert batch["position_ids"][0].eq(0).sum() == len(convs)
    first = len(convs[0][0])
    with torch.no_grad():
        base = forward(model, batch, impl)
        changed = dict(batch)
        changed["input_ids"] = batch["input_ids"].clone()
        changed["input_ids"][0, 1:first] = (batch["input_ids"][0, 1:first] + 7) % 300
        perturbed = forward(model, changed, impl)
        assert not torch.equal(base[0, :first], perturbed[0, :first]), "premise: it changed"
        assert torch.equal(base[0, first:], perturbed[0, first:])
        start = 0
        for tokens, _ in convs:
            alone = forward(model, {"input_ids": torch.as_tensor(tokens)[None].to(device)}, impl)
            packed = base[0, start : start + len(tokens)]
            torch.testing.assert_close(packed, alone[0], rtol=1e-5, atol=1e-5)
            start += len(tokens)


# --------------------------------------------------------------------------- preview


def test_preview_marks_supervised_tokens_and_counts_the_split(
    model_dir: tuple[Path, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from trainer.preview import main

    path, tok = model_dir
    rows = conversations(60, seed=9, max_turns=2)
    data = write_jsonl(tmp_path / "chat.jsonl", rows)
    common = ["model=hf_llama", f"model.pretrained={path}", "data=chat", f"data.path={data}"]
    common += [f"data.max_length={MAX_LENGTH}", "data.val_every_nth=4", "data.tokenize_workers=1"]
    samples = {}
    for truncation in ("drop", "cut"):
        main([*common, f"data.truncation={truncation}", "preview.samples=2"])
        out = capsys.readouterr().out.strip().splitlines()
        stats = json.loads(out[-1])
        # Reference: transformers' tokenization of the training conversations (every 4th
        # validates), the same rules.
        kept = tokens = targets = 0
        for i, row in enumerate(rows):
            if i % 4 == 0:
                continue
            ids, mask = reference_mask(tok, row["messages"])
            if truncation == "cut":
                ids, mask = ids[:MAX_LENGTH], mask[:MAX_LENGTH]
            if len(ids) <= MAX_LENGTH and sum(mask[1:]):
                kept, tokens, targets = kept + 1, tokens + len(ids), targets + sum(mask[1:])
        assert stats["samples"] == kept and stats["tokens"] == tokens
        assert stats["supervised_tokens"] == targets
        assert stats["dropped"] == 45 - kept
        assert kept // 3 <= stats["rows"] <= kept
        want = 1 - tokens / (stats["rows"] * MAX_LENGTH)
        assert abs(stats["padding_fraction"] - want) < 1e-12
        text = "\n".join(out)
        assert text.count("=== row ") == 2 and "{+" in text and "<|im_end|>+}" in text
        samples[truncation] = kept
    assert samples["cut"] > samples["drop"], "premise: some conversations are cut"


def test_preview_of_other_data_is_one_paragraph(capsys: pytest.CaptureFixture[str]) -> None:
    from trainer.preview import main

    with pytest.raises(SystemExit) as exit_:
        main(["model=gpt_tiny", "data.path=stdlib", "data.glob=a*.py"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "data=chat" in err and "Traceback" not in err


# --------------------------------------------------------------------------- the step


def test_a_micro_batch_without_supervised_tokens_adds_nothing(
    model_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    """A window whose first micro-batch has no supervised target (all -100) gives the same
    gradient as the other micro-batch alone: it adds nothing to the sum nor the count."""
    rows, collate = packed_rows(model_dir, tmp_path)
    some = collate([rows[0], rows[1]])
    none = collate([rows[2]])
    none["shift_labels"] = torch.full_like(none["shift_labels"], -100)
    grads = []
    for window in ([none, some], [some]):
        model = build("llama", "sdpa", model_dir[0], 0)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        ctx = StepContext(
            model=model,
            optimizer=opt,
            scheduler=None,
            task=CausalLMTask(),
            precision=Precision("fp32", "cpu"),
            dist=DistInfo(),
            clip_grad_norm=None,
            callbacks=CallbackList([]),
        )
        result = AccumulateStep()(ctx, window)
        assert int(result.global_count) == int((some["shift_labels"] != -100).sum())
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-9)


def test_the_chunked_loss_reads_packed_rows_as_the_plain_loss(
    model_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    """Large vocabularies take the chunked loss (from the last hidden state): on packed rows it
    is the plain loss, position ids and all."""
    rows, collate = packed_rows(model_dir, tmp_path)
    batch = collate([rows[0], rows[1], rows[2]])
    model = build("llama", "sdpa", model_dir[0], 0)
    chunked = CausalLMTask(chunk_size=16, chunked_vocab_threshold=1)
    assert chunked.chunked(model)
    with torch.no_grad():
        want = CausalLMTask(chunk_size=None).loss_sum(model, batch)
        torch.testing.assert_close(chunked.loss_sum(model, batch), want, rtol=1e-6, atol=1e-6)


# --------------------------------------------------------------------------- issue #45 §5


@pytest.mark.parametrize("suffix", [".jsonl", ".parquet"])
def test_data_hf_refuses_a_field_that_is_not_text(tmp_path: Path, suffix: str) -> None:
    """`data=hf data.text_field=messages` trained on the Python text of the list."""
    from trainer.data.hf import hf_data

    rows = conversations(30)
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    if suffix == ".parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        path = tmp_path / "chat.parquet"
        pq.write_table(pa.Table.from_pylist(rows), path)
    with pytest.raises(UserError) as err:
        hf_data(str(path), text_field="messages", cache_dir=str(tmp_path / "cache"))
    text = str(err.value)
    assert "data.text_field" in text and "'messages'" in text and "data=chat" in text, text
    assert "\n" not in text and str(path) in text


def test_data_uses_the_pretrained_directorys_tokenizer(
    model_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    """`model.pretrained=DIR` holding a tokenizer, without data.tokenizer: the data is that
    tokenizer's ids, not UTF-8 bytes; a directory without one and a vocabulary other than 256
    is refused."""
    path, tok = model_dir
    texts = [{"text": f"über café number {i} of the quick brown fox"} for i in range(40)]
    data = write_jsonl(tmp_path / "docs.jsonl", texts)
    args = ["model=hf_llama", f"model.pretrained={path}", "data=hf", f"data.path={data}"]
    splits, _ = build_data(to_config(compose_config(args))[0].data)
    assert splits.vocab_size == len(tok)
    sample = splits.train[0]
    ids = tok(texts[1]["text"], add_special_tokens=False)["input_ids"]
    assert sample[: len(ids)].tolist() == ids
    bare = tmp_path / "bare"
    bare.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(path / name, bare / name)
    args[1] = f"model.pretrained={bare}"
    with pytest.raises(UserError, match=r"data\.tokenizer: .* holds no tokenizer\.json .* 320"):
        build_data(to_config(compose_config(args))[0].data)


@pytest.mark.parametrize("data", ["hf", "chat"])
def test_export_writes_the_transformers_class_and_the_tokenizer_unchanged(
    data: str, model_dir: tuple[Path, Any], tmp_path: Path
) -> None:
    """The export of a fine-tuned pretrained Llama: `LlamaForCausalLM` (not cumulus's
    subclass), the trained weights, and the tokenizer as it was (special tokens, template),
    so that apply_chat_template gives the ids training used. data=hf names the tokenizer
    directory; data=chat renders with data.chat_template=FILE, which the export carries."""
    from scripts.export_hf import main as export

    path, tok = model_dir
    rows = conversations(40, seed=8, max_turns=1)
    args = ["model=hf_llama", f"model.pretrained={path}", "logger=none", "train.max_steps=2"]
    args += ["train.micro_batch_size=2", "train.grad_accum_steps=1", "eval.every_steps=0"]
    args += ["checkpoint.every_steps=2", "scheduler.warmup_steps=0", "data.tokenize_workers=1"]
    template = tmp_path / "plain.jinja"
    template.write_text(PLAIN)
    if data == "hf":
        texts = [{"text": tok.apply_chat_template(r["messages"], tokenize=False)} for r in rows]
        file = write_jsonl(tmp_path / "docs.jsonl", texts)
        args += ["data=hf", f"data.path={file}", f"data.tokenizer={path}", "data.block_size=64"]
    else:
        file = write_jsonl(tmp_path / "chat.jsonl", rows)
        args += ["data=chat", f"data.path={file}", f"data.chat_template={template}"]
        args += [f"data.max_length={MAX_LENGTH}"]
    run = tmp_path / "run"
    train_in_process(args, run)
    out = tmp_path / "exported"
    # The paths the export reads, named again (a checkpoint's own are data: saved_paths=true).
    named = [a for a in args if a.startswith(("model.pretrained=", "data.tokenizer="))]
    named += [a for a in args if a.startswith("data.chat_template=")]
    export([f"checkpoint={run}", f"out={out}", *named])
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLM"]
    got = transformers.AutoTokenizer.from_pretrained(out)
    for name in (
        "eos_token",
        "pad_token",
        "bos_token",
        "all_special_tokens",
        "added_tokens_decoder",
    ):
        assert str(getattr(got, name)) == str(getattr(tok, name)), name
    assert got.chat_template == (PLAIN if data == "chat" else tok.chat_template)
    messages = rows[0]["messages"]
    ids = got.apply_chat_template(messages, return_dict=False)
    assert ids == tok.apply_chat_template(messages, return_dict=False)
    trained = ChatEncoder(str(path), PLAIN, "x", None)
    assert ids == encode_one(trained, rows[0])[0].tolist(), "the ids training used"
    model = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM"
    state = torch.load(run / "checkpoints/step_00000002/state.pt", weights_only=True)["model"]
    for name, p in model.state_dict().items():
        assert torch.equal(p, state[name]), name
