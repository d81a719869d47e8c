"""The compatibility table (trainer/run/compatibility.py) is where every refusal between
features and layouts comes from: each pair below is refused by the table alone, in this one
process, from the config (the step and callbacks built from it, as trainer/run/lifecycle.py
asks before the world's size or any process group), or for the rows a built part decides,
from that part; the table holds exactly these rows; with the table emptied nothing else
refuses them at those moments (the scattered checks of before are gone), their paragraphs
live in no other module of trainer/, and docs/architecture.md shows the table as it is."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests.conftest import REPO, TINY, compose_config, stdlib_text
from trainer.config.cli import to_config
from trainer.config.errors import ConfigError
from trainer.run import compatibility
from trainer.run.compatibility import Choices
from trainer.run.lifecycle import check_choices

MOE = ["+model.moe.experts=4", "+model.moe.top_k=2"]
DP_SGD = ["step=dp_sgd", "step.max_grad_norm=1.0", "step.noise_multiplier=1.0"]
GRAPHS = ["train.compile=true", "train.compile_mode=reduce-overhead"]
AUTO = ["train.micro_batch_size=auto", "train.global_batch_size=16"]
GRPO = ["task=grpo", "data=prompts", "reward=[exact_answer]"]

# The rows' features, by their names in the table.
EMA = "an averaged copy of the weights (callbacks: EMA)"
NOT_PLAIN = "a step other than step=accumulate's window"
WHOLE = "a callback of every micro-batch's gradient or of every weight"
CUDA = "CUDA graphs (train.compile_mode=reduce-overhead|max-autotune)"
AUTO_MICRO = "train.micro_batch_size=auto"
MIXTURE = "a mixture of experts"
PADDED = "data padded to each micro-batch's longest row"
WINDOW = "a loss of the whole window"

FT = ["ft=torchft", "ft.lighthouse=http://127.0.0.1:29510"]

# (overrides, the row's features, its key, a piece of its paragraph): refused by the config.
FROM_CONFIG: list[tuple[list[str], tuple[str, str], str, str]] = [
    *(
        (
            [*FT, f"dist.{k}=2", *(MOE if k == "ep" else [])],
            ("ft=torchft", f"dist.{k} > 1"),
            f"dist.{k}",
            "rank r sums with rank r",
        )
        for k in ("tp", "pp", "cp", "ep")
    ),
    ([*FT, *AUTO], ("ft=torchft", AUTO_MICRO), "train.micro_batch_size", "same micro-batches"),
    ([*FT, "step=sam"], ("ft=torchft", NOT_PLAIN), "step", "SAMStep reduces over"),
    (
        [*FT, "callbacks=noise_scale"],
        ("ft=torchft", "a callback of every micro-batch's gradient"),
        "callbacks.noise_scale",
        "count its micro-batches twice",
    ),
    ([*MOE, "dist.ep=2", "dist.tp=2"], ("dist.ep > 1", "dist.tp > 1"), "dist.ep", "dist.tp=2"),
    ([*MOE, "dist.ep=2", "dist.pp=2"], ("dist.ep > 1", "dist.pp > 1"), "dist.ep", "dist.pp=2"),
    ([*MOE, "dist.ep=2", "dist.cp=2"], ("dist.ep > 1", "dist.cp > 1"), "dist.ep", "dist.cp=2"),
    (
        [*MOE, "dist.ep=2", "callbacks=ema"],
        ("dist.ep > 1", EMA),
        "callbacks.ema",
        "its own experts",
    ),
    (
        [*MOE, "dist.ep=2", *AUTO],
        ("dist.ep > 1", AUTO_MICRO),
        "train.micro_batch_size",
        "auto is not probed",
    ),
    (
        [*MOE, "dist.ep=2", "train.compile=true"],
        ("dist.ep > 1", "train.compile=true"),
        "train.compile",
        "all-to-all",
    ),
    (
        [*MOE, "dist.ep=2", "train.grad_norms=per_layer"],
        ("dist.ep > 1", "train.grad_norms=per_layer"),
        "train.grad_norms",
        "this rank's experts only",
    ),
    ([*MOE, "dist.ep=2", "step=sam"], ("dist.ep > 1", NOT_PLAIN), "step", "SAMStep is not built"),
    *(
        ([f"dist.{k}=2", *extra], (f"dist.{k} > 1", second), key, says)
        for k in ("tp", "pp")
        for extra, second, key, says in (
            (AUTO, AUTO_MICRO, "train.micro_batch_size", f"dist.{k}: the automatic"),
            (["train.compile=true"], "train.compile=true", "train.compile", "compiling it"),
            (
                ["train.grad_norms=per_layer"],
                "train.grad_norms=per_layer",
                "train.grad_norms",
                "this rank's share",
            ),
            (["step=sam"], NOT_PLAIN, "step", f"with dist.{k} the window"),
            (["callbacks=noise_scale"], WHOLE, "callbacks.noise_scale", "no rank holds whole"),
        )
    ),
    (["dist.cp=2", "step=sam"], ("dist.cp > 1", NOT_PLAIN), "step", "SAMStep would see them whole"),
    (["dist.cp=2", *AUTO], ("dist.cp > 1", AUTO_MICRO), "train.micro_batch_size", "dist.cp"),
    (
        ["task=dpo", "dist.cp=2"],
        ("task=dpo", "dist.cp > 1"),
        "dist.cp",
        "task=dpo is not available",
    ),
    (
        ["task=dpo", "dist.pp=2"],
        ("task=dpo", "dist.pp > 1"),
        "dist.pp",
        "task=dpo is not available",
    ),
    ([*MOE, "task=dpo", "dist.ep=2"], ("task=dpo", "dist.ep > 1"), "dist.ep", "frozen copy"),
    (
        [*MOE, "task=dpo", "moe=seq_aux"],
        ("task=dpo", "moe.balance=seq_aux"),
        "moe.balance",
        "a pair's two documents",
    ),
    (["task=grpo"], ("task=grpo", "not data=prompts"), "data", "it needs data=prompts"),
    *(
        ([*GRPO, f"dist.{k}=2"], ("task=grpo", f"dist.{k} > 1"), f"dist.{k}", "token by token")
        for k in ("pp", "tp", "cp")
    ),
    ([*GRPO, *AUTO], ("task=grpo", AUTO_MICRO), "train.micro_batch_size", "made after generation"),
    (
        [*GRPO, "step=sam"],
        ("task=grpo", "a step other than step=accumulate"),
        "step",
        "SAMStep` is not built with it",
    ),
    (["adapter=lora", "dist.tp=2"], ("adapter=lora", "dist.tp > 1"), "dist.tp", "megatron_config"),
    (
        ["adapter=lora", "dist.pp=2"],
        ("adapter=lora", "dist.pp > 1"),
        "dist.pp",
        "no pipeline support",
    ),
    ([*GRAPHS, "data.packed=false"], (CUDA, "data.packed=false"), "data.packed", "lengths vary"),
    (
        [*GRAPHS, "+data.sampling=poisson"],
        (CUDA, "data.sampling=poisson"),
        "data.sampling",
        "a different size",
    ),
    ([*GRAPHS, *AUTO], (CUDA, AUTO_MICRO), "train.micro_batch_size", "probes several"),
    (
        ["train.precision=fp8", "dist.tp=2"],
        ("train.precision=fp8", "dist.tp > 1"),
        "train.precision",
        "torchao's own",
    ),
    (
        [*DP_SGD, "train.precision=fp16"],
        ("step=dp_sgd", "train.precision=fp16|fp8"),
        "train.precision",
        "not fp16",
    ),
    ([*DP_SGD, "task=dpo"], ("task=dpo", "step=dp_sgd"), "step", "vmap"),
    (
        ["+data.sampling=poisson"],
        ("data.sampling=poisson", "any step but step=dp_sgd"),
        "data.sampling",
        "needs step=dp_sgd",
    ),
    ([*MOE, "dist.tp=2"], (MIXTURE, "dist.tp > 1"), "dist.tp", "must be 1 with a mixture"),
    ([*MOE, "dist.pp=2"], (MIXTURE, "dist.pp > 1"), "dist.pp", "must be 1 with a mixture"),
    (
        ["model=hf_qwen3_moe", "dist.cp=2"],
        (MIXTURE, "dist.cp > 1"),
        "dist.cp",
        "must be 1 with a mixture",
    ),
    (
        [*MOE, "step=sam"],
        ("moe.balance=global|seq_aux", "a step that prepares no window"),
        "moe.balance",
        "SAMStep does not",
    ),
]


class Routed:
    """A built model that declares one router (the config cannot tell: a user's model)."""

    def routers(self) -> list[Any]:
        return [type("Router", (), {"num_experts": 2, "top_k": 1, "routing": None})()]


def contrastive() -> Any:
    from engine.contrastive import ContrastiveTask

    return ContrastiveTask()


def causal_lm() -> Any:
    from engine.tasks import CausalLMTask

    return CausalLMTask()


def noise_scale() -> Any:
    from engine.callbacks.noise_scale import NoiseScale
    from engine.step import CallbackList

    return CallbackList({"noise": NoiseScale()})


# (overrides, what is built, the row's features, its key, a piece of its paragraph): refused
# the moment that part is built.
FROM_BUILT: list[tuple[list[str], dict[str, Any], tuple[str, str], str, str]] = [
    (["dist.tp=2"], {"model": Routed()}, (MIXTURE, "dist.tp > 1"), "dist.tp", "must be 1"),
    ([*GRAPHS], {"model": Routed()}, (CUDA, "a model with routers"), "model", "(1 router)"),
    (
        [*GRAPHS],
        {"pads_batches": True, "data_description": "chat"},
        (CUDA, PADDED),
        "data",
        "chat pads",
    ),
    (
        ["data=preference"],
        {"task": causal_lm()},
        ("data=preference", "not task=dpo"),
        "task",
        "CausalLMTask reads other",
    ),
    (
        ["data=prompts"],
        {"task": causal_lm()},
        ("data=prompts", "not task=grpo"),
        "task",
        "CausalLMTask reads other",
    ),
    ([*MOE], {"task": contrastive()}, (MIXTURE, WINDOW), "task", "loss per micro-batch"),
    (
        ["step=sam"],
        {"task": contrastive()},
        (WINDOW, "a step of one micro-batch at a time"),
        "step",
        "SAMStep would see one",
    ),
    (
        ["step=cached"],
        {"task": causal_lm()},
        ("step=cached", "a loss per micro-batch"),
        "step",
        "step=cached needs a task",
    ),
    (
        [],
        {"task": contrastive(), "callbacks": noise_scale()},
        (WINDOW, "a callback of every micro-batch's gradient"),
        "callbacks.noise",
        "under step=cached",
    ),
]


def config(overrides: list[str]) -> Any:
    return to_config(compose_config([*TINY, *overrides]))[0]


def built_choices(overrides: list[str], built: dict[str, Any]) -> Choices:
    from trainer.run.build import build_callbacks, build_step

    cfg = config(overrides)
    made = {"step": build_step(cfg.step), "callbacks": build_callbacks(cfg.callbacks, cfg.train)}
    return Choices.of(cfg, cfg.dist.dims(), training=True, **{**made, **built})


@pytest.mark.parametrize(("overrides", "row", "key", "says"), FROM_CONFIG)
def test_the_config_alone_is_refused_by_its_row(
    overrides: list[str], row: tuple[str, str], key: str, says: str
) -> None:
    cfg = config(overrides)
    with pytest.raises(ConfigError) as err:
        check_choices(cfg)  # lifecycle's: before the world's size or any process group
    assert err.value.key == key and says in str(err.value), str(err.value)
    assert "\n" not in str(err.value)
    assert not dist.is_initialized()
    applying = [(r.first.name, r.second.name) for r in compatibility.ROWS]
    assert row in applying


@pytest.mark.parametrize(("overrides", "built", "row", "key", "says"), FROM_BUILT)
def test_a_built_part_is_refused_by_its_row(
    overrides: list[str], built: dict[str, Any], row: tuple[str, str], key: str, says: str
) -> None:
    """A row a built part decides: not refused from the config, refused once it is built."""
    check_choices(config(overrides))
    with pytest.raises(ConfigError) as err:
        built_choices(overrides, built).checked()
    assert err.value.key == key and says in str(err.value), str(err.value)
    first = next(compatibility.refused(built_choices(overrides, built)))
    assert (first.first.name, first.second.name) == row


def test_the_table_holds_exactly_these_rows() -> None:
    """A row removed fails its case above; a row added needs a case here."""
    cases = [row for _, row, _, _ in FROM_CONFIG] + [row for _, _, row, _, _ in FROM_BUILT]
    table = [(r.first.name, r.second.name) for r in compatibility.ROWS]
    assert sorted(set(table)) == sorted(set(cases))
    assert len(table) == len(set(table))


def test_nothing_else_refuses_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the table emptied, every case passes the moments where the table is asked: no
    other refusal sits there (the ones of before were spread over five modules)."""
    monkeypatch.setattr(compatibility, "ROWS", ())
    for overrides, *_ in FROM_CONFIG:
        check_choices(config(overrides))
    for overrides, built, *_ in FROM_BUILT:
        built_choices(overrides, built).checked()


# Rows one process builds a run of, and where each was refused before the table: with the
# table emptied, the run builds past that place.
BUILDS_WITHOUT_THE_TABLE = {
    "moe-step": [*MOE, "step=sam"],  # trainer/run/moe.py check_moe_step
    "poisson": ["+data.sampling=poisson"],  # trainer/run/build.py attach_privacy
    "dp_sgd-fp16": [*DP_SGD, "train.precision=fp16"],  # attach_privacy
    "cached-lm": ["step=cached"],  # trainer/run/window.py step_for_task
    "graphs-padded": [*GRAPHS, "data.packed=false"],  # trainer/run/assemble.py
}


@pytest.mark.parametrize("name", list(BUILDS_WITHOUT_THE_TABLE))
def test_without_the_table_the_run_builds(
    name: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from engine.distributed import DistInfo
    from trainer.config.trust import derived_keys
    from trainer.run.build import build_run

    text = stdlib_text(tmp_path / "text.txt", 4000)
    composed = compose_config([*TINY, f"data.path={text}", *BUILDS_WITHOUT_THE_TABLE[name]])
    cfg, plain = to_config(composed)
    with pytest.raises(ConfigError):
        build_run(cfg, plain, tmp_path / "refused", DistInfo(), derived_keys(composed))
    monkeypatch.setattr(compatibility, "ROWS", ())
    run = build_run(cfg, plain, tmp_path / "run", DistInfo(), derived_keys(composed))
    run.stop.close()


def test_the_paragraphs_live_in_the_table_alone() -> None:
    """Each row's paragraph (its first words before any value it names) is written in no
    other module of trainer/ (the engine keeps its own refusals for its plain-Python users)."""
    sources = {
        p: p.read_text() for p in (REPO / "trainer").rglob("*.py") if p.name != "compatibility.py"
    }
    for row in compatibility.ROWS:
        text = row.why.removeprefix(compatibility.GRAPHS_PREFIX)
        words = re.split(r"\{\w+\}", text)[0][:40]
        if len(words) < 20:
            continue  # a paragraph that starts with a value: its rest is checked by its case
        found = [str(p.relative_to(REPO)) for p, s in sources.items() if words in s]
        assert found == [], (words, found)


def test_architecture_doc_shows_the_table() -> None:
    doc = (REPO / "docs" / "architecture.md").read_text()
    assert compatibility.markdown() in doc
