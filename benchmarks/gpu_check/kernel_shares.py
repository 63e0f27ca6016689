"""What a profile of the decode or the update is made of: each kernel (or, on a CPU, each op) put in
one kind by a table of name patterns (the first that matches), each kind's time per step, and each
kind's floor on the lent GPU (an H200 or an H100: peak) from benchmarks/limit.py's model of the
step's FLOPs and bytes.

The kinds are what decides whether the decode could be faster: the 4-bit base's dequantisation
(bitsandbytes' kernels), the GEMMs (the base's, the head's and LoRA's together: LoRA's are GEMMs
like the base's and cannot be told apart by name; section 13's weight forms measure LoRA's share),
attention over the static cache, the softmax / top-p / multinomial work over the vocabulary, the
norms and element-wise kernels, copies; what is left of a step's wall time once its kernels are
counted is the launches and gaps between graphs (Python, syncs, graph breaks)."""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from benchmarks.limit import step_flops, weight_bytes


@dataclass(frozen=True)
class Peak:
    """A device's dense bf16 tensor-core FLOP/s and HBM bytes/s that the floors divide by."""

    device: str
    flops: float
    bytes_per_s: float


# The lent machines' GPUs: (a pattern of torch.cuda.get_device_name(), the device, NVIDIA's dense bf16
# tensor-core peak, its HBM bandwidth). The floors take the same share of each that issue 48 took of
# the H200's (790 of 989 TFLOP/s, 4.3 of 4.8 TB/s: about what kernels reach). The first that matches.
DATASHEETS = (
    ("H200", "H200", 989e12, 4.8e12),
    ("H100.*PCIe", "H100 PCIe", 756e12, 2.0e12),
    ("H100", "H100 SXM", 989e12, 3.35e12),
)
COMPUTE_SHARE, BANDWIDTH_SHARE = 790 / 989, 4.3 / 4.8


def peak(device_name: str) -> Peak:
    """The floors' peak for the GPU named `device_name`; the H200's for one not in DATASHEETS (and for
    the CPU dry run), its device then saying so."""
    for pattern, device, flops, bandwidth in DATASHEETS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return Peak(device, COMPUTE_SHARE * flops, BANDWIDTH_SHARE * bandwidth)
    return replace(peak("H200"), device=f"H200 (the table has no {device_name})")


H200 = peak("H200")
GAPS = "launches and gaps"
OTHER = "other"

# (kind, pattern): the first pattern that matches a kernel's or op's name (case-insensitive) gives its
# kind. CUDA names (bitsandbytes' kDequantize*, cuBLAS' / CUTLASS's gemm kernels, inductor's triton_*
# kernels, flash / memory-efficient attention) and a CPU run's aten op names alike.
KINDS: tuple[tuple[str, str], ...] = (
    ("dequantisation", r"dequant|kgemm_4bit|gemv_4bit|bitsandbytes|bnb"),
    ("attention", r"flash|fmha|attention|sdpa|scaled_dot_product"),
    ("vocabulary: softmax, top-p, sampling", r"softmax|multinomial|sort|topk|cumsum|exponential|argmax|isin"),
    ("GEMM", r"gemm|xmma|cutlass|cublas|nvjet|triton_tem_fused.*mm|aten::(mm|addmm|bmm|matmul)\b"),
    ("copies", r"memcpy|memset|aten::(copy_|cat|index_copy_|clone|to|_to_copy)\b"),
    ("norms and element-wise", r"triton_|elementwise|vectorized|reduce|norm|rsqrt|silu|aten::"),
)
_COMPILED = [(kind, re.compile(pattern, re.IGNORECASE)) for kind, pattern in KINDS]


def kind_of(name: str) -> str:
    """The kind of a kernel or op named `name`: KINDS' first match, else OTHER."""
    return next((kind for kind, pattern in _COMPILED if pattern.search(name)), OTHER)


@dataclass(frozen=True)
class Event:
    """One kernel (or, on a CPU, one op) of a profile, summed over its calls: its self time in µs."""

    name: str
    us: float
    count: int


def events_of(profile, cuda: bool) -> list[Event]:
    """The kernels of a torch.profiler run with their device time (`cuda`), else the CPU ops with their
    self CPU time (the CPU dry run's stand-in), from its key_averages()."""
    from torch.autograd import DeviceType

    out = []
    for e in profile.key_averages():
        if cuda:
            # A record_function range on the GPU (a compiled region, an optimizer step) spans its kernels: not
            # one of them (torch's own table leaves these out of the device total too).
            if e.device_type != DeviceType.CUDA or getattr(e, "is_user_annotation", False):
                continue
            us = getattr(e, "device_time_total", None)
            us = e.cuda_time_total if us is None else us
        else:
            us = e.self_cpu_time_total
        if us > 0:
            out.append(Event(e.key, float(us), int(e.count)))
    return out


def graph_launches(profile) -> int:
    """How many CUDA graphs the profiled steps launched (cudaGraphLaunch calls): one per graph a step
    runs, so a step with graph breaks launches several."""
    return sum(int(e.count) for e in profile.key_averages() if e.key.startswith("cudaGraphLaunch"))


def shares(events: list[Event], wall_s: float, steps: int) -> dict[str, float]:
    """Seconds per step of each kind (KINDS' order, then OTHER), and GAPS: the wall time per step the
    kernels do not fill (never below 0)."""
    per_step = {kind: 0.0 for kind, _ in KINDS}
    per_step[OTHER] = 0.0
    for e in events:
        per_step[kind_of(e.name)] += e.us / 1e6 / steps
    per_step[GAPS] = max(0.0, wall_s / steps - sum(per_step.values()))
    return per_step


def top(events: list[Event], count: int = 10) -> list[Event]:
    return sorted(events, key=lambda e: -e.us)[:count]


# ------------------------------------------------------------------ floors (limit.py's model)


def linear_parameters(spec: dict) -> float:
    """The body's linear weights (q k v o gate up down, every layer), from limit.weight_bytes's count."""
    H, V = spec["hidden_size"], spec["vocab_size"]
    return (weight_bytes(spec, "fp32") - 4 * H * V) / 4


def decode_step_flops(spec: dict, rows: int, context: int, lora_r: int) -> dict[str, float]:
    """FLOPs of one token step of `rows` rows at `context` positions (limit.step_flops's decode, one
    step): "GEMM" the body's linears and the head, "LoRA" the adapter's, "attention" the rest."""

    def decode(r: int, T: int) -> float:
        # context = P + t + 1 at the step's t = 0: the step after a prompt of context - 1 tokens.
        args = dict(prompts=rows, G=1, P=context - 1, T=T, lora_r=r, ref_rank=r, recompute=False)
        return step_flops(spec, **args)["rollout"]

    total = decode(lora_r, 1) - decode(lora_r, 0)
    lora = total - (decode(0, 1) - decode(0, 0))
    gemm = rows * (2 * linear_parameters(spec) + 2 * spec["hidden_size"] * spec["vocab_size"])
    return {"GEMM": gemm, "LoRA": lora, "attention": total - gemm - lora}


def decode_step_floors(
    spec: dict,
    rows: int,
    context: int,
    slots: int,
    lora_r: int,
    base: str,
    kv_bytes_per_slot: int,
    at: Peak = H200,
) -> dict[str, float]:
    """Seconds one token step cannot beat on the GPU `at`, per kind: the larger of FLOPs / peak and bytes /
    bandwidth. GEMM: the body's weights read in bf16 (a 4-bit base's dequantised copies) and the bf16
    head; dequantisation: the 4-bit weights read and their bf16 copies written (4-bit bases only);
    attention: the static cache's `slots` read per row; the vocabulary: the float32 logits read and
    their probabilities written once."""
    H, V = spec["hidden_size"], spec["vocab_size"]
    flops = decode_step_flops(spec, rows, context, lora_r)
    linear = linear_parameters(spec)
    gemm_bytes = 2 * linear + 2 * H * V
    dequant_bytes = linear * (0.5 + 4 / 64 + 2) if base == "4bit" else 0.0
    floors = {
        "GEMM": max((flops["GEMM"] + flops["LoRA"]) / at.flops, gemm_bytes / at.bytes_per_s),
        "dequantisation": dequant_bytes / at.bytes_per_s,
        "attention": max(flops["attention"] / at.flops, rows * slots * kv_bytes_per_slot / at.bytes_per_s),
        "vocabulary: softmax, top-p, sampling": 2 * rows * V * 4 / at.bytes_per_s,
    }
    floors["step"] = sum(floors.values())
    return floors


def update_floors(
    spec: dict, rows: int, prompt: int, completion: int, lora_r: int, recompute: bool, at: Peak = H200
) -> dict[str, float]:
    """Seconds one update (forward, backward and, with gradient checkpointing, the recomputed forward)
    cannot beat on the GPU `at`, per kind: GEMM all of limit.step_flops's "train" FLOPs (attention's
    included) at the bf16 peak, or the bf16 body's and head's reads, the larger; dequantisation the
    4-bit weights read and their bf16 copies written once a pass."""
    flops = step_flops(
        spec, prompts=rows, G=1, P=prompt, T=completion, lora_r=lora_r, ref_rank=lora_r, recompute=recompute
    )["train"]
    passes = 2 + recompute
    linear = linear_parameters(spec)
    read = passes * (2 * linear + 2 * spec["hidden_size"] * spec["vocab_size"])
    floors = {
        "GEMM": max(flops / at.flops, read / at.bytes_per_s),
        "dequantisation": passes * linear * (0.5 + 4 / 64 + 2) / at.bytes_per_s,
    }
    floors["step"] = sum(floors.values())
    return floors


def table(per_step: dict[str, float], floors: dict[str, float] | None = None) -> list[str]:
    """A Markdown table of ms per step, share of the step and, where known, the floor and how far
    above it (× floor) each kind runs."""
    total = sum(per_step.values()) or 1.0
    lines = ["| kind | ms / step | share | floor ms | × floor |", "|---|---|---|---|---|"]
    for kind, seconds in per_step.items():
        floor = (floors or {}).get(kind)
        far = f"{seconds / floor:,.1f}×" if floor else "-"
        shown = f"{floor * 1e3:.3g}" if floor is not None else "-"
        lines.append(f"| {kind} | {seconds * 1e3:.3f} | {seconds / total:.0%} | {shown} | {far} |")
    return lines
