"""Replica groups coordinated by torchft: a lost group costs one step, never a sample.

A job is `groups` replica groups. Each is a job of its own (DDP or FSDP2 over its ranks); rank
r of every group sums with rank r of the others through torchft's reconfigurable process
group, and torchft's lighthouse forms, at every step, the quorum of the live groups. The
step, made exact across groups:

1. `ReplicaGroups.begin_step`: the quorum. A group behind the others takes their state first,
   peer to peer (torchft's checkpoint transport): it never reads a disk. After a step the
   group committed, the quorum forms while the first forward runs (torchft's async quorum),
   on the last quorum's deal: the count's sum (3.) waits for it after that forward, and says
   whether any group's deal was not the quorum's (`DealChanged`: the attempt is dealt again).
2. The step's global batch is dealt over the quorum: `Replicated.dp_rank` and `dp_size` are
   the participating group's rank x the group's size plus the rank in the group. The batches
   of a step depend only on (seed, step, global batch), so any deal sees the same samples.
3. The count of the window's loss items gains one small sum across groups, which carries a
   one-hot of the group ids (who is live, a duplicated id), the group's size and its deal.
4. After the window, one flat SUM across groups of each rank's gradients (its shards under
   FSDP2) and loss sum: every group then holds bit-identical gradients, so unscaling, the
   finite check and clipping decide alike everywhere. Never torchft's AVG: the loss is
   already divided by the global count.
5. torchft's `should_commit`: a step whose cross-group collective failed anywhere is not taken
   (`StepNotCommitted`); the next quorum redoes the same step with the same samples, dealt
   over the groups still live.

Every micro-batch's forward draws its randomness (dropout) from torch's generator seeded by
(seed, step, the micro-batch's index in the global batch): the same numbers whichever group
runs it, so a deal over fewer groups changes nothing.

torchft is imported only when a `ReplicaGroups` connects (the extra `ft`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import numpy as np
import torch
from torch import nn

from engine.distributed import DistInfo, broadcast_object
from engine.parallel import LayoutError
from engine.parallel.base import (
    NO_GUARD,
    KeepsWindowSums,
    Parallelism,
    WindowContext,
    WindowGuard,
    local_values,
)

# Replica ids sort as their groups' numbers (torchft ranks the quorum's members by id).
REPLICA_ID = "cumulus_{:05d}"
# How often a group with too few live peers asks for a quorum again.
RETRY_S = 0.2


class StepNotCommitted(Exception):
    """This step's collective across groups failed somewhere (a group was lost or hung): its
    update is not made; the next quorum redoes it."""


class DealChanged(StepNotCommitted):
    """The quorum formed during this attempt's first forward (torchft's async quorum) deals
    otherwise than the one before, which the attempt's share was computed for (a group joined
    or left between two steps). Every group sees it in the same sum: no group's attempt is
    used, and the step is dealt again at once, after a blocking quorum."""


class QuorumFailed(Exception):
    """No quorum within the timeout: the lighthouse cannot be reached, or fewer groups than
    the minimum are live."""


class DuplicateGroup(Exception):
    """Another live replica group has this group's id."""


class UnevenGroups(Exception):
    """Replica groups of different sizes: rank r of one must hold what rank r of another
    holds."""


@dataclass(frozen=True)
class ReplicaSettings:
    """What the groups agree on: the lighthouse, this group's id, how many groups the job has
    and needs, and how long a collective, a quorum or a transfer may wait."""

    lighthouse: str
    group: int
    groups: int
    min_groups: int = 1
    timeout_s: float = 30.0
    # The quorum of a step after a committed one is formed while its first forward runs.
    async_quorum: bool = True


@dataclass(frozen=True)
class Quorum:
    """One step's quorum, as this group sees it."""

    step: int  # optimizer steps committed: this quorum makes step + 1
    rank: int  # this group's participating rank (0 .. groups - 1)
    groups: int  # participating groups
    healed: bool = False  # this group took a peer's state in it


@dataclass(frozen=True)
class Membership:
    """Which groups took part in a step, from its count's sum across groups."""

    live: tuple[int, ...]  # group ids, ascending
    duplicated: tuple[int, ...] = ()  # ids that more than one live group claims

    @property
    def writer(self) -> int:
        """The group that writes records and checkpoints: the lowest live id."""
        return self.live[0]


def micro_seed(seed: int, step: int, index: int) -> int:
    """The seed of the random draws of micro-batch `index` of the global batch of step `step`
    (index -1: what follows the window)."""
    return int(np.random.SeedSequence([seed, step, index + 1, 0xF7]).generate_state(1)[0])


class ReplicaGroups:
    """This rank's torchft Manager and the sums across groups. One per rank of a group: rank
    r of every group forms torchft's cross-group process group number r.

    `save` returns what a group behind the others receives (this rank's state, at the step
    boundary); `load` puts a received state in place (its tensors are torchft's read-only
    buffers: cloned before use)."""

    def __init__(
        self,
        settings: ReplicaSettings,
        info: DistInfo,
        save: Callable[[], dict[str, Any]],
        load: Callable[[dict[str, Any]], None],
    ) -> None:
        self.settings, self.info = settings, info
        self._save, self._load = save, load
        self._boundary: dict[str, Any] | None = None  # `save` at an overlapped step's start
        self.manager: Any = None
        self.store: Any = None  # the Manager's TCPStore, hosted by rank 0 (kept alive)
        self.healed = False
        # The full deal until the first quorum: what every group live gives.
        self.quorum = Quorum(0, settings.group, settings.groups)
        self.membership = Membership(tuple(range(settings.groups)))
        # Whether the deal of `quorum` is a guess whose quorum is still forming (`settle`).
        self.forming = False
        # Why no group uses this attempt (seen in the count's sum); raised before the
        # gradients' sum, after the window: an exception between a forward and its backward
        # would leave DDP's reducer and FSDP2's unsharded parameters mid-step.
        self.voided: DealChanged | None = None
        # Seconds the steps waited for their quorums so far (a blocking one: all of it, a
        # state transfer included; an overlapped one: its start and what is left after the
        # first forward).
        self.waited_s = 0.0

    # ---- connecting ----
    def connect(self) -> None:
        """Start the Manager (rank 0: its server, heartbeating to the lighthouse). Late, when
        the group is ready to step: a heartbeating group that does not ask for quorums holds
        the others' quorums back (the lighthouse waits for every healthy group)."""
        quiet_torchft()
        import torchft
        from torchft.manager import Manager

        s = self.settings
        timeout = timedelta(seconds=s.timeout_s)
        host, port = self._fresh_store()
        transport = weights_only_transport(timeout)
        pg = (
            torchft.ProcessGroupNCCL(timeout=timeout)
            if self.info.device.type == "cuda"
            else torchft.ProcessGroupGloo(timeout=timeout)
        )
        try:
            self.manager = Manager(
                pg=pg,
                load_state_dict=self._received,
                state_dict=self._serving,
                min_replica_size=s.min_groups,
                use_async_quorum=False,  # set before each quorum (`_asynchronous`)
                timeout=timeout,
                quorum_timeout=timeout,
                connect_timeout=timeout / 2,  # the paragraph comes within timeout_s
                rank=self.info.rank,
                world_size=self.info.world_size,
                store_addr=host,
                store_port=port,
                lighthouse_addr=s.lighthouse,
                replica_id=REPLICA_ID.format(s.group),
                init_sync=False,  # every group initializes alike from the seed
                checkpoint_transport=transport,
            )
        except RuntimeError as exc:  # torchft: "failed to connect to ... within timeout"
            raise QuorumFailed(first_line(exc)) from None

    def _fresh_store(self) -> tuple[str, int]:
        """A TCPStore of this launch for the Manager, hosted by the group's rank 0: under
        torchrun the agent's store outlives a restart, and a restarted rank would read the
        dead one's manager address from it. Its host is reachable from the other groups (the
        first group's store hosts the cross-group rendezvous)."""
        address = None
        if self.info.is_main:
            host = socket.gethostname()
            self.store = torch.distributed.TCPStore(host, 0, is_master=True, wait_for_workers=False)
            address = (host, self.store.port)
        return broadcast_object(address, self.info)

    def shutdown(self) -> None:
        if self.manager is not None:
            self.manager.shutdown(wait=False)
            self.manager = None

    # ---- the step ----
    def begin_step(self, overlap: bool = False) -> Quorum:
        """The quorum of this step, blocking: a group behind takes a peer's state in it, and
        with fewer live groups than `min_groups` it is asked again until the timeout.

        `overlap` (the step after one this group committed, so no group is ahead of it): the
        quorum is started and forms while the first forward runs (torchft's async quorum);
        the step is computed meanwhile on the last quorum's deal, and `settle` says whether
        the quorum's is the same."""
        began = time.perf_counter()
        try:
            return self._begin(overlap)
        finally:
            self.waited_s += time.perf_counter() - began

    def _begin(self, overlap: bool) -> Quorum:
        if overlap and self.settings.async_quorum:
            step = self.manager.current_step()  # read before torchft's thread runs
            self._asynchronous(True)
            self._boundary = self._save()
            try:
                self.manager.start_quorum()
            except Exception as exc:  # torchft raises TimeoutError, RuntimeError
                raise QuorumFailed(first_line(exc)) from None
            self.healed, self.forming, self.voided = False, True, None
            self.quorum = Quorum(step, self.quorum.rank, self.quorum.groups)
            return self.quorum
        self._asynchronous(False)
        self.forming, self.voided, self._boundary = False, None, None
        deadline = time.monotonic() + self.settings.timeout_s
        while True:
            self.healed = False
            try:
                self.manager.start_quorum()
            except Exception as exc:  # torchft raises TimeoutError, RuntimeError
                raise QuorumFailed(first_line(exc)) from None
            groups = self.manager.num_participants()
            if groups >= self.settings.min_groups:
                break
            self.manager.should_commit()  # False: too few; the Manager's step protocol
            if time.monotonic() > deadline:
                raise QuorumFailed(
                    f"only {groups} of the at least {self.settings.min_groups} groups needed "
                    f"are live"
                )
            time.sleep(RETRY_S)
        rank = self.manager.participating_rank()
        self.quorum = Quorum(self.manager.current_step(), rank, groups, self.healed)
        return self.quorum

    def settle(self) -> bool:
        """Wait for the quorum `begin_step(overlap=True)` started: whether the deal the step
        is being computed on is not the quorum's (a group joined or left, too few are live).
        Nothing forming: False."""
        if not self.forming:
            return False
        self.forming = False
        m, began = self.manager, time.perf_counter()
        try:
            rank, groups, step = m.participating_rank(), m.num_participants(), m.current_step()
        except Exception as exc:  # the quorum failed: this attempt's sums fail with it
            m.report_error(exc)
            return False
        finally:
            self.waited_s += time.perf_counter() - began
        return (step, rank, groups) != (self.quorum.step, self.quorum.rank, self.quorum.groups) or (
            groups < self.settings.min_groups
        )

    def _asynchronous(self, overlap: bool) -> None:
        """torchft's Manager has one mode for all its quorums (`use_async_quorum`); this
        trainer needs both. torchft reads the flag when a quorum starts (whether to wait for it
        and heal at once) and when it forms (a group behind takes part at once, or not): set
        before each. Only a blocking quorum heals: an overlapped one follows a step this group
        committed; a group the others left behind meanwhile heals in it, sits the attempt
        out (torchft zeroes its sums) and voids it (`sum_count`). The previous quorum has
        finished first: its thread reads the flag too."""
        with contextlib.suppress(Exception):  # its failure is raised by the next start
            self.manager.wait_quorum()
        self.manager._use_async_quorum = overlap

    def wait_for_groups(self, timeout_s: float) -> Quorum:
        """A fresh job's first quorum: asked again until every group has joined (or one is
        ahead: this group joined late and took its state), at most `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        quorum = self.begin_step()
        healed = quorum.healed
        while quorum.groups < self.settings.groups and quorum.step == 0:
            if time.monotonic() > deadline:
                break
            time.sleep(RETRY_S / 4)
            quorum = self.begin_step()
            healed = healed or quorum.healed
        self.quorum = Quorum(quorum.step, quorum.rank, quorum.groups, healed)
        return self.quorum

    def resumed_at(self, step: int) -> None:
        """The group's state was read from a checkpoint of `step` (no group was ahead): the
        Manager counts from there, and the next quorum deals that step."""
        self.manager.load_state_dict({"step": step, "batches_committed": 0})

    def sum_count(
        self, count: torch.Tensor, group_size: int, guessed_wrong: bool = False
    ) -> torch.Tensor:
        """The loss items over every group (`count`: this group's), in one small sum that also
        says who is live (`membership`) and whether the groups dealt the step alike: [count,
        group size, one-hot of the group id, one-hot of the dealt rank, the dealt number of
        groups, whether this group's deal was a wrong guess (`settle`)]. The attempt is void
        (`voided`) when any group's deal was a wrong guess or the deals disagree (a group
        that healed in a blocking quorum counts itself; the others, whose quorum formed
        during their forward, did not): every group sees it in the same sum."""
        s, q = self.settings, self.quorum
        message = torch.zeros(4 + 2 * s.groups, dtype=torch.float64, device=count.device)
        message[0] = count.to(torch.float64)
        message[1] = group_size
        message[2 + s.group] = 1.0
        message[2 + s.groups + q.rank] = 1.0
        message[-2] = q.groups
        message[-1] = float(guessed_wrong)
        if self._sum(message):
            sizes, ids = message[1].item(), message[2 : 2 + s.groups].round().long().tolist()
            live = tuple(g for g, n in enumerate(ids) if n > 0)
            self.membership = Membership(live, tuple(g for g, n in enumerate(ids) if n > 1))
            if self.membership.duplicated and s.group in self.membership.duplicated:
                raise DuplicateGroup(f"group id {s.group} is claimed by {ids[s.group]} groups")
            if round(sizes) != group_size * sum(ids):
                raise UnevenGroups(
                    f"this group has {group_size} data-parallel ranks; the {sum(ids)} groups "
                    f"of the quorum have {round(sizes)} together"
                )
            # Dealt alike: ranks 0 .. n-1 once each, and every one of the n over n groups; and
            # every member of the quorum in the sum (torchft zeroes the message of a group
            # that heals in a quorum formed during the forward: it is not dealt a share).
            n = len(live)
            ranks = message[2 + s.groups : -2].round().long().tolist()
            alike = ranks == [1] * n + [0] * (s.groups - n) and round(message[-2].item()) == n * n
            if message[-1] > 0 or not alike or n != self.members():
                self.voided = DealChanged(f"the quorum of step {q.step + 1} changed the deal")
        return message[0].round().to(count.dtype)

    def sum_gradients(
        self,
        params: list[nn.Parameter],
        loss_sum: torch.Tensor,
        item_sums: dict[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Sum every rank's gradients (this rank's values: FSDP2's shards), `loss_sum` and the
        task's `item_sums` (engine/item_sums.py: DPO's rewards) over the groups, in place;
        the summed loss sum and item sums. A parameter without a gradient here gets the
        others' (zeros stand in for it), one without any anywhere stays None. A void attempt
        sums nothing: `DealChanged`, in every group."""
        if self.voided is not None:
            self.void(self.voided)
        item_sums = item_sums or {}
        grads = [local_values(p.grad) if p.grad is not None else None for p in params]
        present = torch.tensor(
            [g is not None for g in grads], dtype=torch.float64, device=loss_sum.device
        )
        items = [
            v.detach().to(torch.float64).reshape(-1).to(loss_sum.device) for v in item_sums.values()
        ]
        small = torch.cat([loss_sum.detach().to(torch.float64).reshape(1), present, *items])
        by_dtype: dict[torch.dtype, list[int]] = {}
        for i, p in enumerate(params):
            by_dtype.setdefault(p.dtype if grads[i] is None else grads[i].dtype, []).append(i)
        flats = {
            dtype: torch.cat(
                [
                    grads[i].reshape(-1)
                    if grads[i] is not None
                    else torch.zeros(
                        local_values(params[i]).numel(), dtype=dtype, device=loss_sum.device
                    )
                    for i in idx
                ]
            )
            for dtype, idx in by_dtype.items()
        }
        if not all(self._sum(t) for t in (small, *flats.values())):
            return loss_sum, item_sums  # not committed: nothing of this step is used
        for dtype, idx in by_dtype.items():
            offset = 0
            for i in idx:
                n = local_values(params[i]).numel()
                if small[1 + i] > 0:
                    values = flats[dtype][offset : offset + n]
                    if grads[i] is None:
                        params[i].grad = grad_like(params[i], values)
                    else:
                        grads[i].copy_(values.view_as(grads[i]))
                offset += n
        summed, offset = {}, 1 + len(params)
        for (name, value), flat in zip(item_sums.items(), items, strict=True):
            part = small[offset : offset + flat.numel()]
            summed[name] = part.reshape(value.shape).to(value.dtype).to(value.device)
            offset += flat.numel()
        return small[0].to(loss_sum.dtype), summed

    def sum_across(self, tensor: torch.Tensor) -> None:
        """SUM `tensor` over the groups in place, inside the step (a failure there: the step
        does not commit, and what `tensor` holds then is not used)."""
        self._sum(tensor)

    def members(self) -> int:
        """The groups of the current quorum: the size of torchft's process group across
        them, healing ones included (`num_participants` leaves those out)."""
        return self.manager._pg.size()

    def void(self, reason: DealChanged) -> None:
        """This attempt is not used by any group (each saw `reason` in the same sum): voted
        down in torchft's commit, so that the step count stays, then raised."""
        self.manager.report_error(reason)
        self.commit()
        raise reason

    def commit(self) -> bool:
        """torchft's vote: whether every collective of this step succeeded in this group (and
        enough groups took part). False leaves the step count: the step is redone."""
        try:
            return bool(self.manager.should_commit())
        except Exception:  # a rank of this group is gone: the group stops anyway
            return False

    def _sum(self, tensor: torch.Tensor) -> bool:
        """SUM `tensor` over the groups in place; False when the collective failed (torchft
        then skips this step's later collectives: the step will not commit)."""
        from torch.distributed import ReduceOp

        self.manager.allreduce(tensor, reduce_op=ReduceOp.SUM).wait()
        return self.manager.errored() is None

    def _serving(self) -> dict[str, Any]:
        """torchft's state callback, in its quorum thread. A blocking quorum calls it while
        the step waits; an overlapped one while the forward runs, so it gets the state taken
        in the main thread at the step's start (references: nothing changes them before the
        commit ends the serving): a state dict taken during a forward is not safe (FSDP2
        reshards its parameters for one)."""
        return self._boundary if self._boundary is not None else self._save()

    def _received(self, state: dict[str, Any]) -> None:
        """torchft's load callback, in the main thread: inside a blocking `start_quorum`, or
        inside `should_commit` for a group left behind that healed in an overlapped one."""
        self._load(cloned(state))
        self.healed = True


def weights_only_transport(timeout: timedelta) -> Any:
    """torchft's HTTP checkpoint transport (each rank serves its state; a rank behind fetches
    it from the same rank of a peer), its receiver reading tensors and plain containers only
    (`torch.load(weights_only=True)`, as checkpoints are read): torchft's own reads any pickle
    a peer sends. What travels is what a checkpoint holds, so nothing else is needed."""
    import urllib.request

    from torch.distributed._serialization import _streaming_load
    from torchft.checkpointing import HTTPTransport

    class WeightsOnlyTransport(HTTPTransport):
        @classmethod
        def _load_from_address(cls, address: str, timeout: timedelta) -> object:
            with urllib.request.urlopen(address, timeout=timeout.total_seconds()) as f:
                return _streaming_load(f, weights_only=True)

    transport = WeightsOnlyTransport(timeout, num_chunks=0)
    # Its HTTP server logs every request on stderr: the trainer says what was received.
    transport._server.RequestHandlerClass.log_message = lambda *args: None
    return transport


def start_lighthouse(
    bind: str,
    port: int,
    *,
    min_groups: int,
    join_timeout_s: float,
    heartbeat_timeout_s: float,
    quorum_tick_ms: int,
) -> tuple[Any, str]:
    """torchft's lighthouse serving on `bind`:`port` (its Rust threads, in this process), and
    the address groups connect to: the server's own (this host's name), or the bound host
    when it is a specific one."""
    os.environ.setdefault("RUST_LOG", "warn")  # read when torchft's extension loads
    from torchft.coordination import LighthouseServer

    host = bind if bind.endswith("]") or ":" not in bind else f"[{bind}]"
    server = LighthouseServer(
        bind=f"{host}:{port}",
        min_replicas=min_groups,
        join_timeout_ms=round(join_timeout_s * 1000),
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=round(heartbeat_timeout_s * 1000),
    )
    served = server.address()
    if bind in ("", "[::]", "::", "0.0.0.0"):
        return server, served
    return server, f"http://{host}:{served.rsplit(':', 1)[1]}"


def quiet_torchft() -> None:
    """torchft's own log lines off (its Rust side logs every quorum; its Python side each
    failed collective, with a traceback): the trainer says what a failure cost. RUST_LOG=info,
    or a level set on the `torchft` logger, brings them back."""
    os.environ.setdefault("RUST_LOG", "warn")  # read when torchft's extension loads
    logger = logging.getLogger("torchft")
    if logger.level == logging.NOTSET:
        logger.setLevel(logging.CRITICAL)
    # torchft's receiver reads tensors onto read-only buffers; `cloned` copies them.
    warnings.filterwarnings("ignore", message="The given buffer is not writable")


def grad_like(param: nn.Parameter, values: torch.Tensor) -> torch.Tensor:
    """A gradient for `param` holding `values` (its local shard's, for a DTensor)."""
    local = local_values(param)
    grad = values.view_as(local).clone()
    if local is param:
        return grad
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        grad, param.device_mesh, param.placements, shape=param.shape, stride=param.stride()
    )


def cloned(state: Any) -> Any:
    """`state` with every tensor copied: torchft's receiver reads tensors onto buffers that
    are not writable, and training updates them in place."""
    from torch.utils._pytree import tree_map

    return tree_map(lambda t: t.clone() if isinstance(t, torch.Tensor) else t, state)


def first_line(exc: BaseException) -> str:
    """What a torchft error says, in short: its gRPC message, or the last cause of a chain
    ("... tcp connect error: Connection refused (os error 111)")."""
    lines = [ln.strip() for ln in str(exc).strip().splitlines() if ln.strip()]
    text = lines[0] if lines else type(exc).__name__
    if 'message: "' in text:
        return text.split('message: "', 1)[1].split('"', 1)[0]
    return text.rsplit(": ", 1)[-1]


class KeyedRandomness:
    """A window guard under which each micro-batch draws from torch's generator seeded by
    its index in the global batch (and the step): the same draws whichever group runs it. The
    window ends on a keyed state too, so every group leaves the step with the same one."""

    def __init__(self, guard: WindowGuard, seed: int, step: int, first: int) -> None:
        self.guard, self.seed, self.step, self.first = guard, seed, step, first

    def micro_batch(self, index: int, count: int, fn: Callable[[], Any]) -> Any:
        torch.manual_seed(micro_seed(self.seed, self.step, self.first + index))
        return self.guard.micro_batch(index, count, fn)

    def gradient_sync(self, ctx: WindowContext, enabled: bool) -> contextlib.AbstractContextManager:
        return self.guard.gradient_sync(ctx, enabled)

    def after_window(self, ctx: WindowContext) -> None:
        self.guard.after_window(ctx)
        torch.manual_seed(micro_seed(self.seed, self.step, -1))


class Replicated:
    """The group's parallelism `inner` (DDP or FSDP2 over its ranks), replicated over the
    replica groups of `replicas`: every member is `inner`'s except the data-parallel
    coordinates (the deal of the current quorum), the count and the window (their sums
    across groups, the commit) and the description."""

    def __init__(self, inner: Parallelism, replicas: ReplicaGroups, seed: int) -> None:
        if inner.name not in ("ddp", "fsdp"):
            raise LayoutError(
                "ft",
                f"replica groups hold the model whole or as FSDP2 shards; {inner.name} inside "
                "a group is not supported",
            )
        self.inner, self.replicas, self.seed = inner, replicas, seed
        self.name = f"ft+{inner.name}"
        self._pending: torch.Tensor | None = None  # the group's count, its sum to come

    def __getattr__(self, name: str) -> Any:
        # Everything this class does not define is the group's own parallelism's member.
        return getattr(self.inner, name)

    # ---- the deal ----
    @property
    def dp_rank(self) -> int:
        return self.replicas.quorum.rank * self.inner.dp_size + self.inner.dp_rank

    @property
    def dp_size(self) -> int:
        return self.replicas.quorum.groups * self.inner.dp_size

    @property
    def group_size(self) -> int:
        """The data-parallel ranks of this group."""
        return self.inner.dp_size

    def describe(self) -> str:
        inner = self.inner.describe()
        s = self.replicas.settings
        own = f"replica group {s.group} of {s.groups} (ft, min {s.min_groups})"
        return own + (f" | {inner}" if inner else "")

    # ---- the step ----
    def global_item_count(self, local: torch.Tensor) -> torch.Tensor:
        group = self.inner.global_item_count(local)
        return self.replicas.sum_count(group, self.inner.dp_size, self.replicas.settle())

    def pending_item_count(self, local: torch.Tensor) -> torch.Tensor:
        """The group's count, summed across the groups in place by `settle_count` after the
        first forward, when a quorum is forming: the forward runs while it forms."""
        if not self.replicas.forming:
            return self.global_item_count(local)
        self._pending = self.inner.global_item_count(local)
        return self._pending

    def settle_count(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            wrong = self.replicas.settle()
            pending.copy_(self.replicas.sum_count(pending, self.inner.dp_size, wrong))

    def sum_across_groups(self, tensor: torch.Tensor) -> None:
        """A task's sum before the window's backward (the balancing's routing counts), made
        over this group's ranks, summed across the groups too."""
        with torch.no_grad():
            self.replicas.sum_across(tensor)

    def keyed_guard(
        self, ctx: WindowContext, micro_batches: int, guard: WindowGuard
    ) -> WindowGuard:
        return KeyedRandomness(guard, self.seed, ctx.step, self.dp_rank * micro_batches)

    def backward_window(
        self,
        ctx: WindowContext,
        window: Sequence[Any],
        global_count: torch.Tensor,
        guard: WindowGuard = NO_GUARD,
    ) -> torch.Tensor:
        """The group's window with keyed randomness, then its sums across groups and the
        commit: `StepNotCommitted` when any collective of the step failed."""
        step = ctx.step
        keyed = KeyedRandomness(guard, self.seed, step, self.dp_rank * len(window))
        loss_sum = self.inner.backward_window(ctx, window, global_count, keyed)
        self.settle_count()  # settled by the first backward already; never left pending
        # The task's item sums of this rank's forwards, summed with rank r of every group (its
        # records then sum them over this group's ranks); a window not committed drops them.
        # So do the sums a task keeps of the window besides (the balancing's routing).
        item_sums = ctx.item_sums.take()
        keeps = ctx.task if isinstance(ctx.task, KeepsWindowSums) else None
        own = keeps.take_window_sums() if keeps is not None else {}
        with ctx.clock.collective("gradient sum across replica groups"):
            params = ctx.trainable_parameters()
            sums = {**item_sums, **own}
            loss_sum, sums = self.replicas.sum_gradients(params, loss_sum, sums)
            committed = self.replicas.commit()
        if not committed:
            raise StepNotCommitted(f"step {step + 1} was not committed")
        ctx.item_sums.add({k: sums[k] for k in item_sums})
        if keeps is not None and own:
            keeps.put_window_sums({k: sums[k] for k in own})
        return loss_sum
