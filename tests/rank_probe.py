"""`python -m tests.rank_probe MODE DIR` under a launcher (tests/test_ranks.py): each rank writes
its launcher environment and what it read from the launcher's TCP store to `DIR/rank<R>.json`
(its own file, renamed into place whole: ranks sharing torchrun's stdout interleave their
lines, so stdout is no channel for a test to read several ranks from), then ends as MODE
says: `ok` (exit 0), `exit2` (rank 1 exits 2), `kill9` (rank 1 SIGKILLs itself); the other
ranks then wait to be stopped by the launcher.

Standard library and torch.distributed's store only: no process group, nothing to tear down.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import signal
import sys
import time
from pathlib import Path

# What a launcher tells its workers: the names torchrun sets, and the trainer reads.
LAUNCH_ENV = re.compile(r"(.*RANK|.*WORLD_SIZE|MASTER_.*|ROLE_NAME|TORCHELASTIC_.*|TORCH_NCCL_.*)")


def main(mode: str, out_dir: str) -> None:
    import torch.distributed as dist

    rank = int(os.environ["RANK"])
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        is_master=False,
        timeout=datetime.timedelta(seconds=60),
    )
    # The first writer wins, every rank reads the same value back (as trainer/run/identity.py).
    agreed = store.compare_set("probe/first", "", f"rank{rank}").decode()
    store.add("probe/arrived", 1)
    while store.add("probe/arrived", 0) < int(os.environ["WORLD_SIZE"]):
        time.sleep(0.01)
    launch_env = {k: v for k, v in os.environ.items() if LAUNCH_ENV.fullmatch(k)}
    probe = json.dumps({"rank": rank, "env": launch_env, "agreed": agreed})
    path = Path(out_dir) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(probe)
    os.replace(tmp, path)  # whole or absent
    if mode == "ok":
        return
    if rank == 1:
        if mode == "exit2":
            sys.exit(2)
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)  # stopped by the launcher long before


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
