"""Pallas kernels for rl_jax: shared-prefix (DualKV) attention with a jnp reference.

``lse_attention`` holds the one pure-jnp two-region (context + own keys) attention with its
log-sum-exp merge; the kernel reference and the rollout sampler's prefill both use it.
``paged_attention`` holds the paged decode attention over a sample's response K/V pages,
returning its log-sum-exp for that merge.
Axis letters follow the legend of ``rl_jax/__init__.py``.

References: DualKV shared-prefix attention (amazon-science/dualkv-flash-attn-for-rl);
Kwon et al. 2023 (PagedAttention).
"""

from pallas_kernels.block_sizes import DEFAULT_BLOCK_SIZES, BlockSizes
from pallas_kernels.lse_attention import merge_partials, partial_softmax, two_region_attention
from pallas_kernels.paged_attention import paged_decode_attention, paged_decode_reference
from pallas_kernels.shared_prefix_attention import (
    BACKENDS,
    current_platform,
    resolve_backend,
    shared_prefix_attention,
    shared_prefix_attention_lse,
    shared_prefix_attention_reference,
    target_platform,
)

__all__ = [
    "BACKENDS",
    "BlockSizes",
    "DEFAULT_BLOCK_SIZES",
    "current_platform",
    "merge_partials",
    "paged_decode_attention",
    "paged_decode_reference",
    "partial_softmax",
    "resolve_backend",
    "shared_prefix_attention",
    "shared_prefix_attention_lse",
    "shared_prefix_attention_reference",
    "target_platform",
    "two_region_attention",
]
