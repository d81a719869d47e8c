"""Step-1 gradient error of gradient accumulation: cumulus vs the Hugging Face Trainer, on the
same GPT-2, the same 8 padded samples (uneven valid-token counts), micro 2 x accumulation 4.

The reference is the gradient of the whole batch at once from HF's own per-token loss.
Two models: transformers' GPT2LMHeadModel (its forward takes `**kwargs`, so the Trainer
passes `num_items_in_batch` and normalizes by the global count), and the same model whose
forward drops the loss kwargs (as many custom and older models do: transformers #37766,
#47688), where the Trainer falls back to dividing each micro-batch's mean by the number of
micro-batches. cumulus computes the loss from the logits itself, so the model cannot matter.

    PYTHONPATH=DIR_WITH_ACCELERATE python scripts/bench_hf_trainer.py

The HF Trainer needs `accelerate`, which is not one of cumulus's dependencies: install it
into the benchmark's environment only (e.g. `pip install --target DIR accelerate`).
"""

from __future__ import annotations

import sys
import sysconfig
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from engine.callbacks import Callback, CallbackList  # noqa: E402
from engine.distributed import DistInfo  # noqa: E402
from engine.numerics.precision import Precision  # noqa: E402
from engine.step import StepContext  # noqa: E402
from engine.steps.accumulate import AccumulateStep  # noqa: E402
from engine.tasks import CausalLMTask  # noqa: E402
from scripts.bench import report  # noqa: E402
from trainer.data.text import text_data  # noqa: E402

SEED, MICRO, ACCUM, BLOCK = 1337, 2, 4, 32
GPT2 = dict(
    vocab_size=256, n_positions=128, n_embd=64, n_layer=2, n_head=4, resid_pdrop=0.0,
    embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=None, eos_token_id=None, use_cache=False,
)  # fmt: skip


def batch() -> tuple[torch.Tensor, torch.Tensor]:
    """8 paragraphs of stdlib source as (inputs, shifted targets), padded with -100."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:20]
    text = Path(tempfile.mkdtemp()) / "text.py"
    text.write_bytes(b"".join(f.read_bytes() for f in files))
    train = text_data(path=str(text), packed=False, block_size=BLOCK).train
    order = np.random.default_rng([SEED, 0]).permutation(len(train))[: MICRO * ACCUM]
    samples = [train[int(i)] for i in order]
    length = max(len(s) for s in samples) - 1
    x = torch.zeros(len(samples), length, dtype=torch.int64)
    y = torch.full((len(samples), length), -100, dtype=torch.int64)
    for row, s in enumerate(samples):
        x[row, : len(s) - 1], y[row, : len(s) - 1] = s[:-1], s[1:]
    return x, y


def models() -> dict[str, type]:
    import transformers

    class DropsLossKwargs(transformers.GPT2LMHeadModel):
        """GPT-2 whose forward takes no **kwargs: the Trainer cannot pass it the count."""

        def forward(self, input_ids=None, attention_mask=None, labels=None):  # type: ignore[override]
            return super().forward(
                input_ids=input_ids, attention_mask=attention_mask, labels=labels
            )

    return {
        "GPT2LMHeadModel (forward takes **kwargs)": transformers.GPT2LMHeadModel,
        "GPT-2 whose forward drops the loss kwargs": DropsLossKwargs,
    }


def fresh(cls: type) -> torch.nn.Module:
    import transformers

    torch.manual_seed(SEED)
    return cls(transformers.GPT2Config(**GPT2))


def grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def reference(x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    """The whole batch at once, HF's own loss (mean over valid tokens), float64; the same
    initial weights as every model above."""
    import transformers

    model = fresh(transformers.GPT2LMHeadModel).double()
    model(input_ids=x, labels=y, shift_labels=y).loss.backward()
    return grads(model)


class Capture(Callback):
    def on_before_optimizer_step(self, ctx: StepContext) -> None:
        self.grads = grads(ctx.model)


def cumulus(cls: type, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    model = fresh(cls)
    capture = Capture()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    ctx = StepContext(
        model=model,
        optimizer=opt,
        scheduler=torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0),
        task=CausalLMTask(),
        precision=Precision("fp32", "cpu"),
        dist=DistInfo(),
        clip_grad_norm=None,
        callbacks=CallbackList({"capture": capture}),
    )
    window = list(zip(x.split(MICRO), y.split(MICRO)))
    AccumulateStep()(ctx, window)
    return capture.grads


def hf_trainer(cls: type, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
    import transformers
    from torch.utils.data import SequentialSampler

    model = fresh(cls)
    # HF shifts labels left by one itself: one more (causally invisible) input position and
    # the targets one place later give it exactly the pairs (x[t] -> y[t]).
    inputs = torch.cat([x, torch.zeros_like(x[:, :1])], dim=1)
    labels = torch.cat([torch.full_like(y[:, :1], -100), y], dim=1)
    rows = [{"input_ids": i, "labels": lab} for i, lab in zip(inputs, labels)]
    captured: dict[str, dict[str, torch.Tensor]] = {}

    class Grab(transformers.TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            captured["g"] = grads(kw["model"])

    class InOrder(transformers.Trainer):
        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return SequentialSampler(self.train_dataset)

    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out,
            per_device_train_batch_size=MICRO,
            gradient_accumulation_steps=ACCUM,
            max_steps=1,
            learning_rate=0.0,
            max_grad_norm=0.0,
            report_to=[],
            save_strategy="no",
            logging_strategy="no",
            use_cpu=True,
            dataloader_drop_last=False,
        )
        collate = lambda b: {k: torch.stack([r[k] for r in b]) for k in b[0]}  # noqa: E731
        trainer = InOrder(
            model=model, args=args, train_dataset=rows, data_collator=collate, callbacks=[Grab()]
        )
        trainer.train()
    return captured["g"]


def rel_error(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    num = sum(float((got[n].double() - w).pow(2).sum()) for n, w in want.items())
    den = sum(float(w.pow(2).sum()) for w in want.values())
    return (num / den) ** 0.5


def main() -> None:
    import transformers

    x, y = batch()
    counts = (y != -100).sum(1).tolist()
    rows = []
    want = reference(x, y)
    for name, cls in models().items():
        ours, theirs = rel_error(cumulus(cls, x, y), want), rel_error(hf_trainer(cls, x, y), want)
        rows.append(f"| {name} | {ours:.1e} | {theirs:.1e} |")
        print(rows[-1], flush=True)
    report(
        [
            "",
            "### Gradient accumulation: step-1 gradient error, cumulus vs the HF Trainer",
            "",
            f"transformers {transformers.__version__}, torch {torch.__version__}, fp32 on CPU; "
            f"GPT-2 (2 layers, 64 wide, bytes), micro {MICRO} x accumulation {ACCUM}, 8 padded "
            f"samples with {counts} valid targets. Error: relative L2 distance of the whole "
            "gradient from the full-batch gradient of HF's own loss (float64). Command:",
            "",
            "    PYTHONPATH=DIR_WITH_ACCELERATE python scripts/bench_hf_trainer.py",
            "",
            "| model | cumulus | HF Trainer |",
            "|---|---|---|",
            *rows,
        ],
        str(REPO / "docs" / "benchmarks.md"),
    )


if __name__ == "__main__":
    main()
