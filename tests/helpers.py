"""What test files share: the tiny GRPO run and its helpers (make_trainer, PROMPTS, the adapter and
4-bit snapshots), the torchrun and recipe helpers, a Qwen2.5-style tool tokenizer and the offline tasks'
small settings. Test files import them by name (`from helpers import make_trainer`), never each other;
the session fixtures (the tiny bases on disk) are in conftest.py."""

import os
import string
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from torch.overrides import TorchFunctionMode
from transformers import PreTrainedTokenizerFast

# Appended to every torchrun script: leave the process group before exiting (a gloo group still up
# at interpreter exit aborts a finished process now and then: "terminate called without an active exception").
_CLEAN_EXIT = """
import torch as _torch
if _torch.distributed.is_initialized():
    _torch.distributed.destroy_process_group()
"""


def cache_listing(cache) -> list[str]:
    """The names in a cache of built bases, less the build locks base_cache keeps beside its entries
    (``.NAME.lock``): the entries, and any temporary directory a build left behind."""
    return sorted(p.name for p in Path(cache).iterdir() if not p.name.endswith(".lock"))


def run_torchrun(source: str, workdir, *args, nproc: int = 2, timeout: int = 300):
    """Write `source` (a Python script, dedented, with the clean exit above appended) to workdir and
    run it under torchrun on CPU (gloo; what `accelerate launch` sets up on GPUs); skip the test where
    gloo is unavailable, fail with the processes' stderr when the run fails. The script can import
    this file's helpers (`from helpers import digit_share`): tests/ is on its PYTHONPATH."""
    import subprocess
    import sys
    import textwrap

    script = os.path.join(str(workdir), "torchrun_script.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent(source) + _CLEAN_EXIT)
    tests = os.path.dirname(os.path.abspath(__file__))
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join(p for p in (tests, os.environ.get("PYTHONPATH")) if p),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",  # a free port of its own: two test processes may run torchrun at once
        "--nproc_per_node",
        str(nproc),
        script,
        *map(str, args),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    if result.returncode != 0 and "gloo" in result.stderr.lower() and "unavailable" in result.stderr.lower():
        pytest.skip("torch.distributed gloo backend unavailable")
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def write_recipe(tmp_path, base_dir, rows: int = 8, **fields) -> "os.PathLike":
    """A recipe YAML for the tiny model over `rows` local "i+1" questions (answer column), with `fields` on top."""
    import json

    import yaml

    data = tmp_path / "prompts.jsonl"
    data.write_text(
        "".join(json.dumps({"question": f"{i}+1", "answer": str(i + 1)}) + "\n" for i in range(rows))
    )
    recipe = dict(
        model_name_or_path=str(base_dir),
        dataset=str(data),
        eval_dataset=str(data),
        prompt_template="Q: {question} A:",
        reward_funcs=["accuracy"],
        num_generations=2,
        prompts_per_step=2,
        max_completion_length=4,
        gradient_checkpointing=False,
        lora_r=4,
        output_dir=str(tmp_path / "run"),
    )
    recipe.update(fields)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


# ---------------------------------------------------------------------------------------------
# The tiny GRPO run most tests train, and what they read back from it.
# ---------------------------------------------------------------------------------------------


def digit_share(prompts, completions, **kwargs):
    """Reward: share of digits in the completion (a tiny random model can move this fast)."""
    return [sum(c.isdigit() for c in text) / max(1, len(text)) for text in completions]


def has_digit(prompts, completions, **kwargs):
    """0/1: a completion with a digit in it (the tiny random model sometimes writes one)."""
    return [float(any(ch.isdigit() for ch in text)) for text in completions]


PROMPTS = [{"prompt": f"{i}+{i % 7}=", "answer": str(i + i % 7)} for i in range(24)]

# make_trainer's settings: 4 QLoRA steps of 2 prompts × 4 completions of at most 6 tokens.
TINY_RUN = dict(
    quantization="4bit",
    lora_r=4,
    lora_alpha=8,
    num_generations=4,
    prompts_per_step=2,
    max_completion_length=6,
    micro_batch_size=3,
    max_steps=4,
    beta=0.04,
    learning_rate=5e-3,
    save_steps=0,
    seed=0,
    gradient_checkpointing=True,
)
# The plainer run some regression tests were found with, as overrides of TINY_RUN (no max_steps: each
# test sets its own): no quantization, 2 completions of 4 tokens, 12 prompts without answers;
# lora_alpha, micro_batch_size and seed at the config's defaults.
SMALL_RUN = dict(
    quantization="none",
    lora_alpha=32,
    num_generations=2,
    max_prompt_length=32,
    max_completion_length=4,
    micro_batch_size=8,
    seed=42,
    gradient_checkpointing=False,
    learning_rate=1e-2,
    train_dataset=[{"prompt": row["prompt"]} for row in PROMPTS[:12]],
)


def make_trainer(
    base_dir, out_dir, *, reward_funcs=(digit_share,), train_dataset=PROMPTS, eval_dataset=None, **overrides
):
    """A GRPOTrainer of TINY_RUN on the model at `base_dir`, writing to `out_dir`/run; `overrides` replace
    config fields (TINY_RUN's or any other)."""
    from lora_grpo import GRPOConfig, GRPOTrainer

    fields = {
        **TINY_RUN,
        "model_name_or_path": base_dir,
        "output_dir": os.path.join(out_dir, "run"),
        **overrides,
    }
    config = GRPOConfig(**fields)
    return GRPOTrainer(
        config, reward_funcs=list(reward_funcs), train_dataset=train_dataset, eval_dataset=eval_dataset
    )


def adapter_state(model, adapter: str) -> dict[str, torch.Tensor]:
    """A copy of one adapter's parameters (POLICY or REFERENCE)."""
    return {n: p.detach().clone() for n, p in model.named_parameters() if f".{adapter}." in n}


def assert_same_adapters(model_a, model_b) -> None:
    """Both adapters of the two models are bit-equal, tensor by tensor (exact resume, no side effects)."""
    from lora_grpo.model.adapters import POLICY, REFERENCE

    for adapter in (POLICY, REFERENCE):
        a, b = adapter_state(model_a, adapter), adapter_state(model_b, adapter)
        for k in a:
            assert torch.equal(a[k], b[k]), f"{adapter}: {k}"


def base_state(model) -> dict[str, torch.Tensor]:
    """A copy of everything in the state dict but the LoRA weights (the 4-bit bytes included)."""
    return {n: t.detach().clone() for n, t in model.state_dict().items() if "lora_" not in n}


def changed(a: dict, b: dict) -> bool:
    """Whether any tensor of two snapshots with the same keys differs."""
    return any(not torch.equal(a[k], b[k]) for k in a)


def load_4bit(path, portable: bool = False):
    """The model at path loaded as users load a QLoRA base: NF4 weights through transformers'
    BitsAndBytesConfig, float32 compute, on the CPU. portable=True also puts it on the one 4-bit
    kernel the trainer uses on every CPU (lora_grpo.model.load.keep_4bit_weights_fixed)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from lora_grpo.model.load import keep_4bit_weights_fixed

    nf4 = BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32
    )
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, quantization_config=nf4, device_map="cpu"
    )
    if portable:
        keep_4bit_weights_fixed(model)
    return model


def frozen_4bit(model) -> dict[str, torch.Tensor]:
    """Every 4-bit layer's stored bytes and quantisation constants, read without state_dict()."""
    import bitsandbytes.nn.modules as bnb_modules

    out = {}
    for name, m in model.named_modules():
        if isinstance(m, bnb_modules.Linear4bit):
            qs = m.weight.quant_state
            out[f"{name}.weight"] = m.weight.data.clone()
            out[f"{name}.absmax"] = qs.absmax.clone()
            if getattr(qs, "state2", None) is not None:
                out[f"{name}.absmax2"] = qs.state2.absmax.clone()
            out[f"{name}.packed"] = torch.tensor(bool(getattr(qs, "packing_format_for_cpu", False)))
    assert out, "no 4-bit layers"
    return out


def assert_same_4bit(a: dict, b: dict) -> None:
    """Two frozen_4bit snapshots are bit-identical."""
    assert a.keys() == b.keys()
    moved = [
        k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])
    ]
    assert not moved, f"frozen base changed: {moved[:4]}"


# ---------------------------------------------------------------------------------------------
# A Qwen2.5-style chat template with tools (tool calls in <tool_call>, replies in <tool_response>),
# on a character tokenizer: the tool runs' stand-in for Qwen2.5-Instruct's tokenizer.
# ---------------------------------------------------------------------------------------------
QWEN25_TEMPLATE = (
    "{%- if tools %}\n    {{- '<|im_start|>system\\n' }}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- messages[0]['content'] }}\n    {%- else %}\n"
    "        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}\n    {%- endif %}\n"
    '    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are '
    'provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}\n    {%- for tool in tools %}\n'
    '        {{- "\\n" }}\n        {{- tool | tojson }}\n    {%- endfor %}\n'
    '    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within '
    '<tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": '
    "<args-json-object>}\\n</tool_call><|im_end|>\\n\" }}\n{%- else %}\n    {%- if messages[0]['role'] == 'system' %}\n"
    "        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}\n    {%- else %}\n"
    "        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}\n"
    "    {%- endif %}\n{%- endif %}\n{%- for message in messages %}\n"
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == '
    '"assistant" and not message.tool_calls) %}\n'
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}\n"
    "    {%- elif message.role == \"assistant\" %}\n        {{- '<|im_start|>' + message.role }}\n"
    "        {%- if message.content %}\n            {{- '\\n' + message.content }}\n        {%- endif %}\n"
    "        {%- for tool_call in message.tool_calls %}\n            {%- if tool_call.function is defined %}\n"
    "                {%- set tool_call = tool_call.function %}\n            {%- endif %}\n"
    '            {{- \'\\n<tool_call>\\n{"name": "\' }}\n            {{- tool_call.name }}\n'
    '            {{- \'", "arguments": \' }}\n            {{- tool_call.arguments | tojson }}\n'
    "            {{- '}\\n</tool_call>' }}\n        {%- endfor %}\n        {{- '<|im_end|>\\n' }}\n"
    '    {%- elif message.role == "tool" %}\n'
    '        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}\n'
    "            {{- '<|im_start|>user' }}\n        {%- endif %}\n        {{- '\\n<tool_response>\\n' }}\n"
    "        {{- message.content }}\n        {{- '\\n</tool_response>' }}\n"
    '        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}\n'
    "            {{- '<|im_end|>\\n' }}\n        {%- endif %}\n    {%- endif %}\n{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n    {{- '<|im_start|>assistant\\n' }}\n{%- endif %}\n"
)
# The response template TRL 1.16 sets for Qwen2.5 / Qwen3 (trl.chat_template_utils.qwen3_template).
QWEN_RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "<|im_start|>assistant\n",
    "fields": {
        "reasoning_content": {"open": "<think>", "close_pattern": r"</think>\s*", "content": "text"},
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>\s*",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<\|im_end\|>\s*", "content": "text"},
    },
}


def char_tokenizer(specials: list[str], eos: str) -> PreTrainedTokenizerFast:
    """Characters and the given special tokens (specials[0] pads, eos ends a turn), no template."""
    vocab = {t: i for i, t in enumerate(specials + ["<unk>"] + sorted(set(string.printable)))}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Split(pattern="", behavior="isolated")
    backend.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        pad_token=specials[0],
        eos_token=eos,
        unk_token="<unk>",
        additional_special_tokens=[t for t in specials[1:] if t != eos],
    )


def qwen_style_tokenizer() -> PreTrainedTokenizerFast:
    """Characters, Qwen2.5's special tokens (<|im_end|> ends a turn) and its tool tokens, its template."""
    tok = char_tokenizer(["<|endoftext|>", "<|im_start|>", "<|im_end|>"], "<|im_end|>")
    tok.add_tokens(["<tool_call>", "</tool_call>"])
    tok.chat_template = QWEN25_TEMPLATE
    return tok


# ---------------------------------------------------------------------------------------------
# The offline tasks' bases, and an environment for tool runs.
# ---------------------------------------------------------------------------------------------

# A pretraining of a few steps of a one-layer model: what the cache and determinism tests of the
# offline bases build (tasks.calculator, tasks.countdown_toy), in about a second.
TINY_PRETRAIN = dict(
    steps=3,
    batch_size=8,
    warmup_steps=1,
    hidden_size=32,
    num_layers=1,
    num_heads=2,
    num_kv_heads=1,
    intermediate_size=64,
    log_every=0,
)


class Counter:
    """An environment: its method is the tool; reset reads the row; get_reward scores the episode
    (the calls made, which a random tiny model rarely makes: most groups score all 0)."""

    def reset(self, answer, **row):
        self.answer, self.calls = answer, 0
        return f" (the answer has {len(answer)} digits)"

    def count(self, n: int) -> int:
        """Count to n.

        Args:
            n: how far to count
        """
        self.calls += 1
        return n

    def get_reward(self):
        return float(self.calls)


def sliding_window_model(tok, kind: str, window: int, eos_boost: float = 12.0, attention: str = "sdpa"):
    """A tiny model with sliding-window layers of `window` tokens and the trainer's two adapters: Gemma 3
    (one sliding layer and one full, q / k norms), Gemma 2 (logit soft-capping, alternating layers) or
    Mistral (every layer slides). The adapters' B factors are random, so each changes the output; EOS's
    logit is scaled by `eos_boost`, so that some completions end early; `attention`: transformers'
    attn_implementation."""
    import transformers

    from lora_grpo.config import GRPOConfig
    from lora_grpo.model.adapters import POLICY, REFERENCE, lora_layers
    from lora_grpo.model.load import attach_adapters

    torch.manual_seed(0)
    sizes = dict(
        vocab_size=len(tok),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=window,
        pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
    )
    config, model_class = {
        "gemma3": (
            lambda: transformers.Gemma3TextConfig(
                head_dim=16, layer_types=["sliding_attention", "full_attention"], **sizes
            ),
            transformers.Gemma3ForCausalLM,
        ),
        "gemma2": (
            lambda: transformers.Gemma2Config(head_dim=16, final_logit_softcapping=5.0, **sizes),
            transformers.Gemma2ForCausalLM,
        ),
        "mistral": (lambda: transformers.MistralConfig(**sizes), transformers.MistralForCausalLM),
    }[kind]
    base = model_class(config()).eval()
    base.set_attn_implementation(attention)
    with torch.no_grad():
        base.lm_head.weight[tok.eos_token_id] *= eos_boost
    model = attach_adapters(
        base, GRPOConfig(model_name_or_path="tiny", lora_r=4, lora_alpha=8, gradient_checkpointing=False)
    )
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, m in lora_layers(model):
            for adapter in (POLICY, REFERENCE):
                m.lora_B[adapter].weight.normal_(0, 0.1, generator=g)
    return model


# Hybrid families for tiny_config, two layers: a linear-attention (Gated DeltaNet, Qwen3.5) or short-convolution
# (LFM2) layer beside a full-attention one; their caches hold convolution and recurrent states beside keys and values.
HYBRIDS = {
    "qwen3_5_text": {
        "head_dim": 16,
        "layer_types": ["linear_attention", "full_attention"],
        "linear_num_key_heads": 1,
        "linear_num_value_heads": 2,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
    },
    "lfm2": {"layer_types": ["conv", "full_attention"]},
}


def tiny_config(model_type: str, vocab_size: int, **fields):
    """A tiny config of any transformers decoder family (`model_type`): hidden 64, intermediate 96, 4 heads,
    2 KV heads; `fields` add to or replace those (layers, token ids, head_dim, sliding_window, ...). "gemma3":
    Gemma 3 4B-27B's Gemma3ForConditionalGeneration, the tiny gemma3_text of `fields` as its language model
    beside a one-layer vision tower."""
    from transformers import AutoConfig, Gemma3Config

    if model_type == "gemma3":
        text = tiny_config("gemma3_text", vocab_size, **fields)
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=32,
            patch_size=8,
        )
        return Gemma3Config(text_config=text.to_dict(), vision_config=vision, mm_tokens_per_image=4)

    sizes = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2)
    return AutoConfig.for_model(model_type, vocab_size=vocab_size, **(sizes | fields))


def tiny_reward_model(tokenizer, seed=0, dropout=0.0):
    """A tiny random Llama sequence classifier (one score) over `tokenizer`'s vocabulary, in eval mode."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(seed)
    config = tiny_config(
        "llama",
        len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        max_position_embeddings=128,
        num_labels=1,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
        attention_dropout=dropout,
    )
    return LlamaForSequenceClassification(config).eval()


class FakeHub:
    """The Hugging Face Hub for tests that push (nothing reaches a network): `install(monkeypatch)` replaces
    huggingface_hub's HfApi.create_repo and upload_folder, which transformers' Trainer and lora_grpo both call, by
    a record of each call. An upload records the files it sends (huggingface_hub's own filter_repo_objects applies
    its allow and ignore patterns) with their bytes, read when it runs: at once, or, for a background one, in the
    worker thread of its HfApi client (one each, as huggingface_hub's) once `release()` follows `hold()`. `fail` is
    an exception every upload raises, `refuse` one create_repo raises, `slow` {commit message: seconds} delays
    those uploads."""

    def __init__(self):
        self.created: list[dict] = []
        self.uploads: list[dict] = []
        self.branches: set[tuple[str, str]] = (
            set()
        )  # (repo, branch) made by create_branch; main is always there
        self.fail: Exception | None = None
        self.refuse: Exception | None = None
        self.slow: dict[str, float] = {}
        self._gate = threading.Event()
        self._gate.set()
        self._pools: dict[int, ThreadPoolExecutor] = {}

    def install(self, monkeypatch) -> "FakeHub":
        from huggingface_hub import HfApi

        hub = self
        monkeypatch.setattr(HfApi, "create_repo", lambda api, repo_id, **kw: hub.create_repo(repo_id, **kw))
        monkeypatch.setattr(HfApi, "upload_folder", lambda api, **kw: hub.upload_folder(api, **kw))
        monkeypatch.setattr(
            HfApi, "create_branch", lambda api, repo_id, **kw: hub.create_branch(repo_id, **kw)
        )
        return self

    def create_branch(self, repo_id, *, branch, exist_ok=False, **_):
        self.branches.add((repo_id, branch))

    def hold(self) -> None:
        self._gate.clear()

    def release(self) -> None:
        self._gate.set()

    def create_repo(self, repo_id, *, token=None, private=None, exist_ok=False, **_):
        from huggingface_hub.hf_api import RepoUrl

        if self.refuse is not None:
            raise self.refuse
        self.created.append({"repo_id": repo_id, "token": token, "private": private, "exist_ok": exist_ok})
        return RepoUrl(f"https://huggingface.co/{repo_id if '/' in repo_id else 'me/' + repo_id}")

    def upload_folder(
        self,
        api,
        *,
        repo_id,
        folder_path,
        path_in_repo=None,
        commit_message=None,
        token=None,
        revision=None,
        allow_patterns=None,
        ignore_patterns=None,
        run_as_future=False,
        **_,
    ):
        from pathlib import Path

        from huggingface_hub.hf_api import CommitInfo
        from huggingface_hub.utils import filter_repo_objects

        def upload():
            self._gate.wait(timeout=120)
            time.sleep(self.slow.get(commit_message, 0.0))
            if self.fail is not None:
                raise self.fail
            if revision not in (None, "main") and (repo_id, revision) not in self.branches:
                raise ValueError(
                    f"Invalid rev id: {revision}"
                )  # the hub commits only to a branch that is there
            root = Path(folder_path)
            names = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
            kept = filter_repo_objects(names, allow_patterns=allow_patterns, ignore_patterns=ignore_patterns)
            self.uploads.append(
                {
                    "repo_id": repo_id,
                    "path_in_repo": path_in_repo,
                    "message": commit_message,
                    "revision": revision,
                    "token": token,
                    "files": {name: (root / name).read_bytes() for name in kept},
                }
            )
            return CommitInfo(
                commit_url=f"https://huggingface.co/{repo_id}/commit/{len(self.uploads):040d}",
                commit_message=commit_message or "",
                commit_description="",
                oid=f"{len(self.uploads):040d}",
            )

        if not run_as_future:
            return upload()
        # one worker a client, as each HfApi has its own
        if id(api) not in self._pools:
            self._pools[id(api)] = ThreadPoolExecutor(1)
        return self._pools[id(api)].submit(upload)


class DecodeLoopReads(TorchFunctionMode):
    """Records the name of each tensor call that reads a value back to the host (on a GPU: waits for the device)
    made inside rollout.generate._sample_tokens, the decode loop, in `in_loop`."""

    READS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "numpy", "cpu"}

    def __init__(self):
        super().__init__()
        self.in_loop = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.READS:
            frame = sys._getframe(1)
            while frame is not None and frame.f_code.co_name != "_sample_tokens":
                frame = frame.f_back
            if frame is not None:
                self.in_loop.append(name)
        return func(*args, **(kwargs or {}))
