"""metrics.png: a run's metrics over steps, one panel per group, reference syncs as dashed lines.

Every run writes it at each checkpoint and at the end (reporting.RunReporter.plot); `lora-grpo plot`
draws it again from metrics.jsonl (its complete records: a line cut short by a killed run is skipped and
named). matplotlib's object API only: no pyplot, no global state.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .logs import read_log

logger = logging.getLogger(__name__)

METRICS_FILE = "metrics.jsonl"
PLOT_FILE = "metrics.png"


PANELS: tuple[tuple[str, Any], ...] = (
    # (title, which metrics: a predicate on the key)
    ("reward", lambda k: k == "reward/mean" or (k.startswith("rewards/") and k.endswith("/mean"))),
    ("eval", lambda k: k.startswith("eval/") and k not in ("eval/completion_length", "eval/kl_to_base")),
    ("KL to reference", lambda k: k == "kl"),
    ("KL to base", lambda k: k == "eval/kl_to_base"),  # never reset by a sync, unlike the one above
    ("completion length", lambda k: k == "completion_length/mean"),
    ("entropy", lambda k: k == "entropy"),
)


@dataclass
class PlotInfo:
    """What a plot drew: its file, each panel's metrics, the steps marked as reference syncs, and the lines of
    metrics.jsonl it skipped ("line 7 (...)": no complete record)."""

    path: Path | None
    panels: dict[str, list[str]] = field(default_factory=dict)
    sync_steps: list[int] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)


def metrics_figure(records: list[dict[str, Any]], keys: Sequence[str] | None = None):
    """(matplotlib Figure, PlotInfo) of a run's metrics records: reward (total and per function),
    eval metrics, KL to the reference, KL to the base (eval), completion length and entropy over steps
    (or one panel per key of `keys`), with a vertical line at each reference sync. Panels without data are left out."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend
    from matplotlib.ticker import MaxNLocator

    present = list(dict.fromkeys(k for r in records for k in r if isinstance(r.get(k), (int, float))))
    if keys:
        panels = {key: [key] for key in keys}
    else:
        panels = {
            title: sorted((k for k in present if wanted(k)), key=lambda k: k != "reward/mean")
            for title, wanted in PANELS
        }
    panels = {t: ks for t, ks in panels.items() if any(k in present for k in ks)}
    if not panels:
        raise ValueError(
            f"no metrics to plot among {len(records)} records" + (f" for keys {list(keys)}" if keys else "")
        )
    syncs = [r["step"] for r in records if r.get("sync/event")]
    fig = Figure(figsize=(7.5, 2.3 * len(panels)))
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    for ax, (title, ks) in zip(axes, panels.items()):
        for key in ks:
            points = [(r["step"], r[key]) for r in records if isinstance(r.get(key), (int, float))]
            sparse = key.startswith("eval/") or len(points) < 3
            total = key == "reward/mean" and len(ks) > 1  # the weighted sum, over its parts
            ax.plot(
                *zip(*points),
                marker="o" if sparse else None,
                ms=3,
                label=key,
                **({"color": "black", "lw": 1.8} if total else {"lw": 1.1}),
            )
        for i, s in enumerate(syncs):
            ax.axvline(
                s, color="gray", alpha=0.4, lw=0.8, ls="--", label="reference sync" if i == 0 else None
            )
        ax.set_ylabel(title)
        ax.grid(alpha=0.2)
        if len(ks) > 1 or (syncs and ax is axes[0]):
            ax.legend(fontsize=7, loc="best")
    axes[-1].set_xlabel("step" + (" (dashed: reference syncs)" if syncs else ""))
    axes[-1].xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    return fig, PlotInfo(None, panels, syncs)


def plot_run(
    run_dir: str | Path, out: str | Path | None = None, keys: Sequence[str] | None = None
) -> PlotInfo:
    """Plot RUN_DIR/metrics.jsonl to `out` (default RUN_DIR/metrics.png); written atomically. Lines that hold
    no complete record (a run killed while writing one) are skipped with a warning naming the file and the lines
    (PlotInfo.skipped); a file with no complete record at all is a ValueError naming them."""
    run_dir = Path(run_dir)
    source = run_dir / METRICS_FILE
    if not source.exists():
        raise FileNotFoundError(f"{source} does not exist: give the output_dir of a run")
    log = read_log(source)
    if not log.records:
        raise ValueError(
            f"{source} holds no complete record ({log.skipped_note() or 'it is empty'}), so there is nothing to "
            "plot. Plot it once the run has logged a step, or give the run directory whose metrics.jsonl holds its "
            "records"
        )
    if log.skipped:
        logger.warning(
            "%s: %s; plotted the %d complete records", source, log.skipped_note(), len(log.records)
        )
    info = plot_records(log.records, Path(out) if out else run_dir / PLOT_FILE, keys)
    info.skipped = log.skipped
    return info


def plot_records(records: list[dict[str, Any]], out: Path, keys: Sequence[str] | None = None) -> PlotInfo:
    """metrics_figure of the records, saved to `out` atomically."""
    fig, info = metrics_figure(records, keys)
    tmp = out.with_name(f".{out.stem}.tmp{out.suffix}")
    try:
        fig.savefig(tmp, dpi=110)
        os.replace(tmp, out)  # a reader never sees half a PNG
    finally:
        tmp.unlink(missing_ok=True)  # a failed write (disk full) leaves nothing behind
    info.path = out
    return info
