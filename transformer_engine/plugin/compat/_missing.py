"""Upstream TE-FL ops with no equivalent in this catalog, each with what is missing and how to port.

An impl registered under one of these names is skipped with an :class:`UpstreamCompatWarning`
naming the reason (the rest of the plugin still registers). The adapted ops are in
:mod:`._adapters`; ``docs/plugins.md`` has the whole porting table.
"""

from __future__ import annotations

from typing import Dict

__all__ = ["MISSING"]

_QUANTIZER = ("takes TE quantizer / quantized-tensor objects, which TE-FL does not build; port to "
              "quantize(x, scale, fp8_dtype, amax_out) / dequantize(q, scale_inv, out_dtype) / cast_transpose")
_DBIAS = "no fused dbias + activation-backward op (TE-FL sums dbias in the module layer); port the d<act> part"
_MOE = "no MoE routing / permutation ops in the catalog"
_ATTN = ("TE-FL chooses attention per call through supports() predicates, not backend/class getters; port the "
         "kernel to fused_attn_fwd(q, k, v, config, ...) / fused_attn_bwd")
_THD = "no THD / KV-cache / context-parallel helper ops in the catalog"
_COMM = "communication overlap / NVSHMEM is not supported by TE-FL"
_VERSION = "library version queries are not ops in TE-FL (capabilities are declared on the OpImpl instead)"
_NOT_IN_CATALOG = "no such op in the catalog"

MISSING: Dict[str, str] = {
    **{name: _QUANTIZER for name in ("quantize", "dequantize", "bgrad_quantize", "multi_tensor_quantize", "split_quantize",
                                       "group_quantize", "bgrad_group_quantize")},
    **{f"dbias_{name}": _DBIAS for name in ("dgelu", "dsilu", "drelu", "dqgelu", "dsrelu")},
    **{name: _MOE for name in ("moe_permute_fwd", "moe_permute_bwd", "moe_unpermute_fwd", "moe_unpermute_bwd",
                                 "fused_topk_with_score_function_fwd", "fused_topk_with_score_function_bwd",
                                 "fused_score_for_moe_aux_loss_fwd", "fused_score_for_moe_aux_loss_bwd",
                                 "fused_moe_aux_loss_fwd", "fused_moe_aux_loss_bwd", "splits_to_offsets")},
    **{name: _ATTN for name in ("get_fused_attn_backend", "get_flash_attention_class", "get_attention_backend")},
    "fused_attn_fwd": "same name, different interface (TE-FL: fused_attn_fwd(q, k, v, config, ...) with a config object "
                      "and an opaque ctx); port the impl to the catalog signature",
    "fused_attn_bwd": "same name, different interface (TE-FL: fused_attn_bwd(dout, q, k, v, out, ctx, config, ...)); "
                      "port the impl to the catalog signature",
    **{name: _THD for name in ("fa_prepare_fwd", "fa_prepare_bwd", "copy_to_kv_cache", "convert_thd_to_bshd",
                                 "convert_bshd_to_thd", "thd_read_half_tensor", "thd_second_half_lse_correction",
                                 "thd_read_second_half_lse", "thd_out_correction", "thd_grad_correction",
                                 "thd_get_partitioned_indices")},
    "fused_rope_forward": "same meaning, but upstream passes qkv_format as its NVTE_QKV_Format enum mirror (which TE-FL "
                          "does not define) in another order; port to fused_rope_forward(t, freqs, tensor_format: str, "
                          "interleaved, start_positions, cu_seqlens, cp_size, cp_rank)",
    "fused_rope_backward": "as fused_rope_forward: port to fused_rope_backward(grad_out, freqs, tensor_format: str, ...)",
    "fused_qkv_rope_forward": "no fused QKV-split RoPE op; port to fused_rope_forward per tensor",
    "fused_qkv_rope_backward": "no fused QKV-split RoPE op; port to fused_rope_backward per tensor",
    "dropout_fwd": "same name, different mask: upstream returns one uint8 per element, TE-FL's dropout_fwd(x, p) a "
                   "bit-packed uint8 mask; port the impl to the catalog's mask layout",
    "dropout_bwd": "same name, different mask layout (see dropout_fwd); port to dropout_bwd(dy, mask, p)",
    "fp8_transpose": "upstream takes a TE DType enum and writes into out=; port to fp8_transpose(q) -> q^T",
    "swap_first_dims": _NOT_IN_CATALOG,
    "fused_amax_and_scale_update_after_reduction": "port to delayed_scaling_update_ (one delayed-scaling update, in place)",
    "multi_tensor_compute_scale_and_scale_inv": "port to scale_from_amax per tensor",
    "multi_tensor_compute_scale_inv_e8m0": _NOT_IN_CATALOG,
    **{name: _NOT_IN_CATALOG for name in (
        "te_general_grouped_gemm", "te_general_grouped_gemm_for_grouped_tensor", "te_general_grouped_gemm_for_discrete_in",
        "te_general_grouped_gemm_for_discrete_out", "grouped_swizzle_for_gemm", "swizzle_scales_for_gemm_",
        "rmsnorm_bwd_add", "fp8_block_scaling_compute_partial_amax", "fp8_block_scaling_partial_cast",
        "mxfp8_scaling_compute_partial_amax", "mxfp8_scaling_partial_cast", "fused_multi_row_padding",
        "fused_multi_row_unpadding", "multi_tensor_unscale_l2norm", "multi_tensor_scale_tensor",
        "multi_tensor_adam_param_remainder", "multi_tensor_adam_fp8", "multi_tensor_adam_capturable",
        "multi_tensor_adam_capturable_master", "cast_to_fp8")},
    **{name: _VERSION for name in ("get_cublasLt_version", "get_cudnn_version", "get_num_cublas_streams")},
    **{name: _COMM for name in ("bulk_overlap_ag_with_external_gemm", "create_fp8_tensor_meta", "create_comm_overlap_helper",
                                  "create_comm_overlap", "create_comm_overlap_p2p", "init_nvshmem_backend",
                                  "create_nvshmem_tensor", "nvshmem_send_on_current_stream",
                                  "nvshmem_wait_on_current_stream", "nvshmem_finalize",
                                  "convert_host_pointers_to_tensor", "get_device_pointer_for_data_and_scales")},
}
