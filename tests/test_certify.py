"""`python -m trainer.certify` on a user's own project (docs/your-model.md's tagger, from its
own package and config folder): the layouts it can host train as the one-process reference
(exit 0, its table), a layout the model cannot take is skipped with the trainer's reason, and
a task that returns a mean instead of a sum (with `task.check_sum=false`, so the start-up
check does not stop it first) is caught: exit 1, naming the layout that differs. A mixture of
experts is compared over the steps before its routing first differs from the reference's.

The table's figures are checked against `trainer.compare` run here on the same run
directories, and each layout's own banner says it ran as the layout it names.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO
from tests.ranks import explain, launch, run_cli
from tests.user_project import select, write_project
from trainer.checks.certify import MIXTURE_HORIZON, Outcome, judge, table
from trainer.checks.compare import compare

TIMEOUT = 150.0
CONFIG = [
    "data.n_train=64",
    "train.micro_batch_size=8",
    "train.grad_accum_steps=2",  # a global batch of 16
    "certify.steps=4",
]
# The docs' task with the classic mistake: a mean over the micro-batch, not a sum.
BROKEN = """
import torch.nn.functional as F
from tagger import IGNORE, TaggingTask


class MeanTask(TaggingTask):
    def loss_sum(self, model, batch):
        logits = model(batch["features"]).flatten(0, 1)
        return F.cross_entropy(logits, batch["labels"].flatten(), ignore_index=IGNORE)
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = write_project(tmp_path_factory.mktemp("certify_project"))
    (root / "broken_tagger.py").write_text(BROKEN)
    return root


def certify(project: Path, work: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "trainer.certify", *select(project), *CONFIG, *extra]
    return launch([*cmd, f"certify.dir={work}"], TIMEOUT, PYTHONPATH=f"{project}:{REPO}")


def row(stdout: str, layout: str) -> str:
    rows = [line for line in stdout.splitlines() if line.startswith(f"{layout} ")]
    assert len(rows) == 1, stdout
    return rows[0]


@pytest.mark.multiproc
def test_user_model_is_certified(project: Path, tmp_path: Path) -> None:
    """accum and ddp2 agree with the reference; pp2 is skipped (the tagger declares no
    pipeline stages); exit 0 with the table, certify.json and certify.html written."""
    work = tmp_path / "work"
    proc = certify(project, work, "certify.layouts=[accum,ddp2,pp2]")
    assert proc.returncode == 0, explain(proc)
    assert "CERTIFIED: 2 layouts train as the reference" in proc.stdout, explain(proc)
    assert row(proc.stdout, "single").endswith("reference")
    assert "skipped: the trainer refuses it" in row(proc.stdout, "pp2")
    assert "pipeline_stage" in row(proc.stdout, "pp2")
    banners = {
        "single": "world 1 x micro 8 x accum 2 = global batch 16",
        "accum": "world 1 x micro 4 x accum 4 = global batch 16",
        "ddp2": "world 2 x micro 8 x accum 1 = global batch 16",
    }
    for layout, banner in banners.items():
        assert banner in (work / f"{layout}.log").read_text(), layout
    for layout in ("accum", "ddp2"):
        line = row(proc.stdout, layout)
        assert line.endswith("same"), line
        diffs, _ = compare(work / "single", work / layout, keys=["train/loss", "train/grad_norm"])
        assert all(d.within and d.steps == 4 for d in diffs)
        figures = re.findall(r"\d\.\d\de[+-]\d\d", line)
        by_metric = {d.metric: f"{d.max_abs:.2e}" for d in diffs}
        assert figures == [by_metric["train/loss"], by_metric["train/grad_norm"]], line
    report = json.loads((work / "certify.json").read_text())
    status = {o["name"]: o["status"] for o in report["layouts"]}
    assert status == {"single": "reference", "accum": "same", "ddp2": "same", "pp2": "skipped"}
    page = (work / "certify.html").read_text()
    assert "CERTIFIED: 2 layouts" in page and 'data-run="2"' in page
    assert not re.search(r"https?:|\b(src|href)\s*=", page)


MOE = ["model=gpt_tiny", "+model.moe.experts=4", "+model.moe.top_k=2", "moe.aux_coef=1.0"]


@pytest.mark.multiproc
def test_mixture_of_experts_is_certified(tmp_path: Path) -> None:
    """gpt_tiny as a mixture of experts (4 experts top-2, moe.balance=global, the aux loss
    weighing): accumulation, FSDP2 and expert parallelism (ep2: 2 experts on each of 2 ranks,
    tokens sent all-to-all, DDP for the rest) train as the reference. (DDP and the automatic
    micro-batch of a mixture are shown exact in tests/test_moe.py and
    tests/test_auto_micro_batch.py; certify's own layouts for them in the dense tests here.)
    The table says that a mixture is compared up to the step its routing first differs from
    the reference's, and why; here every layout routes every step alike."""
    split = ["train.micro_batch_size=8", "train.grad_accum_steps=2", "certify.steps=3"]
    layouts = "certify.layouts=[accum,fsdp2,ep2]"
    cmd = [sys.executable, "-m", "trainer.certify", *MOE, *split, layouts]
    work = tmp_path / "work"
    proc = launch([*cmd, f"certify.dir={work}"], TIMEOUT, PYTHONPATH=str(REPO))
    assert proc.returncode == 0, explain(proc)
    assert "CERTIFIED: 3 layouts train as the reference" in proc.stdout, explain(proc)
    for layout in ("accum", "fsdp2", "ep2"):
        assert row(proc.stdout, layout).endswith("same"), explain(proc)
    assert "ep2: 2 ranks, train.micro_batch_size=8 dist.ep=2" in proc.stdout, proc.stdout
    # The horizon of a mixture, and why: every layout routed every step as the reference did.
    assert f"({MIXTURE_HORIZON})" in proc.stdout, proc.stdout
    report = json.loads((work / "certify.json").read_text())
    for outcome in report["layouts"][1:]:
        assert outcome["routing_differs_at"] is None, outcome
    log = (work / "ep2.log").read_text()
    assert "experts split over 2 ranks (dist.ep=2)" in log, log
    assert "world 2 x micro 8 x accum 1 = global batch 16" in log, log


def write_records(run_dir: Path, losses: list[float], digests: list[int] | None) -> Path:
    """A run's metrics.jsonl: train/loss and train/grad_norm per step (and the routing
    digest of a mixture)."""
    run_dir.mkdir(parents=True)
    with (run_dir / "metrics.jsonl").open("w") as out:
        for step, loss in enumerate(losses, 1):
            record = {"step": step, "train/loss": loss, "train/grad_norm": 2 * loss}
            if digests is not None:
                record["train/moe_routing_digest"] = float(digests[step - 1])
            out.write(json.dumps(record) + "\n")
    return run_dir


def test_a_mixture_is_compared_until_its_routing_differs(tmp_path: Path) -> None:
    """Records written here: a layout whose routing differs from step 4 (its loss too, by a
    token's worth) is `same` over steps 1-3, saying so; one routed alike whose loss differs at
    step 5 is `different`; one routed unlike the reference at step 1 (the same weights) is
    `different`; without digests (a dense model) a loss differing at step 5 is `different`."""
    losses, digests = [5.0, 4.0, 3.5, 3.0, 2.8, 2.6], [11, 12, 13, 14, 15, 16]
    later = [*losses[:4], 2.81, 2.6]  # off at step 5
    runs = {
        "flipped": ([*losses[:3], 3.01, 2.9, 2.5], [11, 12, 13, 99, 98, 97]),
        "alike": (later, digests),
        "first": (losses, [10, 12, 13, 14, 15, 16]),
        "dense": (later, None),
    }
    mixture = write_records(tmp_path / "single", losses, digests)
    dense = write_records(tmp_path / "single-dense", losses, None)
    outcomes = {}
    for name, (values, digest) in runs.items():
        run_dir = write_records(tmp_path / name, values, digest)
        outcome = outcomes[name] = Outcome(name, 1, [], "ran", run_dir=str(run_dir))
        judge(outcome, dense if digest is None else mixture, 6, 1e-5, 1e-5)
    flipped = outcomes["flipped"]
    assert (flipped.status, flipped.routing_differs_at) == ("same", 4), flipped
    assert flipped.reason == "over steps 1-3: routing differs from step 4"
    assert flipped.max_diff == {"train/loss": 0.0, "train/grad_norm": 0.0}
    for name in ("alike", "dense"):
        outcome = outcomes[name]
        assert (outcome.status, outcome.routing_differs_at) == ("different", None), outcome
        assert outcome.at_step == {"train/loss": 5, "train/grad_norm": 5}
    assert outcomes["first"].status == "different"
    assert outcomes["first"].reason.startswith("routes step 1 unlike the reference")
    text = table([Outcome("single", 1, [], "reference"), flipped], 1e-5, 1e-5, mixture=True)
    assert text.splitlines()[2].endswith("same over steps 1-3: routing differs from step 4")
    assert text.splitlines()[-1] == f"({MIXTURE_HORIZON})"
    assert MIXTURE_HORIZON not in table([Outcome("single", 1, [], "reference")], 1e-5, 1e-5)


def test_ep2_is_a_default_layout_of_a_mixture_dist_ep_splits() -> None:
    """Without certify.layouts, a model whose mixture dist.ep can split (the in-tree GPT's
    model.moe, transformers' Qwen3-MoE and OLMoE, whose experts transformers declares) is
    also certified under ep2; a dense model is not offered it."""
    from tests.conftest import compose_config
    from trainer.checks.certify import DEFAULT_LAYOUTS, default_layouts
    from trainer.config.cli import to_config

    def layouts(args: list[str]) -> list[str]:
        return default_layouts(to_config(compose_config(args))[0])

    assert layouts(MOE) == [*DEFAULT_LAYOUTS, "ep2"]
    assert layouts(["model=gpt_tiny"]) == list(DEFAULT_LAYOUTS)
    assert layouts(["model=hf_qwen3_moe"]) == [*DEFAULT_LAYOUTS, "ep2"]
    assert layouts(["model=hf_qwen3_moe", "model.family=olmoe"]) == [*DEFAULT_LAYOUTS, "ep2"]


@pytest.mark.launches
def test_mean_instead_of_sum_is_caught(project: Path, tmp_path: Path) -> None:
    """The mean task trains differently once the batch is cut into more micro-batches:
    exit 1, the accum layout named as the one that differs."""
    proc = certify(
        project,
        tmp_path / "work",
        "task._target_=broken_tagger.MeanTask",
        "task.check_sum=false",
        "certify.layouts=[accum]",
    )
    assert proc.returncode == 1, explain(proc)
    assert "DIFFERENT: train/" in row(proc.stdout, "accum"), explain(proc)
    assert "NOT CERTIFIED: accum differs from the reference" in proc.stdout


@pytest.mark.launches
@pytest.mark.parametrize(
    ("arg", "says"),
    [
        ("certify.layouts=[accum,warp9]", "certify.layouts"),
        ("certify.steps=0", "certify.steps"),
        ("certify.step=3", "certify.step"),
        ("train.max_steps=abc", "train.max_steps"),
        ("model=nothing_like_it", "model"),
    ],
)
def test_bad_input_is_one_paragraph(project: Path, tmp_path: Path, arg: str, says: str) -> None:
    """Refused before any launch: exit 2, one line naming the key, no traceback."""
    args = [*select(project), arg, f"certify.dir={tmp_path / 'w'}"]
    proc = run_cli(args, module="trainer.certify", timeout=60, PYTHONPATH=f"{project}:{REPO}")
    assert proc.returncode == 2, explain(proc)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], explain(proc)
    assert not (tmp_path / "w").exists()


def test_a_crash_is_reported_by_its_error_not_torchruns_banner() -> None:
    """A layout whose ranks crashed (a traceback, then torchrun's failure report): the reason
    is the exception's own line, not the report's last rule or banner."""
    from trainer.checks.certify import crash_line

    log = """cumulus | run dir /tmp/w/cp2 | run id 1234
[rank 0] training failed:
Traceback (most recent call last):
  File "trainer/run/fit.py", line 10, in fit
ValueError: the batch holds 3 sequences of 17 tokens, which cp=2 cannot split
E1127 12:58:24.104000 27660 torch/distributed/elastic/multiprocessing/api.py:900] failed
Traceback (most recent call last):
  File "torch/distributed/run.py", line 9, in <module>
torch.distributed.elastic.multiprocessing.errors.ChildFailedError:
============================================================
trainer.train FAILED
------------------------------------------------------------
Failures:
  <NO_OTHER_FAILURES>
------------------------------------------------------------
Root Cause (first observed failure):
[0]:
  exitcode  : 1 (pid: 27672)
  traceback : To enable traceback see: https://pytorch.org/docs/stable/elastic/errors.html
============================================================
"""
    assert crash_line(log).startswith("ValueError: the batch holds 3 sequences")
    killed = "cumulus | run dir /tmp/w/ddp2\nstep 1 done\n" + log[log.index("=====") :]
    assert crash_line(killed) == "step 1 done"  # no exception: the last line before the report
