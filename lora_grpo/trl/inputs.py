"""The input forms TRL 1.16's GRPOTrainer takes, turned into what lora_grpo's trainer takes.

eval_dataset     a Dataset; an IterableDataset (read to its end, as transformers' evaluation loop reads
                 it: there is no eval_limit in TRL's config); a DatasetDict, IterableDatasetDict or a
                 plain dict of named sets (each evaluated and logged as eval_<name>_*)
environments     no train_dataset: the environment owns the data and its reset() supplies the prompt;
                 TRL's placeholder rows (an empty user message, one generation round's worth) drive
                 the loop for max_steps. A dataset without a `prompt` column (a dict of environments'
                 routing rows, whose only column may be `environment`): each row's prompt is that empty
                 user message, which its environment's reset() fills, as TRL defaults a missing prompt
"""

from __future__ import annotations

from collections.abc import Mapping

import datasets

from ..data.prompts import EMPTY_PROMPT


def read_whole(stream: datasets.IterableDataset) -> datasets.Dataset:
    """Every row of a stream, in order, as a map-style Dataset (what an evaluation loop over it reads)."""
    rows = list(stream)
    if not rows:
        raise ValueError("eval_dataset: the streamed IterableDataset yielded no rows")
    return datasets.Dataset.from_list(rows)


def eval_sets(eval_dataset):
    """A Dataset (or None) stays; a stream is read whole; a dict of sets (DatasetDict, IterableDatasetDict
    or a plain dict) becomes a plain dict {name: Dataset} in its order."""
    if eval_dataset is None:
        return None
    if isinstance(eval_dataset, Mapping):  # (an empty one is refused by data.resolve_eval_dataset)
        return {str(name): eval_sets(ds) for name, ds in eval_dataset.items()}
    if isinstance(eval_dataset, datasets.IterableDataset):
        return read_whole(eval_dataset)
    return eval_dataset


def placeholder_prompts(generation_batch_size: int, num_generations: int) -> datasets.Dataset:
    """TRL's rows for a run without train_dataset: one generation round's prompts, each an empty user
    message that the environment's reset() fills."""
    rows = generation_batch_size // num_generations
    return datasets.Dataset.from_dict({"prompt": [EMPTY_PROMPT] * rows})


def environment_prompts(dataset):
    """A dataset (or a dict of eval sets) for environments: rows without a `prompt` column get TRL's empty
    user message, which their environment's reset() fills; anything else is returned as it is."""
    if isinstance(dataset, Mapping):
        return {name: environment_prompts(ds) for name, ds in dataset.items()}
    if isinstance(dataset, datasets.Dataset) and "prompt" not in dataset.column_names:
        return dataset.add_column("prompt", [EMPTY_PROMPT] * len(dataset))
    if isinstance(dataset, datasets.IterableDataset):
        return dataset.map(lambda row: {} if "prompt" in row else {"prompt": EMPTY_PROMPT})
    return dataset
