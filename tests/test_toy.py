"""The toy task and its pre-trained tiny base: data, parsing, reward, pretraining, cache, accuracy."""

import functools
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from helpers import cache_listing, run_torchrun
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from lora_grpo.tasks import toy

# Pretraining settings small enough for a unit test (well under a second per run).
TINY = dict(
    steps=30,
    batch_size=32,
    learning_rate=1e-2,
    warmup_steps=5,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    log_every=0,
)


def _operands(prompt: str) -> tuple[int, int]:
    a, b = prompt.rstrip("=").split("+")
    return int(a), int(b)


# --- task ------------------------------------------------------------------------------------


def test_toy_problems_deterministic_by_seed():
    a, b = toy.toy_problems(40, seed=3), toy.toy_problems(40, seed=3)
    assert a["prompt"] == b["prompt"] and a["answer"] == b["answer"]
    assert toy.toy_problems(40, seed=4)["prompt"] != a["prompt"]
    assert a.column_names == ["prompt", "answer"]


def test_toy_problems_splits_disjoint_and_answers_correct():
    train = toy.toy_problems(8000, seed=0, split="train")
    held = toy.toy_problems(2000, seed=0, split="eval")
    train_set, eval_set = set(train["prompt"]), set(held["prompt"])
    assert len(train_set) == 8000 and len(eval_set) == 2000  # every pair once: the splits are exhaustive
    assert not train_set & eval_set
    for row in list(train.select(range(200))) + list(held.select(range(200))):
        a, b = _operands(row["prompt"])
        assert row["prompt"] == toy.format_prompt(a, b) and row["answer"] == str(a + b)
    assert len(toy.toy_problems(9000, seed=0)) == 9000  # beyond the pool: pairs repeat
    with pytest.raises(ValueError):
        toy.toy_problems(5, seed=0, split="test")


def test_prompt_completion_and_carry_free_sum():
    assert toy.format_prompt(7, 45) == "07+45="
    assert toy.format_completion(52) == "052" and toy.format_completion(125) == "125"
    assert toy.carry_free_sum(12, 35) == 47  # no carry: the same as the sum
    assert toy.carry_free_sum(57, 68) == 15  # 7+8 -> 5, 5+6 -> 1, carries dropped
    assert toy.carry_free_sum(99, 1) == 90
    assert toy.carry_free_sum(0, 0) == 0


# --- parsing and reward ----------------------------------------------------------------------


@pytest.mark.parametrize(
    "text, value",
    [
        ("52", 52),
        ("052", 52),
        (" 52\n", 52),
        ("52<eos><pad><pad>", 52),
        ("52<eos>99", 52),
        ("-3", -3),
        ([{"role": "assistant", "content": "125"}], 125),
        ("", None),
        ("5 2", None),
        ("52x", None),
        ("x52", None),
        ("<eos>52", None),
        ("5.2", None),
        ([], None),
    ],
)
def test_parse_answer(text, value):
    assert toy.parse_answer(text) == value


def test_toy_reward():
    prompts = ["57+68=", "57+68=", "57+68=", "12+35=", "00+00="]
    completions = ["125", "015", "12", "047", "000"]
    assert toy.toy_reward(prompts, completions, answer=["125", "125", "125", "47", "0"], extra=[1] * 5) == [
        1.0,
        0.0,
        0.0,
        1.0,
        1.0,
    ]


# --- greedy accuracy -------------------------------------------------------------------------


def _always_sevens(tokenizer):
    """A real tiny causal LM whose greedy output is always "7777": a zero head with a bias on "7"."""
    model = toy.make_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    head = torch.nn.Linear(32, len(tokenizer), bias=True)
    with torch.no_grad():
        head.weight.zero_()
        head.bias.zero_()
        head.bias[tokenizer.convert_tokens_to_ids("7")] = 5.0
    model.lm_head = head
    return model


def test_greedy_accuracy_exact_on_a_known_model():
    tokenizer = toy.make_tokenizer()
    model = _always_sevens(tokenizer).train()
    ds = toy.toy_problems(30, seed=0, split="eval")
    answers = ["7777" if i % 3 == 0 else a for i, a in enumerate(ds["answer"])]  # 10 of 30 rows match
    ds = ds.remove_columns("answer").add_column("answer", answers)
    assert toy.greedy_accuracy(model, tokenizer, ds, batch_size=8) == pytest.approx(10 / 30)
    assert model.training  # mode restored
    assert toy.greedy_accuracy(model, tokenizer, ds, max_new_tokens=3) == 0.0  # "777" is not 7777
    assert toy.greedy_accuracy(model, tokenizer, ds.select([])) == 0.0


def test_greedy_accuracy_on_real_and_peft_models():
    from peft import LoraConfig, get_peft_model

    tokenizer = toy.make_tokenizer()
    ds = toy.toy_problems(20, seed=0, split="eval")
    model = toy.make_tiny_model(tokenizer, hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1)
    assert 0.0 <= toy.greedy_accuracy(model, tokenizer, ds) <= 1.0
    peft_model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear"))
    assert 0.0 <= toy.greedy_accuracy(peft_model, tokenizer, ds, batch_size=7) <= 1.0
    # A zeroed final norm makes every logit 0: greedy emits <pad> (id 0), which parses to nothing.
    with torch.no_grad():
        model.model.norm.weight.zero_()  # get_peft_model wrapped it in place
    assert toy.greedy_accuracy(peft_model, tokenizer, ds) == 0.0


# --- pretraining and the cache ---------------------------------------------------------------


def _record(path) -> dict:
    return json.loads((Path(path) / "toy_pretrain.json").read_text())


def test_pretrain_toy_base_saves_learns_and_is_deterministic(tmp_path):
    rng = torch.get_rng_state()
    out = toy.pretrain_toy_base(tmp_path / "a", seed=5, **TINY)
    assert torch.equal(rng, torch.get_rng_state())  # the caller's RNG is left alone
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert (tokenizer.pad_token_id, tokenizer.eos_token_id) == (0, 1)
    assert model.config.num_hidden_layers == 1 and model.config.hidden_size == 32
    losses = _record(out)["losses"]
    assert len(losses) == TINY["steps"]
    assert sum(losses[-5:]) < 0.6 * sum(losses[:5])
    assert _record(out)["settings"]["seed"] == 5

    again = toy.pretrain_toy_base(tmp_path / "b", seed=5, **TINY)
    other = toy.pretrain_toy_base(tmp_path / "c", seed=6, **TINY)
    w_a, w_b, w_c = (load_file(str(Path(p) / "model.safetensors")) for p in (out, again, other))
    assert w_a.keys() == w_b.keys()
    assert all(torch.equal(w_a[k], w_b[k]) for k in w_a)
    assert not all(torch.equal(w_a[k], w_c[k]) for k in w_a)


def test_ensure_toy_base_trains_once_and_caches(tmp_path, monkeypatch):
    calls = []
    real = toy.pretrain_toy_base

    @functools.wraps(real)
    def counting(out_dir, **kwargs):
        calls.append(kwargs)
        return real(out_dir, **kwargs)

    monkeypatch.setattr(toy, "pretrain_toy_base", counting)
    first = toy.ensure_toy_base(tmp_path, seed=0, **TINY)
    second = toy.ensure_toy_base(tmp_path, seed=0, **TINY)
    assert first == second and len(calls) == 1
    assert Path(first).parent == tmp_path and Path(first).name == toy.toy_base_dirname(0, **TINY)
    assert cache_listing(tmp_path) == [Path(first).name]  # no temporary dir left behind
    AutoModelForCausalLM.from_pretrained(first)
    AutoTokenizer.from_pretrained(first)

    monkeypatch.setenv("LORA_GRPO_CACHE", str(tmp_path / "env"))
    assert toy.default_cache_dir() == tmp_path / "env"


def test_ensure_toy_base_rebuilds_an_incomplete_entry(tmp_path, capsys):
    tiny = {**TINY, "steps": 3}
    final = tmp_path / toy.toy_base_dirname(0, **tiny)
    # What a non-zero rank used to leave under torch.distributed: tokenizer and record, no config or weights.
    toy.make_tokenizer().save_pretrained(final)
    (final / "toy_pretrain.json").write_text(json.dumps({"format_version": toy.TOY_FORMAT_VERSION}))
    path = toy.ensure_toy_base(tmp_path, seed=0, **tiny)
    out = capsys.readouterr().out
    assert path == str(final)
    assert "(missing config.json, model.safetensors); rebuilding it" in out, out
    AutoModelForCausalLM.from_pretrained(path)
    assert cache_listing(tmp_path) == [final.name]  # the bad entry and the temp dirs are gone
    assert toy.toy_base_problem(path) is None
    assert _record(path)["losses"]  # the rebuilt record, not the stub

    record = _record(path)
    (final / "toy_pretrain.json").write_text(json.dumps({**record, "format_version": 1}))
    assert "format_version 1" in toy.toy_base_problem(path)
    (final / "toy_pretrain.json").write_text(json.dumps(record))
    (final / "config.json").write_text("{}")  # no model_type: AutoConfig cannot load it
    assert "config.json does not load" in toy.toy_base_problem(path)
    assert toy.toy_base_problem(tmp_path / "absent") == "missing"


# Two processes under torch.distributed (what `torchrun` / `accelerate launch` start) ensure the toy
# base on one empty cache; each also pretrains a private copy, which must hold config and weights on
# every rank, not only on global rank 0.
DIST_SCRIPT = textwrap.dedent(
    """
    import json, os, sys
    import torch.distributed as dist
    from lora_grpo.tasks import toy

    cache, out, tiny = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    path = toy.ensure_toy_base(cache, **tiny)
    again = toy.ensure_toy_base(cache, **tiny)  # cached: every rank still passes the same barrier
    own = toy.pretrain_toy_base(f"{out}/own{rank}", **tiny)
    record = {"path": path, "again": again, "own": sorted(os.listdir(own))}
    json.dump(record, open(f"{out}/rank{rank}.json", "w"))
    dist.destroy_process_group()
    """
)


def test_ensure_toy_base_builds_once_under_torch_distributed(tmp_path):
    cache = tmp_path / "cache"
    tiny = json.dumps({**TINY, "steps": 3})
    result = run_torchrun(DIST_SCRIPT, tmp_path, cache, tmp_path, tiny, timeout=120)
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["path"] == r1["path"] == r0["again"] == r1["again"]
    assert result.stdout.count("[toy pretrain] building") == 1, result.stdout  # built once, by one rank
    assert cache_listing(cache) == [Path(r0["path"]).name]  # no temporary dir left behind
    assert set(toy.TOY_BASE_FILES) <= set(os.listdir(r0["path"]))
    AutoModelForCausalLM.from_pretrained(r0["path"])
    AutoTokenizer.from_pretrained(r0["path"])
    for r in (r0, r1):
        assert {"config.json", "model.safetensors"} <= set(r["own"]), r["own"]


# Two processes that need one entry at once (a second run started beside the first, two test workers)
# build it once: the second waits for the first's lock. The build waits for a file here, so that the test
# decides when it ends, and what each process printed goes to a file of its own.
RACE_SCRIPT = textwrap.dedent(
    """
    import functools, json, os, sys, time
    from lora_grpo.tasks import toy

    cache, go, tiny = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
    pretrain = toy.pretrain_toy_base

    @functools.wraps(pretrain)  # the cache entry's name hashes the settings its signature names
    def held_until_go(out_dir, **kwargs):
        while not os.path.exists(go):
            time.sleep(0.05)
        return pretrain(out_dir, **kwargs)

    toy.pretrain_toy_base = held_until_go
    print("entry", toy.ensure_toy_base(cache, **tiny), flush=True)
    """
)


def test_a_process_needing_an_entry_another_builds_waits_and_builds_it_only_if_the_builder_dies(tmp_path):
    """Cache "done": the builder finishes and the waiter uses its entry. Cache "killed": the builder is
    killed mid-build (out of memory, SIGKILL); the waiter then takes the lock, removes the temporary
    directory the killed build left, and builds the entry itself."""
    go, tiny = tmp_path / "go", json.dumps({**TINY, "steps": 3})
    env, started = {**os.environ, "OMP_NUM_THREADS": "1"}, []

    def start(cache, name):
        out = tmp_path / f"{cache}-{name}.txt"
        process = subprocess.Popen(
            [sys.executable, "-c", RACE_SCRIPT, str(tmp_path / cache), str(go), tiny],
            stdout=out.open("w"),
            stderr=subprocess.STDOUT,
            env=env,
        )
        started.append(process)
        return process, out

    def wait_for(text, *started):
        deadline = time.monotonic() + 120
        while not all(text in out.read_text() for _, out in started):
            ended = any(process.poll() is not None for process, _ in started)
            assert not ended and time.monotonic() < deadline, [out.read_text() for _, out in started]
            time.sleep(0.1)

    try:
        (builder, built), (killed, killed_out) = firsts = start("done", "first"), start("killed", "first")
        wait_for("[toy pretrain] building", *firsts)
        (waiter, waited), (taker, took) = seconds = start("done", "second"), start("killed", "second")
        wait_for("waiting for another process that is building", *seconds)
        killed.kill()
        killed.wait()
        go.touch()
        for process in (builder, waiter, taker):
            assert process.wait(timeout=120) == 0
    finally:  # a failed test leaves no process waiting for the file
        for process in started:
            process.kill()
            process.wait()
    entries = {name: out.read_text() for name, out in [("built", built), ("waited", waited), ("took", took)]}
    name = toy.toy_base_dirname(0, **{**TINY, "steps": 3})
    building = "[toy pretrain] building"
    assert f"entry {tmp_path / 'done' / name}" in entries["built"] and building in entries["built"]
    assert f"entry {tmp_path / 'done' / name}" in entries["waited"] and building not in entries["waited"]
    assert "left by a build that did not finish" in entries["took"] and building in entries["took"]
    assert f"entry {tmp_path / 'killed' / name}" in entries["took"]
    for cache in ("done", "killed"):
        assert cache_listing(tmp_path / cache) == [name]  # the killed build's temporary directory is gone
        AutoModelForCausalLM.from_pretrained(tmp_path / cache / name)


def test_cache_name_encodes_every_setting():
    base = toy.toy_base_dirname(0, **TINY)
    assert base == toy.toy_base_dirname(0, **TINY)
    assert base != toy.toy_base_dirname(1, **TINY)
    assert base != toy.toy_base_dirname(0, **{**TINY, "noise": 0.5})
    assert base != toy.toy_base_dirname(0, **{**TINY, "steps": 31})
    assert base == toy.toy_base_dirname(0, **{**TINY, "log_every": 7})  # logging does not change weights
    defaults = toy.toy_base_settings()
    assert toy.toy_base_dirname() == toy.toy_base_dirname(defaults.pop("seed"), **defaults)
    with pytest.raises(TypeError):
        toy.toy_base_dirname(0, stepz=3)


# Failed before the fix it guards: the tiny base was a qwen2 model, and transformers 5 swaps the
# tokenizer of any qwen2 checkpoint for Qwen2Tokenizer (byte-level BPE): spaces and letters of our
# character tokenizer would then encode differently.
def test_saved_tiny_base_loads_back_with_the_same_tokenizer(tiny_base_dir):
    from lora_grpo.config import GRPOConfig
    from lora_grpo.model.load import load_tokenizer

    text = "user: <think>a b</think> 12+35=\nassistant: "
    loaded = load_tokenizer(GRPOConfig(model_name_or_path=tiny_base_dir))
    assert loaded(text, add_special_tokens=False)["input_ids"] == toy.make_tokenizer()(text)["input_ids"]
    assert loaded.decode(loaded(text)["input_ids"]) == text
