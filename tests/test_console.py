"""A quiet, truthful console (issue 65, items 9 and 10): nothing printed that a user cannot
act on, refusals before work, messages that say what is true (the first record after a
resume, one stop line, counts in the right number), and a mixture of experts' expert load and
perplexity where a dense run has them."""

from __future__ import annotations

import enum
import logging
import math
import re
import sys
from pathlib import Path

import pytest

from tests.conftest import CONFIG_DIR, TINY, read_metrics, train_in_process, train_records
from tests.ranks import explain, launch, python_cmd, run_cli, torchrun

# What transformers' import of torchao and its from_pretrained printed in every run, export
# and evaluation (torchao 0.18, torch 2.13, transformers 5).
NOISE = ("Failed to load", "_pytree", "Enum subclass", "Loading weights", "Writing model shards")


@pytest.mark.launches
def test_a_transformers_run_and_its_export_print_no_dependency_noise(tmp_path: Path) -> None:
    """A pretrained GPT-2 directory trained one step and exported: none of torchao's
    kernel-load lines, torch's Enum deprecations or transformers' progress bars reach the
    console. Before: two "Failed to load ..._C_mxfp8...so / _C_cutlass_90a.abi3.so" lines, two
    `_pytree` warnings and a "Loading weights" bar in each, "Writing model shards" in the
    export. The export is a fresh interpreter (a script): it imports transformers and torchao
    itself, which the warm training rank had imported before it started."""
    transformers = pytest.importorskip("transformers")
    fields = {"vocab_size": 256, "n_positions": 64, "n_embd": 32, "n_layer": 1, "n_head": 2}
    config = transformers.GPT2Config(**fields, bos_token_id=None, eos_token_id=None)
    transformers.GPT2LMHeadModel(config).save_pretrained(tmp_path / "pretrained")
    run_dir = tmp_path / "run"
    args = ["model=hf_gpt2", f"model.pretrained={tmp_path / 'pretrained'}", "logger=none"]
    args += ["data.block_size=32", "train.max_steps=1", "eval.every_steps=0"]
    args += ["checkpoint.every_steps=1", "scheduler.warmup_steps=0", f"hydra.run.dir={run_dir}"]
    trained = run_cli(args, timeout=240)
    assert trained.returncode == 0, explain(trained)
    export = [sys.executable, "scripts/export_hf.py", f"checkpoint={run_dir}"]
    exported = launch([*export, f"out={tmp_path / 'exported'}"], 240)
    assert exported.returncode == 0, explain(exported)
    for proc in (trained, exported):
        said = proc.stdout + proc.stderr
        assert not [n for n in NOISE if n in said], explain(proc)


class KernelPreference(enum.Enum):  # named as torchao's, but the user's own
    AUTO = "auto"


def test_the_noise_filters_keep_every_other_message() -> None:
    """Only torchao's kernel-load lines and the deprecation about torchao's own Enums are
    dropped: another torchao warning, the same deprecation about a user's Enum, and a
    kernel-load line of another package all still reach the handlers."""
    from engine.dependency_noise import silence_dependency_noise

    silence_dependency_noise()
    torchao_enum = enum.Enum("ScaleCalculationMode", "FLOOR")
    torchao_enum.__module__ = "torchao.float8.config"
    deprecation = (
        "%s is an Enum subclass and is now natively supported by torch.compile as an opaque "
        "value type. Calling register_constant() on Enum subclasses is deprecated"
    )
    so = "/site-packages/torchao/_C_mxfp8.cpython-310-x86_64-linux-gnu.so"
    said: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            said.append(record.getMessage())

    names = ("torchao", "torch.utils._pytree", "otherpkg")
    loggers = [logging.getLogger(n) for n in names]
    for logger in loggers:
        logger.addHandler(handler := Keep())
        logger.propagate = False
    try:
        torchao, pytree, other = loggers
        torchao.warning(f"Failed to load {so}: Could not load this library: {so}")
        torchao.warning("Skipping import of cpp extensions due to incompatible torch version")
        pytree.warning(deprecation, torchao_enum)
        pytree.warning(deprecation, KernelPreference)
        other.warning(f"Failed to load {so}: Could not load this library")
    finally:
        for logger in loggers:
            logger.handlers = [h for h in logger.handlers if not isinstance(h, Keep)]
            logger.propagate = True
    del handler
    assert len(said) == 3, said
    assert said[0].startswith("Skipping import of cpp extensions"), said
    assert "KernelPreference" in said[1], said
    assert said[2].startswith("Failed to load"), said


@pytest.mark.multiproc
def test_a_resumed_run_on_two_ranks_says_what_is_true(tmp_path: Path) -> None:
    """A 5-step run of one process (checkpoint at step 5) resumed on 2 ranks to step 12, with
    records every 4 steps and a stop request after step 9: its first record is at step 8
    (before: "the first record comes at step 4"); the checkpoint was "saved by 1 rank"
    (before: "1 ranks"); the stop request is said once, by rank 0 (before: once per rank)."""
    run_dir = tmp_path / "run"
    args = [*TINY, "train.log_every=4", "checkpoint.every_steps=5", f"hydra.run.dir={run_dir}"]
    first = launch(python_cmd("trainer.train", *args, "train.max_steps=5"), 180)
    assert first.returncode == 0, explain(first)
    stop = "+callbacks.stop={_target_: tests.moe_support.StopAfter, step: 9}"
    resumed = [*args, "train.max_steps=12", "train.grad_accum_steps=1", stop]
    proc = launch(torchrun(2, resumed), 240)
    assert proc.returncode == 0, explain(proc)
    assert "step 6 done in" in proc.stdout, explain(proc)
    assert "the first record comes at step 8\n" in proc.stdout, explain(proc)
    assert "was saved by 1 rank, this run has 2" in proc.stderr, explain(proc)
    stops = re.findall(r"stop requested: saving step (\d+)", proc.stderr)
    assert stops == ["10"], explain(proc)
    steps = [r["step"] for r in train_records(read_metrics(run_dir))]
    assert steps == [4, 5, 8], steps  # 5: the first run's last record


@pytest.mark.launches
def test_a_declared_mixture_is_refused_by_one_process_too() -> None:
    """The config decides it, before the world's size is checked: one process with
    dist.cp=2 and transformers' Mixtral (model.config.num_local_experts) is refused for the
    mixture, not for the missing ranks (before: "2 context-parallel ranks need a world...").
    On 2 ranks, dist.tp=2 with the in-tree mixture: tests/test_moe.py
    test_tensor_parallel_is_refused (no torch UserWarning before the refusal)."""
    pytest.importorskip("transformers")
    proc = run_cli(["model=hf_mixtral", "dist.cp=2", "logger=none"])
    assert proc.returncode == 2, explain(proc)
    said = "error: invalid config `dist.cp`: must be 1 with a mixture-of-experts model (got 2)"
    assert said in proc.stderr, explain(proc)


def test_a_mixture_records_its_expert_load_and_perplexity(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """gpt_tiny with 4 experts: each evaluation records `val/ppl` = exp(val/loss) as a dense
    run's does (before: none, the balancing wrapper hid the causal-LM task); the progress line
    and the closing summary show `train/moe_load_max` (before: neither)."""
    args = [*TINY, "model.moe.experts=4", "train.max_steps=4", "train.log_every=2"]
    records = train_in_process([*args, "eval.every_steps=2", "eval.max_batches=1"], tmp_path)
    said = capsys.readouterr().out
    evals = [r for r in records if "val/loss" in r]
    assert [r["step"] for r in evals] == [2, 4]
    for r in evals:
        assert math.isclose(r["val/ppl"], math.exp(r["val/loss"]), rel_tol=1e-12), r
    trains = train_records(records)
    assert [r["step"] for r in trains] == [2, 4]
    # A progress line starts with its bar; a sample's text may start with "[" too.
    progress = [ln for ln in said.splitlines() if re.match(r"\[[#-]{20}\] \d+/4 ", ln)]
    for r, line in zip(trains, progress, strict=True):
        assert f"| expert load {r['train/moe_load_max']:.2f}x |" in line, line
    (closing,) = [ln for ln in said.splitlines() if ln.startswith("run finished")]
    assert f"train/moe_load_max {trains[-1]['train/moe_load_max']:.4f}" in closing, closing


def test_a_sample_s_control_characters_are_spelled_out() -> None:
    """An untrained model's sample holds characters a terminal obeys (\\x03, an escape
    sequence): the console shows them spelled out (before: sent raw to the terminal)."""
    import io

    from trainer.tracking.records import Progress

    stream = io.StringIO()
    Progress(4, stream).write({"step": 2, "val/loss": 1.5, "val/sample": "[ab\x03c\x1b[2Jd\n\te"})
    said = stream.getvalue()
    assert "[ab\\x03c\\x1b[2Jd\n\te" in said, said
    assert "\x03" not in said and "\x1b" not in said, said


def test_counts_are_said_in_the_right_number() -> None:
    """One of a thing is said in the singular: "CERTIFIED: 1 layout trains", "this run's 1
    step", "the last 1 step to decay" (before: "1 layouts train", "1 steps")."""
    from trainer.checks.certify import Outcome, table
    from trainer.run.optim import warmup_note

    outcomes = [Outcome("single", 1, [], "reference"), Outcome("accum", 1, [], "same")]
    assert "CERTIFIED: 1 layout trains as the reference" in table(outcomes, 1e-6, 0.0)
    outcomes.append(Outcome("ddp2", 2, [], "same"))
    assert "CERTIFIED: 2 layouts train as the reference" in table(outcomes, 1e-6, 0.0)
    assert "covers more than half of this run's 1 step (train.max_steps)" in warmup_note(
        {"warmup_steps": 50}, 1, 3e-3
    )
    assert "only the last 1 step to decay" in warmup_note({"warmup_steps": 2}, 3, 3e-3)


@pytest.mark.parametrize(
    ("key", "off"),
    [("eval.every_steps", "evaluation"), ("checkpoint.every_steps", "checkpoints")],
)
def test_null_for_a_period_says_that_0_disables(key: str, off: str) -> None:
    """`eval.every_steps=null` (a user's guess at "never") is refused naming what does turn
    evaluation off (before: only "Incompatible value 'None' ...; the default is 100")."""
    from trainer.config.cli import check_overrides
    from trainer.config.errors import ConfigError

    with pytest.raises(ConfigError) as err:
        check_overrides([f"{key}=null"], CONFIG_DIR)
    assert f"{key}=0 disables {off}" in str(err.value), err.value
