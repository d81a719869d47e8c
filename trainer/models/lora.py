"""LoRA adapters through `peft` (`adapter=lora`, the `adapter` extra): built with peft's
`LoraConfig` and `get_peft_model` on any model whose layers peft can wrap (the transformers
models, the in-tree GPT by its module names, a user's module), the base frozen.

The model cumulus trains stays the user's module itself: peft injects its LoRA layers in place
(`q_proj` becomes a peft layer holding `base_layer`, `lora_A.default`, `lora_B.default`), so
the model keeps its class, its forward and what it declares to the trainer (blocks, output
head, FLOPs). peft's `PeftModel` around it is kept for what only peft does: its adapter
directory (`save_pretrained`) and merging (`merge_and_unload`).

`Adapter` is also the checkpoint's record of the adapters (component `adapter`): the LoRA
settings and a fingerprint of the frozen base (engine/checkpoint/fingerprint.py), checked
before anything of a checkpoint is loaded into a model: adapters are refused on another base.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch
from torch import nn

from engine.checkpoint.fingerprint import fingerprint_difference, frozen_fingerprint
from trainer.config.errors import ConfigError, UserError
from trainer.config.schema import AdapterCfg
from trainer.models.hf import is_transformers_model

EXTRA = "adapter"


def require_peft() -> Any:
    try:
        import peft
    except ImportError:
        raise UserError(
            f"adapter=lora: peft is not installed; install the extra: pip install "
            f"'cumulus[{EXTRA}]'"
        ) from None
    return peft


# ---- what peft can wrap ------------------------------------------------------------------
def _is_linear(module: nn.Module) -> bool:
    """nn.Linear, or transformers' Conv1D (GPT-2's linear layers, weights as (in, out))."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


def output_layer(model: nn.Module) -> nn.Module | None:
    """The layer that gives the logits, which `all-linear` leaves out (peft's convention)."""
    for hook in ("get_output_embeddings", "output_head"):
        fn = getattr(model, hook, None)
        if callable(fn):
            try:
                return fn()
            except (AttributeError, NotImplementedError):
                continue
    return None


def linear_modules(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if name and _is_linear(m)}


def describe_linear(model: nn.Module) -> str:
    """The model's linear module names, for error messages: last names with their counts."""
    counts = Counter(name.rsplit(".", 1)[-1] for name in linear_modules(model))
    if not counts:
        return f"{type(model).__name__} has no linear layer"
    names = ", ".join(f"{n} (x{c})" if c > 1 else n for n, c in sorted(counts.items()))
    head = output_layer(model)
    heads = [n for n, m in linear_modules(model).items() if m is head]
    note = f"; the output layer is {heads[0]}" if heads else ""
    return f"the linear modules of {type(model).__name__} are {names}{note}"


def resolve_targets(model: nn.Module, cfg: AdapterCfg) -> list[str]:
    """`adapter.target_modules` as module names peft matches (a name matches a module whose
    path is it or ends in `.name`): `all-linear` is every linear layer but the output layer.
    A name that matches no module is refused in one paragraph listing the linear ones."""
    linear = linear_modules(model)
    if cfg.target_modules == "all-linear":
        head = output_layer(model)
        keep = [n for n, m in linear.items() if m is not head]
        if not keep:
            raise UserError(
                f"adapter=lora: peft cannot wrap {type(model).__name__}: adapter.target_modules="
                f"all-linear found no linear layer besides the output layer "
                f"({describe_linear(model)}). LoRA adapts linear layers (nn.Linear, "
                "transformers' Conv1D); name other layers peft supports (embeddings, "
                "convolutions) in adapter.target_modules, or train it with adapter=none",
                all_ranks=True,
            )
        leaves = sorted({n.rsplit(".", 1)[-1] for n in keep})
        heads = {n.rsplit(".", 1)[-1] for n, m in linear.items() if m is head}
        return sorted(keep) if heads & set(leaves) else leaves
    names = [n for n, _ in model.named_modules() if n]
    for target in cfg.target_modules:
        if not any(n == target or n.endswith("." + target) for n in names):
            raise ConfigError(
                "adapter.target_modules",
                f"{target!r} names no module of {type(model).__name__} ({describe_linear(model)}"
                "). Name modules by the last part of their path (e.g. [q_proj,v_proj]) or use "
                "all-linear",
            )
    return list(cfg.target_modules)


def check_modules_to_save(model: nn.Module, cfg: AdapterCfg) -> None:
    names = [n for n, _ in model.named_modules() if n]
    for target in cfg.modules_to_save or []:
        if not any(n == target or n.endswith("." + target) for n in names):
            top = ", ".join(n for n, _ in model.named_children())
            raise ConfigError(
                "adapter.modules_to_save",
                f"{target!r} names no module of {type(model).__name__} (its top-level modules: "
                f"{top}); name modules to train whole by the last part of their path",
            )


# ---- building ------------------------------------------------------------------------------
@dataclasses.dataclass
class Adapter:
    """The adapters of a run: peft's `PeftModel` around `model` (for its adapter directory and
    merging), the settings, and, as the checkpoint component `adapter`, the base's
    fingerprint."""

    peft_model: Any
    cfg: AdapterCfg
    model: nn.Module
    base: str = "model.*"  # where the base comes from, in words (for the refusal)
    _base: dict[str, Any] | None = None

    def base_fingerprint(self) -> dict[str, Any]:
        """Of the frozen weights as they are now (collective when they are sharded); once."""
        if self._base is None:
            self._base = frozen_fingerprint(self.model)
        return self._base

    def state_dict(self) -> dict[str, Any]:
        return {"config": dataclasses.asdict(self.cfg), "base": self.base_fingerprint()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuse adapters trained on another base (every rank alike)."""
        difference = fingerprint_difference(state["base"], self.base_fingerprint())
        if difference is not None:
            raise UserError(
                f"checkpoint: its adapters were trained on another base model than the one "
                f"this run builds ({difference}); this run's base is {self.base}. Point "
                "model.pretrained (or model.*) at the base the adapters were trained on, or "
                "start the adapters afresh with checkpoint.resume=never",
                all_ranks=True,
            )


def apply_adapter(
    model: nn.Module,
    cfg: AdapterCfg,
    *,
    base: str = "model.*",
    shards: bool = False,
    is_main: bool = True,
    fake: bool = False,
) -> Adapter:
    """LoRA on `model` in place through peft, every other parameter frozen. `shards`
    (FSDP2): trainable parameters of mixed dtypes are upcast to one, with one NOTE. `fake`:
    the model's tensors are the planner's fake tensors."""
    peft = require_peft()
    targets = resolve_targets(model, cfg)
    check_modules_to_save(model, cfg)
    linear = linear_modules(model)
    chosen = [m for n, m in linear.items() if any(n == t or n.endswith("." + t) for t in targets)]
    config = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=targets,
        modules_to_save=list(cfg.modules_to_save) if cfg.modules_to_save else None,
        use_dora=bool(cfg.use_dora),
        # transformers' Conv1D holds its weight as (in, out): GPT-2's layers.
        fan_in_fan_out=bool(chosen) and all(not isinstance(m, nn.Linear) for m in chosen),
        task_type="CAUSAL_LM" if _causal_lm(model) else None,
    )
    try:
        with warnings.catch_warnings():  # peft asks a transformers model a deprecated name
            warnings.filterwarnings(
                "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
            )
            peft_model = _get_peft_model(peft, model, config, fake)
    except (ValueError, TypeError, NotImplementedError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise UserError(
            f"adapter=lora: peft cannot wrap {type(model).__name__} with adapter.target_modules="
            f"{cfg.target_modules} ({first}). LoRA adapts the layers peft supports (linear, "
            f"embedding and convolution layers); {describe_linear(model)}. Name those in "
            "adapter.target_modules (or all-linear), or train the model with adapter=none",
            all_ranks=True,
        ) from None
    if shards:
        one_trainable_dtype(model, is_main)
    return Adapter(peft_model, cfg, model, base)


def _get_peft_model(peft: Any, model: nn.Module, config: Any, fake: bool) -> Any:
    """peft's `get_peft_model`. On the planner's fake tensors peft's own move of each new
    layer to its base layer's device fails (a fake parameter cannot be swapped): the layers
    are made as real tensors outside the fake mode, then replaced by fake ones of the same
    shapes (values do not matter where nothing real is computed)."""
    if not fake:
        return peft.get_peft_model(model, config)
    from torch._subclasses.fake_tensor import is_fake, unset_fake_temporarily

    with unset_fake_temporarily():
        peft_model = peft.get_peft_model(model, config)
    for module in model.modules():
        for name, p in list(module.named_parameters(recurse=False)):
            if not is_fake(p):  # back under the fake mode: torch.empty is fake
                empty = torch.empty(p.shape, dtype=p.dtype, device=p.device)
                setattr(module, name, nn.Parameter(empty, requires_grad=p.requires_grad))
    return peft_model


def _causal_lm(model: nn.Module) -> bool:
    """A transformers causal LM (its adapter directory says task_type CAUSAL_LM)."""
    name = type(model).__name__
    return is_transformers_model(model) and name.endswith(("ForCausalLM", "LMHeadModel"))


def one_trainable_dtype(model: nn.Module, is_main: bool) -> None:
    """FSDP2 reduces one dtype of gradients per unit: trainable parameters of mixed dtypes (fp32
    adapters beside a bf16 `modules_to_save` copy of a bf16 base) are upcast to the widest."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    dtypes = {p.dtype for p in trainable}
    if len(dtypes) <= 1:
        return
    widest = max(dtypes, key=lambda d: torch.finfo(d).bits)
    upcast = [p for p in trainable if p.dtype != widest]
    for p in upcast:
        p.data = p.data.to(widest)
    if is_main:
        kinds = ", ".join(sorted(str(d).removeprefix("torch.") for d in dtypes))
        print(
            f"NOTE: dist.strategy=fsdp reduces one gradient dtype per sharded unit; the "
            f"trainable parameters were {kinds}, so {len(upcast)} of them were upcast to "
            f"{str(widest).removeprefix('torch.')} (the frozen base keeps its dtype)",
            flush=True,
        )


# ---- export --------------------------------------------------------------------------------
def export_line(adapter: Adapter) -> str:
    """The run header's line on what scripts/export_hf.py makes of the adapters."""
    from trainer.models import export

    if export.export_support(adapter.model) is not None:  # no Hugging Face architecture
        return export.export_line(adapter.model)
    if is_transformers_model(adapter.model):
        return (
            "export: scripts/export_hf.py writes the adapters as a PEFT adapter directory "
            "(merge=true: the merged model)"
        )
    return "export: scripts/export_hf.py writes the merged model as GPT2LMHeadModel (merge=true)"


@dataclasses.dataclass(frozen=True)
class Exported:
    kind: str  # what was written, in words
    cls: str
    note: str = ""  # what the user must know to load it


def export_adapter(
    adapter: Adapter, out: Path, base: str | None, merge: bool, tokenizer: Any = None
) -> Exported:
    """`out` as a PEFT adapter directory (`adapter_config.json`, `adapter_model.safetensors`
    in peft's key layout, written by peft itself) for `PeftModel.from_pretrained(base, out)`,
    or with `merge` the merged model as a `save_pretrained` directory."""
    from trainer.models.export import saved_architecture, to_gpt2

    model = adapter.model
    if merge:
        merged = adapter.peft_model.merge_and_unload()  # the user's module, weights merged
        if not is_transformers_model(merged):  # the in-tree GPT
            eos = tokenizer.eos_token_id if tokenizer is not None else None
            merged = to_gpt2(merged.cpu(), eos)
        merged.save_pretrained(out)
        return Exported("the merged model", saved_architecture(out, type(merged).__name__))
    if not is_transformers_model(model):
        raise UserError(
            f"checkpoint: the adapters of a {type(model).__name__} export merged only "
            "(scripts/export_hf.py ... merge=true): a PEFT adapter directory names its base "
            "as a transformers directory, which the in-tree GPT's weights are only after the "
            "export maps them to GPT2LMHeadModel (other module names and layouts)"
        )
    config = adapter.peft_model.peft_config["default"]
    config.base_model_name_or_path = base
    adapter.peft_model.save_pretrained(out)
    note = ""
    if base is None:
        note = (
            "NOTE: the adapters' base was a random initialization (model.pretrained=null), "
            "which no directory holds: PeftModel.from_pretrained needs that model built the "
            "same way (model.*, seed); merge=true writes a model that stands alone"
        )
    return Exported("a PEFT adapter directory", type(adapter.peft_model).__name__, note)
