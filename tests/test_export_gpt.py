"""`scripts/export_hf.py` on the default model, the in-tree GPT: it becomes transformers'
`GPT2LMHeadModel`, and transformers' own implementation (the independent reference) gives
cumulus's logits and validation loss; models with no mapping are refused with one paragraph.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tests.conftest import TINY, stdlib_text, train_in_process
from tests.ranks import explain, launch, run_cli

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

BLOCK = 64  # gpt_tiny's block_size


@pytest.mark.launches
def test_default_gpt_exports_with_cumulus_validation_loss(tmp_path: Path) -> None:
    """A gpt_tiny checkpoint (byte-level text, 4 steps) exports; `from_pretrained` loads a
    GPT2LMHeadModel with tied embeddings and a tokenizer whose ids are the UTF-8 bytes; its
    loss over the first 4 validation batches equals `trainer.evaluate`'s within 1e-5."""
    text = stdlib_text(tmp_path / "text.py", 200_000)
    run = tmp_path / "run"
    train_in_process(
        [*TINY, f"data.path={text}", "train.max_steps=4", "checkpoint.every_steps=4"], run
    )
    ckpt = run / "checkpoints" / "step_00000004"
    out = tmp_path / "exported"
    export = launch([sys.executable, "scripts/export_hf.py", f"checkpoint={ckpt}", f"out={out}"])
    assert export.returncode == 0, explain(export)
    assert "as GPT2LMHeadModel, with a byte-level tokenizer" in export.stdout, explain(export)
    evaluated = run_cli(
        [f"checkpoint={ckpt}", f"data.path={text}", "eval.max_batches=4"],
        module="trainer.evaluate",
    )
    assert evaluated.returncode == 0, explain(evaluated)
    want = json.loads(evaluated.stdout.strip().splitlines()[-1])

    model = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    assert type(model).__name__ == "GPT2LMHeadModel"
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    tok = transformers.AutoTokenizer.from_pretrained(out)
    sample = "def f(x):\n    return 'é€' + x  # ünïcode\n"
    assert tok(sample)["input_ids"] == list(sample.encode("utf-8"))
    assert tok.decode(list(sample.encode("utf-8"))) == sample

    # The validation split's first 4 batches of 16 (eval.batch_size's default): the last
    # tenth of the file's bytes, in windows of BLOCK + 1 (data.packed, every window whole).
    from trainer.data.text import text_data

    val = text_data(path=str(text), packed=True, block_size=BLOCK).val
    total, count = 0.0, 0
    with torch.no_grad():
        for i in range(4 * 16):
            s = val[i].long()[None, :]  # (1, BLOCK + 1)
            logits = model(input_ids=s[:, :-1]).logits
            total += float(F.cross_entropy(logits[0], s[0, 1:], reduction="sum"))
            count += s.shape[1] - 1
    assert count == want["val/items"]
    assert abs(total / count - want["val/loss"]) <= 1e-5, (total / count, want["val/loss"])


@pytest.mark.parametrize(
    "shape",
    [
        {"n_layer": 3, "n_head": 4, "n_embd": 64},
        {"n_layer": 2, "n_head": 2, "n_embd": 32, "bias": False},
        {"n_layer": 2, "n_head": 2, "n_embd": 32, "fake_quant_bits": 4},
    ],
    ids=["plain", "no_bias", "fake_quant"],
)
def test_gpt_variants_give_gpt2s_logits(shape: dict) -> None:
    """Random weights (not the initialization: biases and norms moved off 0 and 1), several
    shapes, `bias=false` and fake-quantized training: transformers' GPT-2 computes the same
    logits as cumulus's GPT to fp32 round-off."""
    from trainer.models.export import to_gpt2
    from trainer.models.gpt import GPT

    torch.manual_seed(0)
    gpt = GPT(vocab_size=300, block_size=BLOCK, **shape).eval()
    with torch.no_grad():
        for p in gpt.parameters():
            p.add_(0.05 * torch.randn_like(p))
    ids = torch.randint(0, 300, (2, BLOCK))
    with torch.no_grad():
        want, got = gpt(ids), to_gpt2(gpt)(input_ids=ids).logits
    assert (want - got).abs().max().item() <= 1e-5


@pytest.mark.launches
def test_a_model_with_no_mapping_is_refused(tmp_path: Path) -> None:
    """experiment=digits (a CNN): one paragraph naming what exports, exit 2, nothing written."""
    run = tmp_path / "run"
    args = ["experiment=digits", "logger=none", "train.max_steps=1", "eval.every_steps=0"]
    train_in_process([*args, "checkpoint.every_steps=1"], run)
    out = tmp_path / "exported"
    proc = launch([sys.executable, "scripts/export_hf.py", f"checkpoint={run}", f"out={out}"])
    assert proc.returncode == 2, explain(proc)
    assert "Traceback" not in proc.stderr, explain(proc)
    (line,) = [ln for ln in proc.stderr.splitlines() if ln.startswith("error")]
    assert "CNN has no Hugging Face architecture" in line and "model=gpt_small" in line, line
    assert not out.exists()
