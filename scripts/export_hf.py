"""Write a trained checkpoint as a Hugging Face directory that
`AutoModelForCausalLM.from_pretrained` loads (safetensors + config.json) and `AutoTokenizer`
beside it: a transformers model (`model=hf_*`) as its own class, the in-tree GPT
(`model=gpt_small|gpt_tiny`) as `GPT2LMHeadModel` with the same logits (`trainer/models/export.py`).
The tokenizer is the run's `data.tokenizer`, or for byte-level text one whose ids are the
UTF-8 bytes. Other models (a CNN, your own) have no mapping and are refused.

    python scripts/export_hf.py checkpoint=RUN_DIR/checkpoints/step_NNNNNNNN out=DIR
    python scripts/export_hf.py checkpoint=RUN_DIR out=DIR trust=[mypkg]

A run directory means its newest valid checkpoint. The checkpoint's saved config is untrusted
input: only targets cumulus ships are built from it, others only under `trust=[PKG,...]`.

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

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.checkpoint import CheckpointError, load_checkpoint  # noqa: E402
from engine.distributed import DistInfo  # noqa: E402
from engine.parallel.dims import build_parallelism  # noqa: E402
from engine.rng import seed_everything  # noqa: E402
from trainer.config.cli import run_command  # noqa: E402
from trainer.config.errors import UserError  # noqa: E402
from trainer.config.schema import Config, register_configs  # noqa: E402
from trainer.config.trust import parse_trust  # noqa: E402
from trainer.models.export import export_support, run_tokenizer, to_gpt2  # noqa: E402
from trainer.models.lora import export_adapter  # noqa: E402
from trainer.run.assemble import build_adapter, build_model  # noqa: E402
from trainer.run.evaluation import checkpoint_config, resolve_checkpoint  # noqa: E402
from trainer.run.identity import register_resolvers  # noqa: E402
from trainer.run.state import RunState  # noqa: E402

USAGE = (
    "usage: python scripts/export_hf.py checkpoint=PATH|RUN_DIR out=DIR [merge=true] "
    "[trust=[PKG,...]]"
)


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
    if not hasattr(model, "save_pretrained"):  # the in-tree GPT
        model = to_gpt2(model.cpu(), tokenizer.eos_token_id if tokenizer is not None else None)
    model.save_pretrained(out)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    print(
        f"exported step {ckpt.step} of {path} to {out} as {type(model).__name__}, with {what}",
        flush=True,
    )


def main(argv: list[str]) -> None:
    register_configs()
    register_resolvers()
    try:
        trust, argv = parse_trust(argv)
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    keys = [a.split("=", 1)[0] for a in argv]
    args = dict(a.split("=", 1) for a in argv if "=" in a)
    merge = args.pop("merge", "false").lower()
    if (
        len(args) + ("merge" in keys) != len(argv)  # each argument once, as key=value
        or set(args) != {"checkpoint", "out"}
        or merge not in ("true", "false")
    ):
        print(f"error: {USAGE}", file=sys.stderr)
        sys.exit(2)
    path, out = Path(args["checkpoint"]).expanduser(), Path(args["out"]).expanduser()
    try:
        path = resolve_checkpoint(path)
        cfg = checkpoint_config(path, [], trust, command="python scripts/export_hf.py")
    except (UserError, CheckpointError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    run_command(cfg, lambda config, plain, info: export(path, config, info, out, merge == "true"))


if __name__ == "__main__":
    main(sys.argv[1:])
