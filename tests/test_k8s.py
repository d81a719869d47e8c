"""docker/k8s/: the Kubeflow TrainJob and the JobSet run the documented multi-node command.

The manifests are parsed with `yaml.safe_load`; their torchrun command is compared with the
one under `trainer.train` in docs/reference/commands.md (the same flags in the same order,
c10d rendezvous, `-m trainer.train`) and with docs/guides/deploy.md's "Deploy on Kubernetes"
section; the rendezvous endpoint is the one the runtime provides; the run directory is on the
shared claim. Each manifest's script then runs here, on one node, with the variables its
runtime would inject.
"""

from __future__ import annotations

import re
import shlex
import socket
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.conftest import REPO, read_metrics, stdlib_text, train_records
from tests.ranks import explain, launch_all

K8S = REPO / "docker" / "k8s"
DOCS = REPO / "docs"
# What Kubeflow Trainer's torch plugin sets in the trainer container (and refuses in
# spec.trainer.env): pkg/runtime/framework/plugins/torch/torch.go.
PET = {"PET_NNODES", "PET_NPROC_PER_NODE", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT"}


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((K8S / name).read_text())


def torchrun_commands(text: str) -> list[list[str]]:
    """The multi-node torchrun commands (with `--nnodes`) of a script or a page section,
    continuation lines joined, comments and a leading `exec` dropped."""
    joined = re.sub(r"\\\n", " ", text)
    lines = [ln for ln in joined.splitlines() if re.match(r"\s*(exec\s+)?torchrun .*--nnodes", ln)]
    commands = [shlex.split(line, comments=True) for line in lines]
    return [c[1:] if c[0] == "exec" else c for c in commands]


def torchrun_tokens(text: str) -> list[str]:
    (tokens,) = torchrun_commands(text)
    return tokens


def flags(tokens: list[str]) -> list[str]:
    """Launcher flag names, up to the module."""
    return [t.split("=")[0] for t in tokens[1 : tokens.index("-m")]]


def option(tokens: list[str], name: str) -> str:
    (value,) = [t.split("=", 1)[1] for t in tokens if t.startswith(f"{name}=")]
    return value


def page_section(page: str, title: str) -> str:
    """The text of a `## title` section of a page of docs/."""
    return (DOCS / page).read_text().split(f"## {title}\n", 1)[1].split("\n## ", 1)[0]


def trainjob_container() -> tuple[dict[str, Any], dict[str, Any]]:
    job = load("trainjob.yaml")
    (override,) = job["spec"]["podTemplateOverrides"]
    return job, override


def jobset_container() -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    js = load("jobset.yaml")
    (rjob,) = js["spec"]["replicatedJobs"]
    pod = rjob["template"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return js, rjob, pod | {"container": container}


def script_of(command: list[str]) -> str:
    """The script of `bash -c SCRIPT NAME`: Hydra overrides come after it, from `args`."""
    assert command[:2] == ["bash", "-c"] and len(command) == 4, command
    return command[2]


def run_dir_on_claim(tokens: list[str], volumes: list[dict], mounts: list[dict]) -> None:
    claim = load("pvc.yaml")
    assert "ReadWriteMany" in claim["spec"]["accessModes"]  # pods on several nodes mount it
    (volume,) = [v for v in volumes if "persistentVolumeClaim" in v]
    assert volume["persistentVolumeClaim"]["claimName"] == claim["metadata"]["name"]
    (mount,) = [m for m in mounts if m["name"] == volume["name"]]
    run_dir = option(tokens, "hydra.run.dir")
    assert run_dir.startswith(mount["mountPath"].rstrip("/") + "/"), (run_dir, mount)


REFERENCE_COMMAND = torchrun_commands(page_section("reference/commands.md", "`trainer.train`"))[0]


def test_readme_command_is_the_multi_node_one() -> None:
    """Guards the reference itself: the multi-node line of the commands reference."""
    assert flags(REFERENCE_COMMAND) == [
        "--nnodes",
        "--nproc_per_node",
        "--rdzv_backend",
        "--rdzv_endpoint",
        "--rdzv_id",
    ]
    assert option(REFERENCE_COMMAND, "--rdzv_backend") == "c10d"


@pytest.mark.parametrize("manifest", ["trainjob.yaml", "jobset.yaml"])
def test_manifest_runs_the_readme_command(manifest: str) -> None:
    """Same flags in the same order, c10d, `-m trainer.train`, the args appended; the
    deploy guide shows exactly this command."""
    if manifest == "trainjob.yaml":
        command = trainjob_container()[0]["spec"]["trainer"]["command"]
    else:
        command = jobset_container()[2]["container"]["command"]
    tokens = torchrun_tokens(script_of(command))
    assert tokens[0] == "torchrun" and flags(tokens) == flags(REFERENCE_COMMAND), tokens
    assert option(tokens, "--rdzv_backend") == "c10d"
    assert tokens[tokens.index("-m") + 1] == "trainer.train" and tokens[-1] == "$@", tokens
    shown = torchrun_commands(page_section("guides/deploy.md", "Deploy on Kubernetes"))
    assert tokens in shown, (tokens, shown)


def test_trainjob_reads_what_kubeflow_trainer_injects() -> None:
    """Every variable the command reads is one the torch plugin sets (none is set by hand:
    the webhook refuses them); the endpoint is the first pod's address; the run dir is on
    the claim mounted into the runtime's `node` container."""
    job, override = trainjob_container()
    assert job["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and job["kind"] == "TrainJob"
    assert job["spec"]["runtimeRef"]["name"] == "torch-distributed"
    trainer = job["spec"]["trainer"]
    script = script_of(trainer["command"])
    assert set(re.findall(r"\$\{?(\w+)", script)) == PET - {"PET_NODE_RANK"}  # c10d ranks
    assert not PET & {e["name"] for e in trainer.get("env", [])}
    tokens = torchrun_tokens(script)
    assert option(tokens, "--nnodes") == "$PET_NNODES"
    assert option(tokens, "--rdzv_endpoint") == "$PET_MASTER_ADDR:$PET_MASTER_PORT"
    assert override["targetJobs"] == [{"name": "node"}]
    (container,) = override["spec"]["containers"]
    assert container["name"] == "node"
    run_dir_on_claim(tokens, override["spec"]["volumes"], container["volumeMounts"])


def test_jobset_endpoint_is_its_first_pod() -> None:
    """The rendezvous endpoint is the DNS name JobSet gives the first pod of the first job,
    on a port the container declares; NNODES is the number of pods."""
    js, rjob, pod = jobset_container()
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["kind"] == "JobSet"
    network = js["spec"]["network"]
    assert network["enableDNSHostnames"] is True
    container = pod["container"]
    env = {e["name"]: e for e in container["env"]}
    name, subdomain = js["metadata"]["name"], network.get("subdomain", js["metadata"]["name"])
    host, port = env["RDZV_ENDPOINT"]["value"].rsplit(":", 1)
    assert host == f"{name}-{rjob['name']}-0-0.{subdomain}"
    assert int(port) in [p["containerPort"] for p in container["ports"]]
    spec = rjob["template"]["spec"]
    assert int(env["NNODES"]["value"]) == spec["completions"] == spec["parallelism"]
    assert rjob["replicas"] == 1
    index = env["NODE_RANK"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    tokens = torchrun_tokens(script_of(container["command"]))
    assert option(tokens, "--nnodes") == "$NNODES"
    assert option(tokens, "--rdzv_endpoint") == "$RDZV_ENDPOINT"
    run_dir_on_claim(tokens, pod["volumes"], container["volumeMounts"])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.multiproc
def test_manifest_scripts_train_on_one_node(tmp_path: Path) -> None:
    """Each script, as the pod runs it (`bash -c SCRIPT NAME ARGS...`), with its runtime's
    variables for one node of one process and the volume's mount path pointing here: torchrun
    rendezvouses over c10d and the run writes its records into the run dir on the volume.
    The real commands (bash, real torchrun): the scripts and their launcher are what is
    tested."""
    text = stdlib_text(tmp_path / "text.py", 60_000)
    args = [
        "model=gpt_tiny",
        "logger=none",
        f"data.path={text}",
        "train.max_steps=3",
        "train.micro_batch_size=4",
        "train.grad_accum_steps=1",
        "train.log_every=1",
        "eval.every_steps=0",
        "checkpoint.every_steps=0",
    ]
    job, override = trainjob_container()
    _, _, pod = jobset_container()
    port_a, port_b = free_port(), free_port()
    runs = {
        "trainjob": (
            job["spec"]["trainer"]["command"],
            override["spec"]["containers"][0]["volumeMounts"][0]["mountPath"],
            {
                "PET_NNODES": "1",
                "PET_NPROC_PER_NODE": "1",
                "PET_NODE_RANK": "0",
                "PET_MASTER_ADDR": "127.0.0.1",
                "PET_MASTER_PORT": str(port_a),
            },
        ),
        "jobset": (
            pod["container"]["command"],
            pod["container"]["volumeMounts"][0]["mountPath"],
            {
                "NNODES": "1",
                "NPROC_PER_NODE": "1",
                "RDZV_ENDPOINT": f"127.0.0.1:{port_b}",
                "NODE_RANK": "0",
            },
        ),
    }
    cmds, run_dirs = {}, {}
    for name, (command, mount, variables) in runs.items():
        volume = tmp_path / name
        script = script_of(command).replace(mount, str(volume))
        run_dirs[name] = Path(option(torchrun_tokens(script), "hydra.run.dir"))
        assert run_dirs[name].is_relative_to(volume)
        script = script.replace(
            "exec torchrun ", f"exec {sys.executable} -m torch.distributed.run "
        )
        # Each in its own environment: a shell prefix, as the pod's env would set them.
        prefix = " ".join(f"{k}={shlex.quote(v)}" for k, v in variables.items())
        cmds[name] = ["bash", "-c", f"export {prefix}\n{script}", command[3], *args]
    results = launch_all(cmds, 150, real=True, TMPDIR=str(tmp_path))
    for name, proc in results.items():
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
        records = train_records(read_metrics(run_dirs[name]))
        assert [r["step"] for r in records] == [1, 2, 3], f"{name}\n{explain(proc)}"


def test_ft_jobset_runs_one_job_per_replica_group() -> None:
    """jobset_ft.yaml (ft=torchft): a lighthouse Job apart from the groups, one Job per group
    (its index the group's id, the Jobs' count ft.groups), each group's torchrun rendezvousing
    at its own first pod, the lighthouse at its Job's pod; hosts advertised by their DNS names;
    the run directory on the claim; a lost group pod replaced by its own Job."""
    js = load("jobset_ft.yaml")
    assert js["apiVersion"] == "jobset.x-k8s.io/v1alpha2" and js["kind"] == "JobSet"
    name, network = js["metadata"]["name"], js["spec"]["network"]
    subdomain = network.get("subdomain", name)
    assert network["enableDNSHostnames"] is True
    jobs = {j["name"]: j for j in js["spec"]["replicatedJobs"]}
    assert set(jobs) == {"lighthouse", "group"}
    assert js["spec"]["successPolicy"]["targetReplicatedJobs"] == ["group"]
    lighthouse, group = jobs["lighthouse"], jobs["group"]
    (beacon,) = lighthouse["template"]["spec"]["template"]["spec"]["containers"]
    assert beacon["command"][:3] == ["python", "-m", "trainer.lighthouse"]
    port = int(option(beacon["command"], "--port"))
    assert port in [p["containerPort"] for p in beacon["ports"]]
    pod = group["template"]["spec"]["template"]["spec"]
    assert pod["setHostnameAsFQDN"] is True
    assert lighthouse["template"]["spec"]["template"]["spec"]["setHostnameAsFQDN"] is True
    assert group["template"]["spec"]["backoffLimit"] > 0
    (container,) = pod["containers"]
    env = {e["name"]: e for e in container["env"]}
    assert int(env["GROUPS_N"]["value"]) == group["replicas"]
    spec = group["template"]["spec"]
    assert int(env["NNODES"]["value"]) == spec["completions"] == spec["parallelism"]
    index = env["GROUP"]["valueFrom"]["fieldRef"]["fieldPath"]
    assert index == "metadata.annotations['jobset.sigs.k8s.io/job-index']"
    assert env["LIGHTHOUSE"]["value"] == f"http://{name}-lighthouse-0-0.{subdomain}:{port}"
    tokens = torchrun_tokens(script_of(container["command"]))
    assert flags(tokens)[:5] == flags(REFERENCE_COMMAND) and "--max-restarts" in flags(tokens)
    host, rdzv_port = option(tokens, "--rdzv_endpoint").rsplit(":", 1)
    assert host == f"{name}-group-$GROUP-0.{subdomain}"
    assert int(rdzv_port) in [p["containerPort"] for p in container["ports"]]
    ft = {t.split("=", 1)[0]: t.split("=", 1)[1] for t in tokens if t.startswith("ft")}
    assert ft == {
        "ft": "torchft",
        "ft.lighthouse": "$LIGHTHOUSE",
        "ft.group": "$GROUP",
        "ft.groups": "$GROUPS_N",
    }
    run_dir_on_claim(tokens, pod["volumes"], container["volumeMounts"])


def test_slurm_ft_runs_one_array_task_per_group(tmp_path: Path) -> None:
    """scripts/slurm_ft.sbatch (ft=torchft), run here with SLURM's commands stubbed (they
    print what they were given): the array index is the group's id, the array's size
    ft.groups, each group a torchrun job of its own (its rendezvous id per group, restarts
    on) over every GPU of its nodes; without a lighthouse address it refuses to start."""
    import os
    import subprocess

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stubs = {
        "srun": 'echo "srun $*"',
        "scontrol": 'echo "node-a"; echo "node-b"',
        "nvidia-smi": 'echo "GPU 0"; echo "GPU 1"; echo "GPU 2"',
        "scancel": "true",
    }
    for name, body in stubs.items():
        (bin_dir / name).write_text(f"#!/usr/bin/env bash\n{body}\n")
        (bin_dir / name).chmod(0o755)
    env = {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ['PATH']}",
        "SLURM_ARRAY_TASK_ID": "1",
        "SLURM_ARRAY_TASK_COUNT": "3",
        "SLURM_ARRAY_JOB_ID": "77",
        "SLURM_JOB_ID": "78",
        "SLURM_JOB_NODELIST": "node-[a-b]",
        "SLURM_JOB_NUM_NODES": "2",
    }
    script = REPO / "scripts" / "slurm_ft.sbatch"
    cmd = ["bash", str(script), "hydra.run.dir=/shared/runs/exp1"]
    refused = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert refused.returncode != 0 and "FT_LIGHTHOUSE" in refused.stderr, refused.stderr
    env["FT_LIGHTHOUSE"] = "http://lh-node:29510"
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = [ln for ln in proc.stdout.splitlines() if ln.startswith("srun ")]
    tokens = shlex.split(line)
    assert option(tokens, "--nnodes") == "2" and option(tokens, "--nproc_per_node") == "3"
    assert option(tokens, "--rdzv_endpoint") == "node-a:29500"
    assert option(tokens, "--rdzv_id") == "ft-77-1" and int(option(tokens, "--max-restarts")) > 0
    assert tokens[tokens.index("-m") + 1] == "torch.distributed.run"  # torchrun, under srun
    assert " -m trainer.train " in line
    ft = {t.split("=", 1)[0]: t.split("=", 1)[1] for t in tokens if t.startswith("ft")}
    assert ft == {
        "ft": "torchft",
        "ft.lighthouse": "http://lh-node:29510",
        "ft.group": "1",
        "ft.groups": "3",
    }
    assert tokens[-1] == "hydra.run.dir=/shared/runs/exp1"
