"""Scoring a rollout: rewards (every reward function called by keyword) and group-relative advantages.

    rollout + the prompts' dataset rows ─► rewards.rollout_keywords (TRL's keywords) ─► compute_rewards:
        (B,) weighted rewards, (B, F) per function ─► multi_objective_advantages (B,) ─► the step's
        reward and completion metrics, over every process's groups

The reward functions are resolved and checked first (resolve_rewards: a wrong one fails before the
model loads); the scorer is built once the run's sizes exist. The reward functions see
`trainer_state`: the run's TrainState (transformers' TrainerState, as TRL passes it), or the TRL
front door's own; in a tool run, `environments`: the sampler's last rollout's instances.

A reward model (rewards.RewardModel) scores on the run's device, a loaded one (a hub id or path) in
the run's compute dtype, as TRL loads it with the policy's model_init_kwargs (place_reward_models);
its forwards take at most the run's `forward_rows` completions each (memory.sizes.RunSizes: the
micro_batch_size), and the memory plan measures its scoring forward at every candidate size
(probe_passes).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from .algo.advantages import multi_objective_advantages, reads_whole_batch, zero_std_fraction
from .batch import loss_mask
from .data.prompts import PROMPT_MESSAGES
from .rewards import (
    RewardModel,
    check_reward_weights,
    compute_rewards,
    resolve_reward_funcs,
    reward_metrics,
    reward_names,
    rollout_keywords,
)
from .rollout import tool_metrics, with_observation

Tensor = torch.Tensor


@dataclass
class Scored:
    """One rollout's rewards, B = prompts × G rows: what advantages, metrics and completions.jsonl read."""

    rewards: Tensor  # (B,) weighted sum over the functions (NaN where none scored the row)
    per_func: Tensor  # (B, F), NaN where a function returned None
    metrics: dict[str, float]  # compute_rewards' rewards/* and reward/* over these rows
    completions: list  # (B,) as the reward functions saw them
    extra: dict[str, list] = field(default_factory=dict)  # log_extra's columns, (B,) each
    logged: dict[str, list[float]] = field(default_factory=dict)  # log_metric's values

    @property
    def all_metrics(self) -> dict[str, float]:
        """The reward metrics with each log_metric name's mean."""
        return {**self.metrics, **{k: sum(v) / len(v) for k, v in self.logged.items()}}

    def rows(self, index: Tensor, names: list[str]) -> Scored:
        """The rows ``index`` (1-D long), in that order; the metrics recomputed over them (names: the
        reward functions')."""
        picked = index.tolist()
        rewards, per_func = self.rewards[index], self.per_func[index]
        return Scored(
            rewards,
            per_func,
            reward_metrics(rewards, per_func, names),
            [self.completions[i] for i in picked],
            {k: [v[i] for i in picked] for k, v in self.extra.items()},
            self.logged,
        )

    @staticmethod
    def concat(parts: list[Scored], names: list[str]) -> Scored:
        """Several rounds' rewards as one, rows in order; log_extra columns a round lacks are None there."""
        if len(parts) == 1:
            return parts[0]
        rewards, per_func = torch.cat([p.rewards for p in parts]), torch.cat([p.per_func for p in parts])
        columns = {k: None for p in parts for k in p.extra}
        extra = {k: [x for p in parts for x in p.extra.get(k, [None] * len(p.completions))] for k in columns}
        logged: dict[str, list[float]] = {}
        for p in parts:
            for k, v in p.logged.items():
                logged.setdefault(k, []).extend(v)
        return Scored(
            rewards,
            per_func,
            reward_metrics(rewards, per_func, names),
            [c for p in parts for c in p.completions],
            extra,
            logged,
        )


def resolve_rewards(config, reward_specs, *, environment: bool = False) -> list:
    """The run's reward functions from functions, built-in names or dotted paths
    (rewards.resolve_reward_funcs), checked against the config's reward_weights. With an environment
    (`environment`), none is fine here: its get_reward may be the reward (RolloutScorer's
    environment_rewards)."""
    funcs = resolve_reward_funcs(
        reward_specs, context={"max_completion_length": config.max_completion_length}
    )
    if not funcs and not environment:
        raise ValueError("no reward functions: pass reward_funcs=[...] or set reward_funcs in the config")
    check_reward_weights(config.reward_weights, len(funcs))
    return funcs


def reward_models(reward_funcs) -> list[RewardModel]:
    """The reward models among the functions; each remembers the batch_size its user asked for (the
    cap over the run's size)."""
    for fn in reward_funcs:
        if isinstance(fn, RewardModel) and not hasattr(fn, "requested_batch_size"):
            fn.requested_batch_size = fn.batch_size
    return [fn for fn in reward_funcs if isinstance(fn, RewardModel)]


def place_reward_models(reward_funcs, device: torch.device, dtype: torch.dtype) -> None:
    """Each reward model onto the run's device; one loaded from a path (not the caller's object) also into
    the run's compute dtype, in the same move (no float32 copy on the GPU first), unless its model_kwargs
    chose a dtype or it is quantized (bitsandbytes' models move, but refuse a cast)."""
    for fn in reward_models(reward_funcs):
        quantized = getattr(fn.model, "is_quantized", False) or getattr(fn.model, "quantization_method", None)
        cast = getattr(fn, "castable", False) and not quantized
        fn.model.to(device, **({"dtype": dtype} if cast else {}))


def probe_passes(reward_funcs) -> tuple[Callable[[int, tuple[int, int]], None], ...]:
    """For the memory plan: each reward model's scoring forward of m worst-case sequences of
    (prompt, completion) tokens (the policy tokenizer's count, capped at the reward model's
    context), no grad."""

    def probe(fn: RewardModel) -> Callable[[int, tuple[int, int]], None]:
        def run(m: int, tokens: tuple[int, int]) -> None:
            config = fn.model.config
            limit = getattr(config.get_text_config(), "max_position_embeddings", None) or sum(tokens)
            length = min(sum(tokens), limit)
            vocab = fn.model.get_input_embeddings().weight.shape[0]
            ids = (torch.arange(m * length, device=fn.model.device) % vocab).view(m, length)
            with torch.no_grad():
                fn.model.eval()(input_ids=ids, attention_mask=torch.ones_like(ids))

        return run

    return tuple(probe(fn) for fn in reward_models(reward_funcs))


class RolloutScorer:
    """The reward side of a step, built once: the functions, their names, the config's weights.

    reward_funcs: resolve_rewards' functions; environment_rewards: each environment class's
    get_reward, after them with weight 1 (as TRL adds them). trainer_state: what reward functions
    get as trainer_state. sizes: the run's sizes (memory.sizes.RunSizes), whose forward_rows caps a
    reward model's forwards; None: the reward model's own batch_size. sampler: the run's
    sampler.PolicySampler, whose last rollout's environments reward functions get (TRL's
    `environments` keyword); None: no environments."""

    def __init__(
        self,
        config,
        reward_funcs,
        accelerator,
        trainer_state=None,
        *,
        environment_rewards=(),
        sizes=None,
        sampler=None,
    ):
        self.config, self.accelerator = config, accelerator
        self.reward_funcs = [*reward_funcs, *environment_rewards]
        self.weights = (
            None
            if config.reward_weights is None
            else [*config.reward_weights, *(1.0 for _ in environment_rewards)]
        )
        self.names = reward_names(self.reward_funcs)
        self.trainer_state, self.sizes, self.sampler = trainer_state, sizes, sampler
        # the last scored training step's (prompts, completions, per_func, rewards, advantages)
        self.last_samples = None

    def score(self, rollout, rows: dict[str, list], group_size: int) -> Scored:
        """Every reward function on the rollout: the weighted rewards, the per-function table, their
        metrics. Reward functions may log_extra(column, values) and log_metric(name, value), as in
        TRL; the metrics get each logged name's mean."""
        prompts, completions, columns = rollout_keywords(
            rollout, rows, group_size, self.trainer_state, PROMPT_MESSAGES
        )
        # a tool run: a conversational completion is its turns and tool replies
        if rollout.messages is not None:
            completions = [
                m if isinstance(p, list) else c for p, c, m in zip(prompts, completions, rollout.messages)
            ]
        environments = None if self.sampler is None else self.sampler.environments
        if environments is not None:
            columns["environments"] = environments
            # each rollout's prompt as the model saw it: its environment's reset() text joins the messages (TRL)
            prompts = [
                with_observation(p, seen) if seen and isinstance(p, list) else p
                for p, seen in zip(prompts, self.sampler.observations, strict=True)
            ]
        extra, logged = {}, {}
        if self.sizes is not None:
            # a reward model's forwards are sized as the run's others
            size = self.sizes.forward_rows
            for fn in reward_models(self.reward_funcs):
                fn.batch_size = min(fn.requested_batch_size, size)
        columns["log_extra"] = lambda column, values: extra.setdefault(column, []).extend(values)
        columns["log_metric"] = lambda name, value: logged.setdefault(name, []).append(float(value))
        rewards, per_func, metrics = compute_rewards(
            self.reward_funcs,
            prompts,
            completions,
            columns,
            weights=self.weights,
            bisect_on_error=self.config.reward_bisect_on_error,
        )
        # completions as the reward functions saw them (completions.jsonl keeps the conversation)
        return Scored(rewards, per_func, metrics, completions, extra, logged)

    def rewards(self, rollout, rows: dict[str, list], group_size: int):
        """(rewards (B,), per-function (B, F) with NaN where a function returned None, metrics)."""
        scored = self.score(rollout, rows, group_size)
        return scored.rewards, scored.per_func, scored.all_metrics

    def _count_tokens(self, tokens: float) -> dict[str, float]:
        # the run's prompt and completion tokens so far, over every process (TrainerState's
        # num_input_tokens_seen, as TRL counts it; checkpointed with the state)
        if self.trainer_state is None:
            return {}
        self.trainer_state.num_input_tokens_seen += int(tokens)
        return {"num_tokens": float(self.trainer_state.num_input_tokens_seen)}

    def _advantages(self, per_func: Tensor) -> Tensor:
        """(B,) advantages of this process's (B, F) rewards. Where they read the whole batch (scale_rewards
        'batch', normalize_then_sum), over every process's rows, as TRL gathers the rewards first: each
        process computes them on the gathered table and keeps its own rows."""
        cfg, acc = self.config, self.accelerator

        def of(table: Tensor) -> Tensor:
            args = (self.weights, cfg.num_generations, cfg.scale_rewards, cfg.multi_objective_aggregation)
            return multi_objective_advantages(table, *args)

        if acc.num_processes == 1 or not reads_whole_batch(
            cfg.scale_rewards, cfg.multi_objective_aggregation
        ):
            return of(per_func)
        from accelerate.utils import gather_object

        # the processes' tables may differ in rows (dynamic sampling's rounds): gathered whole, in process order
        parts = gather_object([per_func.cpu()])
        start = sum(len(part) for part in parts[: acc.process_index])
        return of(torch.cat(parts).to(per_func.device))[start : start + len(per_func)]

    def advantages(
        self, rollout, rows: dict[str, list], scored: Scored | None = None, sampled: tuple | None = None
    ) -> tuple[Tensor, dict[str, float]]:
        """Rewards → group-relative advantages (B,), with the step's reward and completion metrics.

        scored: the rollout's rewards when already computed (None: score it here). sampled: with dynamic
        sampling, (every completion the step sampled: a Rollout, its Scored, and the rows of them that
        are `rollout`, (B,) long); the reward and completion metrics and completions.jsonl cover them
        all, the rows not trained on marked "dropped"."""
        cfg, acc = self.config, self.accelerator
        scored = scored or self.score(rollout, rows, cfg.num_generations)
        advantages = self._advantages(scored.per_func)
        seen_rollout, seen, extra, seen_advantages = rollout, scored, scored.extra, advantages
        if sampled is not None:
            seen_rollout, seen, trained = sampled
            dropped = torch.ones(len(seen.completions), dtype=torch.bool)
            dropped[trained] = False
            seen_advantages = torch.zeros(len(seen.completions))
            seen_advantages[trained] = advantages.float().cpu()
            extra = {**seen.extra, "dropped": dropped.tolist()}
        self.last_samples = (
            seen_rollout.prompts,
            seen.completions,
            seen.per_func,
            seen.rewards,
            seen_advantages,
            extra,
        )
        uneven = sampled is not None  # each process may have sampled another number of rounds
        rewards, per_func = seen.rewards, seen.per_func
        # the tokens the model generated, as TRL counts them: not those of tool replies (the rewards' keyword
        # completion_lengths counts every token of the completion)
        generated = (
            seen_rollout.completion_lengths
            if seen_rollout.tool_mask is None
            else loss_mask(seen_rollout, False).sum(1)
        )
        lengths, truncated = generated.float(), seen_rollout.truncated.float()
        # every token the step generated from, prompt and completion (TRL's num_tokens)
        tokens = seen_rollout.prompt_mask.sum().float().reshape(1) + lengths.sum().reshape(1)
        calls = (
            None
            if seen_rollout.tool_calls is None
            else (seen_rollout.tool_calls.float(), seen_rollout.tool_failures.float())
        )
        metrics = seen.all_metrics
        if acc.num_processes > 1:  # metrics over every process's groups, not just this one's
            gather = _gather_uneven if uneven else _gather
            rewards, per_func, lengths, truncated, tokens = (
                gather(acc, t) for t in (rewards, per_func, lengths, truncated, tokens)
            )
            calls = None if calls is None else tuple(gather(acc, t) for t in calls)
            metrics = {**reward_metrics(rewards, per_func, self.names), **_pooled_logged(seen.logged)}
        metrics.update(
            {
                "frac_reward_zero_std": zero_std_fraction(rewards, cfg.num_generations),
                "completion_length/mean": lengths.mean().item(),
                "completion_length/max": lengths.max().item(),
                "completion_length/min": lengths.min().item(),
                **terminated_length_metrics(lengths, truncated.bool()),
                "truncated_fraction": truncated.mean().item(),
                **self._count_tokens(tokens.sum().item()),
                **({} if calls is None else tool_metrics(*calls)),
            }
        )
        return advantages, metrics


def terminated_length_metrics(lengths: Tensor, truncated: Tensor) -> dict[str, float]:
    """Mean, min and max length of the completions that ended (EOS within max_completion_length);
    0 when none did, as TRL. lengths (B,) float, truncated (B,) bool."""
    ended = lengths[~truncated]
    ended = ended if ended.numel() else lengths.new_zeros(1)
    return {
        "completion_length/terminated_mean": ended.mean().item(),
        "completion_length/terminated_min": ended.min().item(),
        "completion_length/terminated_max": ended.max().item(),
    }


def _pooled_logged(logged: dict[str, list[float]]) -> dict[str, float]:
    """Each log_metric name's mean over every process's values, as TRL's (a name one process logged alone is its
    mean; a collective: every process calls it)."""
    from accelerate.utils import gather_object

    sums: dict[str, list[float]] = {}
    for part in gather_object([{name: (sum(values), len(values)) for name, values in logged.items()}]):
        for name, (total, count) in part.items():
            pooled = sums.setdefault(name, [0.0, 0])
            pooled[0], pooled[1] = pooled[0] + total, pooled[1] + count
    return {name: total / count for name, (total, count) in sorted(sums.items()) if count}


def _gather(acc, t: Tensor) -> Tensor:
    return acc.gather(t.to(acc.device)).cpu()


def _gather_uneven(acc, t: Tensor) -> Tensor:
    """Rows of every process, whatever their count on each (a collective: every process calls it)."""
    from accelerate.utils import gather_object

    return torch.cat(gather_object([t.cpu()]))
