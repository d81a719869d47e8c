"""`task=token_classification`: one label per position, positions labelled -100 ignored.

References are written out here: per-position cross-entropy as -log softmax summed in a
Python loop, and, for the real trainer on docs/your-model.md's tagger (variable-length
sequences padded by `pad_collate`), plain full-batch gradient descent in float64.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch import nn

from engine.tasks import TaskOutputError, TokenClassificationTask
from tests.conftest import read_metrics
from tests.ranks import explain, launch
from tests.test_user_model import EXACT, ONE, STEPS, final_weights, reference, trainer, user_module
from tests.user_project import write_project


class PerPosition(nn.Module):
    """(B, T, F) -> (B, T, C); takes its input positionally or as `features=`."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(3, 5)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.proj(features)


def hand_sums(logits: torch.Tensor, labels: torch.Tensor, ignore: int) -> tuple[float, int, int]:
    """(sum of -log p(label), items, correct) over positions whose label is not `ignore`."""
    loss, items, correct = 0.0, 0, 0
    for b in range(labels.shape[0]):
        for t in range(labels.shape[1]):
            y = int(labels[b, t])
            if y == ignore:
                continue
            row = logits[b, t].tolist()
            loss -= row[y] - math.log(sum(math.exp(v) for v in row))
            items += 1
            correct += int(max(range(len(row)), key=row.__getitem__) == y)
    return loss, items, correct


@pytest.mark.parametrize("ignore", [-100, 3])
def test_loss_count_and_accuracy_match_a_hand_sum(ignore: int) -> None:
    """Dict and tuple batches: the loss is the sum over non-ignored positions, the count is
    their number, and the accuracy sum is the number of them predicted right."""
    model = PerPosition()
    x = torch.randn(3, 4, 3, generator=torch.Generator().manual_seed(1))
    labels = torch.tensor([[0, 1, ignore, ignore], [4, 3, 2, 1], [ignore] * 4])
    with torch.no_grad():
        want_loss, want_items, want_correct = hand_sums(model(x), labels, ignore)
    task = TokenClassificationTask(ignore_index=ignore)
    for batch in ({"features": x, "labels": labels}, (x, labels)):
        assert int(task.count_items(batch)) == want_items
        loss = task.loss_sum(model, batch)
        assert loss.requires_grad
        assert float(loss.detach()) == pytest.approx(want_loss, rel=1e-6)
        with torch.no_grad():
            sums = task.eval_sums(model, batch)
        assert int(sums["accuracy"]) == want_correct
        assert float(sums["loss"]) == pytest.approx(want_loss, rel=1e-6)


def test_one_label_per_sample_points_to_classification() -> None:
    with pytest.raises(TaskOutputError, match=r"one label per position.*task=classification"):
        TokenClassificationTask().count_items((torch.zeros(2, 3), torch.tensor([0, 1])))


@pytest.mark.launches
def test_trainer_with_the_task_is_full_batch_gradient_descent(tmp_path: Path) -> None:
    """The tagger of docs/your-model.md with `task=token_classification` instead of its own
    task, in float64 (sequences of 0 to 6 positions, padded): every step's train/loss and the
    final weights equal plain full-batch GD to 1e-10, and val/accuracy equals the accuracy
    of the final weights over the validation positions, counted here."""
    project = write_project(tmp_path / "project")
    run_dir = tmp_path / "run"
    cmd = trainer(
        project,
        run_dir,
        *[o for o in EXACT if not o.startswith("eval.every_steps")],
        *ONE,
        "model.dtype=float64",
        "task=token_classification",
        f"eval.every_steps={STEPS}",
    )
    proc = launch(cmd, 150, PYTHONPATH=str(project))
    assert proc.returncode == 0, explain(proc)
    records = read_metrics(run_dir)
    train = [r["train/loss"] for r in records if "train/loss" in r]
    want_losses, want_weights = reference(project)
    assert len(train) == STEPS
    assert max(abs(a - b) for a, b in zip(train, want_losses)) <= 1e-10, (train, want_losses)
    weights = final_weights(run_dir)
    for key, want in want_weights.items():
        assert (weights[key] - want).abs().max().item() <= 1e-10, key

    tagger = user_module(project)
    model = tagger.Tagger(dtype="float64")
    model.load_state_dict(weights)
    val = tagger.tagging_data(n_train=8, n_val=4, dtype="float64")["val"]
    correct = items = 0
    with torch.no_grad():
        for i in range(len(val)):
            sample = val[i]
            predicted = model(sample["features"]).argmax(-1).tolist()
            correct += sum(p == y for p, y in zip(predicted, sample["labels"]))
            items += len(sample["labels"])
    (evaluation,) = [r for r in records if "val/accuracy" in r]
    assert evaluation["val/items"] == items > 0
    assert evaluation["val/accuracy"] == pytest.approx(correct / items, abs=1e-12)
