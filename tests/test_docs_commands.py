"""Every `python -m trainer.*` command that README.md and docs/ write is composed with the real
config, in this process, through the trainer's own checks (tests/docs_commands.py): an unknown
key, a bad value or a config name found nowhere fails here, not in a user's terminal. The
checker is itself tested on a synthetic page with deliberate mistakes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.conftest import REPO
from tests.docs_commands import DocCommand, check_command, commands_in, documented_commands
from trainer.config.errors import UserError


@pytest.fixture(scope="module")
def compose() -> Iterator[Any]:
    """Hydra initialized once for every command of the module, each distinct list of overrides
    composed once."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    from trainer.config.schema import register_configs
    from trainer.run.assemble import CONFIG_DIR
    from trainer.run.identity import register_resolvers

    register_configs()
    register_resolvers()
    composed: dict[tuple[str, ...], Any] = {}  # many commands compose the same overrides

    def compose(overrides: list[str]) -> Any:
        key = tuple(overrides)
        if key not in composed:
            composed[key] = hydra_compose("train", overrides=overrides)
        return composed[key]

    with initialize_config_dir(config_dir=str(CONFIG_DIR), version_base=None):
        yield compose


def refusal(command: DocCommand, compose: Any) -> str | None:
    """Why the trainer would refuse `command` before any work, or None."""
    try:
        check_command(command, compose)
    except UserError as exc:
        return str(exc)
    except Exception as exc:  # Hydra's own errors (a key it cannot merge, a bad interpolation)
        return f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"
    return None


@pytest.mark.filterwarnings("ignore:provider=hydra.searchpath")  # $PWD/my_configs: the user's
def test_every_documented_command_composes(compose: Any) -> None:
    """README.md and docs/**/*.md: each command is accepted (or, shown refused, refused)."""
    commands = documented_commands(REPO)
    assert len(commands) > 50, "the scan found too few commands: is it still reading the pages?"
    wrong = []
    for command in commands:
        why = refusal(command, compose)
        if command.refused and why is None:
            wrong.append(f"{command}\n    shown refused, but accepted")
        elif not command.refused and why is not None:
            wrong.append(f"{command}\n    {why}")
    assert not wrong, "documented commands the trainer refuses:\n" + "\n".join(wrong)


SYNTHETIC = """\
# A page with mistakes

```bash
python -m trainer.train model=gpt_tiny train.max_stepz=10
python -m trainer.train train.max_steps=abc
python -m trainer.train model=gpt_tinyy
python -m trainer.train train.precision=fp7
python -m trainer.train model=gpt_tiny model.n_layerz=2
python -m trainer.plan dist.pp=2 plan.wrld=8
python -m trainer.evaluate checkpoint=RUN eval.every_stepz=1
python -m trainer.certify certify.layoutz=[accum]
python -m trainer.preview preview.sample=3
python -m trainer.train --verbose
```

Correct ones, with placeholders:

```bash
python -m trainer.train model=gpt_tiny [train.max_steps=10] [overrides] ...
torchrun --nproc_per_node=2 -m trainer.train model.pretrained=DIR plan.world=W
python -m trainer.compare RUN_A RUN_B --atol 1e-6
```

`python -m trainer.plan [training overrides] plan.world=W plan.gpu=h100` inline, and
`python -m trainer.train train.log_every=0` (refused) inline.

<!-- illustrative -->
```bash
PYTHONPATH=. python -m trainer.train "hydra.searchpath=[file://$PWD/mine]" model=mine model.width=3
```

```bash
python -m trainer.train model=mine
```
"""


def test_checker_refuses_the_mistakes_of_a_synthetic_page(compose: Any) -> None:
    """The checker on a page it was never shown: each deliberate mistake is refused, naming
    the key; the placeholders, the inline commands, the refused one and the illustrative
    block pass; the same user's option without the marker fails."""
    commands = commands_in(SYNTHETIC, "synthetic.md")
    assert len(commands) == 17, [str(c) for c in commands]
    mistakes, correct = commands[:10], commands[10:]
    names = [
        "train.max_stepz",
        "train.max_steps",
        "model",
        "train.precision",
        "n_layerz",
        "plan.wrld",
        "eval.every_stepz",
        "certify.layoutz",
        "preview.sample",
        "--verbose",
    ]
    for command, name in zip(mistakes, names, strict=True):
        why = refusal(command, compose)
        assert why is not None and name in why, f"{command}: {why}"
    assert "Did you mean `train.max_steps`?" in str(refusal(mistakes[0], compose))
    by_text = {c.text: c for c in correct}
    assert [c.where for c in correct if c.illustrative] == ["synthetic.md:29"]
    unmarked = by_text["python -m trainer.train model=mine"]
    shown_refused = next(c for c in correct if c.refused)
    for command in correct:
        if command not in (unmarked, shown_refused):
            assert refusal(command, compose) is None, f"{command}: {refusal(command, compose)}"
    assert "train.log_every" in str(refusal(shown_refused, compose))
    assert "no config named 'mine'" in str(refusal(unmarked, compose))
