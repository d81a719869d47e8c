"""`python -m trainer.lighthouse`: torchft's lighthouse for `ft=torchft` runs (the extra `ft`).

The lighthouse forms, at every step, the quorum of the replica groups that are live: groups
heartbeat to it from a thread of their own, and ask it for the step's quorum before the step.
It keeps no training state: a group never sends it a tensor. One lighthouse serves one job;
start it before the groups, and keep it up for the job's life (groups stop with one paragraph
after `ft.timeout_s` when it is gone, the writer saving the last committed step first).
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import signal
import sys
import threading
from collections.abc import Sequence

from trainer.version import answer_version


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.lighthouse",
        description="torchft's lighthouse for ft=torchft: prints its address (the groups' "
        "ft.lighthouse) on the first line of stdout and serves until interrupted.",
        epilog="torchft's own log lines (each quorum it forms) are off unless RUST_LOG=info.",
    )
    parser.add_argument(
        "--min-groups",
        type=int,
        default=1,
        help="no quorum forms with fewer live groups (give the groups the same "
        "ft.min_groups); default 1",
    )
    parser.add_argument(
        "--port", type=int, default=29510, help="port to listen on; 0: a free one (29510)"
    )
    parser.add_argument(
        "--bind",
        default="[::]",
        help="address to listen on ([::]: every interface, the default; 127.0.0.1: this "
        "machine only)",
    )
    parser.add_argument(
        "--join-timeout-s",
        type=float,
        default=5.0,
        help="when the groups change, how long a live group that has not asked yet is waited "
        "for before the quorum forms without it: above the spread of the groups' step times "
        "(5)",
    )
    parser.add_argument(
        "--heartbeat-timeout-s",
        type=float,
        default=2.0,
        help="a group silent this long is lost (its step is redone by the others): what a "
        "dead group costs the live ones (2)",
    )
    parser.add_argument(
        "--quorum-tick-ms",
        type=int,
        default=100,
        help="how often the lighthouse looks again at groups it waits for (100)",
    )
    args = parser.parse_args(argv)
    if args.min_groups < 1:
        parser.error(f"--min-groups must be at least 1, got {args.min_groups}")
    for name in ("join_timeout_s", "heartbeat_timeout_s", "quorum_tick_ms"):
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be positive")
    return args


def address(served: str, bind: str) -> str:
    """What groups connect to: the server's own address (this host's name), or the bound
    host when it is a specific one."""
    host = bind.rsplit(":", 1)[0] if bind.count(":") == 1 else bind
    if host in ("", "[::]", "0.0.0.0"):
        return served
    return f"http://{host}:{served.rsplit(':', 1)[1]}"


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    answer_version(argv, "trainer.lighthouse")
    args = parse_args(argv)
    if importlib.util.find_spec("torchft") is None:
        from trainer.config.schema import FT_INSTALL

        print(f"error: the lighthouse is torchft's, which is not installed: {FT_INSTALL}")
        return 2
    os.environ.setdefault("RUST_LOG", "warn")  # read when torchft's extension loads
    from torchft.coordination import LighthouseServer

    bind = args.bind if args.bind.endswith("]") or ":" not in args.bind else f"[{args.bind}]"
    try:
        server = LighthouseServer(
            bind=f"{bind}:{args.port}",
            min_replicas=args.min_groups,
            join_timeout_ms=round(args.join_timeout_s * 1000),
            quorum_tick_ms=args.quorum_tick_ms,
            heartbeat_timeout_ms=round(args.heartbeat_timeout_s * 1000),
        )
    except Exception as exc:  # the port is taken, the address is not this host's
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"error: the lighthouse cannot listen on {bind}:{args.port}: {first}")
        return 2
    print(address(server.address(), args.bind), flush=True)
    print(
        f"lighthouse: min groups {args.min_groups}, join timeout {args.join_timeout_s:g} s, "
        f"heartbeat timeout {args.heartbeat_timeout_s:g} s; the groups run with "
        "ft=torchft ft.lighthouse=<the address above>",
        file=sys.stderr,
        flush=True,
    )
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
