"""Fused kernels for the training forwards (``--model.fused_kernels``).

A decoder layer's matmuls run near the machine's ceiling; its RMSNorms, the gated MLP's ``act(gate) * up`` and the
rotary embedding run as chains of small elementwise ops that each read and write the whole activation, forward and
backward. On the e2e bench's model that was about a tenth of the training phase. :func:`fuse_kernels` swaps those
modules for ``torch.compile`` regions (:mod:`rlhf_sg.kernels.ops`) that compute the same values (the norms bit for
bit in every dtype, the products rounded once), where the module's source matches the form the op stands in for
(:mod:`rlhf_sg.kernels.fuse`); anything else runs as it is. Off by default, as peers' fused kernels are (OpenRLHF's
``--use_liger_kernel``, verl's ``use_fused_kernels``): each process compiles its ops once at its first forward
(seconds on a CPU; cached on disk for the next run).

:mod:`rlhf_sg.kernels.host_memory` is the CPU ranks' allocator setting: the memory a step frees stays in the
process, so the next step's activations are not faulted in again (every CPU model-worker rank, flag or not).
"""

from rlhf_sg.kernels.fuse import FUSED_ATTR, describe, fuse_kernels, fused_counts, unfuse_kernels

__all__ = ["FUSED_ATTR", "describe", "fuse_kernels", "fused_counts", "unfuse_kernels"]
