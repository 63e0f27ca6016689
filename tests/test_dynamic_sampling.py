"""Dynamic sampling (dynamic_sampling.py): groups of equal rewards dropped, the quota filled over rounds,
the round cap, epochs counted in prompts, completions.jsonl's marks, exact resume, two processes alike;
and the exact saving of update.zero_gradient_rows (the update equals the full computation)."""

import json

import pytest
import torch
from helpers import PROMPTS, Counter, adapter_state, assert_same_adapters, make_trainer, run_torchrun

from lora_grpo.dynamic_sampling import Round, dropped_kinds, informative_groups, sample_step
from lora_grpo.model.adapters import POLICY
from lora_grpo.rollout import Rollout
from lora_grpo.scorer import Scored
from lora_grpo.update import zero_gradient_rows


# ------------------------------------------------------------------------------ which groups carry signal
def test_equal_groups_are_dropped_exactly_and_a_near_tie_is_kept():
    per_func = torch.tensor([[1.0], [1.0], [1.0], [0.0], [0.5], [0.5 + 1e-7], [2.0], [2.0]])
    assert informative_groups(per_func, None, 2).tolist() == [False, True, True, False]
    # a threshold drops the near-tie too (and keeps the group of std 0.707)
    assert informative_groups(per_func, None, 2, min_std=1e-3).tolist() == [False, True, False, False]


def test_the_weighted_sum_decides_and_none_counts_as_zero():
    # two functions: (1, 0) and (0, 1) sum to the same reward with weights (1, 1): no signal
    per_func = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, float("nan")], [1.0, 0.0]])
    assert informative_groups(per_func, None, 2).tolist() == [False, False]
    assert informative_groups(per_func, [2.0, 1.0], 2).tolist() == [True, False]


def test_gdpo_keeps_a_group_where_any_function_varies():
    # normalize_then_sum normalises each function in its group: (1,0),(0,1) has signal there
    per_func = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [1.0, 1.0], [float("nan"), 3.0], [2.0, 3.0]])
    got = informative_groups(per_func, None, 2, aggregation="normalize_then_sum")
    assert got.tolist() == [True, False, False]  # a None is left out of its function's comparison
    assert informative_groups(per_func, [1.0, 0.0], 2, aggregation="normalize_then_sum")[0]


def test_a_row_no_function_scored_is_not_hidden():
    per_func = torch.tensor([[float("nan")], [float("nan")]])
    assert informative_groups(per_func, None, 2).tolist() == [True]  # the advantages' error names it


def test_dropped_groups_are_told_apart_by_the_first_reward():
    first = torch.tensor([1.0, 1.0, 0.0, float("nan"), 0.5, 0.5, 1.0, 0.0])
    dropped = torch.tensor([True, True, True, False])
    kinds = dropped_kinds(first, dropped, 2, threshold=1.0)
    assert kinds == {"dropped_all_correct": 1, "dropped_all_wrong": 2, "dropped_other": 0}
    assert dropped_kinds(first, torch.tensor([False, False, False, True]), 2, 1.0)["dropped_other"] == 1


# ------------------------------------------------------------------------------ rounds of a step
def _rollout(prompt_lengths, completion_lengths, first_id: int) -> Rollout:
    """A rollout whose row i has prompt tokens first_id + i (left-padded with 0) and completion
    tokens 100 + first_id + i (right-padded)."""
    B, P, T = len(prompt_lengths), max(prompt_lengths), max(completion_lengths)
    prompt_ids, prompt_mask = torch.zeros(B, P, dtype=torch.long), torch.zeros(B, P, dtype=torch.long)
    ids, mask = torch.zeros(B, T, dtype=torch.long), torch.zeros(B, T, dtype=torch.long)
    for i, (p, t) in enumerate(zip(prompt_lengths, completion_lengths)):
        prompt_ids[i, P - p :], prompt_mask[i, P - p :] = first_id + i, 1
        ids[i, :t], mask[i, :t] = 100 + first_id + i, 1
    return Rollout(
        prompt_ids,
        prompt_mask,
        ids,
        mask,
        torch.zeros(B, dtype=torch.bool),
        [f"p{first_id + i}" for i in range(B)],
        [f"c{first_id + i}" for i in range(B)],
        sampling_logprobs=-mask.float(),
    )


def _round(first_id: int, rewards: list[float], prompt_len: int, completion_len: int) -> Round:
    B = len(rewards)
    rollout = _rollout([prompt_len] * B, [completion_len - (i % 2) for i in range(B)], first_id)
    per_func = torch.tensor(rewards, dtype=torch.float32).view(-1, 1)
    scored = Scored(per_func[:, 0], per_func, {}, list(rollout.completions), {"note": [first_id] * B})
    return Round({"prompt": [f"q{first_id + g}" for g in range(B // 2)]}, rollout, scored)


def _sample(rounds, quota, max_rounds):
    queue = list(rounds[1:])
    return sample_step(
        rounds[0],
        lambda: queue.pop(0) if queue else None,
        group_size=2,
        quota=quota,
        max_rounds=max_rounds,
        informative=lambda s: informative_groups(s.per_func, None, 2),
        classify=lambda s, dropped: dropped_kinds(s.per_func[:, 0], dropped, 2, 1.0),
        pad_token_id=0,
        names=["r"],
    )


def test_rounds_fill_the_quota_in_sampling_order_and_stop_there():
    rounds = [
        _round(0, [1, 1, 0, 1, 0, 0], prompt_len=2, completion_len=3),  # groups: correct, signal, wrong
        _round(10, [0, 1, 1, 1, 1, 0], prompt_len=4, completion_len=5),  # signal, correct, signal
        _round(20, [0, 1, 0, 1, 0, 1], prompt_len=1, completion_len=1),  # never drawn
    ]
    step = _sample(rounds, quota=3, max_rounds=4)
    assert step.counts["rounds"] == 2 and step.counts["prompts"] == 6
    assert step.groups.tolist() == [1, 3, 5] and step.counts["filled"] == 0
    assert step.counts["dropped_all_correct"] == 2 and step.counts["dropped_all_wrong"] == 1
    rows, rollout, scored = step.trained(["r"])
    assert rows["prompt"] == ["q1", "q10", "q12"]
    assert rollout.prompts == ["p2", "p3", "p10", "p11", "p14", "p15"]
    assert scored.per_func[:, 0].tolist() == [0, 1, 0, 1, 1, 0] and scored.extra["note"] == [
        0,
        0,
        10,
        10,
        10,
        10,
    ]
    # the padded concatenation keeps every row's tokens: prompt left-padded, completion right-padded
    assert rollout.prompt_ids.shape == (6, 4) and rollout.completion_ids.shape == (6, 5)
    for row, original in zip(rollout.prompts, rollout.prompt_ids):
        i = int(row[1:])
        assert original[original != 0].tolist() == [i] * (2 if i < 10 else 4)
    assert rollout.completion_mask.sum(1).tolist() == [3, 2, 5, 4, 5, 4]
    assert torch.equal(rollout.sampling_logprobs, -rollout.completion_mask.float())


def test_the_round_cap_and_the_end_of_the_data_fill_a_short_step_with_the_earliest_dropped_groups():
    rounds = [_round(0, [1, 1, 0, 1], 2, 2), _round(10, [0, 0, 1, 1], 2, 2), _round(20, [0, 1, 0, 1], 2, 2)]
    capped = _sample(rounds, quota=2, max_rounds=2)
    assert capped.counts["rounds"] == 2 and capped.groups.tolist() == [1, 0]  # 1 informative, 1 filled
    assert capped.counts["filled"] == 1 and capped.counts["informative"] == 1
    spent = _sample(rounds[:1], quota=2, max_rounds=5)  # more() has no prompts left
    assert spent.counts["rounds"] == 1 and spent.groups.tolist() == [1, 0]


# ------------------------------------------------------------------------------ in a run
def half_constant(prompts, completions, **kwargs):
    """Prompts of even i score 1 whatever the completion (no signal); the others a digit share."""
    return [
        1.0 if int(p.split("+")[0]) % 2 == 0 else sum(ch.isdigit() for ch in c) / max(1, len(c))
        for p, c in zip(prompts, completions)
    ]


DYNAMIC = dict(dynamic_sampling=True, beta=0.0, log_completions=True, micro_batch_size=8)


def test_a_run_trains_only_on_informative_groups(tiny_base_dir, tmp_path):
    trainer = make_trainer(tiny_base_dir, str(tmp_path), reward_funcs=[half_constant], max_steps=3, **DYNAMIC)
    seen = []
    original = trainer.scorer.advantages

    def remember(rollout, rows, scored=None, sampled=None):
        seen.append((list(rows["prompt"]), sampled))
        return original(rollout, rows, scored, sampled)

    trainer.scorer.advantages = remember
    trainer.train()
    history = trainer.state.log_history
    steps = [h for h in history if "dynamic_sampling/rounds" in h]
    assert len(steps) == 3
    for (prompts, _), h in zip(seen, steps):
        informative, filled = h["dynamic_sampling/informative_groups"], h["dynamic_sampling/filled_groups"]
        trained_even = sum(int(p.split("+")[0]) % 2 == 0 for p in prompts)
        assert len(prompts) == 2  # the quota: prompts_per_step
        assert trained_even <= filled == 2 - min(2, informative)  # constant prompts train only as filling
        assert h["dynamic_sampling/prompts_consumed"] == 2 * h["dynamic_sampling/rounds"]
        kinds = ("dropped_all_correct", "dropped_all_wrong", "dropped_other")
        dropped = sum(h[f"dynamic_sampling/{k}"] for k in kinds)
        assert dropped == h["dynamic_sampling/prompts_consumed"] - informative
    assert sum(h["dynamic_sampling/rounds"] for h in steps) > 3  # some step needed a second round
    assert trainer.state.batches.epochs_done == pytest.approx(
        sum(h["dynamic_sampling/prompts_consumed"] for h in steps) / len(PROMPTS)
    )
    records = [json.loads(line) for line in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    first_step = [r for r in records if r["step"] == 1]
    assert len(first_step) == 4 * steps[0]["dynamic_sampling/prompts_consumed"]  # every completion sampled
    for r in first_step:
        if r["dropped"]:
            assert r["advantage"] == 0
    assert sum(not r["dropped"] for r in first_step) == 8  # the trained groups: 2 prompts × 4


def test_num_epochs_counts_the_prompts_consumed(tiny_base_dir, tmp_path):
    rows = PROMPTS[:8]
    trainer = make_trainer(
        tiny_base_dir,
        str(tmp_path),
        reward_funcs=[half_constant],
        train_dataset=rows,
        max_steps=0,
        num_epochs=1,
        dynamic_sampling_max_rounds=2,
        **DYNAMIC,
    )
    assert trainer.total_steps == 4  # an upper bound: every step one round
    trainer.train()
    consumed = sum(h["dynamic_sampling/prompts_consumed"] for h in trainer.state.log_history if "epoch" in h)
    assert consumed == len(rows)  # one pass over the data, however many steps it took
    assert trainer.state.global_step < 4 and trainer.state.epoch == 1.0


def test_resume_equals_the_uninterrupted_run(tiny_base_dir, tmp_path):
    kw = dict(reward_funcs=[half_constant], max_steps=3, **DYNAMIC)
    full = make_trainer(tiny_base_dir, str(tmp_path / "full"), save_steps=1, save_total_limit=0, **kw)
    full.train()
    resumed = make_trainer(
        tiny_base_dir,
        str(tmp_path / "resumed"),
        resume_from_checkpoint=str(tmp_path / "full" / "run" / "checkpoint-1"),
        **kw,
    )
    resumed.train()
    assert_same_adapters(full.model, resumed.model)
    keys = ("dynamic_sampling/rounds", "dynamic_sampling/prompts_consumed", "reward/mean", "loss")
    tail = [[h[k] for k in keys] for h in full.state.log_history[1:] if "loss" in h]
    assert tail == [[h[k] for k in keys] for h in resumed.state.log_history[1:] if "loss" in h]
    assert resumed.state.batches.state_dict() == full.state.batches.state_dict()


def test_with_several_steps_per_rollout_a_moving_reference_and_planned_sizes(tiny_base_dir, tmp_path):
    trainer = make_trainer(
        tiny_base_dir,
        str(tmp_path),
        reward_funcs=[half_constant],
        max_steps=4,
        dynamic_sampling=True,
        steps_per_generation=2,
        num_iterations=2,
        beta=0.04,
        ref_sync_steps=2,
        ref_sync_alpha=0.5,
        micro_batch_size="auto",
    )
    trainer.train()
    history = trainer.state.log_history
    rollouts = [h for h in history if "dynamic_sampling/rounds" in h]
    assert len(history) == 4 and len(rollouts) == 1  # one rollout feeds 2 × 2 optimizer steps
    assert rollouts[0]["dynamic_sampling/prompts_consumed"] % 4 == 0  # rounds of prompts_per_generation
    assert [h.get("sync/reason") for h in history] == [None, "steps", None, "steps"]
    assert trainer.memory_plan is not None and isinstance(trainer.micro_batch_size, int)


def test_with_an_environment_each_round_scores_its_own_episodes(qwen_tool_base_dir, tmp_path):
    from lora_grpo import GRPOConfig, GRPOTrainer

    config = GRPOConfig(
        model_name_or_path=qwen_tool_base_dir,
        num_generations=4,
        prompts_per_step=2,
        max_completion_length=24,
        max_steps=1,
        save_steps=0,
        micro_batch_size=8,
        gradient_checkpointing=False,
        output_dir=str(tmp_path / "run"),
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=3,
        log_completions=True,
        temperature=1.5,
    )
    chat = [
        {"prompt": [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]} for r in PROMPTS[:12]
    ]
    trainer = GRPOTrainer(config, train_dataset=chat, environment_factory=Counter)
    rounds = []
    score = trainer.scorer.score

    def remember(rollout, rows, group_size):
        scored = score(rollout, rows, group_size)
        rounds.append([e.calls for e in trainer.sampler.environments])  # this round's episodes
        assert scored.per_func[:, 0].tolist() == rounds[-1]
        return scored

    trainer.scorer.score = remember
    trainer.train()
    step = trainer.state.log_history[0]
    assert step["dynamic_sampling/rounds"] == len(rounds) and len(rounds) >= 1
    records = [json.loads(x) for x in (tmp_path / "run" / "completions.jsonl").read_text().splitlines()]
    assert len(records) == 8 * len(rounds) and sum(not r["dropped"] for r in records) == 8
    assert all(isinstance(r["completion"], list) for r in records)  # the conversations, every round's


TWO_PROCESSES = """
import json, sys, torch
from lora_grpo import GRPOConfig, GRPOTrainer
from test_dynamic_sampling import half_constant

base, out = sys.argv[1], sys.argv[2]
prompts = [{"prompt": f"{i}+{i % 5}="} for i in range(24)]
cfg = GRPOConfig(model_name_or_path=base, quantization="none", lora_r=4, num_generations=4, prompts_per_step=2,
                 max_completion_length=5, micro_batch_size=8, max_steps=3, beta=0.0, dynamic_sampling=True,
                 learning_rate=1e-2, output_dir=out + "/run", save_steps=0, gradient_checkpointing=False)
t = GRPOTrainer(cfg, reward_funcs=[half_constant], train_dataset=prompts)
t.train()
sums = {n: p.detach().double().sum().item() for n, p in t.model.named_parameters() if "lora_" in n}
# one epoch of each process's 12 prompts, at most 2 rounds a step: the processes agree when it ends
cfg.max_steps, cfg.num_epochs, cfg.dynamic_sampling_max_rounds, cfg.output_dir = 0, 1, 2, out + "/epoch"
e = GRPOTrainer(cfg, reward_funcs=[half_constant], train_dataset=prompts)
e.train()
# Process 1's groups carry no signal: it draws dynamic_sampling_max_rounds rounds a step, and its epochs end first.
rank = t.accelerator.process_index
def uneven(prompts, completions, **kwargs):
    return [0.0] * len(completions) if rank == 1 else half_constant(prompts, completions, **kwargs)
cfg.max_steps, cfg.num_epochs, cfg.dynamic_sampling_max_rounds, cfg.output_dir = 3, 1, 3, out + "/synced"
cfg.beta, cfg.ref_sync_every_epoch, cfg.ref_sync_alpha = 0.04, True, 0.5
y = GRPOTrainer(cfg, reward_funcs=[uneven], train_dataset=prompts[:16])
y.train()
reference = {n: p.detach().double().sum().item() for n, p in y.model.named_parameters() if ".reference." in n}
json.dump({"sums": sums, "history": t.state.log_history, "epoch_steps": e.state.global_step,
           "epochs_done": e.state.batches.epochs_done, "reference": reference,
           "syncs": [i + 1 for i, h in enumerate(y.state.log_history) if h.get("sync/event")]},
          open(f"{out}/rank{rank}.json", "w"))
"""


def test_two_processes_fill_their_own_quota_and_stay_identical(tiny_base_dir, tmp_path):
    run_torchrun(TWO_PROCESSES, tmp_path, tiny_base_dir, tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for name in r0["sums"]:
        assert r0["sums"][name] == pytest.approx(r1["sums"][name], rel=1e-6, abs=1e-9), name
    for h0, h1 in zip(r0["history"], r1["history"]):
        for key in ("dynamic_sampling/rounds", "dynamic_sampling/prompts_consumed", "reward/mean", "loss"):
            assert h0[key] == pytest.approx(h1[key]), key
    # each process drew its own prompts at its own pace: the counts are over both
    assert all(h["dynamic_sampling/prompts_consumed"] >= 4 for h in r0["history"] if "loss" in h)
    assert r0["epoch_steps"] == r1["epoch_steps"] <= 6  # the same last step; 6 = one round a step
    assert max(r0["epochs_done"], r1["epochs_done"]) >= 1  # the first process out of prompts ended it
    # An epoch ends on every process when it ends on any: its sync at the same step, one reference slot everywhere
    # (each process synced at its own epoch's end before; with the front door's epoch save, one alone gathered).
    assert r0["syncs"] == r1["syncs"] and r0["syncs"], (r0["syncs"], r1["syncs"])
    assert r0["reference"] == pytest.approx(r1["reference"], rel=1e-6, abs=1e-9)


TWO_PROCESSES_RESUME = """
import json, sys, torch
from lora_grpo import GRPOConfig, GRPOTrainer
from test_dynamic_sampling import half_constant

base, out = sys.argv[1], sys.argv[2]
prompts = [{"prompt": f"{i}+{i % 5}="} for i in range(24)]

def run(output_dir, **kw):
    cfg = GRPOConfig(model_name_or_path=base, quantization="none", lora_r=4, num_generations=4, prompts_per_step=2,
                     max_completion_length=5, micro_batch_size=8, max_steps=4, beta=0.0, dynamic_sampling=True,
                     learning_rate=1e-2, output_dir=output_dir, gradient_checkpointing=False, **kw)
    t = GRPOTrainer(cfg, reward_funcs=[half_constant], train_dataset=prompts)
    t.train()
    return t

full = run(out + "/full", save_steps=2)
resumed = run(out + "/resumed", save_steps=0, resume_from_checkpoint=out + "/full/checkpoint-2")
pairs = zip(full.model.named_parameters(), resumed.model.named_parameters())
saved = torch.load(out + "/full/checkpoint-2/trainer_state.pt", weights_only=True)
positions = [p.get("batches") for p in saved["process_state"]]
json.dump({"same": all(torch.equal(p, q) for (_, p), (_, q) in pairs), "positions": positions,
           "rounds": [[m.get("dynamic_sampling/rounds") for m in t.state.log_history] for t in (full, resumed)]},
          open(f"{out}/resume{full.accelerator.process_index}.json", "w"))
"""


def test_two_processes_resume_exactly_each_at_its_own_data_position(tiny_base_dir, tmp_path):
    """Each process draws its prompts at its own pace: a checkpoint keeps every process's own data position (the
    main process's alone sent the others to its place), so the resumed run is the uninterrupted one."""
    run_torchrun(TWO_PROCESSES_RESUME, tmp_path, tiny_base_dir, tmp_path)
    r0, r1 = (json.loads((tmp_path / f"resume{r}.json").read_text()) for r in (0, 1))
    assert r0["same"] and r1["same"]
    assert r0["positions"][0] != r0["positions"][1]  # the processes were at other places
    assert r0["rounds"][0] == r0["rounds"][1]  # each step drew as many rounds


# ------------------------------------------------------------------------------ the exact saving
@pytest.mark.parametrize("loss_type", ["dapo", "grpo", "dr_grpo", "cispo", "sapo", "vespo", "luspo"])
def test_leaving_out_zero_advantage_rows_gives_the_full_update(
    tiny_base_dir, tmp_path, loss_type, monkeypatch
):
    from lora_grpo import update as update_module
    from lora_grpo.batch import Batch

    trainer = make_trainer(tiny_base_dir, str(tmp_path), beta=0.0, loss_type=loss_type, micro_batch_size=1)
    rollout = trainer.generate(["1+1=", "2+2=", "3+3="])
    advantages = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.0, -1.0, 0.0, 0.5, 0.0, 0.0, 0.0, 0.0])
    batch = Batch.from_rollout(rollout, advantages, mask_truncated_completions=False)
    assert zero_gradient_rows(batch.advantages, batch.completion_mask, trainer.config).sum() == 9

    def grads(skip: bool, micro_batch_size: int):
        if not skip:
            monkeypatch.setattr(update_module, "zero_gradient_rows", lambda *a: None)
        else:
            monkeypatch.undo()
        for p in trainer.params:
            p.grad = None
        captured = []  # the gradients the optimizer would step with (the adapters stay as they are)
        monkeypatch.setattr(
            trainer.update,
            "_step_unless_nonfinite",
            lambda *a: captured.extend(p.grad.clone() for p in trainer.params) or False,
        )
        metrics = trainer.update(batch, micro_batch_size)
        return captured, metrics

    for micro_batch_size in (1, 4):
        full, full_metrics = grads(skip=False, micro_batch_size=micro_batch_size)
        saved, saved_metrics = grads(skip=True, micro_batch_size=micro_batch_size)
        assert any(g.abs().sum() > 0 for g in full)
        for a, b in zip(full, saved):
            if micro_batch_size == 1:  # one row per forward: the same kernels, bit for bit
                assert torch.equal(a, b)
            else:  # other rows share the forwards: the same up to float rounding
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
        assert saved_metrics["loss"] == pytest.approx(full_metrics["loss"], rel=1e-6, abs=1e-9)
        assert saved_metrics["grad_norm"] == pytest.approx(full_metrics["grad_norm"], rel=1e-5)
        assert full_metrics["zero_advantage_skipped"] == 0 and saved_metrics["zero_advantage_skipped"] == 0.75
    # Off-policy (ratio e, past 1 + ε): the rows left out clip nothing, so the clip fractions' token means count
    # their tokens as TRL's do; over the trained rows alone they came out larger (found in review).
    batch.old_logp = trainer.log_probs(batch) - 1.0
    full, full_metrics = grads(skip=False, micro_batch_size=4)
    saved, saved_metrics = grads(skip=True, micro_batch_size=4)
    means = [k for k in full_metrics if k.startswith("clip_ratio/") and not k.endswith(("_min", "_max"))]
    for k in means:
        assert saved_metrics[k] == pytest.approx(full_metrics[k], rel=1e-5, abs=1e-9), k


def test_the_saving_is_off_where_a_zero_advantage_row_still_has_a_gradient(tiny_base_dir, tmp_path):
    from lora_grpo import GRPOConfig

    advantages, mask = torch.tensor([0.0, 1.0, 0.0]), torch.ones(3, 2)
    base = dict(model_name_or_path="toy", beta=0.0)
    assert zero_gradient_rows(advantages, mask, GRPOConfig(**base)).tolist() == [True, False, True]
    for off in (
        {"beta": 0.04},
        {"entropy_coef": 0.01},
        {"use_adaptive_entropy": True},
        {"top_entropy_quantile": 0.5},
        {"loss_type": "bnpo"},
    ):
        assert zero_gradient_rows(advantages, mask, GRPOConfig(**{**base, **off})) is None, off
    # a row without loss tokens is idle too, and every row may be
    assert zero_gradient_rows(torch.ones(2), torch.tensor([[0, 0], [1, 1]]), GRPOConfig(**base)).tolist() == [
        True,
        False,
    ]
    assert zero_gradient_rows(torch.zeros(3), mask, GRPOConfig(**base)).tolist() == [True, True, True]


def test_a_step_where_every_reward_is_equal_runs_no_forward_and_steps_as_the_full_update(
    tiny_base_dir, tmp_path, monkeypatch
):
    """All 16 rewards equal at beta 0: no row has a gradient, so the update runs no forward or backward,
    yet the optimizer steps with zero gradients exactly as after the full computation (Adam's moments
    from the step before still move the adapter)."""
    from lora_grpo import update as update_module
    from lora_grpo.batch import Batch

    def two_updates(skip: bool):
        trainer = make_trainer(tiny_base_dir, str(tmp_path / str(skip)), beta=0.0, micro_batch_size=4)
        rollout = trainer.generate(["1+1=", "2+2="])
        signal = Batch.from_rollout(
            rollout,
            torch.tensor([1.0, -1.0, 0.5, -0.5, 1.0, -1.0, 0.0, 0.0]),
            mask_truncated_completions=False,
        )
        equal = Batch.from_rollout(rollout, torch.zeros(8), mask_truncated_completions=False)
        trainer.update(signal, 4)
        forwards = []
        original = trainer.update.forward
        monkeypatch.setattr(
            trainer.update, "forward", lambda *a, **k: forwards.append(1) or original(*a, **k)
        )
        if not skip:
            monkeypatch.setattr(update_module, "zero_gradient_rows", lambda *a: None)
        metrics = trainer.update(equal, 4)
        monkeypatch.undo()
        return adapter_state(trainer.model, POLICY), metrics, len(forwards)

    full, full_metrics, full_forwards = two_updates(skip=False)
    saved, saved_metrics, saved_forwards = two_updates(skip=True)
    assert full_forwards == 2 and saved_forwards == 0
    for name in full:
        assert torch.equal(full[name], saved[name]), name
    assert saved_metrics["zero_advantage_skipped"] == 1.0 and full_metrics["zero_advantage_skipped"] == 0.0
    assert saved_metrics["loss"] == 0.0 and saved_metrics["grad_norm"] == 0.0 == full_metrics["grad_norm"]
    assert "entropy" in full_metrics and "entropy" not in saved_metrics


def test_the_trl_front_door_takes_it_as_an_extension_field(tiny_base_dir, tmp_path):
    from datasets import Dataset

    from lora_grpo.trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(
        output_dir=str(tmp_path / "run"),
        use_cpu=True,
        bf16=False,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        max_steps=2,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        dynamic_sampling=True,
        dynamic_sampling_max_rounds=3,
    )
    assert GRPOConfig(output_dir=str(tmp_path)).dynamic_sampling is False  # TRL's behaviour by default
    trainer = GRPOTrainer(
        model=tiny_base_dir, reward_funcs=half_constant, args=args, train_dataset=Dataset.from_list(PROMPTS)
    )
    assert trainer.native.config.dynamic_sampling and trainer.native.config.dynamic_sampling_max_rounds == 3
    trainer.train()
    logged = [r for r in trainer.state.log_history if "dynamic_sampling/rounds" in r]
    assert len(logged) == 2 and all(1 <= r["dynamic_sampling/rounds"] <= 3 for r in logged)
