"""The sizes a run trains with: micro_batch_size and gradient_checkpointing, fixed in the config or
'auto' (the start-up memory probe, memory.plan_run_memory), and what a resume keeps of a checkpoint's.

The probe runs once, when training starts (or when a size is first needed); a trainer that only
evaluates never probes, and its forwards take at most UNPLANNED_FORWARD_ROWS sequences. The sizes in
use live in the TrainState (saved in checkpoints). The run's largest decode shape is reserved for the
compiled sampler here too (memory.reserve_decode_shape), so rollouts and evals share one cache.
"""

from __future__ import annotations

from ..model.load import set_gradient_checkpointing
from .estimate import pass_estimate
from .probe import MemoryPlan, plan_run_memory, reserve_decode_shape, resume_sizes

UNPLANNED_FORWARD_ROWS = (
    8  # sequences per eval / reward-model forward of a trainer that only evaluates ('auto', no probe)
)


class RunSizes:
    """update: the run's update.PolicyUpdate (what the probe measures); state: its TrainState;
    side_passes: the reward models' scoring forwards (scorer.probe_passes), planned too."""

    def __init__(
        self,
        config,
        update,
        accelerator,
        state,
        longest_prompt: int,
        eval_longest_prompt: int | None = None,
        side_passes: tuple = (),
    ):
        self.config, self.update, self.accelerator, self.state = config, update, accelerator, state
        self.longest_prompt, self.eval_longest_prompt = longest_prompt, eval_longest_prompt
        self.side_passes = side_passes
        reserve_decode_shape(config, update.model, longest_prompt, eval_longest_prompt)
        self.plan: MemoryPlan | None = None
        self._planned = False

    def make_plan(self) -> MemoryPlan | None:
        """Probe and choose the 'auto' sizes (once); None when both are fixed in the config."""
        cfg = self.config
        if not self._planned:
            self._planned = True
            if cfg.micro_batch_size == "auto" or cfg.gradient_checkpointing == "auto":
                self.plan = plan_run_memory(
                    self.update,
                    device=self.accelerator.device,
                    num_processes=self.accelerator.num_processes,
                    longest_prompt=self.longest_prompt,
                    eval_longest_prompt=self.eval_longest_prompt,
                    side_passes=self.side_passes,
                    estimate=self._estimate,
                )
                self.state.micro_batch_size = self.plan.micro_batch_size
                self.state.gradient_checkpointing = self.plan.gradient_checkpointing
        return self.plan

    def _estimate(self, tokens: tuple[int, int], worst: tuple[int, int]):
        """The pass's bytes from the model's shapes (memory_probe 'auto'); on a CPU with the attention
        scores its kernel keeps for backward."""
        model = self.update.model
        return pass_estimate(
            model.config,
            model.get_input_embeddings().weight.dtype,
            tokens,
            worst,
            self.config.logprob_chunk_size,
            attention_scores=self.accelerator.device.type != "cuda",
        )

    @property
    def micro_batch_size(self) -> int:
        if self.state.micro_batch_size == "auto":
            self.make_plan()
        return self.state.micro_batch_size

    @property
    def forward_rows(self) -> int:
        """The most sequences a forward other than the decode's takes (eval/kl_to_base's, a reward
        model's scoring): micro_batch_size when it is known (fixed, planned or resumed), without
        probing; UNPLANNED_FORWARD_ROWS (at most the step's batch) for an 'auto' trainer that only evaluates."""
        size = self.state.micro_batch_size
        return size if size != "auto" else min(UNPLANNED_FORWARD_ROWS, self.config.step_batch)

    @property
    def gradient_checkpointing(self) -> bool:
        if self.state.gradient_checkpointing == "auto":
            self.make_plan()
        return self.state.gradient_checkpointing

    def resume(self, current: tuple, saved_state: dict) -> str | None:
        """After a checkpoint's TrainState was loaded: the sizes this resume uses (an 'auto' size takes
        the checkpoint's when it fits), recompute switched to match; the line to print, or None."""
        saved = (saved_state.get("micro_batch_size"), saved_state.get("gradient_checkpointing"))
        (size, on), line = resume_sizes(self.plan, self.config, current, saved)
        if on != current[1]:
            set_gradient_checkpointing(self.update.model, on)
        self.state.micro_batch_size, self.state.gradient_checkpointing = size, on
        return line
