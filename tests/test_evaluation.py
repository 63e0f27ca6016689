"""Evaluation: the pass@k estimator against hand-computed values, and evaluate() on a tiny model (greedy
scores plus pass@k, split across processes, without touching the training sampler)."""

import json
import math
import textwrap
from fractions import Fraction

import pytest
import torch
from helpers import (
    PROMPTS,
    assert_same_adapters,
    digit_share,
    has_digit,
    make_trainer,
    run_torchrun,
    write_recipe,
)

from lora_grpo import GRPOConfig
from lora_grpo.cli import main
from lora_grpo.config import ConfigError
from lora_grpo.evaluation import (
    PromptResult,
    count_correct,
    eval_chunks,
    eval_metrics,
    mean_pass_at_k,
    pass_at_k,
)


def exact_pass_at_k(n, c, k):
    return float(1 - Fraction(math.comb(n - c, k), math.comb(n, k)))


# ---------------------------------------------------------------------------------- estimator


def test_pass_at_k_hand_values():
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4, abs=1e-15)  # c / n
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7, abs=1e-15)  # 1 − C(3,2)/C(5,2) = 1 − 3/10
    assert pass_at_k(5, 2, 3) == pytest.approx(0.9, abs=1e-15)  # 1 − C(3,3)/C(5,3) = 1 − 1/10
    assert [pass_at_k(5, 0, k) for k in range(1, 6)] == [0.0] * 5  # nothing correct
    assert (
        pass_at_k(5, 4, 2) == 1.0 and pass_at_k(5, 2, 4) == 1.0
    )  # n − c < k: every k-subset has a correct one
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(1000, 1, 500) == pytest.approx(0.5, abs=1e-12)  # 1 − C(999,500)/C(1000,500) = 500/1000


def test_pass_at_k_matches_the_binomial_formula_and_is_stable():
    for n in range(1, 13):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(exact_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
    # Binomials of ~10^58 and up: the product form never builds them.
    for n, c, k in [(200, 10, 100), (200, 1, 7), (500, 3, 250), (1024, 17, 64)]:
        assert pass_at_k(n, c, k) == pytest.approx(exact_pass_at_k(n, c, k), rel=1e-12)


def test_pass_at_k_per_problem_arrays_and_the_mean():
    assert pass_at_k(5, [2, 0, 5], 2).tolist() == pytest.approx([0.7, 0.0, 1.0], abs=1e-15)
    assert pass_at_k([5, 8], [2, 8], 1).tolist() == pytest.approx([0.4, 1.0])
    assert mean_pass_at_k([5, 5], [2, 0], 2) == pytest.approx(0.35)
    assert mean_pass_at_k(5, [], 2) != mean_pass_at_k(5, [], 2)  # NaN for no problems
    for k in range(1, 6):  # monotone in k
        assert pass_at_k(5, 2, k) <= pass_at_k(5, 2, min(k + 1, 5))


def test_pass_at_k_errors():
    with pytest.raises(ValueError, match=r"pass@6 needs at least k=6 samples .* num_samples=5"):
        pass_at_k(5, 2, 6)
    with pytest.raises(ValueError, match="num_correct=6 must be between 0 and num_samples=5"):
        pass_at_k(5, 6, 1)
    with pytest.raises(ValueError, match="num_correct=-1"):
        pass_at_k(5, -1, 1)
    for k in (0, -2, 1.5, True):
        with pytest.raises(ValueError, match="must be an integer ≥ 1"):
            pass_at_k(5, 2, k)


def test_count_correct_reads_each_prompts_group_and_none_is_wrong():
    first = torch.tensor([1.0, 0.0, float("nan"), 1.0, 1.0, 1.5, 0.99, 0.2, 0.0])
    assert count_correct(first, 3, 1.0).tolist() == [1, 3, 0]
    assert count_correct(first, 3, 0.5).tolist() == [1, 3, 1]


def test_chunks_cover_every_prompt_once_whatever_the_number_of_processes():
    for num_prompts in range(14):
        for batch in range(1, 6):
            single = eval_chunks(num_prompts, batch)
            assert [i for _, start, stop in single for i in range(start, stop)] == list(range(num_prompts))
            for world in range(1, 5):
                shards = [eval_chunks(num_prompts, batch, world, rank) for rank in range(world)]
                # the same chunks as one process, dealt round-robin: the work does not depend on world
                assert sorted(c for shard in shards for c in shard) == single
    assert eval_chunks(5, 2, 2, 0) == [(0, 0, 2), (2, 4, 5)] and eval_chunks(5, 2, 2, 1) == [(1, 2, 4)]
    assert eval_chunks(5, 64, 2, 1) == []  # a process may get nothing (it still joins the gather)


def test_eval_metrics_need_every_prompt_exactly_once():
    results = [PromptResult(1, (0.0, float("nan")), 3, 1), PromptResult(0, (1.0, float("nan")), 5, 2)]
    metrics = eval_metrics(results, ["acc", "never"], [1, 2], 2, 2)
    assert metrics["eval/acc"] == 0.5 and math.isnan(metrics["eval/never"])
    assert metrics["eval/completion_length"] == 4.0
    assert metrics["eval/pass@1"] == pytest.approx(0.75) and metrics["eval/pass@2"] == 1.0
    with pytest.raises(RuntimeError, match="2 results for 3 prompts"):
        eval_metrics(results, ["acc", "never"], [], 0, 3)
    with pytest.raises(RuntimeError, match="3 results for 2 prompts"):
        eval_metrics(results + results[:1], ["acc", "never"], [], 0, 2)
    assert "eval/tools/call_frequency" not in metrics  # no tools, no tool metrics


def test_eval_reward_is_the_weighted_sum_of_each_prompts_rewards_a_none_counting_0():
    # prompt 0: 1.0 and 0.5; prompt 1: 0.0 and None; prompt 2: None and 2.0 (weights 2 and 0.5)
    nan = float("nan")
    results = [PromptResult(0, (1.0, 0.5), 3), PromptResult(1, (0.0, nan), 3), PromptResult(2, (nan, 2.0), 3)]
    metrics = eval_metrics(results, ["a", "b"], [], 0, 3, weights=[2.0, 0.5])
    assert metrics["eval/reward"] == pytest.approx(((2.0 + 0.25) + 0.0 + 1.0) / 3)
    assert metrics["eval/a"] == 0.5 and metrics["eval/b"] == 1.25  # each function: over the prompts it scored
    assert eval_metrics(results, ["a", "b"], [], 0, 3)["eval/reward"] == pytest.approx((1.5 + 0.0 + 2.0) / 3)
    # a reward function named "reward" keeps its own name
    assert eval_metrics(results, ["reward", "b"], [], 0, 3)["eval/reward"] == 0.5
    # a prompt no function scored is left out of eval/reward, as from a training step's reward
    unscored = results + [PromptResult(3, (nan, nan), 3)]
    assert eval_metrics(unscored, ["a", "b"], [], 0, 4)["eval/reward"] == pytest.approx((1.5 + 0.0 + 2.0) / 3)


def test_eval_tool_metrics_count_greedy_completions_that_called_and_their_calls():
    results = [PromptResult(i, (1.0,), 5, tool_calls=c) for i, c in enumerate([0, 2, 1, 0])]
    metrics = eval_metrics(results, ["acc"], [], 0, 4)
    assert metrics["eval/tools/calling_fraction"] == 0.5 and metrics["eval/tools/call_frequency"] == 0.75


# ---------------------------------------------------------------------------------- config and CLI


def test_config_fields_and_errors():
    base = dict(model_name_or_path="toy")
    cfg = GRPOConfig(**base)
    assert cfg.eval_pass_k == [] and cfg.eval_num_samples is None and cfg.eval_temperature is None
    assert cfg.eval_correct_threshold == 1.0
    assert GRPOConfig.parse_value("eval_pass_k", "[1,8]") == [1, 8]
    assert GRPOConfig(**base, eval_pass_k=[1, 8], eval_num_samples=16).eval_num_samples == 16
    for bad in (8, [0, 2], ["8"], [True]):
        with pytest.raises(
            ConfigError, match=r"eval_pass_k=.* must be a list of integers( ≥ 1)?.* e.g. \[1, 8\]"
        ):
            GRPOConfig(**base, eval_pass_k=bad)
    with pytest.raises(ConfigError, match=r"eval_num_samples=4: pass@k needs n ≥ k .* n ≥ 8"):
        GRPOConfig(**base, eval_pass_k=[1, 8], eval_num_samples=4)
    with pytest.raises(ConfigError, match=r"eval_temperature=0.0 must be > 0"):
        GRPOConfig(**base, eval_pass_k=[1], eval_temperature=0.0)


@pytest.fixture
def recipe(tiny_base_dir, tmp_path):
    return write_recipe(tmp_path, tiny_base_dir, rows=6)


def test_cli_eval_k(recipe, capsys):
    assert main(["eval", "--recipe", str(recipe), "--k", "1,2", "--k", "4", "--k", "2"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert sorted(metrics) == [
        "eval/answer_accuracy",
        "eval/completion_length",
        "eval/kl_to_base",
        "eval/pass@1",
        "eval/pass@2",
        "eval/pass@4",
        "eval/reward",
    ]
    assert all(0 <= metrics[f"eval/pass@{k}"] <= 1 for k in (1, 2, 4))
    assert main(["eval", "--recipe", str(recipe)]) == 0  # no --k: greedy only, as before
    assert "eval/pass@1" not in json.loads(capsys.readouterr().out)
    assert main(["eval", "--recipe", str(recipe), "--k", "1,x"]) == 2
    assert "--k expects integers such as 8 or 1,8, got '1,x'" in capsys.readouterr().err
    assert main(["eval", "--recipe", str(recipe), "--k", "0"]) == 2
    assert "eval_pass_k=[0]" in capsys.readouterr().err
    assert main(["eval", "--recipe", str(recipe), "--k", "8", "--set", "eval_num_samples=4"]) == 2
    assert "eval_num_samples=4" in capsys.readouterr().err


# ---------------------------------------------------------------------------------- evaluate()


def always_right(prompts, completions, **kwargs):
    return [1.0] * len(completions)


# make_trainer's run, without quantization, in one micro-batch, 3 steps; 7 eval prompts.
EVAL_RUN = dict(
    quantization="none",
    micro_batch_size=8,
    max_steps=3,
    gradient_checkpointing=False,
    eval_dataset=PROMPTS[:7],
)


def test_evaluate_reports_pass_at_k_beside_greedy(tiny_base_dir, tmp_path):
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        **EVAL_RUN,
        reward_funcs=[has_digit, digit_share],
        eval_pass_k=[4, 1, 2],
        eval_num_samples=6,
    )
    generator_state = trainer.generator.get_state()
    metrics = trainer.evaluate(batch_prompts=3)
    assert list(metrics) == [
        "eval/reward",
        "eval/has_digit",
        "eval/digit_share",
        "eval/completion_length",
        "eval/pass@1",
        "eval/pass@2",
        "eval/pass@4",
        "eval/kl_to_base",
    ]
    assert trainer.eval_metric_names() == list(metrics)  # what metric_for_best_model may name
    # the weighted sum (weights 1): of every prompt's two rewards, so also the sum of their means
    assert metrics["eval/reward"] == pytest.approx(metrics["eval/has_digit"] + metrics["eval/digit_share"])
    assert all(0 <= metrics[k] <= 1 for k in metrics if k not in ("eval/completion_length", "eval/reward"))
    assert 1 <= metrics["eval/completion_length"] <= 6
    assert metrics["eval/pass@1"] <= metrics["eval/pass@2"] <= metrics["eval/pass@4"]
    assert torch.equal(trainer.generator.get_state(), generator_state)  # the training sampler drew nothing
    # Deterministic: the same metrics again; greedy ones do not depend on the chunking.
    assert trainer.evaluate(batch_prompts=3) == metrics
    again = trainer.evaluate(batch_prompts=7)
    for key in ("eval/has_digit", "eval/digit_share", "eval/completion_length"):
        assert again[key] == pytest.approx(metrics[key], abs=1e-6)


def test_a_run_evaluates_at_its_start_every_eval_step_and_once_at_its_end(tiny_base_dir, tmp_path):
    # eval_steps 1 divides max_steps 3: the last step's eval is the closing one, not a second one.
    trainer = make_trainer(tiny_base_dir, tmp_path, **EVAL_RUN, eval_steps=1)
    calls, evaluate = [], trainer.evaluator.evaluate

    def counted(*args, **kwargs):
        calls.append(trainer.state.global_step)
        return evaluate(*args, **kwargs)

    trainer.evaluator.evaluate = counted
    trainer.train()
    assert calls == [0, 1, 2, 3]


def test_named_eval_sets_are_each_evaluated_as_alone(tiny_base_dir, tmp_path):
    """A dict of eval sets: each set's metrics under eval/<name>/, equal to evaluating that set alone; a
    new source passed to evaluate() is rendered and checked as the run's own."""
    easy, hard = PROMPTS[12:16], PROMPTS[16:22]
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        **{**EVAL_RUN, "eval_dataset": {"easy": easy, "hard": hard}},
        ref_sync_on_plateau=True,
        eval_steps=1,
    )  # the plateau trigger reads the first set
    both = trainer.evaluate()
    assert [k for k in both if k.endswith("/completion_length")] == [
        "eval/easy/completion_length",
        "eval/hard/completion_length",
    ]
    for name, rows in (("easy", easy), ("hard", hard)):
        alone = trainer.evaluate(rows)  # a list of rows, resolved as the run resolves its own
        assert {f"eval/{name}/{k.removeprefix('eval/')}": v for k, v in alone.items()} == {
            k: v for k, v in both.items() if k.startswith(f"eval/{name}/")
        }
    from lora_grpo.evaluation import headline_score

    assert headline_score(both, trainer.reward_names) == both[f"eval/easy/{trainer.reward_names[0]}"]
    with pytest.raises(ValueError, match="eval_dataset"):
        trainer.evaluate([{"question": "no prompt column"}])


def test_an_empty_set_in_a_dict_of_eval_sets_is_named(tiny_base_dir, tmp_path):
    import datasets

    empty = datasets.Dataset.from_dict({"prompt": []})
    trainer = make_trainer(tiny_base_dir, tmp_path, **EVAL_RUN)
    message = r"^eval_dataset\['hard'\]: the prompt dataset from Dataset is empty: .*\(fill that set, or leave it out"
    # was: "eval_dataset: ... is empty", which of the sets unsaid
    with pytest.raises(ValueError, match=message):
        trainer.evaluate({"easy": PROMPTS[:3], "hard": empty})
    with pytest.raises(ValueError, match=r"^eval_dataset\['hard'\]: the prompt dataset from list is empty"):
        make_trainer(
            tiny_base_dir,
            tmp_path / "other",
            **{**EVAL_RUN, "eval_dataset": {"easy": PROMPTS[:3], "hard": []}},
        )
    with pytest.raises(
        ValueError, match=r"^eval_dataset\['hard'\]: cannot find the prompts: no column 'prompt'"
    ):
        trainer.evaluate({"easy": PROMPTS[:3], "hard": [{"question": "no prompt column"}]})


def test_a_reward_that_is_always_right_gives_pass_at_k_one(tiny_base_dir, tmp_path):
    trainer = make_trainer(
        tiny_base_dir, tmp_path, **EVAL_RUN, reward_funcs=[always_right], eval_pass_k=[1, 3]
    )
    metrics = trainer.evaluate()
    assert metrics["eval/always_right"] == 1.0
    assert metrics["eval/pass@1"] == 1.0 and metrics["eval/pass@3"] == 1.0
    # A threshold above every value: nothing is correct.
    trainer = make_trainer(
        tiny_base_dir,
        tmp_path,
        **EVAL_RUN,
        reward_funcs=[always_right],
        eval_pass_k=[1, 3],
        eval_correct_threshold=1.5,
    )
    assert trainer.evaluate()["eval/pass@3"] == 0.0


def test_eval_during_training_leaves_the_training_trajectory_unchanged(tiny_base_dir, tmp_path):
    """Eval (greedy and sampled) every step gives the same adapters as no eval at all: it draws
    nothing from the training sampler or the global RNGs."""
    runs = []
    for name, extra in (
        ("plain", {}),
        ("evaluated", dict(eval_steps=1, eval_pass_k=[1, 2], eval_temperature=1.3)),
    ):
        trainer = make_trainer(
            tiny_base_dir, tmp_path / name, **EVAL_RUN, ref_sync_steps=2, lora_dropout=0.1, **extra
        )
        if not extra:
            trainer.eval_dataset = None  # no eval at all, not even before and after
        trainer.train()
        runs.append(trainer)
    plain, evaluated = runs
    assert "eval/pass@2" in evaluated.state.log_history[0] and "eval/pass@2" not in plain.state.log_history[0]
    assert_same_adapters(plain.model, evaluated.model)
    assert [m["reward/mean"] for m in plain.state.log_history] == [
        m["reward/mean"] for m in evaluated.state.log_history
    ]


# ---------------------------------------------------------------------------------- two processes

SHARDED = textwrap.dedent(
    """
    import json, sys, torch
    from lora_grpo import GRPOConfig, GRPOTrainer
    from lora_grpo.model.adapters import POLICY

    from helpers import has_digit

    base, out = sys.argv[1], sys.argv[2]
    def weight(prompts, completions, weight, **kw):  # each prompt's own value: the mean shows double counts
        return [float(w) for w in weight]
    prompts = [{"prompt": f"{i}+{i % 3}=", "weight": 10 ** i} for i in range(5)]
    cfg = GRPOConfig(model_name_or_path=base, quantization="none", lora_r=4, num_generations=2, prompts_per_step=2,
                     max_completion_length=5, eval_pass_k=[1, 2, 3], output_dir=out + "/run", save_steps=0,
                     gradient_checkpointing=False, seed=3)
    t = GRPOTrainer(cfg, reward_funcs=[has_digit, weight], train_dataset=prompts * 2, eval_dataset=prompts)
    torch.manual_seed(7)  # the same non-trivial adapter in every process and every run
    for name, p in t.model.named_parameters():
        if f"lora_B.{POLICY}." in name:
            p.data.normal_(0, 0.3)
    metrics = t.evaluate(batch_prompts=2)  # chunks [0:2] [2:4] [4:5]: process 0 gets two, process 1 one
    world, rank = t.accelerator.num_processes, t.accelerator.process_index
    json.dump(metrics, open(f"{out}/eval-{world}-{rank}.json", "w"))
    """
)


def test_sharded_eval_matches_one_process_and_counts_every_prompt_once(tiny_base_dir, tmp_path):
    run_torchrun(SHARDED, tmp_path, tiny_base_dir, tmp_path, nproc=1)
    run_torchrun(SHARDED, tmp_path, tiny_base_dir, tmp_path, nproc=2)
    single, *sharded = (
        json.loads((tmp_path / f"eval-{w}-{r}.json").read_text()) for w, r in ((1, 0), (2, 0), (2, 1))
    )
    assert sharded[0] == single and sharded[1] == single  # every process returns the single-process metrics
    assert single["eval/weight"] == pytest.approx((1 + 10 + 100 + 1000 + 10000) / 5)  # each prompt once
    assert single["eval/pass@1"] <= single["eval/pass@2"] <= single["eval/pass@3"]
