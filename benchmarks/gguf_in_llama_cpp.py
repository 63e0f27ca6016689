"""A trained smollm2-135m-chat-sum run, exported as GGUF, answering its held-out prompts in llama.cpp itself.

The run (`lora-grpo train smollm2-135m-chat-sum`) is exported to f16 and q8_0 files in a temporary directory
with `export_gguf`; each file is loaded by llama.cpp (llama-cpp-python, not a dependency: `pip install
llama-cpp-python`, see tests/test_gguf_llama_cpp.py) and answers the 210 held-out chat-sum prompts as the
run's own evaluation does: the tokenizer's chat template, greedy, at most 24 tokens, the last integer scored.
Prints the run's own accuracy (its summary.json) beside each file's.

    python benchmarks/gguf_in_llama_cpp.py runs/smollm2-135m-chat-sum [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path


def held_out_accuracy(path: Path, tokenizer, rows, threads: int) -> tuple[float, float]:
    """(accuracy, seconds) of the GGUF file `path` in llama.cpp over the chat-sum `rows`."""
    import llama_cpp

    from lora_grpo.tasks.chat_arithmetic import last_number_reward

    llm = llama_cpp.Llama(model_path=str(path), n_ctx=256, n_batch=256, n_threads=threads, verbose=False)
    start, replies = time.perf_counter(), []
    try:
        for messages in rows["prompt"]:
            text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
            llm.reset()
            reply = []
            for token in llm.generate(tokenizer(text)["input_ids"], temp=0.0, top_k=1):
                if token == llm.token_eos() or len(reply) == 24:
                    break
                reply.append(token)
            replies.append(tokenizer.decode(reply, skip_special_tokens=True))
    finally:
        llm.close()
    return sum(last_number_reward(replies, rows["answer"])) / len(replies), time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run", type=Path, help="a finished smollm2-135m-chat-sum run directory")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp's threads")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from lora_grpo import export_gguf
    from lora_grpo.export import run_config
    from lora_grpo.model.bases import resolve_base
    from lora_grpo.tasks.chat_arithmetic import chat_sum_problems

    config = run_config(args.run)
    tokenizer = AutoTokenizer.from_pretrained(resolve_base(config.model_name_or_path))
    rows = chat_sum_problems(210, split="eval")
    own = json.loads((args.run / "summary.json").read_text())["accuracy_after"]
    print(f"the run's own held-out greedy accuracy: {own:.3f}")
    with tempfile.TemporaryDirectory() as folder:
        for gguf_type in ("f16", "q8_0"):
            path = Path(folder) / f"policy.{gguf_type}.gguf"
            export_gguf(args.run, path, gguf_type=gguf_type)
            accuracy, seconds = held_out_accuracy(path, tokenizer, rows, args.threads)
            print(
                f"{gguf_type} in llama.cpp: {accuracy:.3f} over {len(rows)} prompts ({seconds:.0f} s)",
                flush=True,
            )


if __name__ == "__main__":
    main()
