"""Rollout engine: jitted KV-cache sampler, prompt-once groups, continuous batching, APRIL.

Public API::

    out = rollout.generate(cfg, params, prompts, n=1, max_new_tokens=..., temperature=1.0,
                           top_p=1.0, top_k=0, eos_id=None, seed=0)
    engine = rollout.RolloutEngine(cfg, n=8, max_slots=16, max_new_tokens=512)
    out = engine.rollout_groups(params, prompt_iter, k_groups=32, policy_version=step)
    agent = rollout.AgentEngine(cfg, renderer, tok.decode, n=4, max_slots=8, max_turns=4)
    out = agent.rollout(params, [rollout.EpisodeSpec(make_env, example)], policy_version=step)
    # online: requests come and go while others decode (what the server's lanes do)
    loop = rollout.Loop(engine, engine.prepare_params(params), policy_version=step)
    loop.submit(engine.groups_of(engine.new_request(prompt_ids)))
    loop.step(); loop.running_tokens(groups); loop.abort(group)

Modules: ``core`` (``EngineCore``: the one engine both faces are), ``loop`` (the one
scheduling loop: a single-turn request is the one-turn case of a multi-turn episode),
``engine`` (``RolloutEngine``: requests in and out of the loop, APRIL,
its checkpoints), ``held`` (both engines' held groups between calls: APRIL, the staleness
bound, the uid counter), ``generation`` (``generate``), ``records`` (prompts, groups,
``Rollout``), ``slots`` (admission arrays, forks, buckets), ``sampler`` (the jitted pieces:
``kv_cache``, ``prefill``, ``decode``), ``pages`` (the paged response cache: page pool,
page tables, live-page buckets), ``sampling`` (token draws); multi-turn rollouts: ``agent``
(``AgentEngine``: episodes in and out of the loop, its checkpoints), ``agent_records``,
``env_pool`` (environment steps off the decode loop) and ``extend`` (incremental prefill of
observations).
Axis letters: the legend of ``rl_jax/__init__.py``.
"""

from rl_jax.rollout.agent import AgentEngine
from rl_jax.rollout.agent_records import AgentRollout, EpisodeSpec, Renderer, env_seed
from rl_jax.rollout.engine import RolloutEngine
from rl_jax.rollout.generation import generate
from rl_jax.rollout.loop import Loop
from rl_jax.rollout.records import (GroupRequest, Prompt, Rollout, RolloutError, Sample,
                                    assemble)
from rl_jax.rollout.sampler import DecodeState, cast_params, kv_cache_bytes, merge_partials
from rl_jax.rollout.sampling import SamplingParams, filter_logits, sample_logits

__all__ = [
    "AgentEngine",
    "AgentRollout",
    "DecodeState",
    "EpisodeSpec",
    "GroupRequest",
    "Loop",
    "Prompt",
    "Renderer",
    "Rollout",
    "RolloutEngine",
    "RolloutError",
    "Sample",
    "SamplingParams",
    "assemble",
    "cast_params",
    "env_seed",
    "filter_logits",
    "generate",
    "kv_cache_bytes",
    "merge_partials",
    "sample_logits",
]
