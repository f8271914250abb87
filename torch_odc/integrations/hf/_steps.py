"""Planning a Trainer's optimizer steps from its dataset: the step loader (one item per optimizer
step, this rank's microbatches of it). The plan, the padded-token arithmetic and the derived cap
are the step core's (:mod:`torch_odc.step`); what is the Trainer's here is the order of its
rows (accelerate's seedable sampler) and its microbatches of ``per_device_train_batch_size``
consecutive rows, which the derived cap matches. Runs in DataLoader workers when there are any:
nothing here holds a trainer."""

from __future__ import annotations

import math

import torch

from torch_odc import step as core

__all__ = ["ODCStep"]

WHERE = "torch_odc.integrations.hf"


class ODCStep:
    """One optimizer step as this rank sees it: its collated microbatches (possibly none).

    ``counts[r]`` is rank r's number of microbatches in the step, ``indices`` this rank's
    dataset indices per microbatch, ``step``/``epoch`` where the step is in the epoch. It is not
    a mapping of model inputs (``"labels" in step`` is False), so the Trainer's loop counts and
    gathers nothing from it. With the derived cap (``ODCConfig.max_tokens_per_microbatch=None``)
    the loader hands out every rank's rows of the step (``assigned``, dataset indices) and this
    rank's features uncollated; the trainer packs and collates them in its own process
    (``_odc_materialize``), where the cap is known. Rows with images (a vision-language
    dataset) plan against ``plain_frontier``: (padded tokens, vision patches) of the unmodified
    trainer's microbatches so far that no other of them holds fewer of both (see
    ``plain_microbatches``); ``plain_tokens`` is then their largest padded tokens."""

    __slots__ = (
        "assigned",
        "cap",
        "cap_frontier",
        "collate",
        "counts",
        "epoch",
        "features",
        "indices",
        "microbatches",
        "order_position",
        "plain_frontier",
        "plain_tokens",
        "step",
        "work",
    )

    def __init__(
        self,
        microbatches,
        counts,
        indices,
        epoch,
        step,
        *,
        assigned=None,
        features=None,
        collate=None,
        plain_tokens=None,
        order_position=None,
        plain_frontier=None,
    ):
        self.microbatches, self.counts, self.indices = microbatches, counts, indices
        self.epoch, self.step = epoch, step
        self.assigned, self.features, self.collate = assigned, features, collate
        self.plain_tokens, self.order_position = plain_tokens, order_position
        self.plain_frontier = plain_frontier
        self.cap, self.cap_frontier, self.work = None, None, None

    def __contains__(self, key) -> bool:
        return False

    def __repr__(self) -> str:
        return f"ODCStep(epoch={self.epoch}, step={self.step}, microbatches per rank {self.counts})"


class _StepData(torch.utils.data.Dataset):
    """The epoch's optimizer steps: item (epoch, step) is this rank's collated share of it.
    Runs in the DataLoader's workers when there are any; holds no trainer."""

    def __init__(
        self,
        dataset,
        collate,
        lengths,
        per_step,
        world,
        rank,
        planner,
        shuffle,
        seed,
        drop_last,
        costs=None,
        rows=None,
        per_device=None,
        padding_free=False,
        plain_multiple=1,
        patches=None,
    ):
        self.dataset, self.collate, self.lengths, self.costs = dataset, collate, lengths, costs
        self.per_step, self.world, self.rank, self.planner = per_step, world, rank, planner
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        # The derived cap (rows given): per row its sequences' lengths, the unmodified
        # trainer's rows per microbatch, and how the collator lays rows out.
        self.rows, self.per_device, self.padding_free = rows, per_device, padding_free
        self.plain_multiple = plain_multiple  # the user's collator's pad_to_multiple_of
        # Per row its images' vision patches in all, when the dataset has images: the derived
        # cap is then a frontier of (padded tokens, patches) points (plain_up_to).
        self.patches = patches
        self._orders: dict[int, list[int]] = {}
        self._plain_max: tuple[int | None, list] = (None, [])

    def __len__(self) -> int:  # what the Trainer reports as "Num examples"
        return len(self.lengths)

    def num_steps(self) -> int:
        n = len(self.lengths)
        return n // self.per_step if self.drop_last else math.ceil(n / self.per_step)

    def plain_up_to(self, epoch: int, step: int):
        """The padded tokens of the largest microbatch the unmodified trainer runs in this
        epoch up to and including ``step``: its peak memory so far, which the derived cap
        matches (a per-step match would be stricter than the run's peak asks). With images,
        the frontier of its microbatches so far as (padded tokens, patches) points
        (:func:`frontier`): an ODC microbatch holding no more of both than one of them."""
        if self._plain_max[0] != epoch:
            order, n = self.order(epoch), self.num_steps()
            best, prefix = ([] if self.patches is not None else 0), []
            for k in range(n):
                ids = order[k * self.per_step : (k + 1) * self.per_step]
                rows = [self.rows[i] for i in ids]
                if self.patches is not None:
                    best = core.frontier(
                        [
                            *best,
                            *core.plain_microbatches(
                                rows,
                                [self.patches[i] for i in ids],
                                self.per_device,
                                self.padding_free,
                                self.plain_multiple,
                            ),
                        ]
                    )
                else:
                    best = max(
                        best,
                        core.plain_largest_microbatch(
                            rows, self.per_device, self.padding_free, self.plain_multiple
                        ),
                    )
                prefix.append(best)
            self._plain_max = (epoch, prefix)
        return self._plain_max[1][step]

    def order(self, epoch: int) -> list[int]:
        """The epoch's sequence order, the same on every rank (a generator seeded from the
        seed and the epoch, like accelerate's seedable sampler)."""
        if epoch not in self._orders:
            n = len(self.lengths)
            if self.shuffle:
                gen = torch.Generator()
                gen.manual_seed(self.seed + epoch)
                self._orders = {epoch: torch.randperm(n, generator=gen).tolist()}
            else:
                self._orders = {epoch: list(range(n))}
        return self._orders[epoch]

    def __getitem__(self, key) -> ODCStep:
        epoch, step = key
        ids = self.order(epoch)[step * self.per_step : (step + 1) * self.per_step]
        lengths = [self.lengths[i] for i in ids]
        if self.rows is not None:  # the derived cap: LB-Mini assigns rows to ranks here
            plain = self.plain_up_to(epoch, step)
            points = None
            if self.patches is not None:  # LB-Mini's own packing: tokens and patches as one
                points, plain = plain, max(t for t, _ in plain)
                cap = max(t + p for t, p in points)
            else:
                cap = plain
            costs = [self.costs[i] for i in ids] if self.costs is not None else None
            plan = core.plan_step(
                lengths, self.world, self.planner, step=step, costs=costs, cap=cap, where=WHERE
            )
            assigned = [[ids[j] for mb in p for j in mb] for p in plan]
            features = {i: self.dataset[i] for i in assigned[self.rank]}
            return ODCStep(
                None,
                None,
                None,
                epoch,
                step,
                assigned=assigned,
                features=features,
                collate=self.collate,
                plain_tokens=plain,
                order_position={i: j for j, i in enumerate(ids)},
                plain_frontier=points,
            )
        costs = [self.costs[i] for i in ids] if self.costs is not None else None
        plan = core.plan_step(
            lengths, self.world, self.planner, step=step, costs=costs, where=WHERE
        )
        mine = [[ids[j] for j in mb] for mb in plan[self.rank]]
        batches = [self.collate([self.dataset[i] for i in mb]) for mb in mine]
        return ODCStep(batches, [len(p) for p in plan], mine, epoch, step)


class _StepKeys(torch.utils.data.Sampler):
    """The loader's batch sampler: one batch per optimizer step, holding the step's one key
    (epoch, step). Being a batch sampler is what lets the Trainer resume mid-epoch: its
    ``skip_first_batches`` wraps it in a sampler that drops the first k batches (keys only: the
    skipped steps are neither planned nor collated) and reaches ``set_epoch`` through it. The
    steps that follow are planned exactly as in the uninterrupted run: a step's plan is a
    function of (epoch, step) and the dataset only."""

    def __init__(self, steps: _StepData):
        self.steps, self.epoch = steps, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.steps.num_steps()

    def __iter__(self):
        return iter([[(self.epoch, s)] for s in range(len(self))])


class _StepLoader(torch.utils.data.DataLoader):
    """A DataLoader of ODCSteps; the Trainer calls set_epoch on it before every epoch."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


def _only(items):
    """The collate function of the step loader: a batch is one ODCStep."""
    (step,) = items
    return step


def _sequence_lengths(dataset, key: str) -> list[int]:
    try:
        import datasets

        if isinstance(dataset, datasets.Dataset) and key in dataset.column_names:
            return [len(x) for x in dataset[key]]
    except ImportError:
        pass
    return [len(dataset[i][key]) for i in range(len(dataset))]
