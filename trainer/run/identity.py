"""One run identity for all ranks: the run directory stamp and the run id.

Hydra resolves `hydra.run.dir` in every process before our code runs. The default
`${now:...}` would give ranks that start in different seconds different directories, so the
default run dir uses `${run_stamp:}` instead: under torchrun the first rank to ask writes its
timestamp into torchrun's rendezvous store and every rank (and every restart of the job)
reads that same value back.
"""

from __future__ import annotations

import datetime
import os
import secrets

from omegaconf import OmegaConf

from trainer.config.pretrained import register_random_init

STAMP_FORMAT = "%Y-%m-%d/%H-%M-%S"
_STAMP_KEY = "cumulus/run_stamp"


def run_stamp() -> str:
    now = datetime.datetime.now().strftime(STAMP_FORMAT)
    if int(os.environ.get("WORLD_SIZE", "1")) == 1:
        return now
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
        import torch.distributed as dist

        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=60),
        )
        # First writer wins; the key outlives worker restarts (the agent owns the store).
        return store.compare_set(_STAMP_KEY, "", now).decode()
    # Without the agent store the launcher's run id is the only rank-shared value.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return f"torchrun-{run_id}"
    raise RuntimeError(
        "cannot agree on a run directory across ranks: set hydra.run.dir=... explicitly"
    )


def new_run_id() -> str:
    return secrets.token_hex(4)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver("run_stamp"):
        OmegaConf.register_new_resolver("run_stamp", run_stamp, use_cache=True)
    register_random_init()  # configs/model/hf_*.yaml's in-tree defaults
