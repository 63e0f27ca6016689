"""Evaluation: greedy scores and pass@k over held-out prompts, split across processes.

    eval prompts ─► chunks of `batch_prompts` prompts; process p takes chunks p, p + world, ...
                    (each decoded in parts of at most the training rollout's rows: memory.decode_rows)
                 ─► greedy completion per prompt → every reward function   (eval/<reward>, eval/completion_length;
                                                          eval/reward: their weighted sum)
                 ─► with eval_pass_k: n sampled completions per prompt → c = how many the first
                    reward function scores ≥ eval_correct_threshold       (eval/pass@k)
                 ─► sampled completions (the pass@k ones when drawn at the training temperature,
                    else one per prompt) → k3 KL of the policy to the base, summed per prompt
                                                                          (eval/kl_to_base)
                 ─► gather every process's per-prompt results, check each prompt came once → metrics

Every forward is sized as the run's are (memory/probe.py plans them): a decode runs at most
memory.decode_rows(config) sequences at once, the training rollout's count, so with the compiled
sampler the eval decodes in the training rollout's kept cache (no second cache, no second graph);
the KL forwards take at most `forward_rows()` sequences (the run's micro_batch_size).

The chunk, not the process, is the unit of work: a chunk's completions depend only on its prompts
(their padding) and on its own sampling generator, seeded from (seed, chunk index). So the metrics
do not depend on the number of processes, every process returns the same ones, and
`lora-grpo eval` of a saved adapter reproduces the trainer's final eval. The eval generators are
fresh each time and never the trainer's: evaluating leaves the training sampling stream untouched
(greedy decoding draws nothing).

pass@k is the unbiased estimator of Chen et al. 2021 ("Evaluating Large Language Models Trained
on Code", §2.1), in the product form of their reference implementation.

eval/kl_to_base is KL(π_θ ‖ π_start) per completion token: π_start is the model the run started
from (the base with adapters off, or the warm-start adapter; adapters.base_forward). Estimator:
k3 = exp(log π_start − log π_θ) − (log π_start − log π_θ) − 1 per token (Schulman 2020,
"Approximating KL Divergence"), on completions sampled from π_θ at the training temperature, with
both log-probs at that temperature: the estimator and the distributions of the training `kl`
metric, so the two are on one scale. k3 is unbiased for each token's KL given its prefix and never
negative, so an unchanged policy gives exactly 0. The mean is over every completion token of the
eval (Σ k3 / Σ tokens, gathered per prompt), not over prompts. Greedy completions are not samples
from π_θ, so they are not used. Unlike the training `kl`, which measures the distance to the
current reference and restarts at every sync, this one is never reset.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from .algo.advantages import weighted_sum
from .algo.loss import k3_kl
from .batch import MicroBatch, loss_mask
from .memory.probe import decode_rows
from .model.adapters import base_forward, eval_mode
from .run.failures import agreed_failures

Tensor = torch.Tensor


# ---------------------------------------------------------------------------------- pass@k


def _pass_at_k_one(n: int, c: int, k: int) -> float:
    if not 0 <= c <= n:
        raise ValueError(f"num_correct={c} must be between 0 and num_samples={n}")
    if n < k:
        raise ValueError(
            f"pass@{k} needs at least k={k} samples per problem, got num_samples={n}: sample n ≥ k "
            "completions per prompt (eval_num_samples) or lower k"
        )
    if n - c < k:  # every k-subset of the n samples holds a correct one
        return 1.0
    # C(n−c, k) / C(n, k) = ∏_{i=n−c+1}^{n} (1 − k/i): no huge binomials, no cancellation.
    return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1, dtype=np.float64)))


def pass_at_k(num_samples, num_correct, k: int):
    """pass@k per problem: the probability that at least one of k completions drawn without
    replacement from the problem's n samples is correct (Chen et al. 2021, §2.1, unbiased):

        pass@k = 1 − C(n−c, k) / C(n, k) = 1 − ∏_{i=n−c+1}^{n} (1 − k/i)

    ``num_samples`` (n) and ``num_correct`` (c): ints, or array-likes of one entry per problem
    (a scalar n is shared by every problem). Returns a float for scalars, else a float64 array
    shaped like ``num_correct``. n − c < k gives 1; c = 0 gives 0.

    Raises ValueError when k < 1, n < k, or c is outside [0, n].

    >>> round(pass_at_k(5, 2, 1), 12), round(pass_at_k(5, 2, 2), 12)   # 2/5; 1 − C(3,2)/C(5,2)
    (0.4, 0.7)
    """
    if isinstance(k, bool) or not isinstance(k, (int, np.integer)) or k < 1:
        raise ValueError(f"k={k!r} must be an integer ≥ 1")
    n, c = np.broadcast_arrays(np.asarray(num_samples), np.asarray(num_correct))
    out = np.array(
        [_pass_at_k_one(int(ni), int(ci), int(k)) for ni, ci in zip(n.ravel(), c.ravel())], dtype=np.float64
    )
    return float(out[0]) if n.ndim == 0 else out.reshape(n.shape)


def mean_pass_at_k(num_samples, num_correct, k: int) -> float:
    """The mean of :func:`pass_at_k` over problems (the reported pass@k); NaN for no problems."""
    values = np.atleast_1d(pass_at_k(num_samples, num_correct, k))
    return float(values.mean()) if values.size else math.nan


def num_eval_samples(pass_k: Sequence[int], num_samples: int | None) -> int:
    """Completions to sample per eval prompt: ``num_samples``, else max(pass_k); 0 when pass@k is off."""
    if not pass_k:
        return 0
    n = max(pass_k) if num_samples is None else num_samples
    if n < max(pass_k):
        raise ValueError(f"pass@{max(pass_k)} needs at least {max(pass_k)} samples per prompt, got {n}")
    return n


def count_correct(first_reward: Tensor, num_samples: int, threshold: float) -> Tensor:
    """(m·n,) first-reward values, prompt-major (a prompt's n samples contiguous, as a Rollout's
    groups) -> (m,) long, how many of each prompt's samples are correct (value ≥ threshold; a None,
    stored as NaN, is not correct)."""
    return (first_reward.reshape(-1, num_samples) >= threshold).sum(1)


# ----------------------------------------------------------------------- splitting the work


def eval_chunks(num_prompts: int, batch_prompts: int, num_processes: int = 1, process_index: int = 0):
    """This process's chunks as (chunk index, start, stop): chunk i covers prompts
    [i·batch_prompts, (i+1)·batch_prompts) and goes to process i mod num_processes. The chunks of
    all processes cover every prompt exactly once, whatever the sizes; a process may get none."""
    if batch_prompts < 1:
        raise ValueError(f"batch_prompts={batch_prompts} must be ≥ 1")
    starts = range(0, num_prompts, batch_prompts)
    return [
        (i, start, min(start + batch_prompts, num_prompts))
        for i, start in enumerate(starts)
        if i % num_processes == process_index
    ]


def chunk_generator(seed: int, chunk: int, device, stream: int = 0) -> torch.Generator:
    """The sampling generator of one eval chunk: a function of (seed, chunk) only, never of the
    process, the step or the trainer's own sampling state. `stream` > 0 gives independent ones
    for other uses of the same chunk (1: the kl_to_base samples when pass@k's cannot serve)."""
    entropy = [seed % 2**32, chunk, 0x6576616C] + ([stream] if stream else [])  # 0x6576616C = "eval"
    state = np.random.SeedSequence(entropy).generate_state(1)[0]
    return torch.Generator(device=device).manual_seed(int(state))


# ---------------------------------------------------------------------------------- results


@dataclass
class PromptResult:
    """One eval prompt's outcome: plain Python values, so gather_object can move it between processes."""

    index: int  # position in the eval dataset
    scores: tuple[float, ...]  # (F,) greedy completion's reward per function; NaN where it returned None
    length: int  # greedy completion's tokens
    num_correct: int | None = None  # correct sampled completions (of n); None without pass@k
    kl_sum: float | None = None  # Σ k3 KL to the base over its sampled completions' tokens
    kl_tokens: int | None = None  # the number of those tokens
    tool_calls: int | None = None  # tool calls of its greedy completion (a tool run)


def prompt_results(
    start: int,
    scores: Tensor,
    lengths: Tensor,
    num_correct: Tensor | None,
    kl: Tensor | None = None,
    tool_calls: Tensor | None = None,
) -> list[PromptResult]:
    """A chunk's results: scores (m, F), lengths (m,), num_correct (m,) or None, kl (m, 2) of
    (Σ k3, tokens) or None; prompt i is start + i."""
    scores, lengths = scores.cpu().tolist(), lengths.cpu().tolist()
    correct = [None] * len(lengths) if num_correct is None else num_correct.cpu().tolist()
    kls = [(None, None)] * len(lengths) if kl is None else [(s, int(t)) for s, t in kl.cpu().tolist()]
    calls = [None] * len(lengths) if tool_calls is None else [int(c) for c in tool_calls.cpu().tolist()]
    return [
        PromptResult(start + i, tuple(s), int(n), c, *k, t)
        for i, (s, n, c, k, t) in enumerate(zip(scores, lengths, correct, kls, calls, strict=True))
    ]


def eval_metrics(
    results: Sequence[PromptResult],
    names: Sequence[str],
    pass_k: Sequence[int],
    num_samples: int,
    num_prompts: int,
    weights: Sequence[float] | None = None,
) -> dict[str, float]:
    """Every process's results -> eval/<name> (mean over prompts where the function applied; NaN
    where it never did), eval/reward (the weighted sum of the functions' rewards, a None as 0, over the
    prompts some function scored, as a training step's `reward`; `weights` None: all 1),
    eval/completion_length (greedy), eval/pass@k for each k in ``pass_k``, eval/kl_to_base (Σ k3 / Σ
    tokens over every prompt, summed in prompt order) when the results carry it. A reward function
    named "reward" keeps eval/reward for its own mean.

    Raises RuntimeError unless the results hold each of the ``num_prompts`` prompts exactly once.
    """
    results = sorted(results, key=lambda r: r.index)
    if [r.index for r in results] != list(range(num_prompts)):
        raise RuntimeError(
            f"eval gathered {len(results)} results for {num_prompts} prompts; every prompt must be "
            "evaluated exactly once (this is a bug in lora_grpo's eval sharding)"
        )
    if not results:
        raise ValueError("the eval dataset has no prompts")
    scores = torch.tensor([r.scores for r in results], dtype=torch.float64)  # (N, F)
    weights = torch.tensor([1.0] * len(names) if weights is None else list(weights), dtype=torch.float64)
    # a prompt no function scored is left out, as from a training step's reward (and TRL's)
    metrics = {"eval/reward": weighted_sum(scores, weights).nanmean().item()}
    metrics.update({f"eval/{name}": scores[:, j].nanmean().item() for j, name in enumerate(names)})
    metrics["eval/completion_length"] = float(np.mean([r.length for r in results]))
    for k in sorted(set(pass_k)):
        metrics[f"eval/pass@{k}"] = mean_pass_at_k(num_samples, [r.num_correct for r in results], k)
    if all(r.kl_sum is not None for r in results):
        tokens = sum(r.kl_tokens for r in results)
        metrics["eval/kl_to_base"] = math.fsum(r.kl_sum for r in results) / tokens if tokens else math.nan
    # greedy completions that call a tool, calls per completion
    if all(r.tool_calls is not None for r in results):
        metrics["eval/tools/calling_fraction"] = float(np.mean([r.tool_calls > 0 for r in results]))
        metrics["eval/tools/call_frequency"] = float(np.mean([r.tool_calls for r in results]))
    return metrics


def metric_names(reward_names: Sequence[str], config, *, tools: bool) -> list[str]:
    """The eval/* metrics eval_metrics returns for a run's reward functions and config (eval_pass_k,
    eval_kl_to_base), and `tools` (a tool run): what metric_for_best_model may name."""
    names = ["eval/reward", *(f"eval/{name}" for name in reward_names), "eval/completion_length"]
    names += [f"eval/pass@{k}" for k in sorted(set(config.eval_pass_k))]
    if config.eval_kl_to_base:
        names.append("eval/kl_to_base")
    if tools:
        names += ["eval/tools/calling_fraction", "eval/tools/call_frequency"]
    return list(dict.fromkeys(names))  # a reward function named "reward": once


def headline_score(metrics: dict[str, float], reward_names: Sequence[str]) -> float:
    """The eval score a run is judged by: the first reward function's greedy mean (the summary's
    accuracy; what the plateau trigger watches), on the first set when there are named sets."""
    key = f"eval/{reward_names[0]}"
    if key not in metrics:  # named eval sets (eval/<name>/<reward>): the first set's
        key = next(k for k in metrics if k.startswith("eval/") and k.endswith(f"/{reward_names[0]}"))
    return metrics[key]


# ---------------------------------------------------------------------------------- evaluator


class Evaluator:
    """evaluate(dataset) → eval/* metrics (the module docstring), on what the trainer hands it:

    sample(prompts, num_generations, temperature, generator, rows) → a Rollout of the policy (rows:
    the prompts' dataset columns, which reset a tool run's environments);
    score(rollout, rows, group_size) → (m·n, F) rewards per function, NaN where one returned None;
    log_probs(micro_batch) → (B, T) per-token log-probs under the active adapter (the trainer's own
    forward, so eval/kl_to_base uses the training KL's distributions); forward_rows() → the most
    sequences one such forward may take (the run's micro_batch_size); weights: the reward functions'
    (eval/reward), None: all 1.

    The config is read at each call (a test may turn eval_kl_to_base off between two evals).
    """

    def __init__(
        self,
        config,
        accelerator,
        reward_names: Sequence[str],
        *,
        model,
        sample: Callable,
        score: Callable,
        log_probs: Callable,
        forward_rows: Callable[[], int],
        weights: Sequence[float] | None = None,
    ):
        self.config, self.accelerator, self.reward_names = config, accelerator, list(reward_names)
        self.weights = weights
        self.model, self.sample, self.score, self.log_probs = model, sample, score, log_probs
        self.forward_rows = forward_rows

    @torch.no_grad()
    def evaluate(self, dataset, batch_prompts: int = 64) -> dict[str, float]:
        """eval/<reward>, eval/reward and eval/completion_length of one greedy completion per prompt; with
        eval_pass_k, eval/pass@k of eval_num_samples sampled ones (correct: the first reward function
        ≥ eval_correct_threshold); with eval_kl_to_base, eval/kl_to_base (pass@k's samples when
        they are drawn at the training temperature, else one more per prompt). Processes split the
        prompts in chunks of batch_prompts and gather the results: each prompt counts once, every
        process returns the same metrics."""
        cfg, acc = self.config, self.accelerator
        n = num_eval_samples(cfg.eval_pass_k, cfg.eval_num_samples)
        # the chunks of this process (reward functions, tools) before the gather: a failure on one stops all
        with agreed_failures(acc):
            results = self._chunks(dataset, batch_prompts, n)
        if acc.num_processes > 1:
            from accelerate.utils import gather_object

            results = gather_object(results)
        return eval_metrics(results, self.reward_names, cfg.eval_pass_k, n, len(dataset), self.weights)

    def _chunks(self, dataset, batch_prompts: int, n: int) -> list:
        """This process's chunks of the eval prompts, n sampled completions per prompt: their per-prompt results
        (prompt_results)."""
        cfg, acc = self.config, self.accelerator
        temperature = cfg.temperature if cfg.eval_temperature is None else cfg.eval_temperature
        rows_at_once = decode_rows(cfg)  # the training rollout's rows: one decode shape for the run
        # samples of the policy itself
        kl_on_pass_k = cfg.eval_kl_to_base and n > 0 and temperature == cfg.temperature
        results = []
        for chunk, start, stop in eval_chunks(
            len(dataset), batch_prompts, acc.num_processes, acc.process_index
        ):
            rows = dataset[start:stop]
            scores, lengths, calls = [], [], []
            for sub in _parts(rows, rows_at_once):
                rollout = self.sample(sub["prompt"], 1, 0.0, None, sub)  # greedy draws nothing
                # Scored before the next part's rollout: an environment's instances (their get_reward, a reward
                # function's environments=) are this part's only until then.
                scores.append(self.score(rollout, sub, 1))
                # the tokens the policy wrote: tool replies in the completion are not its own (as training counts)
                lengths.append(loss_mask(rollout, False).sum(1))
                calls.append(rollout.tool_calls)
            scores, lengths = torch.cat(scores), torch.cat(lengths)
            calls = None if calls[0] is None else torch.cat(calls)
            correct, kl = None, []
            if n:
                # The chunk's own generator: the training sampling stream stays untouched and the
                # draws do not depend on the process that evaluates the chunk.
                generator = chunk_generator(cfg.seed, chunk, acc.device)
                first = []
                for sub in _parts(rows, max(1, rows_at_once // n)):
                    sampled = self.sample(sub["prompt"], n, temperature, generator, sub)
                    first.append(self.score(sampled, sub, n)[:, 0])
                    if kl_on_pass_k:
                        kl.append(self.kl_to_base(sampled, n))
                correct = count_correct(torch.cat(first), n, cfg.eval_correct_threshold)
            # one sample per prompt, from the chunk's second stream
            if cfg.eval_kl_to_base and not kl_on_pass_k:
                generator = chunk_generator(cfg.seed, chunk, acc.device, stream=1)
                for sub in _parts(rows, rows_at_once):
                    kl.append(
                        self.kl_to_base(self.sample(sub["prompt"], 1, cfg.temperature, generator, sub), 1)
                    )
            results += prompt_results(start, scores, lengths, correct, torch.cat(kl) if kl else None, calls)
        return results

    @torch.no_grad()
    def kl_to_base(self, rollout, group_size: int) -> Tensor:
        """(m, 2) per prompt of the rollout: Σ k3 KL(policy ‖ start) over its group_size sampled
        completions' tokens, and their number. The forwards take at most forward_rows() sequences
        each (the run's micro_batch_size, the same on every process: processes take process 0's
        sizes), as the training log-prob forwards do."""
        rows, width = self.forward_rows(), rollout.completion_ids.shape[1]
        ids, attention = rollout.input_ids, rollout.attention_mask
        parts = [
            MicroBatch(ids[s : s + rows], attention[s : s + rows], width)
            for s in range(0, ids.shape[0], rows)
        ]
        with eval_mode(self.model):
            logp = torch.cat([self.log_probs(mb) for mb in parts])
            with base_forward(self.model):
                start = torch.cat([self.log_probs(mb) for mb in parts])
        # the policy's own tokens: tool replies are context it read, not choices it made (as the training KL)
        mask = loss_mask(rollout, False).to(device=logp.device, dtype=torch.float32)
        k3 = k3_kl(logp.float(), start.float()) * mask
        return torch.stack([k3.sum(1), mask.sum(1)], 1).reshape(-1, group_size, 2).sum(1)


def _parts(rows: dict[str, list], size: int) -> list[dict[str, list]]:
    """A chunk's dataset columns cut into consecutive parts of at most `size` prompts."""
    count = len(next(iter(rows.values())))
    return [{key: values[s : s + size] for key, values in rows.items()} for s in range(0, count, size)]
