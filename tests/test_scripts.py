"""Every shell script parses; the launcher really launches."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tests.conftest import REPO, TINY, read_metrics, train_records
from tests.ranks import explain, launch, launch_all, python_cmd

SCRIPTS = sorted(
    [
        *REPO.glob("scripts/*.sh"),
        *REPO.glob("scripts/*.sbatch"),
        *REPO.glob("docker/*.sh"),
        REPO / ".ci" / "run",
    ]
)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: str(p.relative_to(REPO)))
def test_script_parses(script: Path) -> None:
    proc = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.launches
def test_launch_sh_single_process(tmp_path: Path) -> None:
    """`scripts/launch.sh` with overrides trains (one process on a CPU-only machine). The real
    command: the script is what is tested."""
    run_dir = tmp_path / "run"
    script = ["bash", str(REPO / "scripts" / "launch.sh"), *TINY, "train.max_steps=2"]
    proc = launch([*script, f"hydra.run.dir={run_dir}"], 120, cwd=tmp_path, real=True)
    assert proc.returncode == 0, explain(proc)
    assert [r["step"] for r in train_records(read_metrics(run_dir))] == [1, 2]


def test_dockerfile_installs_the_package() -> None:
    """No Docker engine here: check that the image copies what `pip install` needs."""
    text = (REPO / "docker" / "Dockerfile").read_text()
    for needed in ("pyproject.toml", "engine", "trainer", "configs", "launch.sh"):
        assert needed in text
    assert text.count("FROM ") == 1 and "pytorch/pytorch" in text


@pytest.mark.launches
def test_multirun_from_the_command_line_and_from_a_config(tmp_path: Path) -> None:
    """Hydra's multirun still runs each job: asked with `-m` (scripts/multirun.sh's way; the
    run mode then comes from the command line alone, trainer.config.cli.compose_once), and
    asked by a config of the user's own that sets `hydra.mode: MULTIRUN` (with
    `hydra.searchpath`, Hydra composes to read it, as it always did). Each job trains in its
    own directory with its own learning rate."""
    user = tmp_path / "configs" / "experiment"
    user.mkdir(parents=True)
    (user / "sweep.yaml").write_text(
        "# @package _global_\nhydra:\n  mode: MULTIRUN\n  sweeper:\n"
        "    params:\n      optim.lr: 0.01,0.02\n"
    )
    cmds = {
        "flag": python_cmd(
            "trainer.train", "-m", *TINY, "train.max_steps=2", "optim.lr=0.01,0.02",
            f"hydra.sweep.dir={tmp_path / 'flag'}",
        ),
        "config": python_cmd(
            "trainer.train", *TINY, "train.max_steps=2", "experiment=sweep",
            f"hydra.searchpath=[file://{tmp_path / 'configs'}]",
            f"hydra.sweep.dir={tmp_path / 'config'}",
        ),
    }  # fmt: skip
    for name, proc in launch_all(cmds, 240).items():
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
        for job, lr in (("0", 0.01), ("1", 0.02)):
            records = train_records(read_metrics(tmp_path / name / job))
            assert [r["step"] for r in records] == [1, 2], (name, job)
            saved = yaml.safe_load((tmp_path / name / job / ".hydra" / "config.yaml").read_text())
            assert saved["optim"]["lr"] == lr, (name, job, saved["optim"])


def test_bench_moe_counts_the_all_to_all_rows_that_leave_the_rank() -> None:
    """scripts/bench_moe.py --ep's counter, on one expert dispatch of rank 0 of 2 (a fake
    process group: each all-to-all hands a rank the rows it sent, as if the other rank sent
    the same): of 16 routed rows, the 10 for rank 1's experts (4-7) leave in the dispatch and
    again in the combine, and 4 of the 8 expert counts exchanged first; as many arrive."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from engine.parallel.expert import ExpertGroup
    from scripts import bench_moe as bench

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        group = ExpertGroup(dist.group.WORLD, 2, 0, 4)
        counts = [3, 1, 0, 2, 5, 0, 1, 4]  # rows per expert: 6 for rank 0's, 10 for rank 1's
        with bench.AllToAllBytes() as counted:
            out = group.run(torch.randn(16, 8), counts, lambda rows, local: rows * 2)
    finally:
        dist.destroy_process_group()
    assert out.shape == (16, 8)
    leaving = 2 * 10 * 8 * 4 + 4 * 8  # float32 rows out and back, int64 counts
    assert counted.sent == counted.received == leaving


# ---- scripts/bench_nanogpt.py --gpu: what can be checked without a GPU

ANCHOR = REPO.parent / "shared" / "anchors" / "nanogpt"


def test_bench_nanogpt_gpu_copies_the_anchor_and_writes_one_token_file(tmp_path: Path) -> None:
    """The anchor is copied into the git-ignored folder (refreshed, token files kept), used
    from there when the anchor is absent (a GPU machine holding only the checkout), and the
    token file is uint16 ids below the vocabulary, the same for the same seed."""
    from scripts import bench_nanogpt as bench

    assert "nanogpt" in str(bench.ANCHOR_COPY.relative_to(REPO))
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", str(bench.ANCHOR_COPY / "train.py")], cwd=REPO
    )
    assert ignored.returncode == 0, ".anchors/ must be git-ignored: never commit the anchor"
    anchor, dest = tmp_path / "anchor", tmp_path / "checkout" / ".anchors" / "nanogpt"
    anchor.mkdir()
    (anchor / "train.py").write_text("v1")
    data = bench.write_tokens(bench.copy_anchor(anchor, dest) / "data" / bench.DATASET, 5000)
    train = np.fromfile(data / "train.bin", dtype=np.uint16)
    assert train.size == 5000 and int(train.max()) < bench.GPU_VOCAB and len(set(train)) > 1000
    assert np.fromfile(data / "val.bin", dtype=np.uint16).size == 4096
    (anchor / "train.py").write_text("v2")
    bench.copy_anchor(anchor, dest)
    assert (dest / "train.py").read_text() == "v2"
    assert (data / "train.bin").read_bytes() == train.tobytes()  # kept
    again = bench.write_tokens(tmp_path / "again", 5000)
    assert (again / "train.bin").read_bytes() == train.tobytes()  # seeded
    assert bench.copy_anchor(tmp_path / "absent", dest) == dest  # the copy serves
    with pytest.raises(SystemExit, match="--prepare-only"):
        bench.copy_anchor(tmp_path / "absent", tmp_path / "nothing")


@pytest.mark.launches
@pytest.mark.skipif(not (ANCHOR / "train.py").is_file(), reason="no nanoGPT anchor here")
def test_bench_nanogpt_gpu_command_lines_are_the_same_run(tmp_path: Path) -> None:
    """nanoGPT's own configurator accepts every argument the GPU command passes (it refuses
    unknown keys and wrong types), and cumulus's overrides compose into the same shapes, batch,
    precision and compilation."""
    from scripts import bench_nanogpt as bench
    from tests.conftest import compose_config
    from trainer.config.cli import to_config

    work = bench.copy_anchor(ANCHOR, tmp_path / "nanogpt")
    cmd = bench.nanogpt_gpu_cmd(50, tmp_path / "out")
    assert cmd[1] == "-c" and "runpy.run_path('train.py'" in cmd[2]
    source = (work / "train.py").read_text()
    head = source[: source.index("config = {k: globals()[k]")]  # the settings, overridden
    check = head + "import json; print(json.dumps({k: globals()[k] for k in config_keys}))"
    proc = subprocess.run(
        [cmd[0], "-c", check, *cmd[3:]], cwd=work, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    theirs = json.loads(proc.stdout.splitlines()[-1])
    want = {"batch_size": 16, "gradient_accumulation_steps": 8, "block_size": 1024}
    want |= {"n_layer": 12, "n_head": 12, "n_embd": 768, "bias": False, "dropout": 0.0}
    want |= {"max_iters": 49, "dtype": "bfloat16", "compile": True, "device": "cuda"}
    want |= {"dataset": bench.DATASET, "always_save_checkpoint": False, "eval_iters": 1}
    assert {k: theirs[k] for k in want} == want
    assert theirs["eval_interval"] > 49  # one evaluation, at iteration 0
    ours = bench.cumulus_gpu_cmd(50, tmp_path / "data", tmp_path / "run", ["task.chunk_size=null"])
    assert ours[1:4] == ["-m", "trainer.train", "experiment=gpt2_small"]
    cfg, _ = to_config(compose_config(ours[3:]))
    assert cfg.task["chunk_size"] is None  # a variant's overrides come last
    model = {k: cfg.model[k] for k in ("vocab_size", "n_layer", "n_head", "n_embd", "bias")}
    assert model == {"vocab_size": 50304, "n_layer": 12, "n_head": 12, "n_embd": 768, "bias": False}
    assert (cfg.model["block_size"], cfg.data["block_size"], cfg.model["dropout"]) == (
        1024,
        1024,
        0.0,
    )
    train = cfg.train
    assert (train.micro_batch_size, train.global_batch_size, train.max_steps) == (16, 128, 50)
    assert (train.precision, train.compile, train.log_every) == ("bf16", True, 1)


def test_bench_nanogpt_gpu_table_from_a_fake_result_set(tmp_path: Path) -> None:
    """The table from nanoGPT's log lines and cumulus's records: medians of the second half,
    tokens/s of 16 x 8 x 1024 tokens, MFU with nanoGPT's FLOPs per token (6N + 12 L T C, N
    counted here on the GPT at these shapes) against 989 TFLOP/s."""
    from scripts import bench_nanogpt as bench
    from scripts.bench import report
    from trainer.models.gpt import GPT

    stdout = "\n".join(
        [
            "step 0: train loss 10.9, val loss 10.9",
            *(
                f"iter {i}: loss 9.1, time {9000 if i == 0 else 270 + i % 3:.2f}ms, mfu -100.00%"
                for i in range(50)
            ),
            "PEAK_MEMORY_BYTES 34359738368",
        ]
    )
    theirs = bench.parse_nanogpt(stdout)
    run = tmp_path / "run"
    run.mkdir()
    records = [
        {"step": s, "train/loss": 9.0, "train/step_time_ms": 30000.0 if s <= 25 else 280.0 + s % 2,
         "train/peak_mem_mb": 30000.0 + s, "time/compute_s": 0.276}
        for s in range(1, 51)
    ]  # fmt: skip
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    ours = bench.parse_cumulus(run)
    with torch.device("meta"):
        gpt = GPT(vocab_size=50304, block_size=1024, n_layer=12, n_head=12, n_embd=768, bias=False)
    n = gpt.num_params() - gpt.pos_emb.weight.numel()
    flops = 6 * n + 12 * 12 * 1024 * 768
    tokens = 16 * 8 * 1024
    assert theirs.step_ms == 271.0  # iterations 25..49: 270..272, median 271
    assert theirs.tokens_per_s == pytest.approx(tokens / 0.271)
    assert theirs.mfu == pytest.approx(tokens / 0.271 * flops / 989e12)
    assert theirs.peak_gib == 32.0 and theirs.compute_ms is None
    assert ours.step_ms == 280.0 and ours.compute_ms == pytest.approx(276.0)  # 13 x 280, 12 x 281
    assert ours.peak_gib == pytest.approx(30050 / 1024)
    out = tmp_path / "benchmarks.md"
    out.write_text("# Benchmarks\n")
    variant = bench.parse_cumulus(run, ["task.chunk_size=null"])
    table = bench.gpu_table(
        [theirs, ours, variant],
        "NVIDIA H200",
        "2.11.0+cu130",
        50,
        "2026-11-28",
        ["task.chunk_size=null"],
    )
    report(table, str(out))
    text = out.read_text()
    assert text.startswith("# Benchmarks\n")  # appended
    assert "### nanoGPT vs cumulus on one GPU (NVIDIA H200, torch 2.11.0+cu130), 2026-11-28" in text
    assert "python scripts/bench_nanogpt.py --gpu --steps 50 --also 'task.chunk_size=null'" in text
    rows = [
        line.split(" | ")
        for line in text.splitlines()
        if line.startswith("| ") and "---" not in line
    ]
    assert rows[1][:4] == [
        "| nanoGPT train.py",
        f"{tokens / 0.271:,.0f}",
        "1.000",
        f"{theirs.mfu:.1%}",
    ]
    assert rows[2][:3] == [
        "| cumulus experiment=gpt2_small",
        f"{tokens / 0.28:,.0f}",
        f"{271 / 280:.3f}",
    ]
    assert rows[2][5] == "276.0" and rows[1][5] == "-"
    assert rows[3][0] == "| cumulus experiment=gpt2_small task.chunk_size=null"
    with pytest.raises(RuntimeError, match="no iteration times"):
        bench.parse_nanogpt("iter 0: loss 9.1")
