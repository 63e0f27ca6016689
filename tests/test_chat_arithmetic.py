"""The chat-sum task (lora_grpo.tasks.chat_arithmetic): splits that share no sum, the phrasings, the reward."""

from __future__ import annotations

import re

import pytest

from lora_grpo.tasks.chat_arithmetic import KINDS, chat_sum_problems, last_number_reward


def _pairs(rows) -> set[tuple[int, int]]:
    return {tuple(sorted(int(x) for x in re.findall(r"\d+", r["prompt"][0]["content"]))) for r in rows}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_no_held_out_sum_is_trained_on_in_either_order_or_any_phrasing(kind):
    train, held_out = (
        chat_sum_problems(600, split="train", kind=kind),
        chat_sum_problems(200, split="eval", kind=kind),
    )
    assert not _pairs(train) & _pairs(held_out)
    for rows in (train, held_out):
        prompts = [r["prompt"][0]["content"] for r in rows]
        assert len(set(prompts)) == len(prompts)
        for r in rows:
            a, b = (int(x) for x in re.findall(r"\d+", r["prompt"][0]["content"]))
            assert int(r["answer"]) == a + b and r["prompt"][0]["role"] == "user"


def test_one_digit_sums_give_210_held_out_prompts_over_sums_from_3_to_18():
    held_out = chat_sum_problems(210, split="eval", kind="add-1-1")
    # every phrasing of each of the 21 held-out problems; the sums are spread (a linear hash of the
    # pair would have held out only the multiples of 4)
    assert len(_pairs(held_out)) == 12
    assert len({r["prompt"][0]["content"] for r in held_out}) == 210
    assert {int(r["answer"]) for r in held_out} == {3, 6, 8, 9, 10, 11, 12, 14, 15, 18}
    train = chat_sum_problems(600, split="train", kind="add-1-1")
    # 3 (1 + 2) and 18 (9 + 9) have one problem each, both held out: never a training answer
    assert {int(r["answer"]) for r in train} == set(range(2, 18)) - {3}
    with pytest.raises(ValueError, match="has 210 distinct eval prompts, asked for 211"):
        chat_sum_problems(211, split="eval", kind="add-1-1")


def test_the_same_seed_draws_the_same_prompts_and_another_seed_others():
    first, again = chat_sum_problems(50, seed=3), chat_sum_problems(50, seed=3)
    assert first["prompt"] == again["prompt"]
    assert first["prompt"] != chat_sum_problems(50, seed=4)["prompt"]


def test_bad_kind_and_split_are_named():
    with pytest.raises(ValueError, match="kind 'add-2-2': use one of"):
        chat_sum_problems(5, kind="add-2-2")
    with pytest.raises(ValueError, match="split 'test': use 'train' or 'eval'"):
        chat_sum_problems(5, split="test")


def test_the_reward_reads_the_last_integer_of_text_or_a_conversational_completion():
    completions = [
        "To add 3 and 5, you get 8",
        [{"role": "assistant", "content": "3 + 5 = 8."}],
        "3 + 5 is 8, no wait, 9",
        "The answer is eight",
        "To add 3 and 5, you simply",
    ]
    assert last_number_reward(completions, answer=["8"] * 5) == [1.0, 1.0, 0.0, 0.0, 0.0]
