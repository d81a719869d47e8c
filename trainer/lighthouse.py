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
import signal
import sys
import threading
from collections.abc import Sequence

from trainer.version import answer_version

# (flag, type, default, help): the help says what the setting costs or decides.
OPTIONS: tuple[tuple[str, type, object, str], ...] = (
    ("--min-groups", int, 1, "no quorum with fewer live groups: the groups' ft.min_groups (1)"),
    ("--port", int, 29510, "port to listen on; 0: a free one (29510)"),
    ("--bind", str, "[::]", "address to listen on ([::]: every interface; 127.0.0.1: here)"),
    ("--join-timeout-s", float, 5.0, "how long a live group is awaited: above the step skew (5)"),
    ("--heartbeat-timeout-s", float, 2.0, "a group silent this long is lost: what it costs (2)"),
    ("--quorum-tick-ms", int, 100, "how often it looks again at groups it waits for (100)"),
)


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m trainer.lighthouse",
        description="torchft's lighthouse for ft=torchft: prints its address (the groups' "
        "ft.lighthouse) on the first line of stdout and serves until interrupted.",
        epilog="torchft's own log lines (each quorum it forms) are off unless RUST_LOG=info.",
    )
    for flag, kind, default, help_text in OPTIONS:
        parser.add_argument(flag, type=kind, default=default, help=help_text)
    args = parser.parse_args(argv)
    positive = {
        "--min-groups": args.min_groups,
        "--join-timeout-s": args.join_timeout_s,
        "--heartbeat-timeout-s": args.heartbeat_timeout_s,
        "--quorum-tick-ms": args.quorum_tick_ms,
    }
    for flag, value in positive.items():
        if value <= 0:
            parser.error(f"{flag} must be positive, got {value}")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    answer_version(argv, "trainer.lighthouse")
    args = parse_args(argv)
    if importlib.util.find_spec("torchft") is None:
        from trainer.config.schema import FT_INSTALL

        print(f"error: the lighthouse is torchft's, which is not installed: {FT_INSTALL}")
        return 2
    from engine.parallel.replicas import start_lighthouse

    try:
        server, address = start_lighthouse(
            args.bind,
            args.port,
            min_groups=args.min_groups,
            join_timeout_s=args.join_timeout_s,
            heartbeat_timeout_s=args.heartbeat_timeout_s,
            quorum_tick_ms=args.quorum_tick_ms,
        )
    except Exception as exc:  # the port is taken, the address is not this host's
        first = (str(exc).strip().splitlines() or [""])[0]
        print(f"error: the lighthouse cannot listen on {args.bind}:{args.port}: {first}")
        return 2
    print(address, flush=True)
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
