"""Seeded epochs of prompt batches, resumable: which dataset rows each generation round samples."""

from __future__ import annotations

from collections.abc import Iterator, Mapping

import datasets
import numpy as np


class PromptBatches:
    """Seeded epochs of prompt batches, resumable: an infinite iterator of ``(epoch, rows)``.

    Each epoch visits the rows in a fresh permutation drawn from ``(seed, epoch)`` (or in order
    with ``shuffle=False``) and yields ``rows: dict[str, list]`` (column -> ``prompts_per_step``
    values) batches. Under several processes every one holds the whole dataset and draws the same
    permutation; a batch of the run is ``prompts_per_step × num_processes`` consecutive rows of it, and
    process p takes its p-th slice (as TRL's sampler: over the epochs every process sees every row). The
    last ``len(dataset) % (prompts_per_step × num_processes)`` rows of each epoch's permutation are
    dropped, so every step has exactly ``prompts_per_step × G`` completions on each process; with
    reshuffling a different remainder is dropped each epoch. The iterator never ends; the trainer stops
    it (``max_steps``), or pass ``num_epochs``.

    Position: ``(epoch, index)``, where ``index`` is the row offset of the next batch in that
    epoch's permutation (the same on every process). ``state_dict()`` taken after a batch was
    yielded points at the next one, so a run restored with ``load_state_dict`` (or built with
    ``start_epoch``/``start_index``) yields exactly the batches an uninterrupted run would have.

    >>> batches = PromptBatches(datasets.Dataset.from_dict({"prompt": list("abcde")}), 2, seed=0)
    >>> [epoch for epoch, _ in (next(batches) for _ in range(5))]
    [0, 0, 1, 1, 2]
    """

    def __init__(
        self,
        dataset: datasets.Dataset,
        prompts_per_step: int,
        *,
        seed: int = 0,
        shuffle: bool = True,
        start_epoch: int = 0,
        start_index: int = 0,
        num_epochs: int | None = None,
        num_processes: int = 1,
        process_index: int = 0,
    ):
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        if len(dataset) < prompts_per_step * num_processes:
            under = f" × {num_processes} processes" if num_processes > 1 else ""
            raise ValueError(
                f"the train dataset has {len(dataset)} rows, fewer than one batch of prompts_per_step="
                f"{prompts_per_step}{under} (the prompts one rollout draws: prompts_per_step × steps_per_generation "
                "on each process); lower prompts_per_step (in the TRL front door: per_device_train_batch_size × "
                "steps_per_generation / num_generations prompts a rollout), or add prompts"
            )
        self.dataset, self.prompts_per_step, self.seed = dataset, int(prompts_per_step), int(seed)
        # a batch of the run (every process's prompts) and this process's slice of it
        self.batch_rows = self.prompts_per_step * int(num_processes)
        self.first = self.prompts_per_step * int(process_index)
        self.shuffle, self.num_epochs = shuffle, num_epochs
        self._order_epoch: int | None = None
        self._order: np.ndarray | None = None
        self._set_position(start_epoch, start_index)

    @property
    def steps_per_epoch(self) -> int:
        """Batches per epoch, ``len(dataset) // (prompts_per_step × num_processes)``."""
        return len(self.dataset) // self.batch_rows

    def __len__(self) -> int:
        return self.steps_per_epoch

    @property
    def epochs_done(self) -> float:
        """Passes over the data so far: the epoch plus the share of its batches already drawn."""
        return self.epoch + self.index / (self.steps_per_epoch * self.batch_rows)

    def _set_position(self, epoch: int, index: int) -> None:
        if epoch < 0 or not 0 <= index <= len(self.dataset):
            raise ValueError(
                f"invalid start position epoch={epoch}, index={index} for {len(self.dataset)} rows"
            )
        self.epoch, self.index = int(epoch), int(index)
        if self.index + self.batch_rows > len(self.dataset):  # a partial batch: next epoch
            self.epoch, self.index = self.epoch + 1, 0

    def order(self, epoch: int) -> np.ndarray:
        """The row order of ``epoch``: a permutation seeded by ``(seed, epoch)``; shape (len(dataset),)."""
        if self._order_epoch != epoch:
            n = len(self.dataset)
            self._order = (
                np.random.default_rng([self.seed, epoch]).permutation(n) if self.shuffle else np.arange(n)
            )
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> Iterator[tuple[int, dict[str, list]]]:
        return self

    def __next__(self) -> tuple[int, dict[str, list]]:
        if self.num_epochs is not None and self.epoch >= self.num_epochs:
            raise StopIteration
        epoch, start = self.epoch, self.index
        mine = start + self.first
        indices = self.order(epoch)[mine : mine + self.prompts_per_step].tolist()
        self._set_position(epoch, start + self.batch_rows)
        return epoch, self.dataset[indices]

    def state_dict(self) -> dict[str, int]:
        """The position of the next batch, plus what must match on resume."""
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "num_rows": len(self.dataset),
            "prompts_per_step": self.prompts_per_step,
        }

    def load_state_dict(self, state: Mapping[str, int]) -> None:
        """Resume at ``state``'s position. The seed and the dataset size must match (ValueError
        saying what changed and the ways on)."""
        where = f"epoch {state.get('epoch')}, row {state.get('index')}"
        if "num_rows" in state and int(state["num_rows"]) != len(self.dataset):
            raise ValueError(
                f"cannot resume: the checkpoint's run drew its prompts from {state['num_rows']} rows, this run's train "
                f"dataset has {len(self.dataset)} (after filters); the data position ({where} "
                "of a seeded order of those rows) means nothing for other rows. Resume with the same dataset (the same "
                "file, split, filters and prompt settings; from a streamed IterableDataset the run reads the rows its "
                "max_steps needs, so the checkpoint's max_steps), or start a new run from the checkpoint's weights: "
                "init_adapter=<checkpoint>/policy (the optimizer state and step count start afresh)"
            )
        if "seed" in state and int(state["seed"]) != self.seed:
            raise ValueError(
                f"cannot resume: the checkpoint's run ordered its prompts with seed={state['seed']}, this run has "
                f"seed={self.seed}, so the rest of the epoch ({where}) would repeat and skip prompts; resume with "
                f"seed={state['seed']}"
            )
        self._set_position(int(state["epoch"]), int(state["index"]))
