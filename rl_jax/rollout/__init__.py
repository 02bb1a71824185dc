"""Rollout engine: jitted KV-cache sampler, prompt-once groups, continuous batching, APRIL.

Public API::

    out = rollout.generate(cfg, params, prompts, n=1, max_new_tokens=..., temperature=1.0,
                           top_p=1.0, top_k=0, eos_id=None, seed=0)
    engine = rollout.RolloutEngine(cfg, n=8, max_slots=16, max_new_tokens=512)
    out = engine.rollout_groups(params, prompt_iter, k_groups=32, policy_version=step)
"""

from rl_jax.rollout.engine import (GroupRequest, Prompt, Rollout, RolloutEngine, RolloutError,
                                   Sample, assemble, generate)
from rl_jax.rollout.sampler import DecodeState, cast_params, kv_cache_bytes, merge_partials
from rl_jax.rollout.sampling import SamplingParams, filter_logits, sample_logits

__all__ = [n for n in dir() if not n.startswith("_")]
