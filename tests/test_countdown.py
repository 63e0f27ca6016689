"""The countdown task: the seeded generator, the safe evaluator and the reward's rules."""

import ast
import random

import pytest

from lora_grpo.rewards import check_reward_columns, resolve_reward_funcs
from lora_grpo.tasks import countdown
from lora_grpo.tasks.countdown import (
    countdown_problems,
    countdown_reward,
    evaluate_expression,
    extract_equation,
    is_correct_equation,
    make_problem,
)

# ------------------------------------------------------------------------------------ generator


def test_problems_are_solvable_distinct_and_seeded():
    ds = countdown_problems(300, seed=3)
    assert ds.column_names == ["prompt", "nums", "target", "solution"]
    assert ds.to_dict() == countdown_problems(300, seed=3).to_dict()
    assert ds["target"] != countdown_problems(300, seed=4)["target"]
    keys = {(tuple(sorted(n)), t) for n, t in zip(ds["nums"], ds["target"])}
    assert len(keys) == 300
    assert {len(n) for n in ds["nums"]} == {3, 4}
    for row in ds:
        assert is_correct_equation(row["solution"], row["nums"], row["target"]), row
        assert countdown.TARGET_RANGE[0] <= row["target"] <= countdown.TARGET_RANGE[1]
        assert all(countdown.NUMBER_RANGE[0] <= x <= countdown.NUMBER_RANGE[1] for x in row["nums"])
        assert str(row["nums"]) in row["prompt"] and f"equals {row['target']}." in row["prompt"]
        assert "<answer>" in row["prompt"]


def test_train_and_eval_problems_never_overlap():
    def problems(ds):
        return {(tuple(sorted(n)), t) for n, t in zip(ds["nums"], ds["target"])}

    train = problems(countdown_problems(2000, seed=0))
    held_out = problems(countdown_problems(300, seed=1, split="eval"))
    assert len(held_out) == 300 and not train & held_out
    with pytest.raises(ValueError, match="split"):
        countdown_problems(2, split="test")


def test_generated_solutions_follow_the_classic_rules():
    """Every intermediate value is a positive integer (no negatives, no fractions), so the problems
    are solvable under the strictest rules, not only under the reward's lenient exact arithmetic."""

    def check(node):  # the value of a solution's tree, asserting each node's value is a positive integer
        if isinstance(node, ast.Constant):
            return node.value
        a, b = check(node.left), check(node.right)
        value = {ast.Add: a + b, ast.Sub: a - b, ast.Mult: a * b, ast.Div: a / b}[type(node.op)]
        assert value > 0 and value == int(value), ast.unparse(node)
        return int(value)

    rng = random.Random(0)
    for _ in range(300):
        problem = make_problem(rng)
        assert check(ast.parse(problem["solution"], mode="eval").body) == problem["target"]


# ------------------------------------------------------------------------------------ evaluator


@pytest.mark.parametrize(
    "text, value, literals",
    [
        ("(44 + 19) + 35", 98, [44, 19, 35]),
        ("44+19+35", 98, [44, 19, 35]),
        ("(1 + 2) / 3", 1, [1, 2, 3]),
        ("7 / 2 * 4", 14, [7, 2, 4]),  # exact rational intermediates are fine
        ("3 - 10 + 9", 2, [3, 10, 9]),  # and negative ones
        ("6 × 7 ÷ 2 − 1", 20, [6, 7, 2, 1]),  # typographic operators
        ("6 \\times 7 \\div 2", 21, [6, 7, 2]),  # LaTeX operators
        (" ( ( 2 ) ) * 5 ", 10, [2, 5]),
        ("(" * 90 + "1" + ")" * 90, 1, [1]),  # as deep as MAX_ANSWER_CHARS allows: no RecursionError
    ],
)
def test_evaluator_accepts_arithmetic_over_integers(text, value, literals):
    assert evaluate_expression(text) == (value, literals)


@pytest.mark.parametrize(
    "text",
    [
        "__import__('os').system('true')",  # names, calls, strings
        "2 ** 100000",  # powers (and huge values)
        "-5 + 10",  # unary signs
        "+5 + 10",
        "2.5 * 4",  # decimals
        "1e3",
        "0x10 + 1",  # other literal forms
        "1_0 + 1",
        "07 + 1",
        "5 // 2",  # floor division
        "5 % 2",
        "[1, 2]",
        "1 2",  # not one expression
        "",
        "(1 + 2",
        "4 / (2 - 2)",  # division by zero
        "1 + " * 100 + "1",  # longer than MAX_ANSWER_CHARS (which also bounds the nesting)
        "1\x00",
    ],
)
def test_evaluator_rejects_everything_else(text):
    with pytest.raises(ValueError):
        evaluate_expression(text)


def test_is_correct_equation_needs_each_number_exactly_once_and_the_target():
    nums, target = [44, 19, 35], 98
    assert is_correct_equation("35 + (19 + 44)", nums, target)
    assert is_correct_equation("(44 + 19) + 35 = 98", nums, target)  # stating the target is fine
    assert not is_correct_equation("(44 + 19) + 35 = 99", nums, target)  # a wrong right-hand side is not
    assert not is_correct_equation("44 + 54", nums, target)  # other numbers
    assert not is_correct_equation("44 + 19 + 35 + 0", nums, target)  # an extra number
    assert not is_correct_equation("44 * 2 + 10", nums, target)
    assert not is_correct_equation("44 + 44 + 10", nums, target)  # a number twice
    assert not is_correct_equation("44 + 19", nums, 63)  # not every number
    assert not is_correct_equation("44 + 19 - 35", nums, target)  # the wrong value
    assert not is_correct_equation(None, nums, target)
    assert is_correct_equation("10 + 10 - 20 + 1", [10, 20, 10, 1], 1)  # repeated numbers, each used once
    assert is_correct_equation("(44 + 19) + 35", ["44", "19", "35"], "98")  # columns read from CSV as text


def test_extract_equation_reads_the_last_answer_block():
    assert extract_equation("<think>try <answer>1</answer></think> <answer> 2 + 3 </answer>") == "2 + 3"
    assert extract_equation([{"role": "assistant", "content": "<answer>4</answer>"}]) == "4"
    assert extract_equation("2 + 3") is None
    assert extract_equation([]) is None


# ------------------------------------------------------------------------------------ reward


def test_reward_scores_correct_equations_one_and_everything_else_zero():
    good = "<think>44 + 19 = 63, 63 + 35 = 98</think>\n<answer>(44 + 19) + 35</answer>"
    completions = [
        good,
        [{"role": "assistant", "content": good}],  # conversational
        "<answer>(44 + 19) + 35</answer>",  # no think block: still correct (format is another reward)
        "<answer>44 + 19 + 35 + 35</answer>",  # a number twice
        "<answer>44 - 19 + 35</answer>",  # wrong value
        "(44 + 19) + 35",  # no answer block
        "<answer>__import__('os')</answer>",
    ]
    n = len(completions)
    # TRL's keyword call: prompts, completions, completion_ids and the columns, plus trainer extras.
    scores = countdown_reward(
        prompts=["p"] * n,
        completions=completions,
        completion_ids=[[1]] * n,
        nums=[[44, 19, 35]] * n,
        target=[98] * n,
        solution=["x"] * n,
        completion_lengths=[5] * n,
        truncated=[False] * n,
        trainer_state=None,
    )
    assert scores == [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]


def test_reward_skips_rows_without_a_problem_and_checks_lengths():
    scores = countdown_reward(completions=["<answer>1 + 2</answer>"] * 2, nums=[None, [1, 2]], target=[3, 3])
    assert scores == [None, 1.0]
    with pytest.raises(ValueError):
        countdown_reward(completions=["a", "b"], nums=[[1, 2]], target=[3])


def test_reward_resolves_by_dotted_path_and_declares_its_columns():
    (fn,) = resolve_reward_funcs(["lora_grpo.tasks.countdown:countdown_reward"])
    assert fn is countdown_reward
    check_reward_columns([fn], ["nums", "target", "solution"], "train_dataset")
    with pytest.raises(ValueError, match="target"):
        check_reward_columns([fn], ["nums", "solution"], "train_dataset")


def test_the_trainer_generates_the_countdown_dataset_locally(tiny_base_dir, tmp_path):
    from lora_grpo import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        model_name_or_path=tiny_base_dir,
        dataset="countdown",
        eval_dataset="countdown",
        eval_limit=4,
        reward_funcs=["countdown"],
        num_generations=2,
        prompts_per_step=2,
        max_prompt_length=512,
        max_completion_length=4,
        output_dir=str(tmp_path),
        gradient_checkpointing=False,
    )
    trainer = GRPOTrainer(config)
    assert {"nums", "target"} <= set(trainer.train_dataset.column_names)
    assert len(trainer.train_dataset) == 10_000 and len(trainer.eval_dataset) == 4
    assert trainer.reward_funcs[0].__name__ == "countdown_reward"
