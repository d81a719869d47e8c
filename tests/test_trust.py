"""The trust boundary: a checkpoint's saved config is data, never a choice of code.

Crafted checkpoints are real checkpoints of a tiny run whose `state.pt` config was rewritten
and whose manifest was brought back in line with the files (sizes and SHA-256), so only the
trust check stands between them and the code they name. The code they name lives in a
package written into the test's directory and put on PYTHONPATH: it is importable, and a
control run with `trust=[...]` shows that it would run (the sentinel appears) when trusted.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import (
    REPO,
    TINY,
    in_tree_model,
    read_metrics,
    received,
    rewrite_state,
    stdlib_text,
    train_records,
)
from tests.ranks import explain, launch, launch_all
from trainer.config.errors import UserError

STEPS = 4
# A package outside cumulus. Importing any part of it leaves IMPORTED behind; each function
# does one thing a crafted config would want done, to a path the config gives it.
EVIL = {
    "evilpkg/__init__.py": "import os\nopen(os.environ['EVIL_DIR'] + '/IMPORTED', 'a').close()\n",
    "evilpkg/payload.py": """
import os, pickle
open(os.environ["EVIL_DIR"] + "/IMPORTED", "a").close()

def write_sentinel(path: str = "", **kwargs):
    open(path, "w").write("ran")
    return None

def unpickle(path: str = "", **kwargs):
    with open(path, "rb") as f:
        return pickle.load(f)

def truncate(path: str = "", **kwargs):
    open(path, "w").close()
""",
    # A model of the user's own, outside cumulus: trusted with trust=[extpkg].
    "extpkg/__init__.py": "",
    "extpkg/models.py": """
from torch import nn

class BigramLM(nn.Module):
    def __init__(self, vocab_size: int = 256, width: int = 16):
        super().__init__()
        self.vocab_size = vocab_size
        self.emb = nn.Embedding(vocab_size, width)
        self.head = nn.Linear(width, vocab_size)

    def forward(self, idx):
        return self.head(self.emb(idx))  # (B, T, V)
""",
}


class Boom:
    """What the pickle next to the checkpoint would build: touching a file when loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (open, (self.path, "w"))


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """A trained tiny run (checkpoints at steps 2 and 4), the packages, and a bait file."""
    root = tmp_path_factory.mktemp("trust")
    for name, text in EVIL.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    text = stdlib_text(root / "text.txt", 60_000)
    base = [*TINY, f"data.path={text}", f"train.max_steps={STEPS}", "checkpoint.every_steps=2"]
    run = root / "run"
    ext_run = root / "ext_run"
    results = launch_all(
        {
            "gpt": [sys.executable, "-m", "trainer.train", *base, f"hydra.run.dir={run}"],
            "ext": [
                sys.executable, "-m", "trainer.train", *base,
                "model._target_=extpkg.models.BigramLM", "~model.n_layer", "~model.n_head",
                "~model.n_embd", "~model.block_size", "~model.dropout",
                "eval.every_steps=4", "eval.sample_tokens=0", f"hydra.run.dir={ext_run}",
            ],
        },
        180,
        PYTHONPATH=f"{root}:{REPO}",
    )  # fmt: skip
    for name, proc in results.items():
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
    return {"root": root, "run": run, "ext_run": ext_run, "text": text, "base": base}


def craft(src: Path, dst: Path, mutate: Any) -> Path:
    """A copy of checkpoint `src` at `dst` whose saved config `mutate` rewrote, with a manifest
    consistent with its files (as a careful attacker would leave it). The checkpoint was this
    session's own: its signature no longer matches the edited config."""
    return rewrite_state(src, dst, lambda state: mutate(state["config"]))


def place(where: str, spec: dict[str, Any]) -> Any:
    """A config mutation that puts `spec` (a `_target_` node) at `where`."""

    def mutate(cfg: dict[str, Any]) -> None:
        if where == "callbacks":
            cfg["callbacks"] = {"evil": spec}
        elif where == "nested":  # inside a shipped component's argument
            cfg["optim"]["betas"] = [spec, 0.95]
        elif where == "scheduler":
            cfg["scheduler"] = {**spec, "_partial_": True}
        else:
            cfg[where] = spec

    return mutate


PLACES = ["model", "task", "data", "optim", "scheduler", "step", "callbacks", "nested"]
PAYLOADS = ["write_sentinel", "unpickle", "truncate"]


@pytest.mark.launches
def test_crafted_configs_are_refused_before_import(world: dict[str, Any], tmp_path: Path) -> None:
    """In every component, and nested in an argument, each payload: `trainer.evaluate` and
    `scripts/export_hf.py` exit 2 with one paragraph, the payload does not run, nothing of
    its module is imported."""
    ckpt = world["run"] / "checkpoints" / "step_00000004"
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir()
    bait = tmp_path / "bait.txt"
    bait.write_text("precious")
    pickled = tmp_path / "next_to_ckpt.pkl"
    pickled.write_bytes(pickle.dumps(Boom(str(evil_dir / "UNPICKLED"))))
    cmds, expect = {}, {}
    for i, where in enumerate(PLACES):
        payload = PAYLOADS[i % len(PAYLOADS)]
        arg = {
            "write_sentinel": str(evil_dir / "SENTINEL"),
            "unpickle": str(pickled),
            "truncate": str(bait),
        }[payload]
        target = f"evilpkg.payload.{payload}"
        crafted = craft(
            ckpt, tmp_path / f"ckpt_{where}", place(where, {"_target_": target, "path": arg})
        )
        key = {"nested": "optim.betas[0]._target_"}.get(where, f"{where}._target_")
        if where == "callbacks":
            key = "callbacks.evil._target_"
        expect[where] = (key, target)
        cmds[f"eval_{where}"] = [sys.executable, "-m", "trainer.evaluate", f"checkpoint={crafted}"]
        cmds[f"export_{where}"] = [
            sys.executable, "scripts/export_hf.py", f"checkpoint={crafted}",
            f"out={tmp_path / f'out_{where}'}",
        ]  # fmt: skip
    results = launch_all(cmds, 240, PYTHONPATH=f"{world['root']}:{REPO}", EVIL_DIR=str(evil_dir))
    for name, proc in results.items():
        where = name.split("_", 1)[1]
        key, target = expect[where]
        assert proc.returncode == 2, f"{name}\n{explain(proc)}"
        err = proc.stderr.strip()
        assert "Traceback" not in err and len(err.splitlines()) == 1, f"{name}\n{explain(proc)}"
        assert f"`{key}: '{target}'`" in err and "trust=[evilpkg]" in err, err
        assert not (tmp_path / f"out_{where}").exists()
    assert sorted(p.name for p in evil_dir.iterdir()) == []  # no sentinel, no import
    assert bait.read_text() == "precious"


@pytest.mark.launches
def test_trusted_payload_would_run(world: dict[str, Any], tmp_path: Path) -> None:
    """The control: the same crafted checkpoint with `trust=[evilpkg]` (and `saved_paths=true`
    for the sentinel's path) does run the code, so the refusals above are the boundary's
    doing, not a broken payload."""
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir()
    ckpt = world["run"] / "checkpoints" / "step_00000004"
    spec = {"_target_": "evilpkg.payload.write_sentinel", "path": str(evil_dir / "SENTINEL")}
    crafted = craft(ckpt, tmp_path / "ckpt", place("model", spec))
    proc = launch(
        [
            *[sys.executable, "-m", "trainer.evaluate", f"checkpoint={crafted}"],
            *["trust=[evilpkg]", "saved_paths=true"],
        ],
        120,
        PYTHONPATH=f"{world['root']}:{REPO}",
        EVIL_DIR=str(evil_dir),
    )
    assert (evil_dir / "IMPORTED").exists(), explain(proc)
    assert (evil_dir / "SENTINEL").read_text() == "ran"


@pytest.mark.launches
def test_interpolations_in_a_saved_config_are_refused(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """A resolver could hide what a target names: a saved config is resolved, so `${...}` in
    one was put there by hand."""

    def mutate(cfg: dict[str, Any]) -> None:
        cfg["model"]["_target_"] = "${oc.env:EVIL_TARGET}"

    crafted = craft(world["run"] / "checkpoints" / "step_00000004", tmp_path / "ckpt", mutate)
    proc = launch(
        [sys.executable, "-m", "trainer.evaluate", f"checkpoint={crafted}"],
        120,
        EVIL_TARGET="evilpkg.payload.write_sentinel",
    )
    assert proc.returncode == 2, explain(proc)
    assert "interpolation at `model._target_`" in proc.stderr and "Traceback" not in proc.stderr


@pytest.mark.launches
def test_users_own_model_is_trusted_in_own_checkpoints_only(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """A checkpoint of a model from a package outside cumulus, written here (signed with this
    user's secret): evaluated with no flag at all, its target and data path the user's own.
    The same checkpoint received from elsewhere (signed with another secret): refused without
    trust, naming `trust=[extpkg]`; with it, or with the target restated, evaluated. Each to
    the metrics the run logged at that step."""
    run = world["ext_run"]
    logged = [r for r in read_metrics(run) if "val/loss" in r][-1]
    py = f"{world['root']}:{REPO}"
    theirs = received(run / "checkpoints" / f"step_{STEPS:08d}", tmp_path / "theirs")
    evaluate = [sys.executable, "-m", "trainer.evaluate"]
    base = [*evaluate, f"checkpoint={theirs}", "saved_paths=true"]
    results = launch_all(
        {
            "own": [*evaluate, f"checkpoint={run}"],
            "refused": base,
            "trusted": [*base, "trust=[extpkg]"],
            "restated": [*base, "model._target_=extpkg.models.BigramLM"],
        },
        180,
        PYTHONPATH=py,
    )
    refused = results["refused"]
    assert refused.returncode == 2, explain(refused)
    assert "trust=[extpkg]" in refused.stderr and "model._target_" in refused.stderr
    for name in ("own", "trusted", "restated"):
        proc = results[name]
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
        got = json.loads(proc.stdout.strip().splitlines()[-1])
        assert got["step"] == STEPS
        assert got["val/loss"] == pytest.approx(logged["val/loss"], rel=1e-12)


@pytest.mark.launches
def test_resume_builds_nothing_from_a_checkpoints_config(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """Training's own resume takes tensors and plain state only: a checkpoint whose config
    names foreign code resumes (auto and checkpoint.resume=PATH) without importing it, on
    the uninterrupted trajectory."""
    evil_dir = tmp_path / "evil"
    evil_dir.mkdir()
    spec = {"_target_": "evilpkg.payload.write_sentinel", "path": str(evil_dir / "SENTINEL")}

    def mutate(cfg: dict[str, Any]) -> None:
        for where in PLACES:
            place(where, dict(spec))(cfg)

    auto = tmp_path / "auto"
    craft(
        world["run"] / "checkpoints" / "step_00000002",
        auto / "checkpoints" / "step_00000002",
        mutate,
    )
    explicit = craft(world["run"] / "checkpoints" / "step_00000002", tmp_path / "ckpt", mutate)
    cmd = [sys.executable, "-m", "trainer.train", *world["base"]]
    results = launch_all(
        {
            "auto": [*cmd, f"hydra.run.dir={auto}"],
            "path": [*cmd, f"checkpoint.resume={explicit}", f"hydra.run.dir={tmp_path / 'path'}"],
        },
        180,
        PYTHONPATH=f"{world['root']}:{REPO}",
        EVIL_DIR=str(evil_dir),
    )
    reference = {r["step"]: r["train/loss"] for r in train_records(read_metrics(world["run"]))}
    for name, proc in results.items():
        assert proc.returncode == 0, f"{name}\n{explain(proc)}"
        got = {r["step"]: r["train/loss"] for r in train_records(read_metrics(tmp_path / name))}
        assert got == {s: reference[s] for s in (3, 4)}, name
    assert list(evil_dir.iterdir()) == []


@pytest.mark.launches
def test_pretrained_dir_asking_for_custom_code_is_refused(tmp_path: Path) -> None:
    """`model.pretrained=DIR` never runs code from DIR: a config.json with an `auto_map`
    is refused with one paragraph, and the module it names is never imported."""
    pytest.importorskip("transformers")
    pretrained = tmp_path / "model"
    pretrained.mkdir()
    (pretrained / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "architectures": ["EvilLM"],
                "auto_map": {"AutoModelForCausalLM": "modeling_evil.EvilLM"},
                "n_layer": 1, "n_head": 2, "n_embd": 8, "vocab_size": 256, "n_positions": 64,
            }
        )
    )  # fmt: skip
    (pretrained / "modeling_evil.py").write_text(f"open({str(tmp_path / 'RAN')!r}, 'w').close()\n")
    text = stdlib_text(tmp_path / "text.txt", 20_000)
    proc = launch(
        [
            sys.executable, "-m", "trainer.train", *TINY, "model=hf_gpt2",
            f"model.pretrained={pretrained}", f"data.path={text}", "train.max_steps=1",
            f"hydra.run.dir={tmp_path / 'run'}",
        ],
        120,
    )  # fmt: skip
    assert proc.returncode == 2, explain(proc)
    err = proc.stderr.strip()
    assert "model.pretrained" in err and "auto_map" in err and "Traceback" not in err, err
    assert not (tmp_path / "RAN").exists()


@pytest.mark.launches
def test_run_directory_means_its_newest_valid_checkpoint(
    world: dict[str, Any], tmp_path: Path
) -> None:
    """`checkpoint=RUN_DIR` evaluates the newest checkpoint that verifies (a damaged newest
    one is skipped with a warning), and `trainer.api.evaluate` returns what the CLI prints."""
    from trainer.api import evaluate

    run = tmp_path / "run"
    shutil.copytree(world["run"] / "checkpoints", run / "checkpoints")
    explicit = evaluate(run / "checkpoints" / "step_00000004", saved_paths=True)
    assert evaluate(run, saved_paths=True) == explicit and explicit["step"] == STEPS
    state = run / "checkpoints" / "step_00000004" / "state.pt"
    state.write_bytes(state.read_bytes()[:-10])  # damaged: skipped, step 2 is evaluated
    cmd = [sys.executable, "-m", "trainer.evaluate", f"checkpoint={run}", "saved_paths=true"]
    proc = launch(cmd, 120)
    assert proc.returncode == 0, explain(proc)
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    step2 = evaluate(run / "checkpoints" / "step_00000002", saved_paths=True)
    assert got == step2 and got["step"] == 2
    assert "skipping checkpoint" in proc.stderr


@pytest.mark.parametrize(
    "choice",
    [
        f"{group.name}={option.stem}"
        for group in sorted((REPO / "configs").iterdir())
        if group.is_dir() and group.name != "logger"
        for option in sorted(group.glob("*.yaml"))
    ],
)
def test_every_shipped_configuration_is_trusted(choice: str) -> None:
    """Checkpoints of every built-in configuration (and combinations: ema with sam) carry
    only shipped targets, so they evaluate and export with no flag."""
    from omegaconf import OmegaConf

    from tests.conftest import compose_config
    from trainer.config.trust import check_targets, targets
    from trainer.run.assemble import CONFIG_DIR

    extra = ["callbacks=[ema,grad_stats]"] if choice.startswith("step=") else []
    saved = OmegaConf.to_container(compose_config([choice, *extra]), resolve=False)
    assert any(True for _ in targets(saved))
    check_targets(saved, Path("ckpt"), config_dir=CONFIG_DIR)
    with pytest.raises(Exception, match=r"trust=\[elsewhere\]"):
        saved["task"]["_target_"] = "elsewhere.Task"
        check_targets(saved, Path("ckpt"), config_dir=CONFIG_DIR)


def test_trust_prefixes_match_whole_module_names() -> None:
    from trainer.config.trust import UntrustedConfigError, check_targets, parse_trust
    from trainer.run.assemble import CONFIG_DIR

    prefixes, rest = parse_trust(["trust=[mypkg, other.sub]", "eval.max_batches=2"])
    assert prefixes == ["mypkg", "other.sub"] and rest == ["eval.max_batches=2"]
    cfg = {"model": {"_target_": "mypkg.models.Net"}, "task": {"_target_": "other.sub.T"}}
    check_targets(cfg, Path("c"), config_dir=CONFIG_DIR, trust=prefixes)
    for bad in ("mypkgx.Net", "other.subtle.T", "other.T"):
        with pytest.raises(UntrustedConfigError):
            check_targets(
                {"m": {"_target_": bad}}, Path("c"), config_dir=CONFIG_DIR, trust=prefixes
            )
    with pytest.raises(Exception, match="not a module prefix"):
        parse_trust(["trust=[os;rm]"])


@pytest.mark.launches
def test_paths_in_a_received_config_are_data(world: dict[str, Any], tmp_path: Path) -> None:
    """A checkpoint whose saved config points the shipped corpus reader at any file
    (`data.path`) and its token cache at any directory (`data.cache_dir`) is evaluated only
    with those paths from the user: each path the file alone sets is refused naming its key,
    before anything is read or written; restated ones are used; `saved_paths=true` takes the
    file's (the control: they would be used). The export refuses a saved `model.pretrained`."""
    import yaml

    docs = tmp_path / "docs.jsonl"
    text = Path(world["text"]).read_text()
    docs.write_text(
        "".join(json.dumps({"text": text[i : i + 3000]}) + "\n" for i in range(0, 30_000, 3000))
    )
    outside, mine = tmp_path / "outside_cache", tmp_path / "my_cache"
    data = yaml.safe_load((REPO / "configs" / "data" / "hf.yaml").read_text())
    # As cumulus saves a config: resolved (no interpolation left).
    data.update(path=str(docs), cache_dir=str(outside), block_size=64, pretrained=None)
    ckpt = world["run"] / "checkpoints" / "step_00000004"
    crafted = craft(ckpt, tmp_path / "ckpt", place("data", data))
    llama = in_tree_model("hf_llama")
    llama["pretrained"] = str(tmp_path / "somewhere")
    foreign = craft(ckpt, tmp_path / "ckpt_llama", place("model", llama))

    evaluate = [sys.executable, "-m", "trainer.evaluate", f"checkpoint={crafted}"]
    mine_args = [f"data.path={docs}", f"data.cache_dir={mine}", "eval.max_batches=2"]
    results = launch_all(
        {
            "file_paths": [*evaluate, "eval.max_batches=2"],
            "path_restated": [*evaluate, f"data.path={docs}", "eval.max_batches=2"],
            "export": [sys.executable, "scripts/export_hf.py", f"checkpoint={foreign}",
                       f"out={tmp_path / 'exported'}"],
        },
        120,
    )  # fmt: skip
    for name, key in (("file_paths", "data.path"), ("path_restated", "data.cache_dir")):
        proc = results[name]
        err = proc.stderr.strip()
        assert proc.returncode == 2 and len(err.splitlines()) == 1, f"{name}\n{explain(proc)}"
        assert f"`{key}: " in err and "saved_paths=true" in err and "Traceback" not in err, err
    export = results["export"]
    assert export.returncode == 2 and "`model.pretrained: " in export.stderr, explain(export)
    assert "python scripts/export_hf.py" in export.stderr
    assert not outside.exists() and not (tmp_path / "exported").exists()

    # The user's paths are used; the file's only with saved_paths=true.
    saved = [*evaluate, "eval.max_batches=2", "saved_paths=true"]
    results = launch_all({"mine": [*evaluate, *mine_args], "saved": saved}, 120)
    for proc in results.values():
        assert proc.returncode == 0, explain(proc)
    assert any(mine.rglob("*")) and any(outside.rglob("*"))
    same = [json.loads(p.stdout.strip().splitlines()[-1]) for p in results.values()]
    assert same[0] == same[1] and same[0]["step"] == STEPS


def test_path_keys_are_known_by_name() -> None:
    from trainer.config.trust import is_path_key, parse_saved_paths

    for key in (
        "data.path",
        "data.val_path",
        "data.cache_dir",
        "data.tokenizer",
        "model.pretrained",
        "data.chat_template",
        "data.root",
        "data.files[0]",
        "model.weights_file",
    ):
        assert is_path_key(key), key
    for key in ("data.text_field", "model.config.hidden_size", "data.packed", "task.temperature"):
        assert not is_path_key(key), key
    assert parse_saved_paths(["a=1", "saved_paths=true"]) == (True, ["a=1"])
    assert parse_saved_paths(["a=1"]) == (False, ["a=1"])
    with pytest.raises(UserError, match="saved_paths"):
        parse_saved_paths(["saved_paths=yes"])


@pytest.mark.launches
def test_own_checkpoints_are_known_by_their_signature(
    world: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The run this session trained is its own: its paths are taken with no flag. Edited (one
    value that names no path or code), signed with another secret, or saved before signing
    existed (no signature), its config is data again: the path is refused as for any received
    checkpoint. Deleting the secret revokes: the run's own checkpoint is refused too, and
    evaluating creates no new secret."""
    from trainer.config.signing import ENV, SECRET
    from trainer.config.trust import UntrustedConfigError
    from trainer.run.evaluation import checkpoint_config
    from trainer.run.state import DERIVED, SIGNATURE

    ckpt = world["run"] / "checkpoints" / f"step_{STEPS:08d}"
    cfg = checkpoint_config(ckpt, [])
    assert cfg.data.path == str(world["text"])

    def edited(cfg: dict[str, Any]) -> None:
        cfg["eval"]["max_batches"] = 1

    def unsigned(state: dict[str, Any]) -> None:  # as written before signatures
        del state[SIGNATURE], state[DERIVED]

    others = {
        "edited": craft(ckpt, tmp_path / "edited", edited),
        "elsewhere": received(ckpt, tmp_path / "elsewhere"),
        "unsigned": rewrite_state(ckpt, tmp_path / "unsigned", unsigned),
    }
    for name, path in others.items():
        with pytest.raises(UntrustedConfigError, match=r"sets `data.path: .*saved_paths=true"):
            checkpoint_config(path, [])
        again = checkpoint_config(path, [], saved_paths=True)  # as before: by the user's word
        assert again.data.path == str(world["text"]), name

    # Revoked: the secret deleted (a copy of this session's, so other tests keep theirs).
    mine = tmp_path / "config"
    mine.mkdir()
    shutil.copy(Path(os.environ[ENV]) / SECRET, mine / SECRET)
    monkeypatch.setenv(ENV, str(mine))
    checkpoint_config(ckpt, [])
    (mine / SECRET).unlink()
    with pytest.raises(UntrustedConfigError, match=r"sets `data.path: "):
        checkpoint_config(ckpt, [])
    assert list(mine.iterdir()) == []


@pytest.mark.launches
def test_saved_derived_keys_are_references_only(world: dict[str, Any], tmp_path: Path) -> None:
    """The keys a checkpoint says its config derives are data too: a derivation through any
    resolver (`oc.env`, reading the environment) or onto a `_target_` is refused as an
    alteration, before anything is resolved."""
    from trainer.config.trust import UntrustedConfigError
    from trainer.run.evaluation import checkpoint_config
    from trainer.run.state import DERIVED

    ckpt = world["run"] / "checkpoints" / f"step_{STEPS:08d}"
    for i, (key, value) in enumerate(
        [
            ("data.pretrained", "${oc.env:HOME}"),
            ("data.pretrained", "${oc.select:model.pretrained,${oc.env:HOME}}"),
            ("model._target_", "${data.path}"),
            ("data.path", "/tmp/${seed}"),
        ]
    ):

        def derive(state: dict[str, Any], key: str = key, value: str = value) -> None:
            state[DERIVED][key] = value

        crafted = rewrite_state(ckpt, tmp_path / f"ckpt_{i}", derive)
        with pytest.raises(UntrustedConfigError, match="altered"):
            checkpoint_config(crafted, [], saved_paths=True)


def test_the_secret_is_created_once_private_and_never_by_a_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Processes that save at once share one secret (mode 0600 in a 0700 directory); checking a
    signature where there is no secret says "not own" and writes nothing."""
    from concurrent.futures import ThreadPoolExecutor

    from trainer.config.signing import ENV, SECRET, is_own, sign

    monkeypatch.setenv(ENV, str(tmp_path / "cumulus"))
    record = {"config": {"a": 1, "b": [1.5, None, "x"]}, "derived": {}}
    assert not is_own(record, "hmac-sha256:00")
    assert not (tmp_path / "cumulus").exists()
    with ThreadPoolExecutor(8) as pool:
        signatures = set(pool.map(lambda _: sign(record), range(16)))
    assert len(signatures) == 1 and is_own(record, signatures.pop())
    assert sorted(p.name for p in (tmp_path / "cumulus").iterdir()) == [SECRET]
    assert (tmp_path / "cumulus" / SECRET).stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "cumulus").stat().st_mode & 0o777 == 0o700
    signature = sign(record)
    assert not is_own({**record, "config": {"a": 1, "b": [1.5, None, "y"]}}, signature)
    assert not is_own({**record, "config": {"a": True, "b": [1.5, None, "x"]}}, signature)
    assert not is_own(record, signature.upper()) and not is_own(record, None)


@pytest.mark.parametrize(
    "choice",
    [
        ["model=hf_llama", "data=stdlib"],
        ["model=hf_llama", "data=hf"],
        ["model=hf_llama", "data=chat"],
        ["model=hf_encoder", "task=contrastive", "data=pairs"],
        ["model=gpt_tiny", "data=stdlib"],
    ],
)
def test_derived_keys_follow_what_the_user_gives_now(choice: list[str]) -> None:
    """A saved config (resolved) with its derived keys, composed again as evaluation and export
    compose it: with no override, exactly the saved values; with `model.pretrained=NEW_DIR`,
    every key the run derived from it (`data.pretrained`, `data.tokenizer` for pairs) is the
    new directory, and a key the user set at training keeps its value."""
    from omegaconf import OmegaConf

    from tests.conftest import compose_config
    from trainer.config.trust import derived_keys
    from trainer.run.evaluation import compose_config as compose_saved

    old, new = "/old/base", "/moved/base"
    pretrained = [f"model.pretrained={old}"] if choice[0].startswith("model=hf") else []
    composed = compose_config([*choice, *pretrained, "data.packed=false"])
    saved = OmegaConf.to_container(composed, resolve=True)
    derived = derived_keys(composed)
    assert "data.packed" not in derived  # set by the user: saved as given
    again, _ = compose_saved(saved, [], derived)
    assert OmegaConf.to_container(again, resolve=True) == saved
    if not pretrained:
        return
    follows = [k for k, v in derived.items() if "model.pretrained" in v]
    assert follows, derived
    moved, _ = compose_saved(saved, [f"model.pretrained={new}"], derived)
    for key in follows:
        assert OmegaConf.select(moved, key) == new, key
    assert moved.data.packed is False
