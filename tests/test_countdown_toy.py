"""The countdown toy: its format, problems and reward, the cached tiny base (TINY settings only: the full
base is never pre-trained here), and the toy-countdown recipe's names wired end to end."""

import json
from pathlib import Path

import pytest
import torch
from helpers import TINY_PRETRAIN, cache_listing
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_grpo.cli import main, recipe_file, shipped_recipes
from lora_grpo.config import GRPOConfig
from lora_grpo.data.prompts import resolve_dataset
from lora_grpo.model import bases
from lora_grpo.tasks import countdown_toy as ct
from lora_grpo.tasks import pretrain
from lora_grpo.tasks.toy import make_tokenizer

TINY = TINY_PRETRAIN

# --------------------------------------------------------------------------- the task


def test_the_tokenizer_round_trips_the_format_one_character_a_token():
    tok = make_tokenizer()
    text = ct.format_prompt([3, 7, 5], 21) + "3*7"
    assert text == "3 7 5:21=3*7"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.unk_token_id not in ids
    assert tok.decode(ids + [tok.eos_token_id], skip_special_tokens=True) == text
    for problems in (ct.countdown_toy_problems(300, seed=1), ct.countdown_toy_problems(200, split="eval")):
        for row in problems:
            ids = tok(row["prompt"] + row["solution"], add_special_tokens=False)["input_ids"]
            assert tok.unk_token_id not in ids and tok.decode(ids) == row["prompt"] + row["solution"]


def test_problems_are_deterministic_disjoint_and_solvable():
    a, b = ct.countdown_toy_problems(300, seed=3), ct.countdown_toy_problems(300, seed=3)
    assert a.to_dict() == b.to_dict() and a.column_names == ["prompt", "nums", "target", "solution"]
    assert ct.countdown_toy_problems(300, seed=4)["prompt"] != a["prompt"]
    train = ct.countdown_toy_problems(848, seed=0)
    held = ct.countdown_toy_problems(211, seed=0, split="eval")
    key = lambda row: (tuple(sorted(row["nums"])), row["target"])  # noqa: E731
    train_keys, held_keys = {key(r) for r in train}, {key(r) for r in held}
    assert len(train_keys) == 848 and len(held_keys) == 211  # every problem once: the splits are exhaustive
    assert not train_keys & held_keys
    for row in list(train) + list(held):
        assert row["prompt"] == ct.format_prompt(row["nums"], row["target"])
        assert len(row["nums"]) == 3 and all(1 <= x <= 9 for x in row["nums"])
        assert ct.is_reachable(row["solution"], row["nums"], row["target"])
    assert len(ct.countdown_toy_problems(1000, seed=0, split="eval")) == 1000  # beyond the pool: repeats
    with pytest.raises(ValueError):
        ct.countdown_toy_problems(5, split="test")


@pytest.mark.parametrize(
    "completion, score",
    [
        ("3*7", 1.0),
        ("7*3", 1.0),
        (" (3*7) ", 1.0),
        ("3*7<eos><pad>", 1.0),  # text after the end of sequence is not read
        ("3*7<eos>+5", 1.0),
        ([{"role": "assistant", "content": "7*3"}], 1.0),
        ("3+7", 0.0),  # a wrong value
        ("3-7", 0.0),
        ("3*7*1", 0.0),  # a number that was not given
        ("7*3+5-5", 0.0),  # 5 used twice
        ("21", 0.0),  # one number is not an equation
        ("3*7=21", 0.0),
        ("3*", 0.0),
        ("", 0.0),
        ("x", 0.0),
        ("__import__('os')", 0.0),
        ([], 0.0),
    ],
)
def test_reward_on_hand_made_cases(completion, score):
    assert ct.countdown_toy_reward(completions=[completion], nums=[[3, 7, 5]], target=[21]) == [score]


def test_reward_uses_each_number_at_most_once_and_all_three_may_be_used():
    nums = [[7, 2, 7]] * 5
    completions = ["7+7", "7*2", "7*2+7", "7*7-7*2", "(7-2)*7"]
    scores = ct.countdown_toy_reward(completions=completions, nums=nums, target=[14, 14, 21, 35, 35])
    assert scores == [1.0, 1.0, 1.0, 0.0, 1.0]  # 7 is given twice; 7*7-7*2 uses it three times
    assert ct.countdown_toy_reward(completions=["6/2"], nums=[[6, 2, 9]], target=[3]) == [0.0]  # no division
    with pytest.raises(ValueError):
        ct.countdown_toy_reward(completions=["a", "b"], nums=[[1, 2, 3]], target=[3])


def test_noisy_transcripts_swap_plus_and_minus_and_keep_products():
    assert [ct._noisy(s) for s in ("3+7", "7-3", "3*7")] == ["3-7", "7+3", "3*7"]
    tok = make_tokenizer()
    ids, labels = ct._transcripts(tok, [([3, 7, 5], 21, "3*7"), ([9, 5, 7], 14, "9+5")])
    assert tok.decode(ids[0], skip_special_tokens=True) == "3 7 5:21=3*7"
    assert tok.decode(labels[1][labels[1] != -100]) == "9+5<eos>"  # the loss is on the completion only
    assert (labels[0] != -100).sum() == 4


# --------------------------------------------------------------------------- the cached base


def test_the_base_is_built_once_cached_deterministic_and_rebuilt_when_incomplete(tmp_path, capsys):
    rng = torch.get_rng_state()
    first = ct.ensure_countdown_toy_base(tmp_path, **TINY)
    assert torch.equal(rng, torch.get_rng_state())  # the caller's RNG is left alone
    assert "building" in capsys.readouterr().out
    assert cache_listing(tmp_path) == [Path(first).name]  # no temporary dir left behind
    assert Path(first).name.startswith(f"countdown_toy_base-v{ct.FORMAT_VERSION}-")
    weights = Path(first) / "model.safetensors"
    stamp = weights.stat().st_mtime_ns
    assert ct.ensure_countdown_toy_base(tmp_path, **TINY) == first and weights.stat().st_mtime_ns == stamp
    assert "building" not in capsys.readouterr().out
    assert (
        ct.ensure_countdown_toy_base(tmp_path, **{**TINY, "log_every": 7}) == first
    )  # logging: same weights
    assert (
        ct.ensure_countdown_toy_base(tmp_path, seed=1, **TINY) != first
    )  # seed and settings are in the name
    with pytest.raises(TypeError, match="stepz"):
        ct.ensure_countdown_toy_base(tmp_path, stepz=3)

    before = load_file(weights)
    weights.unlink()  # an incomplete entry is rebuilt, the same by seed
    assert ct.ensure_countdown_toy_base(tmp_path, **TINY) == first
    assert "(missing model.safetensors); rebuilding it" in capsys.readouterr().out
    after = load_file(weights)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    record = json.loads((Path(first) / "pretrain.json").read_text())
    assert record["settings"]["steps"] == 3 and len(record["losses"]) == 3
    (Path(first) / "pretrain.json").write_text(json.dumps({**record, "format_version": 0}))
    assert "format_version 0" in pretrain.base_problem(first, "pretrain.json", ct.FORMAT_VERSION)
    assert AutoModelForCausalLM.from_pretrained(first).config.hidden_size == 32
    tok = AutoTokenizer.from_pretrained(first)  # the character tokenizer, loaded back as itself
    assert tok("3 7 5:21=3*7", add_special_tokens=False)["input_ids"] == [
        make_tokenizer().convert_tokens_to_ids(ch) for ch in "3 7 5:21=3*7"
    ]


class _FakeGroup:
    """torch.distributed as one rank of two sees it: initialised, world size 2, barriers counted."""

    def __init__(self, rank):
        self.rank, self.barriers = rank, 0

    def install(self, monkeypatch):
        dist = torch.distributed
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda: 2)
        monkeypatch.setattr(dist, "get_rank", lambda: self.rank)
        monkeypatch.setattr(dist, "barrier", lambda: setattr(self, "barriers", self.barriers + 1))
        monkeypatch.setenv("LOCAL_RANK", str(self.rank))


def test_under_torch_distributed_local_rank_0_builds_and_every_rank_passes_one_barrier(tmp_path, monkeypatch):
    other = _FakeGroup(1)
    other.install(monkeypatch)
    with pytest.raises(RuntimeError, match="did not build"):  # nothing built: rank 1 fails, never hangs
        ct.ensure_countdown_toy_base(tmp_path, **TINY)
    assert other.barriers == 1 and not list(tmp_path.iterdir())
    main_rank = _FakeGroup(0)
    main_rank.install(monkeypatch)
    path = ct.ensure_countdown_toy_base(tmp_path, **TINY)
    assert main_rank.barriers == 1 and pretrain.base_problem(path, "pretrain.json", ct.FORMAT_VERSION) is None
    other.install(monkeypatch)
    assert ct.ensure_countdown_toy_base(tmp_path, **TINY) == path and other.barriers == 2


# --------------------------------------------------------------------------- the names and the recipe


def test_the_names_resolve(monkeypatch, tmp_path):
    monkeypatch.setattr(ct, "ensure_countdown_toy_base", lambda: str(tmp_path))  # not the full base
    assert bases.local_base("toy-countdown") == str(tmp_path)
    config = GRPOConfig(model_name_or_path="toy-countdown", dataset="countdown-toy", seed=2)
    train = resolve_dataset(config.dataset, config, make_tokenizer(), "train")
    held = resolve_dataset(config.dataset, config, make_tokenizer(), "eval")
    assert len(train) == 2000 and len(held) == 200
    assert train[0]["prompt"] == ct.countdown_toy_problems(2000, seed=2)[0]["prompt"]
    assert {"nums", "target"} <= set(train.column_names)  # the reward's columns


def test_the_recipe_is_listed_and_trains_a_step_on_a_tiny_base(tmp_path, capsys):
    assert "toy-countdown" in shipped_recipes()
    assert main(["recipes"]) == 0 and "toy-countdown" in capsys.readouterr().out
    with recipe_file("toy-countdown") as path:
        config = GRPOConfig.from_yaml(path)
    assert config.model_name_or_path == "toy-countdown" and config.dataset == config.eval_dataset
    assert (config.num_generations, config.prompts_per_step, config.beta) == (8, 16, 0.04)
    base = ct.pretrain_countdown_toy_base(tmp_path / "base", **TINY)
    sets = {
        "model_name_or_path": base,
        "eval_limit": 4,
        "prompts_per_step": 2,
        "max_steps": 1,
        "output_dir": str(tmp_path / "run"),
    }
    args = ["train", "toy-countdown"] + [a for k, v in sets.items() for a in ("--set", f"{k}={v}")]
    assert main(args) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 1 and "eval/countdown_toy_reward" in summary["eval_after"]


def test_the_docstring_examples_run():
    import doctest

    result = doctest.testmod(ct)
    assert result.attempted >= 2 and result.failed == 0
