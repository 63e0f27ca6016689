"""Training health: warnings, not stops, when a run's learning signal is gone or its numbers turn.

A run that trains for hours can go on long after it stopped learning. `HealthMonitor` reads each
step's metrics (the dict the trainer logs: ``frac_reward_zero_std``, ``truncated_fraction``,
``kl``, ``entropy``, ``completion_length/mean``, ``reward/mean``, ``rewards/<name>/mean``) and

- returns the warnings to print, each once, at the step where its condition starts (again only
  after the condition was off for ``rearm_steps`` steps in a row, so a flickering one does not
  repeat itself);
- writes a flag per condition into the metrics (``health/<condition>``: 1.0 on the steps where it
  holds, else 0.0), so metrics.jsonl keeps the record.

    condition                 holds when
    no_signal                 every group's rewards are equal (frac_reward_zero_std = 1) for
                              ``zero_std_steps`` steps in a row: every advantage is 0
    all_truncated             every completion hit max_completion_length without EOS
    kl_spike                  kl > ``kl_jump`` × the highest of the previous ``kl_window`` steps
                              (at least ``kl_floor``): a jump, not the noise of a small batch; not
                              in the first ``kl_warmup_steps`` after the start or a sync, where a KL
                              that grows from ~0 is tenfold by construction
    entropy_collapse          entropy < ``entropy_ratio`` × its mean over the first ``baseline_steps``
    length_collapse           completion_length/mean < ``length_ratio`` × its first-steps mean
    reward_none/<name>        reward function <name> returned None for every completion

Each warning says what to look at: the completions log, the learning rate, beta, the reward. The
monitor's state (streaks, the recent KLs, the first steps' baselines, which warnings were given)
is `state_dict()` / `load_state_dict()`: kept in the trainer's TrainState, a resumed run neither
warns again nor forgets a streak.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

CONDITIONS = ("no_signal", "all_truncated", "kl_spike", "entropy_collapse", "length_collapse")


def _number(metrics: dict[str, Any], key: str) -> float | None:
    value = metrics.get(key)
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


@dataclass
class HealthMonitor:
    """Per-step health conditions of a run; see the module docstring. Thresholds are fixed at
    construction; everything else is state, saved by state_dict()."""

    zero_std_steps: int = 5  # steps in a row with no reward spread in any group before no_signal
    kl_jump: float = 10.0  # an order of magnitude in one step
    kl_floor: float = 1e-3  # a jump is measured from at least this KL (a KL near 0 after a sync is no base)
    kl_window: int = (
        5  # ... and from the highest KL of this many previous steps (one low step is no base either)
    )
    kl_warmup_steps: int = 5  # steps after the start and after each sync whose KL only sets the base
    baseline_steps: int = 3  # the first steps whose entropy and completion length are the baselines
    entropy_ratio: float = 0.1
    length_ratio: float = 0.2
    min_baseline_length: float = 4.0  # completions shorter than this from the start cannot collapse
    rearm_steps: int = 10  # a condition warns again only after this many steps off in a row
    # state
    zero_std_streak: int = 0
    recent_kl: list[float] = field(default_factory=list)  # the previous kl_window steps' KL
    kl_steps: int = 0  # steps with a KL since the start or the last sync
    entropy_start: list[float] = field(default_factory=list)  # the first baseline_steps values
    length_start: list[float] = field(default_factory=list)
    episodes: dict[str, list] = field(
        default_factory=dict
    )  # condition -> [warned in this episode, steps off]

    # ------------------------------------------------------------------ per step
    def observe(
        self, step: int, metrics: dict[str, Any], max_completion_length: int | None = None
    ) -> list[str]:
        """Read step `step`'s metrics, add the health/* flags to them, return the warnings that start now.
        max_completion_length: the run's, for the messages (the logged lengths count no tool reply)."""
        holds = {
            name: None for name in CONDITIONS
        }  # None: nothing to say this step (no metric); counts as off
        zero_std, truncated = _number(metrics, "frac_reward_zero_std"), _number(metrics, "truncated_fraction")
        if zero_std is not None:
            self.zero_std_streak = self.zero_std_streak + 1 if zero_std >= 1.0 else 0
            holds["no_signal"] = self.zero_std_streak >= self.zero_std_steps
        if truncated is not None:
            holds["all_truncated"] = truncated >= 1.0
        kl, previous_kl = _number(metrics, "kl"), max(self.recent_kl, default=None)
        if kl is not None:
            warm = self.kl_steps >= self.kl_warmup_steps
            holds["kl_spike"] = (
                warm and previous_kl is not None and kl > self.kl_jump * max(previous_kl, self.kl_floor)
            )
            self.recent_kl, self.kl_steps = [*self.recent_kl, kl][-self.kl_window :], self.kl_steps + 1
        # the next steps measure from the new reference: the KL starts again from ~0
        if metrics.get("sync/event"):
            self.recent_kl, self.kl_steps = [], 0
        holds["entropy_collapse"] = self._collapsed(
            self.entropy_start, _number(metrics, "entropy"), self.entropy_ratio, 0.0
        )
        holds["length_collapse"] = self._collapsed(
            self.length_start,
            _number(metrics, "completion_length/mean"),
            self.length_ratio,
            self.min_baseline_length,
        )
        for key in [k for k in metrics if k.startswith("rewards/") and k.endswith("/mean")]:
            value = metrics[key]
            holds[f"reward_none/{key[len('rewards/') : -len('/mean')]}"] = isinstance(
                value, float
            ) and math.isnan(value)

        warnings = []
        for name, on in holds.items():
            metrics[f"health/{name}"] = float(bool(on))
            episode = self.episodes.setdefault(name, [False, 0])
            if on:
                if not episode[0]:
                    warnings.append(
                        f"step {step}: "
                        + self._message(
                            name, metrics, previous_kl if name == "kl_spike" else None, max_completion_length
                        )
                    )
                episode[0], episode[1] = True, 0
            else:
                episode[1] += 1
                if episode[1] >= self.rearm_steps:
                    episode[0] = False
        metrics["health/zero_std_streak"] = float(self.zero_std_streak)
        return warnings

    def _collapsed(
        self, start: list[float], value: float | None, ratio: float, minimum: float
    ) -> bool | None:
        """Whether `value` fell under `ratio` × the mean of the first values (collected into `start`)."""
        if value is None:
            return None
        if len(start) < self.baseline_steps:
            start.append(value)
            return False
        baseline = sum(start) / len(start)
        return baseline > minimum and value < ratio * baseline

    # ------------------------------------------------------------------ messages
    def _message(
        self, name: str, m: dict[str, Any], previous_kl: float | None, max_completion_length: int | None
    ) -> str:
        reward = _number(m, "reward/mean")
        parts = ", ".join(
            f"{k[len('rewards/') : -len('/mean')]} {v:.3g}"
            for k, v in m.items()
            if k.startswith("rewards/") and k.endswith("/mean") and isinstance(v, (int, float))
        )
        if name == "no_signal":
            return (
                f"every group's rewards have been equal for {self.zero_std_streak} steps in a row "
                f"(frac_reward_zero_std = 1; reward/mean {reward if reward is None else f'{reward:.3g}'}"
                f"{f': {parts}' if parts else ''}): every advantage is 0, so the policy gets no learning signal. "
                "All right: the prompts are too easy for the policy (or it has learnt them: stop here); all wrong: "
                "too hard, or the reward never pays. Look at the completions log (log_completions: true writes "
                "completions.jsonl) and the reward; use prompts of the right difficulty, a reward with partial "
                "credit, or more num_generations"
            )
        if name == "all_truncated":
            longest = max_completion_length or _number(m, "completion_length/max")
            return (
                f"every completion hit max_completion_length ({longest if longest is None else int(longest)} tokens) "
                "without ending: the rewards read cut-off text. Look at the completions log (does the model ever "
                "stop? is its EOS the tokenizer's eos_token / generation_config.eos_token_id?); raise "
                "max_completion_length, penalise overlong answers (the soft_overlong reward), or leave them out "
                "of the loss (mask_truncated_completions: true)"
            )
        if name == "kl_spike":
            base = max(previous_kl or 0.0, self.kl_floor)
            return (
                f"the KL to the reference jumped to {m['kl']:.3g} in one step, from at most {previous_kl:.3g} over the "
                f"steps before (×{m['kl'] / base:.0f}): one update moved the policy far. Look at the "
                "learning rate (lower it, or "
                "warm up), beta (a larger one holds the policy nearer the reference), max_grad_norm, and this "
                "step's completions in the completions log (a reward exploit?)"
            )
        if name == "entropy_collapse":
            baseline = sum(self.entropy_start) / len(self.entropy_start)
            return (
                f"the entropy fell to {m['entropy']:.3g} nats/token, under {self.entropy_ratio:g} × its {baseline:.3g} "
                f"over the first {len(self.entropy_start)} steps: the policy samples nearly the same completion each "
                "time, so groups agree and the learning signal fades. Look at the completions log (one answer "
                "repeated?), the learning rate, beta and the temperature; with the reward at its best this is "
                "convergence"
            )
        if name == "length_collapse":
            baseline = sum(self.length_start) / len(self.length_start)
            return (
                f"completions shrank to {m['completion_length/mean']:.3g} tokens on average, under "
                f"{self.length_ratio:g} × the {baseline:.3g} of the first {len(self.length_start)} steps. Look at the "
                "completions log (empty or one-word answers that a reward still pays?), the length rewards and "
                "their weights (reward_weights), and the learning rate"
            )
        function = name.split("/", 1)[1]
        return (
            f"reward function {function!r} returned None for every completion (it applied to none of them), so it "
            "added nothing to the rewards. Look at the completions log and the dataset column it reads (an answer "
            "it cannot parse?); None means 'does not apply' (lora_grpo.rewards)"
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict[str, Any]:
        """The monitor's state, JSON-ready (thresholds are not state: they come from construction)."""
        return {
            "zero_std_streak": self.zero_std_streak,
            "recent_kl": list(self.recent_kl),
            "kl_steps": self.kl_steps,
            "entropy_start": list(self.entropy_start),
            "length_start": list(self.length_start),
            "episodes": {k: list(v) for k, v in self.episodes.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.zero_std_streak = int(state.get("zero_std_streak", 0))
        self.recent_kl = [float(x) for x in state.get("recent_kl", [])]
        self.kl_steps = int(state.get("kl_steps", len(self.recent_kl)))
        self.entropy_start = [float(x) for x in state.get("entropy_start", [])]
        self.length_start = [float(x) for x in state.get("length_start", [])]
        self.episodes = {k: [bool(v[0]), int(v[1])] for k, v in state.get("episodes", {}).items()}
