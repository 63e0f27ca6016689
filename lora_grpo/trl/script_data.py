"""The data a TRL GRPO recipe names, loaded as TRL 1.16's GRPO script loads it (`lora-grpo trl`).

Either one dataset (`dataset_name`, `dataset_config`: datasets.load_dataset, or a local data file read by
its extension), or a mixture (TRL's DatasetMixtureConfig, `datasets:` in the YAML or `--datasets` on the
command line): each entry is a load_dataset call (path, name, data_dir, data_files, split), its columns
selected, optionally trimmed to a share of the mix (`fraction`), then concatenated, optionally split into
train and test (`test_split_size`). Both given: the mixture, with TRL's warning. The script then takes
`dataset_train_split` and `dataset_test_split` from what was loaded, as TRL's does.

Where this differs from TRL (docs/guides/from-trl.md): the mixture's test split is drawn with the run's
seed (TRL's draws fresh entropy, a different split each run); streaming is refused (lora_grpo draws prompts
from a map-style dataset); a wrong key, split or column is a ConfigError that starts with TRL's sentence
where TRL has one and names the fix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from ..config import ConfigError
from ..config_checks import did_you_mean
from ..data.files import FILE_BUILDERS

logger = logging.getLogger(__name__)


@dataclass
class DatasetMixtureConfig:
    """TRL's DatasetMixtureConfig (TRL 1.16 names and defaults), the fourth group of a TRL recipe's keys."""

    datasets: list[str] = field(
        default_factory=list,
        metadata={
            "help": "datasets to mix: in the YAML a list of mappings (path, name, data_dir, data_files, split, "
            "columns, fraction); on the command line, paths"
        },
    )
    streaming: bool = field(
        default=False,
        metadata={"help": "stream the datasets (refused: lora_grpo shuffles a map-style dataset)"},
    )
    test_split_size: float | None = field(
        default=None, metadata={"help": "share (or count) of the mixture held out as the 'test' split"}
    )


# TRL's DatasetConfig: datasets.load_dataset's arguments, plus the columns to keep and the share of the mix
ENTRY_DEFAULTS = {
    "path": None,
    "name": None,
    "data_dir": None,
    "data_files": None,
    "split": "train",
    "columns": None,
    "fraction": None,
}


def mixture_entries(mixture: DatasetMixtureConfig) -> list[dict]:
    """The mixture's entries, each with every DatasetConfig key (a bare string is a path, as TRL's
    `--datasets a b` reads), or a ConfigError that starts with TRL's sentence where TRL has one."""
    if not isinstance(mixture.datasets, list):
        raise ConfigError(
            f"datasets: {mixture.datasets!r} is not a list: write one `- path: ...` item per dataset under "
            "`datasets:`"
        )
    entries = []
    for at, entry in enumerate(mixture.datasets):
        entry = {"path": entry} if isinstance(entry, str) else entry
        if not isinstance(entry, dict):
            raise ConfigError(
                f"datasets[{at}]: {entry!r} is neither a mapping nor a path: write `- path: NAME` (and name, "
                "data_dir, data_files, split, columns, fraction as needed)"
            )
        for key in entry:
            if key not in ENTRY_DEFAULTS:
                raise ConfigError(
                    f"DatasetConfig.__init__() got an unexpected keyword argument '{key}'. datasets[{at}]: "
                    f"{key!r}{did_you_mean(key, ENTRY_DEFAULTS)} is not one of {list(ENTRY_DEFAULTS)}"
                )
        if entry.get("path") is None:
            raise ConfigError(
                "DatasetConfig.__init__() missing 1 required positional argument: 'path'. "
                f"datasets[{at}]: give the dataset's hub name, a data file or a directory as `path:`"
            )
        entries.append({**ENTRY_DEFAULTS, **entry})
    _check_fractions([entry["fraction"] for entry in entries])
    return entries


def streaming_refused(flag: str) -> ConfigError:
    """The error for a streaming flag (`streaming` of a mixture, `dataset_streaming` of dataset_name)."""
    return ConfigError(
        f"{flag}: lora_grpo draws prompts from a map-style dataset (shuffled, resumable): remove it"
    )


def get_dataset(mixture_config: DatasetMixtureConfig, seed: int = 42):
    """TRL's get_dataset: the mixture's datasets loaded, mixed and, with test_split_size, split into "train" and
    "test", a DatasetDict. The split is drawn with `seed` (transformers' default seed): the same every run (TRL's
    draws another each run)."""
    if mixture_config.streaming:
        raise streaming_refused("streaming")
    if not mixture_config.datasets:
        raise ConfigError("No datasets were loaded from the mixture configuration: list them in `datasets`")
    return load_mixture(mixture_entries(mixture_config), mixture_config.test_split_size, seed)


def script_dataset(script, mixture: DatasetMixtureConfig, seed: int):
    """What TRL's GRPO script loads for these arguments: the mixture when it lists datasets (with TRL's warning
    when dataset_name is given too), else dataset_name; a DatasetDict, the splits named by the script's
    dataset_train_split and dataset_test_split taken from it (`dataset_split`)."""
    # the streaming flag of the data that is loaded (TRL ignores the other)
    flag, streaming = (
        ("streaming", mixture.streaming)
        if mixture.datasets
        else ("dataset_streaming", script.dataset_streaming)
    )
    if streaming:
        raise streaming_refused(flag)
    if mixture.datasets:
        if script.dataset_name:
            logger.warning(
                "Both `datasets` and `dataset_name` are provided. The `datasets` argument will be used to load the "
                "dataset and `dataset_name` will be ignored."
            )
        return get_dataset(mixture, seed)
    if script.dataset_name:
        return load_one(script.dataset_name, script.dataset_config)
    raise ConfigError(
        "Either `datasets` or `dataset_name` must be provided. Give dataset_name (a hub name, a data file or a "
        "directory of split files), or a `datasets:` list to mix several"
    )


def load_one(name: str, config_name: str | None):
    """dataset_name as TRL's script loads it (datasets.load_dataset), and a local data file as datasets reads
    one: its builder by extension, the file as the "train" split."""
    from datasets import DatasetDict, load_dataset

    from ..data.files import load_data_file

    path = Path(name)
    if path.is_file():
        _builder(path, f"dataset_name={name!r}")
        # read as lora-grpo train reads one: a malformed or empty file is named at its line, not a traceback
        return DatasetDict({"train": load_data_file(path)})
    return load_dataset(name, name=config_name)


def _builder(path: Path, what: str) -> str:
    if path.suffix.lower() not in FILE_BUILDERS:
        raise ConfigError(
            f"{what}: a local file must be one of {sorted(FILE_BUILDERS)} (or a directory or hub name that "
            "datasets.load_dataset reads)"
        )
    return FILE_BUILDERS[path.suffix.lower()]


def load_mixture(entries: list[dict], test_split_size: float | None, seed: int):
    """TRL's get_dataset: each entry loaded and its columns selected; with fractions, the first
    round(share × N) rows of each, N the largest mixture that repeats no row; concatenated; split into
    "train" and "test" when test_split_size is set (with `seed`: the same split every run)."""
    from datasets import DatasetDict, concatenate_datasets

    parts = [_load_entry(at, entry) for at, entry in enumerate(entries)]
    fractions = [entry["fraction"] for entry in entries]
    if any(f is not None for f in fractions):
        parts = _by_fraction(parts, fractions)
    try:
        mixed = concatenate_datasets(parts)
    except ValueError as e:
        columns = "; ".join(f"datasets[{at}]: {part.column_names}" for at, part in enumerate(parts))
        raise ConfigError(
            f"the datasets do not mix ({e}): their columns are {columns}. A column must have one type in every "
            "dataset: convert it in the data, or leave it out with the entry's `columns:`"
        ) from e
    if test_split_size is None:
        return DatasetDict({"train": mixed})
    try:
        return mixed.train_test_split(test_size=test_split_size, seed=seed)
    except ValueError as e:
        raise ConfigError(
            f"test_split_size={test_split_size!r}: {e}. Give a share in (0, 1) or a row count below the "
            f"mixture's {len(mixed)} rows"
        ) from e


def _load_entry(at: int, entry: dict):
    from datasets import load_dataset

    from ..data.files import LOAD_FAILURES, load_problem

    path = Path(entry["path"])
    where = f"datasets[{at}] (path {entry['path']!r})"
    try:
        if path.is_file():
            # the file is the "train" split, as a data file given as dataset_name is; `split` may slice it
            dataset = load_dataset(
                _builder(path, where), data_files={"train": str(path)}, split=entry["split"]
            )
        else:
            dataset = load_dataset(
                path=entry["path"],
                name=entry["name"],
                data_dir=entry["data_dir"],
                data_files=entry["data_files"],
                split=entry["split"],
            )
    except FileNotFoundError as e:
        raise ConfigError(
            f"{where}: {e}: correct its `path:` (a hub name, a data file or a directory)"
        ) from e
    except LOAD_FAILURES as e:
        # a local file datasets' loader could not read: named at its line
        if path.is_file() and "split" not in str(e):
            raise ConfigError(f"{where}: cannot load {path}: {load_problem(path, e)}") from e
        if not isinstance(e, ValueError):
            raise
        # datasets: 'Unknown split "x". Should be one of [...]'
        fix = "set its `split:` to one of the splits named" if "split" in str(e) else "correct this entry"
        raise ConfigError(f"{where}: {e}: {fix}") from e
    if entry["columns"] is not None:
        wanted = [entry["columns"]] if isinstance(entry["columns"], str) else list(entry["columns"])
        missing = [c for c in wanted if c not in dataset.column_names]
        if missing:
            raise ConfigError(
                f"{where}: no column {missing[0]!r}{did_you_mean(missing[0], dataset.column_names)}; its columns "
                f"are {dataset.column_names}: correct `columns:`"
            )
        dataset = dataset.select_columns(wanted)
    return dataset


def _check_fractions(fractions: list) -> None:
    """TRL's rule: a share on every entry or on none (checked before anything loads); each ≥ 0, one > 0."""
    if all(f is None for f in fractions):
        return
    if any(f is None for f in fractions):
        raise ConfigError(
            "`fraction` must be set for either all datasets in the mixture or none of them. Fractions now: "
            f"{fractions}: give each entry one, or remove them all to concatenate the datasets whole"
        )
    numbers = all(isinstance(f, int | float) and not isinstance(f, bool) for f in fractions)
    if not numbers or any(f < 0 for f in fractions) or sum(fractions) <= 0:
        raise ConfigError(f"fraction: {fractions}: each share must be a number ≥ 0, and one > 0")


def _by_fraction(parts: list, fractions: list) -> list:
    weights = [f / sum(fractions) for f in fractions]
    total = min(len(part) / w for part, w in zip(parts, weights, strict=True) if w > 0)
    return [part.select(range(round(w * total))) for part, w in zip(parts, weights, strict=True)]


def dataset_split(dataset, script, field_name: str, mixed: bool):
    """The split `script.<field_name>` names, as TRL's script takes it (dataset[split]); a split the dataset does
    not have is a ConfigError naming the dataset, the split, the splits it has and the fix (TRL: KeyError)."""
    split = getattr(script, field_name)
    if split in dataset:
        return dataset[split]
    fixes = f"set {field_name} to one of them"
    if field_name == "dataset_test_split":
        where = (
            "set test_split_size to hold part of the mixture out for evaluation"
            if mixed
            else f"point dataset_name at a directory holding a file per split (train.jsonl and {split}.jsonl: "
            "datasets names the splits after the files)"
        )
        fixes += f", {where}, or set eval_strategy: no to train without evaluation"
    source = "the mixture (datasets:)" if mixed else f"dataset_name={script.dataset_name!r}"
    raise ConfigError(
        f"{source} has no split {split!r} ({field_name}); its splits are {list(dataset)}: {fixes}"
    )
