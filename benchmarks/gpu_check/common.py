"""What several sections use: the allocator's figures (Memory), inductor's cudagraph-skip counter
(CudagraphSkips), the LoRA target modules, and the tiny 4-bit run of sections 7, 10 and 11."""

from __future__ import annotations

import importlib
import logging

import torch

from benchmarks._common import QWEN2_SHAPES, token_prompts

GiB = 2**30
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class Memory:
    """CUDA allocator figures of one device; on a CPU only the resident set (peaks: None)."""

    def __init__(self, device: torch.device):
        self.device, self.cuda = device, device.type == "cuda"

    def now(self) -> tuple[float, float | None]:
        """(allocated, reserved) bytes; on a CPU (resident set, None)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
            return torch.cuda.memory_allocated(self.device), torch.cuda.memory_reserved(self.device)
        import psutil

        return psutil.Process().memory_info().rss, None

    def reset_peak(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)

    def peak(self) -> tuple[float, float] | None:
        """(allocated, reserved) peaks since the last reset_peak; None on a CPU."""
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        return torch.cuda.max_memory_allocated(self.device), torch.cuda.max_memory_reserved(self.device)


class CudagraphSkips:
    """Inductor's cudagraph_skips counter over a block (`count`), and the reasons it logged (`reasons`:
    the warnings of its "cudagraphs" artifact loggers, caught without turning those logs on)."""

    def __enter__(self):
        self.reasons: list[str] = []
        self.loggers = []
        if torch.cuda.is_available():
            importlib.import_module("torch._inductor.cudagraph_utils")  # creates the loggers listened to

            reasons = self.reasons

            class Collect(logging.Handler):
                def emit(self, record):
                    reasons.append(record.getMessage()[:300])

            self.handler = Collect(level=logging.WARNING)
            names = [n for n in list(logging.root.manager.loggerDict) if n.endswith(".__cudagraphs")]
            self.loggers = [logging.getLogger(n) for n in names]
            for logger in self.loggers:
                logger.addHandler(self.handler)
        self.start = self._count()
        return self

    def __exit__(self, *exc):
        self.count = self._count() - self.start
        for logger in self.loggers:
            logger.removeHandler(self.handler)
        return False

    @staticmethod
    def _count() -> int:
        return int(torch._dynamo.utils.counters["inductor"]["cudagraph_skips"])


def tiny_config(path: str, out: str, **overrides):
    from lora_grpo import GRPOConfig

    fields = dict(
        model_name_or_path=path,
        tokenizer_name_or_path=f"{path}/tokenizer",
        quantization="4bit",
        lora_r=8,
        num_generations=4,
        prompts_per_step=2,
        max_prompt_length=None,
        max_completion_length=8,
        micro_batch_size=4,
        gradient_checkpointing=False,
        decode_mode="eager",
        beta=0.04,
        ref_sync_steps=2,
        ref_sync_alpha=0.6,
        learning_rate=1e-3,
        save_steps=1,
        logging_steps=1,
        output_dir=out,
        disable_tqdm=True,
        seed=0,
    )
    fields.update(overrides)
    return GRPOConfig(**fields)


def tiny_prompts(count: int = 16) -> list[dict]:
    return token_prompts(QWEN2_SHAPES["tiny"]["vocab_size"], 8, count=count)
