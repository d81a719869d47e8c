"""`adapter=lora` in the run: peft's LoRA adapters on the built model, its base frozen
(trainer/models/lora.py), before anything converts, copies or lays the model out, so that
fp8, DPO's reference and the layout all see the adapted model."""

from __future__ import annotations

from torch import nn

from engine.distributed import DistInfo
from trainer.config.schema import Config
from trainer.models.lora import Adapter
from trainer.run.extensions.base import Extension
from trainer.run.parts import Parts


def build_adapter(
    cfg: Config, model: nn.Module, info: DistInfo, shards: bool, fake: bool = False
) -> Adapter | None:
    """`adapter=lora`: LoRA on `model` through peft, the base frozen (trainer/models/lora.py);
    `fake`: on the planner's fake tensors."""
    if cfg.adapter.kind == "none":
        return None
    from trainer.models.lora import apply_adapter

    node = cfg.model
    base = (
        f"model.pretrained={node['pretrained']}"
        if node.get("pretrained")
        else f"{node.get('_target_')} initialized from seed {cfg.seed}"
    )
    return apply_adapter(
        model, cfg.adapter, base=base, shards=shards, is_main=info.is_main, fake=fake
    )


class Adapters(Extension):
    """The adapters built on the model as soon as it is (`parts.adapter`)."""

    name = "adapter"

    def model_built(self, parts: Parts) -> Parts:
        with parts.building:
            adapter = build_adapter(
                parts.cfg,
                parts.built_model(),
                parts.info,
                parts.parallel.shards_parameters,
                parts.simulated,
            )
        return parts.replace(adapter=adapter)
