"""The GPU check's sections 13 (what bounds the decode: three weight forms) and 14 (where the step goes:
the profile) on a CPU: the kernels' classification by name on a made-up kernel list, the shares and
gaps, the floors against a real model's weights, the forms' extrapolation, and both sections' --cpu
stand-in run end to end."""

import gzip
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from benchmarks._common import QWEN2_SHAPES  # noqa: E402
from benchmarks.gpu_check import harness  # noqa: E402
from benchmarks.gpu_check import kernel_shares as ks  # noqa: E402
from benchmarks.gpu_check.decode_bound import check_decode_bound, extrapolate  # noqa: E402
from benchmarks.gpu_check.harness import run_section  # noqa: E402
from benchmarks.gpu_check.profile_step import check_profile  # noqa: E402
from benchmarks.gpu_check.sections import SECTIONS  # noqa: E402

BY_NUMBER = {section.number: section for section in SECTIONS}
VOCABULARY = "vocabulary: softmax, top-p, sampling"

# Kernel names as an H200 profile of the compiled decode and the update shows them, and a CPU run's ops.
KERNELS = [
    (
        "void kDequantizeBlockwise<__nv_bfloat16, 512, 64, 8, 2>(float*, unsigned char*, float*, int)",
        "dequantisation",
    ),
    (
        "void kgemm_4bit_inference_naive<__nv_bfloat16, 128, 16>(int, int, int, __nv_bfloat16*)",
        "dequantisation",
    ),
    ("bitsandbytes::dequantize_4bit", "dequantisation"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1", "GEMM"),
    ("nvjet_tst_128x64_64x8_2x1_v_bz_TNN", "GEMM"),
    (
        "void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x1_tn_align8>(Params)",
        "GEMM",
    ),
    ("triton_tem_fused_mm_3", "GEMM"),
    ("aten::mm", "GEMM"),
    ("aten::addmm", "GEMM"),
    (
        "void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4>>(Flash_fwd_params)",
        "attention",
    ),
    ("fmha_cutlassF_bf16_aligned_64x64_rf_sm80", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    (
        "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float>(float*, int)",
        VOCABULARY,
    ),
    (
        "void at::native::sampleMultinomialOnce<float, float>(long*, long, int, float*, float*, int, int)",
        VOCABULARY,
    ),
    ("void at_cuda_detail::cub::DeviceRadixSortOnesweepKernel<...>", VOCABULARY),
    ("aten::exponential_", VOCABULARY),
    ("aten::topk", VOCABULARY),
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0", "norms and element-wise"),
    ("triton_poi_fused_add_mul_silu_4", "norms and element-wise"),
    (
        "void at::native::vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>(int, ...)",
        "norms and element-wise",
    ),
    ("aten::mul", "norms and element-wise"),
    ("Memcpy DtoD (Device -> Device)", "copies"),
    ("Memset (Device)", "copies"),
    ("aten::copy_", "copies"),
    ("aten::cat", "copies"),
    ("MmBackward0", ks.OTHER),
]


@pytest.mark.parametrize("name,kind", KERNELS)
def test_each_kernel_goes_to_its_kind_by_the_first_matching_pattern(name, kind):
    assert ks.kind_of(name) == kind


def test_the_shares_sum_each_kind_per_step_and_the_gaps_are_what_the_kernels_leave():
    events = [
        ks.Event("kDequantizeBlockwise", 4000.0, 96),
        ks.Event("sm90_xmma_gemm_bf16", 6000.0, 192),
        ks.Event("nvjet_tst_128x64", 2000.0, 96),
        ks.Event("flash_fwd_kernel", 1000.0, 48),
        ks.Event("cunn_SoftMaxForward", 500.0, 2),
        ks.Event("MmBackward0", 500.0, 2),
    ]
    per_step = ks.shares(events, wall_s=0.020, steps=2)
    assert per_step["dequantisation"] == pytest.approx(0.002)
    assert per_step["GEMM"] == pytest.approx(0.004)
    assert per_step["attention"] == pytest.approx(0.0005)
    assert per_step[VOCABULARY] == pytest.approx(0.00025)
    assert per_step[ks.OTHER] == pytest.approx(0.00025)
    assert per_step["copies"] == 0.0
    assert per_step[ks.GAPS] == pytest.approx(0.010 - 0.007)
    assert sum(per_step.values()) == pytest.approx(0.010)
    # Kernels that overlap can add up to more than the wall time: no negative gap.
    assert ks.shares(events, wall_s=0.001, steps=1)[ks.GAPS] == 0.0
    assert [e.name for e in ks.top(events, 2)] == ["sm90_xmma_gemm_bf16", "kDequantizeBlockwise"]


def test_the_profile_gives_the_ops_on_a_cpu_and_no_kernels_without_cuda():
    from torch.profiler import ProfilerActivity, profile

    a = torch.randn(64, 64)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            a = a @ a
    ops = {e.name: e for e in ks.events_of(prof, cuda=False)}
    assert ops["aten::mm"].count == 3 and ops["aten::mm"].us > 0
    assert ks.events_of(prof, cuda=True) == [] and ks.graph_launches(prof) == 0


def test_on_cuda_the_kernels_count_and_the_annotated_ranges_around_them_do_not():
    """What key_averages() gives on a GPU (kineto's events as torch 2.13 names them): a compiled region's
    range on the GPU spans its kernels and is not one of them; CUPTI may suffix cudaGraphLaunch."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def event(key, device_type, us, count=1, annotation=False):
        return SimpleNamespace(
            key=key,
            device_type=device_type,
            device_time_total=us,
            self_cpu_time_total=us,
            count=count,
            is_user_annotation=annotation,
        )

    averages = [
        event("sm90_xmma_gemm_bf16", DeviceType.CUDA, 700.0, count=2),
        event("Torch-Compiled Region: 0/0", DeviceType.CUDA, 900.0, annotation=True),
        event("aten::mm", DeviceType.CPU, 300.0, count=2),
        event("cudaGraphLaunch_v10000", DeviceType.CPU, 5.0, count=3),
    ]
    prof = SimpleNamespace(key_averages=lambda: averages)
    assert ks.events_of(prof, cuda=True) == [ks.Event("sm90_xmma_gemm_bf16", 700.0, 2)]
    assert ks.graph_launches(prof) == 3


def test_the_table_gives_each_kind_its_share_and_its_distance_from_the_floor():
    lines = ks.table({"GEMM": 0.003, "attention": 0.001, ks.GAPS: 0.0}, {"GEMM": 0.001})
    assert lines[2] == "| GEMM | 3.000 | 75% | 1 | 3.0× |"
    assert lines[3] == "| attention | 1.000 | 25% | - | - |"
    assert len(lines) == 5


def test_the_floors_count_the_weights_a_real_qwen2_has():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    spec = QWEN2_SHAPES["tiny"]
    model = Qwen2ForCausalLM(Qwen2Config(**spec))
    linear = sum(m.weight.numel() for m in model.model.layers.modules() if isinstance(m, torch.nn.Linear))
    assert ks.linear_parameters(spec) == linear
    H, V, rows = spec["hidden_size"], spec["vocab_size"], 8
    flops = ks.decode_step_flops(spec, rows, context=40, lora_r=4)
    assert flops["GEMM"] == 2 * rows * (linear + H * V)
    lora = sum(
        4 * (m.in_features + m.out_features)
        for m in model.model.layers.modules()
        if isinstance(m, torch.nn.Linear)
    )
    assert flops["LoRA"] == pytest.approx(2 * rows * lora)
    heads, layers = spec["num_attention_heads"], spec["num_hidden_layers"]
    assert flops["attention"] == pytest.approx(rows * 4 * layers * heads * (H // heads) * 40)
    four_bit = ks.decode_step_floors(spec, rows, 40, 64, 4, "4bit", kv_bytes_per_slot=128)
    plain = ks.decode_step_floors(spec, rows, 40, 64, 4, "bf16", kv_bytes_per_slot=128)
    longer = ks.decode_step_floors(spec, rows, 40, 128, 4, "bf16", kv_bytes_per_slot=128)
    assert plain["dequantisation"] == 0 < four_bit["dequantisation"]
    assert longer["attention"] == pytest.approx(2 * plain["attention"])
    assert four_bit["step"] == pytest.approx(sum(v for k, v in four_bit.items() if k != "step"))
    update = ks.update_floors(spec, rows, 16, 16, 4, recompute=True)
    assert update["GEMM"] > ks.update_floors(spec, rows, 16, 16, 4, recompute=False)["GEMM"]


def test_the_floors_divide_by_the_lent_gpus_own_peak():
    """The lent machine may be an H200 or an H100 (SXM or PCIe): each by torch's device name, at the
    share of NVIDIA's figures issue 48 took for the H200 (790 TFLOP/s, 4.3 TB/s); a GPU not in the
    table gets the H200's, named so; a bandwidth-bound floor scales with the bandwidth."""
    h200 = ks.peak("NVIDIA H200")
    assert (h200.device, h200.flops, h200.bytes_per_s) == (
        "H200",
        pytest.approx(790e12),
        pytest.approx(4.3e12),
    )
    assert ks.peak("NVIDIA H100 80GB HBM3").device == "H100 SXM"
    assert ks.peak("NVIDIA H100 PCIe").device == "H100 PCIe"
    sxm = ks.peak("NVIDIA H100 80GB HBM3")
    assert sxm.bytes_per_s == pytest.approx(4.3e12 * 3.35 / 4.8) and sxm.flops == pytest.approx(790e12)
    other = ks.peak("NVIDIA A100-SXM4-40GB")
    assert other.bytes_per_s == h200.bytes_per_s and "A100" in other.device
    step = "vocabulary: softmax, top-p, sampling"
    on = {
        name: ks.decode_step_floors(QWEN2_SHAPES["tiny"], 8, 4, 8, 4, "bf16", 128, ks.peak(name))[step]
        for name in ("NVIDIA H200", "NVIDIA H100 80GB HBM3")
    }
    assert on["NVIDIA H100 80GB HBM3"] == pytest.approx(on["NVIDIA H200"] * 4.8 / 3.35)


def test_the_forms_are_extrapolated_from_the_4bit_steps_at_two_layer_counts():
    forms = {"4bit": 0.006, "bf16": 0.004, "merged": 0.003}
    fixed, at_24 = extrapolate(forms, 6, 0.015, 24, "4bit")
    # The 4-bit form: 0.5 ms a layer, 3 ms fixed; the others keep the fixed part.
    assert fixed == pytest.approx(0.003)
    assert at_24 == pytest.approx({"4bit": 0.015, "bf16": 0.007, "merged": 0.003})


def test_sections_14_and_13_run_their_cpu_stand_ins_and_report_what_bounds_the_decode(tmp_path):
    import argparse

    out = tmp_path / "out"
    args = argparse.Namespace(budget=float("inf"), only={13, 14}, out=str(out), cpu=True, steps=1)
    run = harness.Run(args, torch.device("cpu"), str(tmp_path), SECTIONS)
    assert BY_NUMBER[14].check is check_profile and BY_NUMBER[13].check is check_decode_bound
    assert BY_NUMBER[13].needs == (14,)
    order = [s.number for s in SECTIONS]
    assert order.index(14) < order.index(13) < order.index(2)
    run_section(BY_NUMBER[14], run)
    run_section(BY_NUMBER[13], run)
    profile, bound = run.summary[BY_NUMBER[14].name], run.summary[BY_NUMBER[13].name]
    assert profile["status"] == "passed" and bound["status"] == "passed", run.summary
    found = profile["findings"]
    for table in ("decode_table", "update_table"):
        kinds = [line.split(" | ")[0].removeprefix("| ") for line in found[table][2:]]
        assert kinds == [kind for kind, _ in ks.KINDS] + [ks.OTHER, ks.GAPS]
    # The CPU's ops stand in for the kernels: the 4-bit base's dequantisation and the GEMMs are seen.
    assert found["decode_ms"]["dequantisation"] > 0 and found["decode_ms"]["GEMM"] > 0
    assert found["update_ms"]["GEMM"] > 0 and found["update_floor_s"] > 0
    assert found["skipped_parts"] and found["traces"] == ["decode-trace.json.gz", "update-trace.json.gz"]
    trace = json.loads(gzip.decompress((out / "decode-trace.json.gz").read_bytes()))
    assert found["decode_top"][0][1] > 0 and found["update_top"]
    assert any(e.get("name") == "aten::mm" for e in trace["traceEvents"])
    found = bound["findings"]
    assert set(found["tokens_per_s"]) == {"4-bit base + LoRA", "bf16 base + LoRA", "bf16 base, LoRA merged"}
    # The tiny shape runs every layer: its "24-layer" step is measured, not extrapolated.
    assert found["layers"] == found["full_layers"] == 2 and "fixed_ms" not in found
    assert found["holds_the_step"] in {"dequantisation", "LoRA", "the rest"}
    assert 14 not in run.results
