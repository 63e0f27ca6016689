"""The GPU check: what only a GPU can show about lora_grpo, in one command of a lent machine's visit
(the sections that time something alone, then the others in three lanes side by side: ~516 s by the
estimates against --budget 540; benchmarks/README.md's device-time plan).

Nothing is downloaded: the models are random-init Qwen2s built locally (_common.build_qwen2), in
Qwen2.5-0.5B's and Qwen2.5-1.5B's shapes (their bodies and 151,936-token vocabularies) for the
recipes' sections and in small shapes elsewhere, and the calculator task's tiny base, pre-trained
where the bundle was built (benchmarks/gpu_bundle.py copies it into gpu_bundle/calculator-base;
lora_grpo.tasks.calculator) and loaded by path here. Each section prints what it measured and one "ok:" or
"FAIL:" line per threshold; a missed threshold fails its section after the rest of it has run, an
error fails it where it happens, and the next section runs either way. The exit status is the
number of failed sections.

 1. devices      what device.py decides here: torch_dtype auto, whether decode_mode auto compiles.
 2. memory, 0.5B qwen2.5-0.5b-gsm8k-qlora's settings (4-bit base, LoRA r 16, 8 prompts × G 8, 256 + 384
                 tokens, micro_batch_size / gradient_checkpointing auto) for --steps steps and an eval
                 at the end (a greedy decode and the kl_to_base samples and forwards of 64 token prompts),
                 on an emulated 8 GB card (below). Per step the allocator's allocated and reserved
                 bytes around the rollout, the update (log-probs, loss, backward, optimizer step) and
                 the eval, and the compiled decode's kept caches, against the memory plan's figures
                 (memory/probe.py) and beside memory_estimate's figures for the same sizes; inductor's
                 cudagraph-skip counter over the run.
 3. decode       on section 2's trained model: tokens/s of the eager and the compiled sampler
                 (greedy, the recipe's shape; on CUDA the eager one decodes a quarter of the tokens,
                 its rate the same), the rows that draw the same tokens over its length, and whether each
                 compiled choice is the eager model's own argmax up to rounding (a teacher-forced
                 forward over the compiled rollout: the largest margin by which another token beat the
                 one chosen); what dynamo recorded (graphs, graph breaks, e.g. at bitsandbytes' 4-bit
                 layers, recompiles; TORCH_LOGS-style lines go to stderr).
 4. memory, 1.5B section 2 for qwen2.5-1.5b-gsm8k-calculator-qlora (4 prompts × G 8, 384 + 512 tokens)
                 without its calculator (the tool's replies fill the same max_completion_length slots
                 of the same cache; section 9 runs tools).
 5. decode after updates  a 4-bit "small" model trained 2 steps with the compiled decode (lora_B off
                 zero, optimizer steps, a sync between the rollouts: hard in float32, soft in bf16),
                 then compiled against eager greedy decoding in both dtypes, as in section 3; the
                 training decode's cudagraph skips must be 0.
 6. bf16 KL      the KL between identical adapters, on a bf16 base (must be exactly 0) and on a 4-bit
                 base with bf16 compute (|KL| < 1e-6), after a hard sync, and between nearby adapters:
                 lora_grpo's log-probs of a bf16 model (float32 head) against the same weights in
                 float32 and against log-probs from the model's own bf16 logits (defect 5 of issue 16);
                 on CUDA, the bf16 head's float32 matmul on TF32 (logprobs._tf32_matmuls) against
                 float64, and the TF32 flag restored.
 7. resume       a 4-bit run of 3 steps against the same run resumed from its step-2 checkpoint on
                 the same device (every adapter tensor equal; CUDA in deterministic mode, as attention
                 backward kernels otherwise are not), and the checkpoint resumed by a CPU-only process
                 (CUDA_VISIBLE_DEVICES="") for one more step.
 8. pytest -m gpu the suite's GPU tests, in a subprocess (a time cap inside the budget).
 9. tools        the calculator task with the compiled decode, on the bundled base: 2 training steps
                 that call the tool, then sampled tool rollouts compiled against eager (rows with the
                 same tokens, calls).
10. reward model a tiny sequence-classification reward model (a RewardModel loaded from a path) in a
                 4-bit run with 'auto' sizes: on the run's device and dtype, finite rewards, its
                 scoring forwards within the plan's rows.
11. paged_adamw_8bit  3 steps with bitsandbytes' paged 8-bit AdamW, in a worker process with a time
                 limit (CUDA managed memory can hang): the adapter moves, 8-bit paged states.
12. vs TRL       step time (split into generation, rewards with reference log-probs, and the update)
                 and peak allocated and reserved memory of lora_grpo and of TRL's GRPOTrainer + a peft
                 LoraConfig on the same random 0.5B 4-bit model, prompts, reward and settings (2
                 prompts × G 8, 64 + 64 tokens, up to 2 timed steps after one), both at their
                 defaults and again with gradient checkpointing on in both (TRL's default); each
                 trainer in a fresh worker that stops itself before its limit, its figures recorded
                 as it ends (vs_trl.py); when TRL imports. A measurement: it fails only when a run
                 fails.
13. decode bound the compiled decode of the 0.5B recipe's shape (64 rows, 151,936-token vocabulary)
                 with three weight forms, tokens/s each: the 4-bit base + LoRA, a bf16 base + LoRA,
                 the bf16 base with LoRA merged; at 6 of the 24 layers (three compiles), extrapolated
                 to 24 with section 14's step: what dequantisation, LoRA and the rest cost a token step.
14. profile      torch.profiler over compiled decode token steps of the 0.5B recipe and over one
                 update: the top kernels, each kind's ms (dequantisation, GEMMs, attention, the
                 vocabulary's softmax / sampling, norms, copies, the gaps between graphs) against its
                 floor on the GPU lent (an H200 or an H100: kernel_shares.peak; limit.py's FLOPs and
                 bytes); gzipped traces to --out.
15. compile cache a fresh process with the 0.5B recipe's settings and an empty inductor cache of its
                 own finds section 2's compile in lora_grpo's compile cache (rollout/compile_cache.py):
                 its step 1 − step 2 ≤ 15 s (57.8 − 8.9 s before the cache); a first process fills the
                 cache when section 2 did not run. And whether lora_grpo's allocator setting
                 (expandable segments, set when it is imported) took effect in this process.

Every process of the check compiles into caches in the check's own temporary folder (lora_grpo's,
inductor's and Triton's: cli.CACHES, unless the caller set them), shared by its lanes and workers and
removed at its end: a rerun on the same warm machine compiles cold, as the estimates were measured,
and nothing is written under $HOME.

The emulated 8 GB card (sections 2 and 4): torch's allocator is capped by
set_per_process_memory_fraction at 8 GiB less the 0.5 GiB CUDA context that memory_estimate (and
the recipes' headers) assume, and the free memory the plan reads, lora_grpo.memory.probe.available_bytes
(the function memory/probe.py imports from device.py, replaced here as the tests replace it), is that cap
less what is allocated. The thresholds, in bytes over the model as loaded (the plan's reference):
allocated peak of each rollout ≤ plan.rollout + plan.optimizer; of each update ≤ plan.optimizer +
plan.kept + the probed pass at the chosen size; of the eval ≤ plan.need; the kept caches ≤
plan.kept, and what stays allocated after the first rollout ≤ plan.kept + 8 MiB (the rollout's own
tensors); reserved peaks (which keep every stage's cached blocks) ≤ plan.need; no cudagraph skips.

With --cpu (the dry run, tests/test_gpu_bundle.py) every section runs its code on a CPU in a tiny
shape, "static" standing in for "compiled" (the same fixed-shape decoder without torch.compile:
inductor on a CPU takes tens of seconds a shape, and tests/test_fast_decode.py covers it), what only
CUDA has skipped and listed under the section's "skipped_parts" (section 8 skips whole); section 12's
workers run as on a GPU.

The order (sections.py: one Section record a section, with its number, title, check, estimate_s
and needs, and LANES): first, alone in the check's process, what times something and the first GPU
run left unmeasured (12, the profile 14 and the weight forms 13 that extrapolate from it); then the
lanes side by side, each a worker process of the check (--lane, lanes.py) running its sections in
order: 2 with 3 on its trained model and the compile cache 15 on its compile; 4, 6, 10; and 1, 7,
11, 5, 9, 8, which passed there. What runs in a lane checks memory and correctness (each process has
its own allocator, emulated card, peaks and compiler); its seconds are taken beside the other
lanes. estimate_s is each one's seconds on the H200 as that run measured them, alone (section 12:
its workers' caps; 13, 14 and 15: estimated), printed as the plan at the start.

--budget (default 540) is a hard deadline in seconds of wall time from the process's start: a
section that would start past it is skipped, and so, on a GPU, is one whose estimate exceeds what is
left (it would be cut at the deadline; the time goes to the shorter sections after it), and sections
8 and 12 with less than 60 / 120 s of it left; child processes (sections 7, 8, 11, 12, 15) get what it
leaves; a lane's deadline falls 5 s before the check's, and a lane is not started with less than
15 s left. At the deadline a watchdog thread ends the lanes still running (taking what they
recorded), records the running section as stopped, the ones not started as skipped, writes the
summary and exits with the number of failed sections (a stop is no
failure; SIGTERM does the same; a section stuck in C code holding the GIL is ended by faulthandler
10 s later, exit 1). The last line printed, summary.txt's last line and summary.json's "rerun" are
the command for the sections stopped or skipped for want of time (--only those, --budget 250;
section 3 brings section 2, and is left for the rerun with it). --only 2,4: run those sections
alone. With --out DIR, summary.json (each section: status, seconds, reason, rerun, findings;
"running" while one runs), summary.txt (one line per section) and log.txt (everything printed,
line-buffered) are written there, the summary as each section starts and ends. The device-time plan
of a lent machine's visit (start-up, install, the command and a rerun if it prints one):
benchmarks/README.md.

The modules: harness.py (the Section record, the Run, the budget, the deadline, the summary and
the rerun), lanes.py (sections side by side, a worker process a lane), sections.py (the list and
the lanes), cli.py (the arguments, the workers, main), common.py (what several
sections use), and one module per topic (devices, recipe_memory, decode, numerics, resume,
pytest_gpu, tools, reward_model, paged_adamw, vs_trl, decode_bound, profile_step; kernel_shares: the
profile's kinds of kernel and their floors). From the checkout, with it on PYTHONPATH:

    python3 -m benchmarks.gpu_check --out DIR  # on one CUDA GPU (the lent machine: benchmarks/README.md)
    python3 -m benchmarks.gpu_check --cpu      # a dry run on a CPU with tiny shapes (checks the check)
"""
