"""The micro-batches of each optimizer step, through `torch.utils.data.DataLoader`.

The samples of optimizer step `s` are a pure function of (seed, s, global batch size): an
epoch-wise permutation of all samples, read as one endless stream, global batch after global
batch. Rank r takes the r-th contiguous share of each global batch and cuts it into
micro-batches. Any split into ranks x micro-batches x accumulation therefore sees the same
global batch, and resuming at step `s` needs no loader state: the loader is rebuilt to start
at `s`.

Randomness inside a dataset (augmentation) is made a pure function too: each sample is
fetched with the torch, NumPy and Python generators seeded from (seed, step, position in
the global batch), in whichever worker process fetches it. So the batches of step `s` do not
depend on `data.num_workers` either, and a resumed run draws the same augmentations.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, default_collate, get_worker_info

from engine.evaluate import EvalShare
from trainer.config.errors import UserError
from trainer.run.batch_plan import BatchPlan

Batch = Any
# (dataset index, seed of the sample's generators)
Key = tuple[int, int]
_EVAL_STEP = -1  # the "step" of validation samples: their randomness is fixed once and for all


SAMPLINGS = ("shuffle", "poisson")


class GlobalBatchSampler:
    """Sample indices of each optimizer step's global batch: a pure function of
    (seed, step, global_batch_size).

    `sampling="shuffle"`: epoch-wise permutations read as one stream, `global_batch_size`
    samples per step. `"poisson"`: each sample joins step `s` independently with probability
    q = global_batch_size / num_samples (DP-SGD's privacy accounting assumes exactly this), so
    the batch size varies around `global_batch_size`.
    """

    def __init__(
        self, num_samples: int, global_batch_size: int, seed: int, sampling: str = "shuffle"
    ) -> None:
        if num_samples == 0:
            raise UserError("data: the training split holds no samples; use more or longer text")
        if sampling not in SAMPLINGS:
            raise ValueError(f"sampling must be one of {', '.join(SAMPLINGS)}, got {sampling!r}")
        self.n = num_samples
        self.global_batch_size = global_batch_size
        self.seed = seed
        self.sampling = sampling
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._perms[epoch]

    def global_indices(self, step: int) -> np.ndarray:
        if self.sampling == "poisson":
            rate = min(1.0, self.global_batch_size / self.n)
            draws = np.random.default_rng([self.seed, step, 0x90155]).random(self.n)
            return np.flatnonzero(draws < rate)
        positions = np.arange(step * self.global_batch_size, (step + 1) * self.global_batch_size)
        epochs, offsets = np.divmod(positions, self.n)
        return np.array([self._perm(int(e))[o] for e, o in zip(epochs, offsets)])

    def epoch(self, step: int) -> float:
        return step * self.global_batch_size / self.n


def sample_seed(seed: int, step: int, position: int) -> int:
    """The seed of the sample at `position` of step `step`'s global batch."""
    return int(np.random.SeedSequence([seed, step + 1, position]).generate_state(1)[0])


class SeededSamples:
    """A map-style dataset whose samples are fetched by `Key`: the index, and a seed for the
    generators while that sample is produced. In the main process the generators' states are
    restored afterwards, so training's own random streams (dropout) are untouched."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, key: Key) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[Key]) -> list[Any]:
        in_worker = get_worker_info() is not None
        saved = (
            None if in_worker else (torch.get_rng_state(), np.random.get_state(), random.getstate())
        )
        try:
            out = []
            for index, seed in keys:
                torch.default_generator.manual_seed(seed)
                np.random.seed(seed)
                random.seed(seed)
                out.append(self.dataset[index])
            return out
        finally:
            if saved is not None:
                torch.set_rng_state(saved[0])
                np.random.set_state(saved[1])
                random.setstate(saved[2])


class StepMicroBatches:
    """Batch sampler: this rank's micro-batches of every step from `start_step` on, as
    lists of `Key`s."""

    def __init__(
        self, sampler: GlobalBatchSampler, rank: int, micro: int, accum: int, start_step: int
    ) -> None:
        self.sampler, self.rank, self.micro, self.accum = sampler, rank, micro, accum
        self.start_step = start_step

    def __iter__(self) -> Iterator[list[Key]]:
        # Rank-major: the global batch cut into world x accum micro-batches of `micro` samples
        # (as equal as possible when Poisson sampling makes its size vary; some may be empty).
        parts = self.sampler.global_batch_size // self.micro
        step = self.start_step
        while True:
            indices = self.sampler.global_indices(step)
            positions = np.array_split(np.arange(len(indices)), parts)
            for k in range(self.accum):
                yield [
                    (int(indices[p]), sample_seed(self.sampler.seed, step, int(p)))
                    for p in positions[self.rank * self.accum + k]
                ]
            step += 1


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """`batch` with every tensor inside (tuples, lists, dicts) on `device`."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, Mapping):
        moved = {k: to_device(v, device, non_blocking) for k, v in batch.items()}
        return moved if type(batch) is dict else type(batch)(moved)
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # a namedtuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


class CollateOrNone:
    """The collate function, or None for an empty micro-batch (Poisson sampling can draw one;
    step=dp_sgd skips it). A class, not a lambda: loader workers pickle it."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        return self.collate_fn(samples) if samples else None


def _loader(
    dataset: Any,
    batch_sampler: Any,
    collate_fn: Callable[[list[Any]], Any] | None,
    num_workers: int,
    device: torch.device,
    persistent: bool = False,
) -> DataLoader:
    pin = device.type == "cuda"
    return DataLoader(
        SeededSamples(dataset),
        batch_sampler=batch_sampler,
        collate_fn=CollateOrNone(collate_fn or default_collate),
        num_workers=num_workers,
        pin_memory=pin,
        prefetch_factor=4 if num_workers else None,
        persistent_workers=persistent and num_workers > 0,
        # Its own generator: creating an iterator draws a worker base seed, which must not
        # come from (and shift) the global stream that dropout uses. Samples are reseeded
        # one by one anyway (SeededSamples).
        generator=torch.Generator().manual_seed(0),
    )


class TrainBatches:
    """This rank's windows of micro-batches, step after step, on the device.

    The global batch is laid out rank-major: rank r owns the r-th contiguous share, cut into
    `plan.accum` micro-batches of `plan.micro` samples. `plan` may be replaced between
    windows (`micro_batch_size=auto` shrinking after an out-of-memory error).
    """

    def __init__(
        self,
        dataset: Any,
        sampler: GlobalBatchSampler,
        *,
        rank: int,
        plan: BatchPlan,
        device: torch.device,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
    ) -> None:
        self.dataset = dataset
        self.sampler = sampler
        self.rank = rank
        self.plan = plan
        self.device = device
        self.collate_fn = collate_fn
        self.num_workers = num_workers
        assert sampler.global_batch_size == plan.global_batch

    def windows(self, start_step: int) -> Iterator[list[Batch]]:
        """Windows of steps `start_step`, `start_step + 1`, ...; workers prefetch ahead."""
        plan = self.plan
        batches = StepMicroBatches(self.sampler, self.rank, plan.micro, plan.accum, start_step)
        loader = _loader(self.dataset, batches, self.collate_fn, self.num_workers, self.device)
        it = iter(loader)
        non_blocking = self.device.type == "cuda"
        try:
            while True:
                yield [to_device(next(it), self.device, non_blocking) for _ in range(plan.accum)]
        finally:
            del it  # shuts the workers down

    def window(self, step: int) -> list[Batch]:
        """The window of one step (a fresh loader: for checks and benchmarks, not the loop)."""
        gen = self.windows(step)
        try:
            return next(gen)
        finally:
            gen.close()


def _share(samples: range, rank: int, world_size: int) -> range:
    """The rank-th of `world_size` contiguous parts of `samples`, sizes differing by one at
    most (the first parts the larger)."""
    n = len(samples)
    start = rank * (n // world_size) + min(rank, n % world_size)
    return samples[start : start + n // world_size + (rank < n % world_size)]


def eval_set_size(n_samples: int, batch_size: int, max_batches: int | None) -> int:
    """How many validation samples an evaluation covers, over all ranks."""
    return n_samples if max_batches is None else min(n_samples, max_batches * batch_size)


class EvalBatches:
    """This rank's share of the validation set, streamed to the device batch by batch.

    The set is the first `max_batches * batch_size` samples (or all); rank r takes every
    world_size-th sample from r, so shards differ by at most one sample, none repeats, and
    the set is the same for any world size. Re-iterable; has a length (batches on this rank).

    `whole_batches` (tasks whose loss is of the whole batch: in-batch negatives): the set is
    cut into evaluation batches of `batch_size` samples first, and rank r takes the r-th
    contiguous share of each (as training shares a global batch); every rank then has one
    share of every batch, yielded as an `EvalShare` whose representations evaluation
    gathers, so each batch has the same negatives on any world size.
    """

    def __init__(
        self,
        dataset: Any,
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        max_batches: int | None,
        device: torch.device,
        seed: int,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        num_workers: int = 0,
        whole_batches: bool = False,
    ) -> None:
        size = eval_set_size(len(dataset), batch_size, max_batches)
        self.rows: list[int] | None = None  # whole_batches: this rank's samples of each
        if whole_batches:
            shares = [
                _share(range(start, min(start + batch_size, size)), rank, world_size)
                for start in range(0, size, batch_size)
            ]
            self.rows = [len(share) for share in shares]
            # A rank without a sample of a batch forwards its first one (owning no row).
            indices = [
                list(share) or [start] for share, start in zip(shares, range(0, size, batch_size))
            ]
        else:
            mine = list(range(rank, size, world_size))
            indices = [mine[k : k + batch_size] for k in range(0, len(mine), batch_size)]
        self.batches = [[(i, sample_seed(seed, _EVAL_STEP, i)) for i in b] for b in indices]
        self.dataset, self.collate_fn, self.device = dataset, collate_fn or default_collate, device
        self.seed = seed
        workers = min(num_workers, len(self.batches))
        self.loader = _loader(dataset, self.batches, collate_fn, workers, device, persistent=True)

    def __len__(self) -> int:
        return len(self.batches)

    def __iter__(self) -> Iterator[Batch]:
        non_blocking = self.device.type == "cuda"
        for k, batch in enumerate(self.loader):
            batch = to_device(batch, self.device, non_blocking)
            yield batch if self.rows is None else EvalShare(batch, self.rows[k])

    def first_sample(self) -> Batch | None:
        """The validation set's first sample as a batch of one, the same on every rank (a
        prompt for text samples)."""
        if not len(self.dataset):
            return None
        key = (0, sample_seed(self.seed, _EVAL_STEP, 0))
        return to_device(
            self.collate_fn(SeededSamples(self.dataset).__getitems__([key])), self.device
        )
