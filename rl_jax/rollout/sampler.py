"""Jitted KV-cache sampler over group slots with a shared (prompt-once) prefix cache.

One namespace for the sampler's pieces, which live in three modules:

* ``kv_cache``: the slot state (``DecodeState``) and its cache layout, ``init_state``, the
  token bookkeeping shared by prefill and decode, ``cast_params``; the response pages
  themselves live in ``pages``.
* ``prefill``: ``admit`` (prefill prompts into free slots once per group, first tokens) and
  ``resume`` (rebuild the response K/V of resumed partial samples), both attending through
  ``grouped_attention`` (the two-region log-sum-exp attention of ``pallas_kernels``).
* ``decode``: ``decode`` (the ``while_loop``) over ``decode_step`` and
  ``paged_decode_attention`` (``decode_attention``: one contiguous suffix).

Axis letters: the legend of ``rl_jax/__init__.py``. Each slot g holds one prompt,
prefilled once into the prefix cache (L arrays: keys [G,K,H,P], values [G,K,P,H]), and M
samples whose own response K/V lives on pages of the response pool (L arrays: keys
[Pg,K,H,S], values [Pg,K,S,H]) through a page table [G,M,NP] (``pages``). The replicated
layout is
the same code with M = 1 and the prompt repeated in one slot per sample. Shapes are bucketed
by the engine, so each entry point compiles a few times at most (``TRACE_COUNTS``).

References: Kwon et al. 2023, "Efficient Memory Management for LLM Serving with
PagedAttention" (prefix sharing); Milakov & Gimelshein 2018, "Online normalizer calculation
for softmax" (log-sum-exp merge); DualKV (shared-prompt attention for RL, 2025).
"""

from __future__ import annotations

from pallas_kernels.lse_attention import merge_partials
from rl_jax.rollout.decode import (NEVER, decode, decode_attention, decode_step,
                                   paged_decode_attention)
from rl_jax.rollout.kv_cache import (CACHE_AXES, EOS, LENGTH, REASON_NAMES, RUNNING, STOP,
                                     TRACE_COUNTS, DecodeState, cast_params, init_state,
                                     kv_cache_bytes)
from rl_jax.rollout.prefill import (Admission, Resume, admit, admit_for, admit_with,
                                     grouped_attention, resume)

__all__ = ["CACHE_AXES", "EOS", "LENGTH", "NEVER", "REASON_NAMES", "RUNNING", "STOP", "TRACE_COUNTS",
           "Admission", "DecodeState", "Resume", "admit", "admit_for", "admit_with", "cast_params",
           "decode", "decode_attention", "decode_step", "grouped_attention", "init_state",
           "kv_cache_bytes", "merge_partials", "paged_decode_attention", "resume"]
