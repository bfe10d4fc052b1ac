"""bench/trace_gaps.py's kernel categories, on kernel names taken from the 0.5B update's H100 profiles
(bench/results/*/profile-update-*): each lands in the kind of work it does, and the table sums by kind."""

from __future__ import annotations

import pytest
from tests.helpers.bench_modules import load_bench

trace_gaps = load_bench("trace_gaps.py", "trace_gaps_bench")


@pytest.mark.parametrize("name, kind", [
    ("nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_TNN", "matmul"),
    ("nvjet_sm90_tst_128x160_64x5_1x2_h_bz_splitK_NTT", "matmul"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>(cutlass_80_simt", "matmul"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<64", "attention"),
    ("void pytorch_flash::flash_bwd_convert_dq_kernel<Flash_bwd_kernel_traits<64, 128, 128, 8", "attention"),
    ("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128, 128, 4, false, false, "
     "cutlass::bfloat16_t, Flash_kernel_traits<64, 128, 128, 4, cutlass::bfloat16_t> >", "attention"),
    ("triton_poi_fused__unsafe_view_mul_silu_silu_backward_view_0", "SiLU-and-multiply"),
    ("triton_poi_fused__unsafe_view_mul_silu_6", "SiLU-and-multiply"),
    ("_stats_kernel", "logprob"),
    ("_grad_kernel", "logprob"),
    ("triton_poi_fused__to_copy_add_arange_eq_exp_mul_neg_sub_unsqueeze_0", "logprob"),
    ("triton_per_fused__to_copy__unsafe_view_add_div_expand_mul_pow_sum_view_7", "norm"),
    ("triton_per_fused__to_copy_mean_mul_pow_rsqrt_0", "norm"),
    ("triton_poi_fused__to_copy_add_cat_index_select_mul_neg_slice_transpose_unsqueeze_1", "rotary"),
    ("triton_poi_fused_add_clone_mul_neg_select_backward_slice_transpose_unsqueeze_6", "rotary"),
    ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous", "optimizer"),
    ("Memcpy HtoD (Pinned -> Device)", "copy and fill"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>", "copy and fill"),
    ("void at::native::indexFuncLargeIndex<c10::BFloat16, long, unsigned int, 3, 3, -2, true", "copy and fill"),
    ("void at::native::vectorized_elementwise_kernel<8, at::native::CUDAFunctor_add<c10::BFloat16>", "add and cast"),
    ("triton_poi_fused_select_backward_squeeze_sum_transpose_view_3", "add and cast"),
    ("some_new_kernel", "other"),
])
def test_category(name, kind):
    assert trace_gaps.category(name) == kind


def test_category_table_sums_by_kind():
    ms = 1_000_000  # ns
    events = [(0, 3 * ms, "nvjet_a"), (3 * ms, 4 * ms, "nvjet_b"), (4 * ms, 5 * ms, "_stats_kernel")]
    lines = trace_gaps.category_table(events).splitlines()
    assert lines[2] == "| matmul | 4.0 | 80.0% | 2 | nvjet_a |"
    assert lines[3] == "| logprob | 1.0 | 20.0% | 1 | _stats_kernel |"
    assert lines[-1] == "| all | 5.0 | 100% | 3 | |"
