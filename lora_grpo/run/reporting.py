"""What a run reports, in one place: the progress bar, metrics.jsonl, completions.jsonl, the
experiment trackers and metrics.png.

The trainer makes one `RunReporter` and calls it; every method is a no-op on processes other than
the main one (except `log_step`, whose completion records are gathered from every process, so all
processes call it). Trackers go through accelerate's tracker API (`Accelerator(log_with=...)`,
`init_trackers`, `log`); TensorBoard, W&B and trackio are optional extras:

    pip install 'lora_grpo[tensorboard]'   # or [wandb], [trackio]

Nothing here may stop a run that trains well: a plot that fails is a warning. A tracker package
that is missing is an error, but at trainer start (`accelerator_kwargs`), before any work.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import math
import os
import sys
import warnings
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
from tqdm.auto import tqdm

from ..config import TRACKERS, ConfigError
from ..device import MiB
from . import checkpoint as ckpt
from .logs import read_log
from .plots import METRICS_FILE, PLOT_FILE, PlotInfo, plot_records

if TYPE_CHECKING:  # typing only: the trainer owns both
    from accelerate import Accelerator

    from ..config import GRPOConfig

# tracker → (importable modules, any one of which is enough; the pip extra that installs one)
TRACKER_PACKAGES: dict[str, tuple[tuple[str, ...], str]] = {
    "tensorboard": (("tensorboard", "tensorboardX"), "tensorboard"),  # accelerate writes with either
    "wandb": (("wandb",), "wandb"),
    "trackio": (("trackio",), "trackio"),
}
assert tuple(TRACKER_PACKAGES) == TRACKERS

COMPLETIONS_FILE = "completions.jsonl"


# ----------------------------------------------------------------------------- trackers
def plain(value: Any) -> Any:
    """`value` as JSON holds it, at any depth: NaN/inf as None (bare NaN is not JSON, and other tools refuse
    it), numpy and torch scalars as numbers, their arrays as lists (what a reward function's log_extra may
    give, and TRL's table takes), and anything else JSON has no type for as its str."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    if hasattr(value, "tolist"):  # numpy scalars and arrays, torch tensors
        return plain(value.tolist())
    return str(value)


def json_line(record: dict[str, Any]) -> str:
    """One JSON line of `record` made plain (NaN/inf as null, numpy values as numbers)."""
    return json.dumps(plain(record), allow_nan=False) + "\n"


def tracker_names(report_to: str | Sequence[str] | None) -> list[str]:
    """`report_to` as a list without 'none' and repeats: 'none' → [], 'wandb' → ['wandb']."""
    names = [report_to] if isinstance(report_to, str) else list(report_to or [])
    return [n for i, n in enumerate(names) if n != "none" and n not in names[:i]]


def require_tracker_packages(names: Iterable[str]) -> None:
    """Import each tracker's package; a missing one is a ConfigError naming the pip extra.

    accelerate itself only logs a debug line and drops a tracker whose package is missing, so a
    run would train for hours without the dashboard it was asked for.
    """
    names = list(names)
    for name in names:
        modules, extra = TRACKER_PACKAGES[name]
        errors = []
        for module in modules:
            try:
                importlib.import_module(module)
                break
            except ImportError as e:
                errors.append(e)
        else:
            raise ConfigError(
                f"report_to includes {name!r} but its package is not installed ({errors[0]}): "
                f"pip install 'lora_grpo[{extra}]', or remove {name!r} from report_to"
            )
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    for name in names:
        if name not in LOGGER_TYPE_TO_CLASS:
            import accelerate

            raise ConfigError(
                f"report_to includes {name!r} but accelerate {accelerate.__version__} has no {name} tracker: "
                "pip install -U accelerate"
            )


def logging_dir(config: GRPOConfig) -> Path:
    return Path(config.logging_dir) if config.logging_dir else Path(config.output_dir) / "runs"


def accelerator_kwargs(config: GRPOConfig) -> dict[str, Any]:
    """Keyword arguments of the trainer's `Accelerator` for `config.report_to` ({} for none).

    Checks the tracker packages first, so a missing one fails at trainer start.
    """
    names = tracker_names(config.report_to)
    if not names:
        return {}
    require_tracker_packages(names)
    from accelerate.utils import ProjectConfiguration

    project = ProjectConfiguration(project_dir=config.output_dir, logging_dir=str(logging_dir(config)))
    return {"log_with": names, "project_config": project}


def flat_config(config: GRPOConfig) -> dict[str, Any]:
    """The config as tracker hyperparameters: scalars as they are, lists and dicts as JSON text
    (TensorBoard's hparams take only numbers, strings and booleans)."""
    return {
        k: v if v is None or isinstance(v, (bool, int, float, str)) else json.dumps(v)
        for k, v in config.to_dict().items()
    }


def numbers_only(record: dict[str, Any]) -> dict[str, float]:
    """The numeric entries of a metrics record (strings such as sync/reason are left out)."""
    return {k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and k != "step"}


# ----------------------------------------------------------------------------- completions
def completion_records(
    step: int,
    prompts: Sequence[Any],
    completions: Sequence[Any],
    names: Sequence[str],
    per_func,
    rewards,
    advantages,
    synced: bool,
    extra: dict[str, Sequence] | None = None,
) -> list[dict[str, Any]]:
    """One JSON-ready record per completion: step, prompt, completion, each reward function's value
    (None where it returned None), the weighted reward, the advantage, whether the reference was
    synced after this step, and the columns reward functions logged (log_extra). per_func: (B, F);
    rewards, advantages: (B,); extra: column → B values."""
    per_func = per_func.float().cpu().tolist()
    rewards = rewards.float().cpu().tolist()
    advantages = advantages.float().cpu().tolist()

    def clean(x: float) -> float | None:
        return None if math.isnan(x) else x

    records = []
    for i, (prompt, completion) in enumerate(zip(prompts, completions)):
        record = {"step": step, "prompt": prompt, "completion": completion}
        record.update({name: clean(v) for name, v in zip(names, per_func[i])})
        record.update({"reward": clean(rewards[i]), "advantage": advantages[i], "sync": synced})
        record.update({column: values[i] for column, values in (extra or {}).items() if i < len(values)})
        records.append(record)
    return records


def _cell(value: Any) -> Any:
    value = plain(value)
    return value if value is None or isinstance(value, (bool, int, float, str)) else json.dumps(value)


def table_of(records: list[dict[str, Any]]) -> tuple[list[str], list[list[Any]]]:
    """(columns, rows) of completion records for a tracker's table: chat messages as JSON text."""
    columns = list(records[0])
    return columns, [[_cell(r.get(c)) for c in columns] for r in records]


def _markdown_table(records: list[dict[str, Any]]) -> str:
    columns = list(records[0])

    def fmt(v):
        text = f"{v:.4g}" if isinstance(v, float) else str(_cell(v))
        return text.replace("|", "\\|").replace("\n", "<br>")

    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in columns) + " |" for r in records]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- lines and summary
def format_metrics(metrics: dict[str, Any]) -> str:
    """'k=v k=v' of the numeric entries, 4 significant digits."""
    return " ".join(f"{k}={v:.4g}" for k, v in metrics.items() if isinstance(v, (int, float)))


def progress_line(step: int, total_steps: int, m: dict[str, Any]) -> str:
    """The logging_steps line: step, reward ± std, KL, length, zero-std share, time; sync and eval if any."""
    parts = [f"step {step}/{total_steps}"]
    if "reward/mean" in m:  # a rollout's first step (later steps of the same rollout train on it again)
        parts += [f"reward {m['reward/mean']:.3f}±{m.get('reward/std', float('nan')):.3f}"]
    parts += [f"kl {m.get('kl', 0.0):.4f}"]
    if "completion_length/mean" in m:
        parts += [
            f"len {m['completion_length/mean']:.1f}",
            f"zero-std {m.get('frac_reward_zero_std', 0.0):.2f}",
        ]
    parts += [f"{m.get('time/step', 0.0):.1f}s"]
    if m.get("sync/event"):
        parts.append(f"sync({m['sync/reason']}, err {m['sync/truncation_error']:.1e})")
    if "eval/completion_length" in m:
        parts.append(format_metrics({k: v for k, v in m.items() if k.startswith("eval/")}))
    return " | ".join(parts)


def run_summary(
    history: Sequence[dict[str, Any]],
    *,
    steps: int,
    seconds: float,
    total_seconds: float,
    log_prob_check: float | None,
    micro_batch_size,
    gradient_checkpointing,
    memory_plan,
    headline: str,
    before: dict,
    after: dict,
) -> dict[str, Any]:
    """summary.json: the reward curve's first and last tenth, syncs, the sizes in use, the memory
    plan and the eval before / after (`headline`: the eval metric of the first reward function)."""
    rewards = [m["reward/mean"] for m in history if "reward/mean" in m]
    k = max(1, len(rewards) // 10)
    summary: dict[str, Any] = {
        "steps": steps,
        "seconds": round(seconds, 2),  # train() itself
        "total_seconds": round(total_seconds, 2),  # plus model load (and toy pretraining)
        # the reward curve's start and end: means over its first and last tenth
        "reward_first": float(np.mean(rewards[:k])) if rewards else None,
        "reward_last": float(np.mean(rewards[-k:])) if rewards else None,
        "syncs": sum(1 for m in history if m.get("sync/event")),
        "log_prob_check_max_diff": log_prob_check,  # chunked log-probs vs the model's logits, at start
        "micro_batch_size": micro_batch_size,  # 'auto' resolved
        "gradient_checkpointing": gradient_checkpointing,
    }
    if memory_plan is not None:
        plan = memory_plan
        summary["memory"] = {
            "peak_mib": round(plan.need / MiB, 1),
            "budget_mib": round(plan.budget / MiB, 1),
            "rollout_mib": round(plan.rollout / MiB, 1),
            "probe_seconds": round(plan.seconds, 2),
            "probe": plan.probe,
        }
    if before or after:
        summary["accuracy_before"] = before.get(headline)
        summary["accuracy_after"] = after.get(headline)
        # KL per token of the policy to the model the run started from (0 before a fresh run)
        summary["kl_to_base_before"] = before.get("eval/kl_to_base")
        summary["kl_to_base_after"] = after.get("eval/kl_to_base")
        summary["eval_before"], summary["eval_after"] = before, after
    return summary


# ----------------------------------------------------------------------------- the reporter
def _eval_record_at(step: int) -> Callable[[dict], bool]:
    """Whether a metrics record is an eval's alone (no training step's metrics) at `step`."""
    return lambda record: record["step"] == step and all(k == "step" or k.startswith("eval/") for k in record)


class RunReporter:
    """Progress bar + metrics.jsonl + completions.jsonl + trackers + metrics.png for one run.

    Lifecycle, as the trainer calls it:

        reporter.start(step, resumed)         # logs truncated (resume) or removed, trackers started
        with reporter.progress(step):         # the bar
            ... reporter.log_step(step, metrics, samples)   # every step
        reporter.log(record); reporter.plot() # eval records; at checkpoints
        reporter.finish()                     # plot, trackers closed
    """

    def __init__(
        self, config: GRPOConfig, accelerator: Accelerator, reward_names: Sequence[str], total_steps: int
    ):
        self.config = config
        self.accelerator = accelerator
        self.reward_names = list(reward_names)
        self.total_steps = total_steps
        self.is_main = accelerator.is_main_process
        self.output_dir = Path(config.output_dir)
        self.trackers = tracker_names(config.report_to)
        # called with (step, records) where completions.jsonl gets them (main process)
        self.completion_listeners: list[Callable[[int, list[dict[str, Any]]], None]] = []
        self.bar = None
        self._started = False
        self._plotted_records = -1

    @property
    def metrics_path(self) -> Path:
        return self.output_dir / METRICS_FILE

    @property
    def completions_path(self) -> Path:
        return self.output_dir / COMPLETIONS_FILE

    # ------------------------------------------------------------------ run start / end
    def start(
        self,
        step: int,
        resumed: bool,
        history: Sequence[dict[str, Any]] = (),
        eval_before: dict | None = None,
        end_again: bool = False,
        step_end_again: bool = False,
    ) -> None:
        """Before the first record: a resumed run drops records after `step` (it logs those steps
        again), a fresh one starts fresh logs; the trackers start with the config. A run resumed where
        its metrics.jsonl is not (from a checkpoint copied elsewhere) writes its steps' records first, from
        the checkpoint's `history` (one record a step) after its `eval_before` (step 0), so the log and the
        plot hold the whole run. end_again: the run's end (its eval after training) runs again, so the eval
        record an earlier try logged at the last step is dropped. step_end_again: the end of the step `step`
        failed and runs again, so its metrics records are dropped too (its completions stay: the rollout is not
        sampled again, and the resumed step end has none to log)."""
        if not self.is_main:
            return
        for path in (self.metrics_path, self.completions_path):
            if resumed:
                logged = step - 1 if step_end_again and path == self.metrics_path else step
                ckpt.truncate_log(path, logged, _eval_record_at(step) if end_again else None)
            else:
                path.unlink(missing_ok=True)
        if resumed and history and not self.metrics_path.exists():
            with self.metrics_path.open("w") as f:
                if eval_before:
                    f.write(json_line({"step": 0, **eval_before}))
                f.writelines(json_line({"step": i, **record}) for i, record in enumerate(history[:step], 1))
        if self.trackers:
            self._end_trackers()  # a second train() on the same trainer
            cfg = self.config
            run_name = cfg.run_name or self.output_dir.resolve().name
            init_kwargs: dict[str, dict[str, Any]] = {
                "wandb": {"name": run_name},
                "trackio": {"name": run_name},
                # A resumed run hides the events it logs again (TensorBoard's purge_step).
                "tensorboard": {"purge_step": step + 1} if step else {},
            }
            if "WANDB_DIR" not in os.environ and "wandb" in self.trackers:
                wandb_dir = logging_dir(cfg)
                wandb_dir.mkdir(parents=True, exist_ok=True)
                init_kwargs["wandb"]["dir"] = str(wandb_dir)
            self.accelerator.init_trackers(cfg.project, config=flat_config(cfg), init_kwargs=init_kwargs)
            self._started = True

    def finish(self) -> None:
        """The final plot; trackers closed. (Not accelerator.end_training(): that also destroys the
        process group, which the caller may still need after train().)"""
        if self.is_main:
            self.plot()
            self._end_trackers()

    def _end_trackers(self) -> None:
        if self._started:
            for tracker in self.accelerator.trackers:
                tracker.finish()
            self.accelerator.trackers = []
            self._started = False

    @contextlib.contextmanager
    def progress(self, step: int):
        """The bar over the run's steps, on the main process. Shown also when stderr is not a
        terminal (a log file gets its updates), as transformers' Trainer does; disable_tqdm turns it
        off. If training raises (a stop signal, NaNs), the plot is written and the trackers closed."""
        self.bar = tqdm(
            total=self.total_steps,
            initial=step,
            desc="train",
            unit="step",
            dynamic_ncols=True,
            disable=self.config.disable_tqdm or not self.is_main,
            file=sys.stderr,
        )
        try:
            yield self.bar
        except BaseException:
            if self.is_main:
                self.bar.close()
                self.finish()
            raise
        finally:
            self.bar.close()
            self.bar = None

    # ------------------------------------------------------------------ per step
    def log(self, record: dict[str, Any]) -> None:
        """Append one record ({"step": ..., **metrics}) to metrics.jsonl and send its numbers to
        the trackers (main process only)."""
        if not self.is_main:
            return
        with self.metrics_path.open("a") as f:
            f.write(json_line(record))
        if self._started:
            self.accelerator.log(numbers_only(record), step=record["step"])

    def _completions_due(self, step: int) -> bool:
        """Whether the rollout that begins at optimizer step `step` logs its completions: one of the steps it
        trains (steps_per_generation × num_iterations of them) is a multiple of log_completions_steps. A rollout
        has completions at its first step only, so a multiple that fell on a later one logged nothing."""
        cfg = self.config
        last = step + cfg.steps_per_generation * cfg.num_iterations - 1
        return last // cfg.log_completions_steps > (step - 1) // cfg.log_completions_steps

    def log_step(
        self, step: int, metrics: dict[str, Any], samples: tuple | None = None, show: bool = False
    ) -> None:
        """A training step's record, its completions when due, and the bar. Call on every process.

        samples: (prompts (B,), completions (B,), per_func (B, F), rewards (B,), advantages (B,),
        log_extra's columns) of this process, as scorer.RolloutScorer keeps them, on the first step of a
        rollout; None skips the completions. show: a logging step (num_completions_to_print are printed)."""
        self.log({"step": step, **metrics})
        cfg = self.config
        if samples is not None and show and cfg.num_completions_to_print:
            self.print_samples(step, samples, cfg.num_completions_to_print)
        if cfg.log_completions and samples is not None and self._completions_due(step):
            prompts, completions, per_func, rewards, advantages, extra = samples
            records = completion_records(
                step,
                prompts,
                completions,
                self.reward_names,
                per_func,
                rewards,
                advantages,
                synced=bool(metrics.get("sync/event")),
                extra=extra,
            )
            if self.accelerator.num_processes > 1:
                from accelerate.utils import gather_object

                records = gather_object(records)  # a collective: every process is here
            self.log_completions(step, records)
        if self.bar is not None:
            self._reward = metrics.get("reward/mean", getattr(self, "_reward", float("nan")))  # the rollout's
            self.bar.set_postfix(
                {  # a dict keeps this order (keyword arguments get sorted)
                    "reward": f"{self._reward:.3f}",
                    "kl": f"{metrics.get('kl', 0.0):.3g}",
                    "step_time": f"{metrics.get('time/step', 0.0):.1f}s",
                },
                refresh=False,
            )
            self.bar.update(1)

    def print_samples(self, step: int, samples: tuple, n: int) -> None:
        """The first n completions of the step with their rewards, through the bar (main process)."""
        prompts, completions, per_func, rewards, advantages, _ = samples
        for i in range(min(n, len(completions))):
            scores = " ".join(f"{name}={v:.3g}" for name, v in zip(self.reward_names, per_func[i].tolist()))
            self.print(
                f"  step {step} sample {i}: {str(prompts[i])[-60:]!r} → {str(completions[i])[:120]!r} | {scores} "
                f"| reward {float(rewards[i]):.3g} advantage {float(advantages[i]):.3g}"
            )

    def log_completions(self, step: int, records: list[dict[str, Any]]) -> None:
        """Append the records to completions.jsonl (the whole history) and send them as a table to
        the trackers that take tables (wandb, trackio; TensorBoard gets a markdown text)."""
        if not self.is_main or not records:
            return
        with self.completions_path.open("a") as f:
            f.writelines(json_line(r) for r in records)
        for listener in self.completion_listeners:  # the TRL front door's trackers
            listener(step, records)
        if not self._started:
            return
        columns, rows = table_of(records)
        for name in self.trackers:
            tracker = self.accelerator.get_tracker(name)
            if name == "wandb":
                import wandb

                tracker.log({"completions": wandb.Table(columns=columns, data=rows)}, step=step)
            elif name == "trackio" and hasattr(trackio := importlib.import_module("trackio"), "Table"):
                tracker.log({"completions": trackio.Table(columns=columns, data=rows)}, step=step)
            elif name == "tensorboard":
                tracker.log({"completions": _markdown_table(records)}, step=step)

    def print(self, text: str) -> None:
        """A line on stdout that does not break the bar (main process only)."""
        if self.is_main:
            tqdm.write(text, file=sys.stdout)
            sys.stdout.flush()

    # ------------------------------------------------------------------ plot
    def plot(self) -> PlotInfo | None:
        """metrics.png from metrics.jsonl (main process; skipped when nothing new was logged). A
        failure is a warning: a plot never stops a run."""
        if not self.is_main or not self.metrics_path.exists():
            return None
        try:
            # its complete records (truncate_log named any other line when the run resumed)
            records = read_log(self.metrics_path).records
            if len(records) == self._plotted_records:
                return None
            info = plot_records(records, self.output_dir / PLOT_FILE)
            self._plotted_records = len(records)
            return info
        except Exception as e:  # noqa: BLE001 - any failure of the plot is only a warning
            warnings.warn(
                f"could not plot {self.output_dir / PLOT_FILE}: {type(e).__name__}: {e}", stacklevel=2
            )
            return None
