"""Pallas kernels for rl_jax: shared-prefix (DualKV) attention with a jnp reference.

References: DualKV shared-prefix attention (amazon-science/dualkv-flash-attn-for-rl).
"""

from pallas_kernels.block_sizes import DEFAULT_BLOCK_SIZES, BlockSizes
from pallas_kernels.shared_prefix_attention import (
    BACKENDS,
    shared_prefix_attention,
    shared_prefix_attention_lse,
    shared_prefix_attention_reference,
)

__all__ = [
    "BACKENDS",
    "BlockSizes",
    "DEFAULT_BLOCK_SIZES",
    "shared_prefix_attention",
    "shared_prefix_attention_lse",
    "shared_prefix_attention_reference",
]
