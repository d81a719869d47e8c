"""A pretrained directory keeps its own values: which `model.config` fields the user named.

`model=hf_*` configs (configs/model/) write their fields as `${random_init:V}`: V builds the
model at random init. Beside `model.pretrained=DIR` such a field is not the user's, so it is
dropped and DIR's own `config.json` value stands (its dropout, its `use_cache`). A field the
user names (`model.config.KEY=V` on the command line or in `trainer.api`'s list, or a plain
value in a config file of their own, an experiment included) replaces the marker, and so is
theirs: a runtime field (dropout, `use_cache`, the router's jitter and loss weight) is applied
over the directory's; an architectural one is refused, since the directory decides the
architecture and holds the weights that fit it.

Read from the composed config before it is resolved (`to_config`), so every command and
`trainer.api` follow the same rule; imports no torch and no transformers.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Collection, Mapping, Sequence
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from trainer.config.errors import ConfigError

RANDOM_INIT = "random_init"
_MARK = "${" + RANDOM_INIT + ":"
# The builders whose `config` fields are a transformers config's and `pretrained` a directory.
BUILDERS = frozenset({"trainer.models.hf.causal_lm", "trainer.models.encoder.encoder"})
# Fields that change how a loaded model runs, not its architecture or weights (any field whose
# name holds "drop" too: resid_pdrop, hidden_dropout_prob, layerdrop...).
RUNTIME_FIELDS = frozenset(
    {
        "use_cache",
        "attn_implementation",
        "output_router_logits",
        "router_aux_loss_coef",
        "router_jitter_noise",
    }
)
# Dropout of heads cumulus never builds (GPT-2's double-heads summary, a classifier's).
_UNUSED_HEADS = ("summary_", "classifier_")


def is_runtime_field(name: str) -> bool:
    """Whether transformers config field `name` applies to a pretrained model as given."""
    return name in RUNTIME_FIELDS or "drop" in name


def register_random_init() -> None:
    """`${random_init:V}` is V: the marker of an in-tree default (its meaning is read from the
    unresolved config, `keep_directory_values`)."""
    if not OmegaConf.has_resolver(RANDOM_INIT):
        OmegaConf.register_new_resolver(RANDOM_INIT, lambda value: value)


def _is_default(raw: Any) -> bool:
    return isinstance(raw, str) and raw.startswith(_MARK) and raw.endswith("}")


def keep_directory_values(cfg: DictConfig) -> DictConfig:
    """`cfg` with the `${random_init:V}` fields of `model.config` dropped when
    `model.pretrained` is set (a copy; `cfg` itself when nothing is dropped). A field the user
    named that is not a runtime field is refused in one paragraph naming it."""
    node = cfg.get("model")
    if not isinstance(node, DictConfig) or node.get("_target_") not in BUILDERS:
        return cfg
    pretrained, fields = node.get("pretrained"), node.get("config")
    if not pretrained or not isinstance(fields, DictConfig):
        return cfg
    raw = OmegaConf.to_container(fields, resolve=False)
    assert isinstance(raw, dict)
    defaults = [k for k, v in raw.items() if _is_default(v)]
    refuse_architecture([k for k in raw if k not in defaults], str(pretrained))
    if not defaults:
        return cfg
    cfg = copy.deepcopy(cfg)
    with open_dict(cfg):
        for key in defaults:
            del cfg.model.config[key]
    return cfg


def refuse_architecture(given: Collection[str], pretrained: str) -> None:
    """One paragraph naming the first field of `given` (`model.config` fields the user named
    beside `pretrained`) that is not a runtime field: the directory decides the architecture."""
    structural = [str(k) for k in given if not is_runtime_field(str(k))]
    if not structural:
        return
    key = structural[0]
    saved = _saved_value(pretrained, key)
    says = f" ({key}: {saved} there)" if saved is not None else ""
    others = f" ({', '.join(structural[1:])} too)" if structural[1:] else ""
    raise ConfigError(
        f"model.config.{key}",
        f"is part of the architecture, and model.pretrained={pretrained} decides it: its "
        f"config.json{says} and the weights that fit it. Beside a pretrained directory only "
        "runtime fields apply, over the directory's values (dropout, use_cache, "
        f"{', '.join(sorted(RUNTIME_FIELDS - {'use_cache'}))}). Drop model.config.{key}"
        f"{others}, or leave model.pretrained=null to build the model at random init.",
    )


def _saved_value(pretrained: str, key: str) -> str | None:
    """`key`'s value in the directory's config.json, as JSON, when it says one."""
    try:
        raw = json.loads((Path(pretrained).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None  # the builder reports a directory that is not one
    if not isinstance(raw, dict) or key not in raw:
        return None
    return json.dumps(raw[key])


def dropout_note(fields: Mapping[str, Any], given: Collection[str], pretrained: str | None) -> str:
    """The start-up line's words on a transformers model: where its weights come from and the
    dropout in force, and whose it is beside a directory (`fields`: the model config's fields;
    `given`: those the user named)."""
    rates = {
        k: v
        for k, v in fields.items()
        if "drop" in k
        and not k.startswith(_UNUSED_HEADS)
        and isinstance(v, int | float)
        and not isinstance(v, bool)
    }
    if not pretrained:
        return f"(random init, dropout {_rates(rates)})" if rates else "(random init)"
    origin = f"from {pretrained}"
    if not rates:
        return f"({origin})"
    mine = {k: v for k, v in rates.items() if k in given}
    theirs = {k: v for k, v in rates.items() if k not in given}
    groups = [(theirs, "the directory's"), (mine, "model.config")]
    named = bool(mine and theirs)  # two origins: say which rate is which
    said = "; ".join(f"{_rates(sub, named)}: {whose}" for sub, whose in groups if sub)
    return f"({origin}, dropout {said})"


def _rates(rates: Mapping[str, Any], named: bool = False) -> str:
    """`0.1` when every rate is one value (and not `named`), else each `name=value`."""
    values = set(rates.values())
    if len(values) == 1 and not named:
        return str(values.pop())
    return ", ".join(f"{k}={v}" for k, v in rates.items())


def drop_saved_architecture(cfg: DictConfig, overrides: Sequence[str]) -> None:
    """Beside `model.pretrained`, the architecture fields a checkpoint's saved `model.config`
    holds are not this command's user's: dropped (in place), unless an override names them.
    A run of this version saves none (`keep_directory_values`); earlier versions saved the
    in-tree config whole, and `model.pretrained=DIR` may be given over a random-init run."""
    node = cfg.get("model")
    if not isinstance(node, DictConfig) or node.get("_target_") not in BUILDERS:
        return
    fields = node.get("config")
    if not node.get("pretrained") or not isinstance(fields, DictConfig):
        return
    stated = {o.split("=", 1)[0].lstrip("+~") for o in overrides if "=" in o}
    if stated & {"model", "model.config"}:
        return  # the node is this command's own
    raw = OmegaConf.to_container(fields, resolve=False)
    assert isinstance(raw, dict)
    with open_dict(fields):
        for key in raw:
            if f"model.config.{key}" not in stated and not is_runtime_field(str(key)):
                del fields[key]
