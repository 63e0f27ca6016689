"""Two processes (torchrun, CPU, gloo; what `accelerate launch` starts on GPUs): gradients are averaged,
so both processes hold identical policy and reference adapters after training, though each sampled its own prompts."""

import json
import textwrap

import pytest
from helpers import run_torchrun

from lora_grpo.model.adapters import POLICY, REFERENCE

# What both scripts start with: the tiny base and an output dir from the command line, 16 prompts.
PRELUDE = """
import json, random, sys, torch
from lora_grpo import GRPOConfig, GRPOTrainer

from helpers import digit_share

base, out = sys.argv[1], sys.argv[2]
prompts = [{"prompt": f"{i}+{i % 5}="} for i in range(16)]
"""

SCRIPT = PRELUDE + textwrap.dedent(
    """
    cfg = GRPOConfig(model_name_or_path=base, quantization="none", lora_r=4, num_generations=4,
                     prompts_per_step=2, max_completion_length=5, micro_batch_size=4, max_steps=2,
                     beta=0.04, ref_sync_steps=1, ref_sync_alpha=0.5, learning_rate=1e-2,
                     output_dir=out + "/run", save_steps=0, gradient_checkpointing=False)
    sampled, drawn = [], []
    def digits(prompts, completions, **kwargs):
        sampled.extend(prompts[::4])  # a group's prompt once
        drawn.append(random.random())  # what a reward function, a tool or an environment draws
        return digit_share(prompts, completions, **kwargs)
    t = GRPOTrainer(cfg, reward_funcs=[digits], train_dataset=prompts)
    t.train()
    rank = t.accelerator.process_index
    sums = {n: p.detach().double().sum().item() for n, p in t.model.named_parameters() if "lora_" in n}
    record = {"prompts": sampled, "rows": len(t.train_dataset), "sums": sums, "history": t.state.log_history,
              "drawn": drawn}
    json.dump(record, open(f"{out}/rank{rank}.json", "w"))
    """
)


def test_two_processes_stay_in_sync(tiny_base_dir, tmp_path):
    # accelerate's launcher has no multi-process CPU flag; torchrun sets the same environment.
    run_torchrun(SCRIPT, tmp_path, tiny_base_dir, tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    # each process sampled its own prompts: its slice of each batch of the whole dataset, which it holds
    assert len(r0["prompts"]) == len(r1["prompts"]) == 4 and set(r0["prompts"]).isdisjoint(r1["prompts"])
    assert r0["rows"] == r1["rows"] == 16
    assert r0["sums"].keys() == r1["sums"].keys()
    for name in r0["sums"]:
        assert r0["sums"][name] == pytest.approx(r1["sums"][name], rel=1e-6, abs=1e-9), name
    # Step metrics are gathered over both processes: every process logs the same values.
    for h0, h1 in zip(r0["history"], r1["history"]):
        for key in ("reward/mean", "reward/std", "kl", "completion_length/mean", "entropy", "loss"):
            assert h0[key] == pytest.approx(h1[key], rel=1e-6, abs=1e-9), key
        # the run's throughput, both processes' tokens over the slower one's time (each its own before)
        assert h0["tokens_per_second"] == h1["tokens_per_second"] > 0
    policy_b = [v for k, v in r0["sums"].items() if f"lora_B.{POLICY}." in k]
    ref_b = [v for k, v in r0["sums"].items() if f"lora_B.{REFERENCE}." in k]
    assert any(v != 0 for v in policy_b) and any(v != 0 for v in ref_b)  # both adapters moved
    # The global streams are each process's own once the adapters are built (TRL's set_seed(device_specific=True)):
    # an environment drawing its tasks with random gave every process the same ones.
    assert len(r0["drawn"]) == len(r1["drawn"]) == 2 and set(r0["drawn"]).isdisjoint(r1["drawn"])


RESUME_SCRIPT = PRELUDE + textwrap.dedent(
    """
    def run(output_dir, **kw):
        cfg = GRPOConfig(model_name_or_path=base, quantization="none", lora_r=4, lora_dropout=0.3, num_generations=4,
                         prompts_per_step=2, max_completion_length=5, micro_batch_size=4, max_steps=3, beta=0.04,
                         learning_rate=1e-2, output_dir=output_dir, gradient_checkpointing=False, **kw)
        t = GRPOTrainer(cfg, reward_funcs=[digit_share], train_dataset=prompts)
        t.train()
        return t
    full = run(out + "/full", save_steps=1, save_total_limit=5)
    resumed = run(out + "/resumed", save_steps=0, resume_from_checkpoint=out + "/full/checkpoint-1")
    rank = full.accelerator.process_index
    pairs = zip(full.model.named_parameters(), resumed.model.named_parameters())
    same = all(torch.equal(p, q) for (_, p), (_, q) in pairs)
    loss = [[m["loss"] for m in t.state.log_history] for t in (full, resumed)]
    json.dump({"same": same, "loss": loss}, open(f"{out}/resume{rank}.json", "w"))
    """
)


def test_two_processes_resume_exactly_with_lora_dropout(tiny_base_dir, tmp_path):
    # LoRA dropout draws from each process's global RNG, which differ after a step: each process
    # must get its own RNG states back, not process 0's.
    run_torchrun(RESUME_SCRIPT, tmp_path, tiny_base_dir, tmp_path)
    for rank in (0, 1):
        record = json.loads((tmp_path / f"resume{rank}.json").read_text())
        assert record["same"], f"process {rank}: resumed adapters differ from the uninterrupted run"
        assert record["loss"][0] == record["loss"][1]


OVERFLOW_SCRIPT = PRELUDE + textwrap.dedent(
    """
    cfg = GRPOConfig(model_name_or_path=base, quantization="none", torch_dtype="float16", lora_r=4,
                     num_generations=4, prompts_per_step=2, max_completion_length=5, micro_batch_size=4,
                     max_steps=2, beta=0.04, learning_rate=1e-2, output_dir=out + "/run", save_steps=0,
                     gradient_checkpointing=False)
    t = GRPOTrainer(cfg, reward_funcs=[digit_share], train_dataset=prompts)
    rank = t.accelerator.process_index
    real = t.update.accumulate

    def overflow_on_rank_1(*a, **k):  # the first step's gradients overflow on process 1 alone
        out = real(*a, **k)
        if rank == 1 and t.state.global_step == 0:
            t.params[0].grad.view(-1)[0] = float("inf")
        return out

    t.update.accumulate = overflow_on_rank_1
    t.train()
    sums = {n: p.detach().double().sum().item() for n, p in t.model.named_parameters() if "lora_" in n}
    json.dump({"sums": sums, "history": t.state.log_history}, open(f"{out}/rank{rank}.json", "w"))
    """
)


def test_a_float16_overflow_on_one_process_skips_the_step_on_both(tiny_base_dir, tmp_path):
    """The gradients are averaged before they are unscaled, so an overflow anywhere is an overflow everywhere:
    both processes skip the step and halve the scale, and their adapters stay identical."""
    run_torchrun(OVERFLOW_SCRIPT, tmp_path, tiny_base_dir, tmp_path)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    for record in (r0, r1):
        assert [m["skipped_nonfinite"] for m in record["history"]] == [1.0, 0.0]
        assert [m["loss_scale"] for m in record["history"]] == [2.0**16, 2.0**15]
    assert r0["sums"] == r1["sums"]
    assert any(v != 0 for k, v in r0["sums"].items() if f"lora_B.{POLICY}." in k)  # the second step trained


FAILURE_SCRIPT = PRELUDE + textwrap.dedent(
    """
    from lora_grpo.run.failures import StepFailed

    def config(output_dir, **kw):
        return GRPOConfig(model_name_or_path=base, quantization="none", lora_r=4, num_generations=4, prompts_per_step=2,
                          max_completion_length=5, micro_batch_size=4, max_steps=3, beta=0.04, learning_rate=1e-2,
                          output_dir=output_dir, save_steps=0, gradient_checkpointing=False, **kw)

    evals = [{"prompt": f"eval {i}+1="} for i in range(4)]
    failure = {}  # the stage that raises, on which process

    def reward(prompts, completions, **kwargs):  # raises in step 2's rollout, or in the eval after step 2
        t, rank = failure.get("trainer"), int(__import__("os").environ["RANK"])
        evaluating = prompts[0].startswith("eval")
        if t is not None and rank == failure["rank"] and evaluating == (failure["where"] == "eval"):
            if t.state.global_step == (2 if evaluating else 1):
                raise KeyError("answer")
        return digit_share(prompts, completions, **kwargs)

    def train(output_dir, where=None, failing=None, **kw):
        t = GRPOTrainer(config(output_dir, **kw), reward_funcs=[reward], train_dataset=prompts, eval_dataset=evals)
        failure.clear()
        if where in ("reward", "eval"):
            failure.update(trainer=t, rank=failing, where=where)
        elif where in ("update", "entropy") and t.accelerator.process_index == failing:
            real = t.update.forward
            def broken(*a, **k):  # step 2's training forward runs out of memory
                if t.state.global_step == 1 and k.get("return_entropy"):
                    raise KeyError("answer")
                return real(*a, **k)
            t.update.forward = broken
        try:
            t.train()
            return t, None
        except StepFailed as e:
            return t, e

    rank = int(__import__("os").environ["RANK"])
    said = {}
    # entropy: each micro-batch gathers entropies (top_entropy_quantile < 1): the processes agree before each gather
    for where, failing in (("reward", 1), ("update", 0), ("eval", 0), ("entropy", 0)):
        extra = {"top_entropy_quantile": 0.5} if where == "entropy" else {}
        t, error = train(f"{out}/{where}", where, failing, eval_steps=2 if where == "eval" else 0, **extra)
        said[where] = {"error": str(error), "checkpoint": str(error.checkpoint), "stage": error.stage}
    # the reward failure's checkpoint of step 1 resumes into the run an uninterrupted one is
    whole, _ = train(f"{out}/whole")
    resumed, _ = train(f"{out}/resumed", resume_from_checkpoint=f"{out}/reward/checkpoint-1")
    pairs = zip(whole.model.named_parameters(), resumed.model.named_parameters())
    said["same"] = all(torch.equal(p, q) for (_, p), (_, q) in pairs)
    json.dump(said, open(f"{out}/failed{rank}.json", "w"))
    """
)


def test_a_step_failing_on_one_process_stops_both_and_keeps_the_last_finished_step(tiny_base_dir, tmp_path):
    """A reward function, an update's forward or an eval that raises on one process alone: every process learns it
    before the step's next collective, so both stop in that stage together and the last finished step is
    checkpointed as in one process (before: the other process died in a collective the failing one had left,
    blaming a closed connection, and nothing was kept); its checkpoint resumes exactly."""
    run_torchrun(FAILURE_SCRIPT, tmp_path, tiny_base_dir, tmp_path)
    ranks = [json.loads((tmp_path / f"failed{r}.json").read_text()) for r in (0, 1)]
    # (an eval fails after its step's update: that step is kept, its end pending; 4 eval prompts are one chunk, the
    # main process's)
    for where, failing, step in (("reward", 1, 1), ("update", 0, 1), ("eval", 0, 2), ("entropy", 0, 1)):
        for rank, said in enumerate(ranks):
            # a reward function's own error names its stage; the entropy case is an update's
            assert said[where]["stage"] in (where, "reward", "update")
            assert said[where]["checkpoint"] == str(tmp_path / where / f"checkpoint-{step}"), (where, rank)
            assert f"checkpoint written to {tmp_path / where / f'checkpoint-{step}'}" in said[where]["error"]
            if rank != failing:
                cause = (
                    f"after {step} of 3 optimizer steps: reward function 'reward' raised KeyError: 'answer'"
                    if where in ("reward", "eval")
                    else "the update raised KeyError: 'answer'"
                )
                assert f"process {failing} stopped: {cause}" in said[where]["error"]
        assert (tmp_path / where / f"checkpoint-{step}" / "lora_grpo_state.json").is_file()
    assert ranks[0]["same"] and ranks[1]["same"]


OTHER_COUNT_SCRIPT = PRELUDE + textwrap.dedent(
    """
    import logging
    logging.basicConfig()
    resuming = len(sys.argv) > 3  # the second run: two processes resume the first's checkpoint of one
    kw = dict(resume_from_checkpoint=out + "/one/checkpoint-2", save_steps=0) if resuming else dict(save_steps=1)
    cfg = GRPOConfig(model_name_or_path=base, quantization="none", lora_r=4, num_generations=4, prompts_per_step=2,
                     max_completion_length=5, micro_batch_size=4, max_steps=4 if resuming else 2, beta=0.04,
                     learning_rate=1e-2, output_dir=out + ("/two" if resuming else "/one"),
                     gradient_checkpointing=False, **kw)
    t = GRPOTrainer(cfg, reward_funcs=[digit_share], train_dataset=prompts)
    t.train()
    rank = t.accelerator.process_index
    sums = {n: p.detach().double().sum().item() for n, p in t.model.named_parameters() if "lora_" in n}
    json.dump({"sums": sums, "steps": t.state.global_step}, open(f"{out}/count{rank}.json", "w"))
    """
)


def test_a_checkpoint_of_one_process_resumes_under_two(tiny_base_dir, tmp_path):
    """As TRL's: the second process samples from a fresh stream, both train on in step (their adapters the same)."""
    run_torchrun(OTHER_COUNT_SCRIPT, tmp_path, tiny_base_dir, tmp_path, nproc=1)
    result = run_torchrun(OTHER_COUNT_SCRIPT, tmp_path, tiny_base_dir, tmp_path, "resume")
    assert "saved by 1 process(es); this run has 2: resumed" in result.stderr
    assert "process 1 (not in that run) sample from fresh streams" in result.stderr
    r0, r1 = (json.loads((tmp_path / f"count{r}.json").read_text()) for r in (0, 1))
    assert r0["steps"] == r1["steps"] == 4 and r0["sums"] == r1["sums"]


PROBE_ON_TWO = """
import json, os, sys
from pathlib import Path
from helpers import digit_share
from lora_grpo import GRPOConfig, GRPOTrainer
from lora_grpo.memory import probe as memory

base, out = sys.argv[1], Path(sys.argv[2])
rank = int(os.environ["RANK"])
MiB = 2**20
trainer = GRPOTrainer(
    GRPOConfig(model_name_or_path=base, quantization="none", lora_r=4, num_generations=4, prompts_per_step=4,
               max_completion_length=5, micro_batch_size="auto", gradient_checkpointing=False, memory_probe="sweep",
               memory_budget=1.0, top_entropy_quantile=0.5, max_steps=1, output_dir=str(out / "run"), save_steps=0),
    reward_funcs=[digit_share], train_dataset=[{"prompt": f"{i}+{i % 5}="} for i in range(32)],
)
optimizer = memory.optimizer_state_bytes(trainer.params, "adamw")
memory.available_bytes = lambda device: (1000 * MiB + optimizer, "test RAM")
passes, real_pass = [], memory.probe_pass
memory.probe_pass = lambda update, m, train, *a, **k: (passes.append(m), real_pass(update, m, train, *a, **k))[1]
# each pass really runs (with its collectives: the entropy quantile's gather); process 1 measures 10
# sequences 1% higher, where it no longer fits its 1,000 MiB
def measure_peak(fn, device):
    fn()
    return (100 + 90 * passes[-1]) * MiB * (1.01 if rank == 1 and passes[-1] == 10 else 1.0)
memory.measure_peak = measure_peak
plan = trainer.plan_memory()
(out / f"plan-{rank}.json").write_text(json.dumps({"passes": passes, "size": plan.micro_batch_size}))
"""


def test_two_processes_probe_the_same_passes_and_plan_for_the_tighter(tiny_base_dir, tmp_path):
    """Each process measures its own peaks; every measured figure is the larger of the two, so both run the same
    passes (whose collectives pair up: a process that ran one more pass would wait forever) and take the size
    that fits the tighter process."""
    run_torchrun(PROBE_ON_TWO, tmp_path, tiny_base_dir, tmp_path, timeout=240)
    plans = [json.loads((tmp_path / f"plan-{rank}.json").read_text()) for rank in (0, 1)]
    assert plans[0] == plans[1]
    assert plans[0]["size"] == 9 and 10 in plans[0]["passes"]  # 10 fits process 0 alone: not taken


WHOLE_BATCH = PRELUDE + textwrap.dedent(
    """
    import lora_grpo.scorer as scorer

    cfg = GRPOConfig(model_name_or_path=base, quantization="none", lora_r=4, num_generations=4,
                     prompts_per_step=2, max_completion_length=5, micro_batch_size=8, max_steps=1,
                     output_dir=out + "/run", save_steps=0, gradient_checkpointing=False,
                     scale_rewards=sys.argv[3], multi_objective_aggregation=sys.argv[4])
    seen = {}
    real = scorer.RolloutScorer._advantages
    def advantages(self, per_func):
        seen["per_func"] = per_func.tolist()
        out = real(self, per_func)
        seen["advantages"] = out.tolist()
        return out
    scorer.RolloutScorer._advantages = advantages
    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]
    t = GRPOTrainer(cfg, reward_funcs=[digit_share, length], train_dataset=prompts)
    t.train()
    json.dump(seen, open(f"{out}/advantages{t.accelerator.process_index}.json", "w"))
    """
)


@pytest.mark.parametrize(
    "scale, aggregation", [("batch", "sum_then_normalize"), ("group", "normalize_then_sum")]
)
def test_advantages_that_read_the_whole_batch_read_both_processes_rows(
    tiny_base_dir, tmp_path, scale, aggregation
):
    """scale_rewards 'batch' and GDPO's normalize_then_sum divide by the batch's std: as TRL gathers the rewards
    first, each process's advantages are its rows of those computed over both processes' rows."""
    import torch

    from lora_grpo.algo.advantages import multi_objective_advantages

    run_torchrun(WHOLE_BATCH, tmp_path, tiny_base_dir, tmp_path, scale, aggregation)
    seen = [json.loads((tmp_path / f"advantages{rank}.json").read_text()) for rank in (0, 1)]
    table = torch.tensor(seen[0]["per_func"] + seen[1]["per_func"])
    whole = multi_objective_advantages(table, None, 4, scale, aggregation)
    ours = torch.tensor(seen[0]["advantages"] + seen[1]["advantages"])
    torch.testing.assert_close(ours, whole, rtol=1e-5, atol=1e-6)
    alone = multi_objective_advantages(torch.tensor(seen[0]["per_func"]), None, 4, scale, aggregation)
    assert not torch.allclose(alone, whole[: len(alone)])  # one process's rows alone would give others
