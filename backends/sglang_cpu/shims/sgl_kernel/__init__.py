"""Stand-in for SGLang's kernel package in its CPU mode (see ``backends/sglang_cpu``).

It registers no torch operators, so SGLang's ``cpu_has_amx_support()`` is False and its layers take
their plain-torch paths. SGLang 0.5.23 imports the names below at module level when
``SGLANG_USE_CPU_ENGINE=1`` (``tests/test_sglang_api.py`` scans its source for them); plain decoding,
weight updates and memory release call none of them (measured by tracing every attribute access
through an engine start, generation and updates).
They serve speculative decoding and KV-cache moves, which need SGLang's real CPU kernel build:
calling one raises, naming the feature.
"""

from __future__ import annotations

__version__ = "0.0.0+rlhf_sg.cpu_stand_in"


def _needs_real_kernels(name: str, feature: str):
    def missing(*args, **kwargs):
        raise NotImplementedError(
            f"sgl_kernel.{name} ({feature}) has no stand-in: SGLang's CPU mode here supports plain decoding "
            "only. Build SGLang's CPU kernel package to use this feature."
        )

    missing.__name__ = name
    return missing


assign_req_to_token_pool_cpu = _needs_real_kernels("assign_req_to_token_pool_cpu", "speculative decoding")
copy_all_layer_kv_cache_cpu = _needs_real_kernels("copy_all_layer_kv_cache_cpu", "KV-cache moves between slots")
assign_draft_cache_locs_contiguous_cpu = _needs_real_kernels(
    "assign_draft_cache_locs_contiguous_cpu", "speculative decoding"
)
assign_extend_cache_locs_cpu = _needs_real_kernels("assign_extend_cache_locs_cpu", "speculative decoding")
build_tree_kernel_efficient_cpu = _needs_real_kernels("build_tree_kernel_efficient_cpu", "speculative decoding")
fill_accept_out_cache_loc_cpu = _needs_real_kernels("fill_accept_out_cache_loc_cpu", "speculative decoding")
fill_bonus_tokens_cpu = _needs_real_kernels("fill_bonus_tokens_cpu", "speculative decoding")
rotate_input_ids_cpu = _needs_real_kernels("rotate_input_ids_cpu", "speculative decoding")
verify_tree_greedy_cpu = _needs_real_kernels("verify_tree_greedy_cpu", "speculative decoding")
