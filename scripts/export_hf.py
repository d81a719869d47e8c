"""Write a trained checkpoint as a Hugging Face directory that
`AutoModelForCausalLM.from_pretrained` loads (safetensors + config.json) and `AutoTokenizer`
beside it: a transformers model (`model=hf_*`) as its own class, the in-tree GPT
(`model=gpt_small|gpt_tiny`) as `GPT2LMHeadModel` with the same logits (`trainer/models/export.py`).
The tokenizer is the run's `data.tokenizer`, or for byte-level text one whose ids are the
UTF-8 bytes. An encoder (`model=hf_encoder`) becomes transformers' base model (`AutoModel`)
with the run's tokenizer and sentence-transformers' mean pooling (`modules.json`); a task's own
parameters (a learned temperature) are left out. Other models (a CNN, your own) have no
mapping and are refused.

    python scripts/export_hf.py checkpoint=RUN_DIR/checkpoints/step_NNNNNNNN out=DIR
    python scripts/export_hf.py checkpoint=RUN_DIR out=DIR trust=[mypkg]
    python scripts/export_hf.py checkpoint=RUN_DIR out=DIR model.pretrained=BASE_DIR

A run directory means its newest valid checkpoint. A checkpoint of the user's own (its config
signed with their secret, trainer/config/signing.py) needs no flag. A received one's saved
config is untrusted input: only targets cumulus ships are built from it, others only under
`trust=[PKG,...]`; the paths it names (`model.pretrained`, `data.tokenizer`...) are given
again on the command line (`key=value`, as for `trainer.evaluate`) or taken with
`saved_paths=true`. A base that moved is named again (`model.pretrained=NEW_DIR`): what the
run derived from it (`data.pretrained`) follows.

Either checkpoint layout (`full` or `sharded`, any world size) is read in this one process.
Tied weights (GPT-2's input and output embedding) stay tied in the export.

A run with `adapter=lora` saved its adapters alone: the export is a PEFT adapter directory
(`adapter_config.json`, `adapter_model.safetensors`, written by peft) on the run's base
(`model.pretrained`), which `PeftModel.from_pretrained(base, DIR)` loads; with `merge=true`,
the base with the adapters merged into its weights, as a `save_pretrained` directory.

    python scripts/export_hf.py checkpoint=RUN_DIR out=DIR merge=true
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from engine.distributed import DistInfo  # noqa: E402
from engine.parallel.dims import build_parallelism  # noqa: E402
from engine.rng import seed_everything  # noqa: E402
from engine.window_task import LOSS_MODULE  # noqa: E402
from trainer.config.cli import check_overrides, run_command  # noqa: E402
from trainer.config.errors import UserError  # noqa: E402
from trainer.config.schema import Config, register_configs  # noqa: E402
from trainer.config.trust import parse_saved_paths, parse_trust  # noqa: E402
from trainer.models.encoder import MeanPooling, encoder_tokenizer  # noqa: E402
from trainer.models.export import (  # noqa: E402
    export_support,
    run_tokenizer,
    saved_architecture,
    to_gpt2,
)
from trainer.models.hf import is_transformers_model, no_progress_bars  # noqa: E402
from trainer.models.lora import export_adapter  # noqa: E402
from trainer.run.assemble import CONFIG_DIR, build_model  # noqa: E402
from trainer.run.evaluation import checkpoint_config, resolve_checkpoint  # noqa: E402
from trainer.run.extensions.adapter import build_adapter  # noqa: E402
from trainer.run.identity import register_resolvers  # noqa: E402
from trainer.run.state import RunState  # noqa: E402

USAGE = (
    "usage: python scripts/export_hf.py checkpoint=PATH|RUN_DIR out=DIR [merge=true] "
    "[trust=[PKG,...]] [saved_paths=true] [key=value ...] (keys: the run's config, e.g. "
    "model.pretrained=DIR)"
)
OWN = ("checkpoint", "out", "merge")
# What an export reads of the saved config: the model, and the tokenizer beside it.
USES = ("model", "data.tokenizer", "data.pretrained", "data.chat_template")


def export(path: Path, cfg: Config, info: DistInfo, out: Path, merge: bool = False) -> None:
    try:
        ckpt = load_checkpoint(path, info, checksums=False)  # verified before
    except CheckpointError as exc:
        raise UserError(f"checkpoint: {exc}") from None
    seed_everything(cfg.seed)
    model, _ = build_model(cfg.model, info)
    why = export_support(model)
    if why is not None:
        raise UserError(f"checkpoint: {path} holds {why}")
    drop_task_parameters(ckpt)
    if isinstance(model, MeanPooling):  # model=hf_encoder: the encoder directory
        RunState(model, None, build_parallelism("ddp", info)).load(ckpt)  # the whole model
        export_encoder(model, dict(cfg.data), out)
        print(f"exported step {ckpt.step} of {path} to {out} as an encoder", flush=True)
        return
    adapter = build_adapter(cfg, model, info, shards=False)  # adapter=lora: peft's layers
    if merge and adapter is None:
        raise UserError(
            f"merge=true: {path} holds a whole model (its run had no adapter=lora), nothing "
            "to merge; export it without merge=true"
        )
    # The whole model, or the adapters on the base they were trained on (refused otherwise).
    RunState(model, None, build_parallelism("ddp", info), adapter=adapter).load(ckpt)
    tokenizer, what = run_tokenizer(dict(cfg.data))  # before anything is written
    if adapter is not None:
        done = export_adapter(adapter, out, cfg.model.get("pretrained"), merge, tokenizer)
        if tokenizer is not None:
            tokenizer.save_pretrained(out)
        print(
            f"exported step {ckpt.step} of {path} to {out} as {done.kind} ({done.cls}), "
            f"with {what}",
            flush=True,
        )
        if done.note:
            print(done.note, flush=True)
        return
    if not is_transformers_model(model):  # the in-tree GPT
        model = to_gpt2(model.cpu(), tokenizer.eos_token_id if tokenizer is not None else None)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    print(
        f"exported step {ckpt.step} of {path} to {out} as "
        f"{saved_architecture(out, type(model).__name__)}, with {what}",
        flush=True,
    )


def drop_task_parameters(ckpt: Any) -> None:
    """A task's own parameters (task=contrastive's learned temperature) are saved with the
    model's (engine/window_task.py) but belong to no exported model."""
    weights = ckpt.shared.get("model")
    if isinstance(weights, dict):
        for key in [k for k in weights if k.startswith(f"{LOSS_MODULE}.")]:
            del weights[key]


def export_encoder(model: MeanPooling, data: dict[str, Any], out: Path) -> None:
    """`model=hf_encoder`: transformers' base model (`AutoModel` loads it), the run's
    tokenizer, and sentence-transformers' mean-pooling description."""
    tokenizer = encoder_tokenizer(str(data["tokenizer"])) if data.get("tokenizer") else None
    model.save_encoder(out)  # type: ignore[attr-defined]
    if tokenizer is not None:
        tokenizer.save_pretrained(out)


def main(argv: list[str]) -> None:
    register_configs()
    register_resolvers()
    try:
        trust, argv = parse_trust(argv)
        saved_paths, argv = parse_saved_paths(argv)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    own = [a for a in argv if a.split("=", 1)[0] in OWN]
    overrides = [a for a in argv if a not in own]
    args = dict(a.split("=", 1) for a in own)
    merge = args.pop("merge", "false").lower()
    if (
        len(args) + ("merge" in {a.split("=", 1)[0] for a in own}) != len(own)  # each once
        or set(args) != {"checkpoint", "out"}
        or merge not in ("true", "false")
        or any("=" not in a for a in overrides)
    ):
        print(f"error: {USAGE}", file=sys.stderr)
        sys.exit(2)
    path, out = Path(args["checkpoint"]).expanduser(), Path(args["out"]).expanduser()
    try:
        check_overrides(overrides, CONFIG_DIR)
        path = resolve_checkpoint(path)
        cfg = checkpoint_config(
            path, overrides, trust, "python scripts/export_hf.py", saved_paths, USES
        )
    except (UserError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    with no_progress_bars():  # transformers' "Loading weights", "Writing model shards"
        run_command(
            cfg, lambda config, plain, info: export(path, config, info, out, merge == "true")
        )


if __name__ == "__main__":
    main(sys.argv[1:])
