"""Support for tests/test_ft.py: callbacks the trainer loads by `_target_` (test-only: the
trainer has no knob for any of this), and the launcher loop of a replica group.

- `Slowdown`: every micro-batch's forward sleeps, so a 60-step run of gpt_tiny lasts longer
  than a killed group needs to come back (3-15 s here).
- `KillGroup`: SIGKILL to every process of its own group at step k in phase p (forward,
  backward, allreduce: inside the gradient sum across groups, optimizer: after the commit,
  checkpoint: the checkpoint staged, not yet committed), once each (a marker file survives
  the restart).
- `Pause`: one group stops between two steps for longer than the lighthouse's join timeout.
- `Digests`: per rank, a digest of the weights, the whole optimizer state and the schedule
  after every optimizer step and right after a state is received from a peer; the final
  weights, gathered, in `final_g<G>.pt`.

Heavy imports stay inside functions so that importing a callback from here is cheap.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from engine.callbacks import Callback
from engine.tasks import CausalLMTask

if TYPE_CHECKING:
    from engine.step import StepContext

PHASES = ("forward", "backward", "allreduce", "optimizer", "checkpoint")
WAIT_S = 0.2  # each forward's sleep while a group is away and kills are still to come


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


class Slowdown(Callback):
    """Each forward of the model sleeps `seconds` first."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def setup(self, ctx: StepContext) -> None:
        ctx.model.register_forward_pre_hook(lambda module, args: time.sleep(self.seconds))


class KillGroup(Callback):
    """SIGKILL to this group's processes at the moments of `kills` ("STEP:PHASE,..."), each
    once over the group's restarts (a marker file per kill in `markers`); rank 0 kills. A kill
    comes at the first moment of its phase from its step on while every group is live (a peer
    is there to take the state from), and not after step `until`. `group`: only the group of
    this id kills (every group is given the same overrides by scripts/ft_local.sh); -1: any."""

    def __init__(self, kills: str, markers: str, until: int, group: int = -1) -> None:
        self.kills = [(int(s), p) for s, p in (k.split(":") for k in kills.split(",") if k)]
        for _, phase in self.kills:
            assert phase in PHASES, phase
        self.markers = Path(markers)
        self.until = until
        self.group = group
        self.pids: list[int] = [os.getpid()]
        self.ctx: Any = None

    def due(self, step: int, phase: str) -> bool:
        """Whether this rank kills its group now: a kill of `phase` from a step at most
        `step` (the step being made) has not happened yet, and every kill before it has."""
        replicas = self.ctx.parallel.replicas
        everyone = len(replicas.membership.live) == replicas.settings.groups
        mine = self.group in (-1, replicas.settings.group)
        if _rank() != 0 or not everyone or step > self.until or not mine:
            return False
        for at, p in self.kills:
            if not (self.markers / f"{at}-{p}").exists():  # the next kill not done yet
                return p == phase and at <= step
        return False

    def kill(self, step: int, phase: str) -> None:
        at = next(a for a, p in self.kills if p == phase and a <= step and not self.done(a, p))
        marker = self.markers / f"{at}-{phase}"
        marker.parent.mkdir(parents=True, exist_ok=True)
        with marker.open("w") as f:
            f.write(f"{time.time()}\n")
            f.flush()
            os.fsync(f.fileno())
        print(f"KillGroup: killing the group at step {step} in {phase}", flush=True)
        for pid in self.pids[::-1]:  # this process last
            if pid != os.getpid():
                os.kill(pid, signal.SIGKILL)
        os.kill(os.getpid(), signal.SIGKILL)

    def done(self, at: int, phase: str) -> bool:
        return (self.markers / f"{at}-{phase}").exists()

    def setup(self, ctx: StepContext) -> None:
        import torch.distributed as dist

        self.ctx = ctx
        if dist.is_initialized():
            pids: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(pids, os.getpid())
            self.pids = pids
        ctx.model.register_forward_pre_hook(lambda m, a: self._at("forward"))
        # A parameter half-way through the model: its gradient comes mid-backward.
        params = [p for p in ctx.model.parameters() if p.requires_grad]
        params[len(params) // 2].register_hook(lambda g: self._at("backward"))
        self._patch_sum(ctx.parallel.replicas)
        self._patch_commit()

    def _patch_sum(self, replicas: Any) -> None:
        """The gradient sum across groups is issued; the kill comes before it completes."""
        from torch.distributed import ReduceOp

        original = replicas._sum

        def _sum(tensor: Any) -> bool:
            step = self.ctx.step + 1
            if tensor.numel() > 1000 and self.due(step, "allreduce"):
                replicas.manager.allreduce(tensor, reduce_op=ReduceOp.SUM)
                self.kill(step, "allreduce")
            return original(tensor)

        replicas._sum = _sum

    def _at(self, phase: str) -> None:
        step = self.ctx.step + 1
        if self.due(step, phase):
            self.kill(step, phase)
        elif phase == "forward" and self.waiting(step):
            time.sleep(WAIT_S)

    def waiting(self, step: int) -> bool:
        """A group is away (restarting) while kills may still come (up to `until`): the live
        groups go slower until it is back, so that every kill of the schedule (each waits for
        every group) happens within the run, however long a restart takes on a loaded
        machine."""
        replicas = self.ctx.parallel.replicas
        away = len(replicas.membership.live) < replicas.settings.groups
        return away and step <= self.until

    def _patch_commit(self) -> None:
        """The checkpoint's files are staged; the kill comes before its commit (rename)."""
        import engine.checkpoint.sharded as sharded
        import engine.checkpoint.writer as writer

        def patched(module: Any) -> Any:
            original = module.commit

            def commit(root: Any, tmp: Any, step: int, *args: Any, **kwargs: Any) -> Any:
                if self.due(step, "checkpoint"):
                    self.kill(step, "checkpoint")
                return original(root, tmp, step, *args, **kwargs)

            return commit

        writer.commit = patched(writer)
        sharded.commit = patched(sharded)

    def on_before_optimizer_step(self, ctx: StepContext) -> None:
        self._at("optimizer")


def state_digest(ctx: Any) -> str:
    """sha256 of this rank's weights (local shards), the optimizer's whole state (moments and
    parameter groups: the learning rate) and the scheduler's state."""
    import torch

    from engine.distributed import unwrap
    from engine.parallel.base import local_values

    h = hashlib.sha256()
    for name, t in unwrap(ctx.model).state_dict().items():
        h.update(name.encode())
        h.update(local_values(t).detach().cpu().reshape(-1).view(torch.uint8).numpy().tobytes())
    opt = ctx.optimizer.state_dict()
    for key in sorted(opt["state"]):
        for field, v in sorted(opt["state"][key].items()):
            h.update(f"{key}.{field}".encode())
            if isinstance(v, torch.Tensor):
                v = local_values(v).detach().cpu().reshape(-1)
                h.update(v.view(torch.uint8).numpy().tobytes())
            else:
                h.update(repr(v).encode())
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt["param_groups"]]
    h.update(repr(groups).encode())
    if ctx.scheduler is not None:
        h.update(repr(ctx.scheduler.state_dict()).encode())
    return h.hexdigest()[:16]


class Digests(Callback):
    """`dir/g<G>r<R>.jsonl`: {"step", "digest", "healed"} after every optimizer step of this
    rank, and when a peer's state was just put in place (`healed`: its step); the final
    weights of the group, gathered, in `dir/final_g<G>.pt` (rank 0)."""

    state_optional = True

    def __init__(self, dir: str, group: int, max_steps: int) -> None:
        self.dir, self.group, self.max_steps = Path(dir), group, max_steps
        self.ctx: Any = None

    def setup(self, ctx: StepContext) -> None:
        self.ctx = ctx
        self.dir.mkdir(parents=True, exist_ok=True)

    def _write(self, step: int, healed: bool) -> None:
        line = {"step": step, "digest": state_digest(self.ctx), "healed": healed}
        with (self.dir / f"g{self.group}r{_rank()}.jsonl").open("a") as f:
            f.write(json.dumps(line) + "\n")

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        self._write(step, False)
        if step == self.max_steps:
            self._final(ctx)

    def _final(self, ctx: Any) -> None:
        import torch

        from engine.distributed import unwrap
        from engine.parallel.base import whole_tensor

        state = unwrap(ctx.model).state_dict()
        weights = {n: whole_tensor(t).detach().cpu() for n, t in state.items()}
        if _rank() == 0:
            torch.save(weights, self.dir / f"final_g{self.group}.pt")

    def state_dict(self) -> dict[str, Any]:
        return {"written": True}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state
        if self.ctx is not None and self.ctx.step > 0:
            self._write(self.ctx.step, True)


class Pause(Callback):
    """Group `group` stops for `seconds` once, after its step `step` committed (a long
    checkpoint, a stalled host): longer than the lighthouse's join timeout, the others form
    their quorums without it and go on; it comes back behind them, while heartbeating."""

    def __init__(self, group: int, step: int, seconds: float) -> None:
        self.group, self.step, self.seconds = group, step, seconds
        self.ctx: Any = None

    def setup(self, ctx: StepContext) -> None:
        self.ctx = ctx

    def on_after_optimizer_step(self, ctx: StepContext, step: int) -> None:
        if step == self.step and ctx.parallel.replicas.settings.group == self.group:
            print(f"Pause: group {self.group} stops for {self.seconds:g} s", flush=True)
            time.sleep(self.seconds)


class TargetMeanLM(CausalLMTask):
    """task=causal_lm that also reports, as a task's item sums (engine/item_sums.py), the sum
    of its targets' token ids over its loss items: the record `train/target_id` is the mean
    token id of the step's targets, a function of the step's samples alone, so it is the same
    whichever groups made the step, if its sums span every group and a redone window's are
    dropped."""

    item_sum_names = ("target_id",)

    def loss_and_sums(self, model: Any, batch: Any) -> tuple[Any, dict[str, Any]]:
        import torch

        _, targets = batch
        sums = {
            "target_id": targets.double().sum(),
            "items": torch.tensor(float(targets.numel()), dtype=torch.float64),
        }
        return self.loss_sum(model, batch), sums
