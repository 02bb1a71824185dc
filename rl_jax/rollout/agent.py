"""Multi-turn (agentic) rollouts: continuous batching across turns, exact token ids, KV-cache
time-to-live.

A group is one episode's opening messages × M samples; its first prompt is prefilled once
into the slot's prefix cache (prompt-once). Everything after it (model tokens and observation
tokens) lives in each sample's response region, so R (the response cache) is the longest
trajectory. The host loop (``agent_loop``) drives the jitted pieces of ``kv_cache``,
``prefill`` and ``extend``:

* A sample whose turn ends (an end-of-turn id, or its per-turn budget) leaves the decode
  batch; its decoded text goes to ``env.step`` in a worker pool (``env_pool``) while the
  other samples keep decoding. When the observation comes back, its ids
  (``renderer.delta_ids``) are added by an incremental prefill at the sample's position
  (``extend``) and the sample resumes, sampling from the chunk's last logits.
* KV time-to-live (Continuum): a group whose samples all wait on their environments keeps
  its slot for ``ttl`` seconds; past that, if waiting work needs a slot, the group is evicted
  and later re-prefilled from its full token history (prompt + every appended id) when an
  observation returns. ``stats["kv_hit_rate"]`` = resumes without re-prefill / all resumes.
* ``schedule="turn_sync"`` is the baseline: every sample waits for the slowest environment
  step of its turn, then all continue together (same engine, same device code).

Token ids are never re-tokenized: model tokens are kept as sampled and only the environment's
messages are rendered (``renderer.delta_ids``), so trained ids are sampled ids. Every token
is drawn with the uniform of (seed, group uid, sample, trajectory index) and environments are
seeded with ``env_seed(seed, uid, sample)``, so trajectories do not depend on tool timing,
batching or evictions.

``rollout`` runs every requested episode to its end; ``rollout_groups`` returns K complete
groups and holds the rest across calls (APRIL across turns, a staleness bound, checkpoint
export/import by environment replay: ``agent_held``). Sharded meshes are not supported here
(single-device programs).

Axis letters: the legend of ``rl_jax/__init__.py`` (G slots, M samples, P prompt
cache length, R trajectory cache length); U turns (``agent_records``).

References: "Continuum: Efficient and Robust Multi-Turn LLM Agent Scheduling with KV Cache
Time-to-Live" (2025); Yu et al. 2022, "Orca" (iteration-level scheduling).
"""

from __future__ import annotations

import collections
import itertools
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.models.config import ModelConfig
from rl_jax.rollout import kv_cache, prefill, slots
from rl_jax.rollout.agent_held import HeldEpisodes
from rl_jax.rollout.agent_loop import Group, Loop
from rl_jax.rollout.agent_records import AgentRollout, EpisodeSpec, Trajectory, env_seed
from rl_jax.rollout.env_pool import EnvPool
from rl_jax.rollout.extend import Extension, decode_turns, extend
from rl_jax.rollout.records import RolloutError, check_int, pow2, sampling_params

__all__ = ["AgentEngine", "SCHEDULES"]

SCHEDULES = ("continuous", "turn_sync")


class AgentEngine(HeldEpisodes):
  """Multi-turn rollouts over group slots (see the module docstring).

  Usage::

      engine = AgentEngine(cfg, renderer, tok.decode, n=4, max_slots=8, max_turns=4)
      out = engine.rollout(params, [EpisodeSpec(make_env, example)] * 16, policy_version=v)

  Args:
    cfg: model config. renderer: ``agent_records.Renderer`` (prompt_ids, delta_ids,
      end_of_turn_ids). detokenize: ids -> text of an assistant turn (e.g. ``tok.decode``).
    n: samples per episode (M). max_slots: group slots decoded together (G).
    max_prompt_len: longest first prompt. max_total_tokens: longest trajectory after the
      first prompt (model and observation tokens). max_turn_tokens: model tokens per turn.
    max_turns: assistant turns per trajectory. max_obs_tokens: ids per observation (longer
      ones are cut and flagged).
    temperature, top_p, top_k: sampling. stop_ids: ids ending a turn (default
      ``renderer.end_of_turn_ids[0]``). seed: base seed of sampling and environments.
    ttl: seconds a group waiting on its environments keeps its KV cache (None: never evict;
      0: evict whenever work waits). step_timeout: seconds an environment step may run.
    workers: environment threads. schedule: "continuous" or "turn_sync" (the baseline).
    poll_steps: decode steps between checks for returned observations.
    over_sampling: ``rollout_groups`` keeps ceil(f·K) groups in flight (APRIL).
    max_staleness: η; held samples with a model token more than η versions old restart.
    dtype: sampler dtype (None = cfg's). context: maximum positions.
  """

  def __init__(self, cfg: ModelConfig, renderer, detokenize: Callable[[list[int]], str], *,
               n: int = 1, max_slots: int = 8, max_prompt_len: int = 128,
               max_total_tokens: int = 256, max_turn_tokens: int = 64, max_turns: int = 4,
               max_obs_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
               top_k: int = 0, stop_ids: Sequence[int] | None = None, seed: int = 0,
               ttl: float | None = 1.0, step_timeout: float | None = 30.0, workers: int = 16,
               schedule: str = "continuous", poll_steps: int = 8,
               over_sampling: float = 2.0, max_staleness: int | None = None,
               dtype: str | None = None, context: int | None = None):
    for name, v in dict(n=n, max_slots=max_slots, max_prompt_len=max_prompt_len,
                        max_total_tokens=max_total_tokens, max_turn_tokens=max_turn_tokens,
                        max_turns=max_turns, max_obs_tokens=max_obs_tokens, workers=workers,
                        poll_steps=poll_steps).items():
      check_int(name, v, 1)
    if schedule not in SCHEDULES:
      raise RolloutError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not float(over_sampling) >= 1.0:
      raise RolloutError(f"over_sampling must be >= 1, got {over_sampling!r}")
    if max_staleness is not None:
      check_int("max_staleness", max_staleness, 0)
    if ttl is not None and not float(ttl) >= 0:
      raise RolloutError(f"ttl must be >= 0 seconds or None, got {ttl!r}")
    stop = list(stop_ids) if stop_ids is not None else list(renderer.end_of_turn_ids[:1])
    if not stop:
      raise RolloutError("no stop id: pass stop_ids or a renderer with end_of_turn_ids")
    if dtype is not None:
      cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    self.context = int(context or cfg.max_position_embeddings)
    if max_prompt_len + max_total_tokens > self.context:
      raise RolloutError(f"max_prompt_len={max_prompt_len} + max_total_tokens="
                         f"{max_total_tokens} exceeds the context of {self.context} positions")
    self.cfg, self.renderer, self.detokenize = cfg, renderer, detokenize
    self.n, self.G, self.M = int(n), int(max_slots), int(n)
    self.max_prompt_len, self.max_total = int(max_prompt_len), int(max_total_tokens)
    self.max_turn, self.max_turns = int(max_turn_tokens), int(max_turns)
    self.max_obs, self.seed, self.schedule = int(max_obs_tokens), int(seed), schedule
    self.ttl = None if ttl is None else float(ttl)
    self.poll_steps = int(poll_steps)
    self.P, self.R = pow2(self.max_prompt_len, 8), pow2(self.max_total, 8)
    self.stop = set(stop)
    self.sp, self.filtered = sampling_params(cfg, temperature, top_k, top_p, stop, None)
    self.pool = EnvPool(int(workers), step_timeout)
    self._uids = itertools.count()
    self.over_sampling = float(over_sampling)
    self.max_staleness = None if max_staleness is None else int(max_staleness)
    self.buffer: collections.deque[Group] = collections.deque()  # held unfinished groups
    self._ready: collections.deque[Group] = collections.deque()  # complete beyond K
    self.live: dict[int, Group] = {}  # every group not yet returned, by uid

  # ---------------------------------------------------------------- requests
  def prepare_params(self, params):
    """Trainer parameters cast to the sampler's dtype (jitted; a no-op when they match)."""
    want = jnp.dtype(self.cfg.param_dtype)
    if any(leaf.dtype != want for leaf in jax.tree.leaves(params)):
      params = kv_cache.cast_params(params, str(want))
    return params

  def new_group(self, spec: EpisodeSpec, uid: int | None = None) -> Group:
    """Reset M fresh environments (seeds ``env_seed(seed, uid, m)``) and render the prompt.

    The M samples share one first prompt (prompt-once); environments whose opening
    messages render differently raise RolloutError.
    """
    uid = next(self._uids) if uid is None else int(uid)
    trajs, prompt = [], None
    for m in range(self.M):
      env = spec.make_env()
      messages = list(env.reset(spec.example, env_seed(self.seed, uid, m)))
      ids = [int(t) for t in self.renderer.prompt_ids(messages, tools=tuple(env.tools))]
      if prompt is None:
        prompt = ids
      elif ids != prompt:
        raise RolloutError(f"episode {uid}: sample {m}'s opening messages differ from sample "
                           "0's; a group shares one first prompt")
      trajs.append(Trajectory(env, messages))
    if not prompt or len(prompt) > self.max_prompt_len:
      raise RolloutError(f"episode {uid}: first prompt has {len(prompt or [])} ids; it must "
                         f"have 1 to max_prompt_len={self.max_prompt_len}")
    if any(not 0 <= t < self.cfg.vocab_size for t in prompt):
      raise RolloutError(f"episode {uid}: prompt id outside the vocabulary")
    return Group(uid, prompt, trajs, spec)

  def rollout(self, params, episodes: Sequence[EpisodeSpec], *,
              policy_version: int = 0, first_uid: int | None = None) -> AgentRollout:
    """Run every episode (M samples each) to its end.

    Args:
      params: trainer parameters. episodes: one EpisodeSpec per group; group uids are
        drawn in order from the engine's counter, or are ``first_uid, first_uid + 1, ..``
        when given (a trainer seeds each step's groups by their place in the run).
        policy_version: recorded per model token.
    Returns:
      AgentRollout, groups in uid order; ``stats`` adds ``kv_hit_rate``, ``resumes``,
      ``evictions``, ``reprefill_tokens``, ``env_steps``, ``timeouts``, ``env_errors``,
      ``decode_calls``, ``seconds`` and ``trajectories_per_s``.
    """
    params = self.prepare_params(params)
    groups = [self.new_group(spec, None if first_uid is None else first_uid + i)
              for i, spec in enumerate(episodes)]
    self.live.update((g.uid, g) for g in groups)
    loop = Loop(self, params, policy_version)
    loop.run(groups)
    for g in groups:
      self.live.pop(g.uid, None)
    return loop.result(groups)

  def warmup(self, params) -> int:
    """Compile every shape the loop can meet (admission, re-prefill, extension and decode
    buckets) on padding rows, so no ``rollout`` call compiles. Returns the programs traced."""
    e, before = self, sum(kv_cache.TRACE_COUNTS.values())
    params = self.prepare_params(params)
    key, version = jax.random.key(self.seed, impl="threefry2x32"), jnp.int32(0)
    state = kv_cache.init_state(e.cfg, e.G, e.M, e.P, e.R)
    ladder = lambda lo, top: sorted({min(top, pow2(lo << i)) for i in range(top.bit_length())})
    loop = Loop(self, params, 0)
    for Bn in ladder(4, e.G):
      for Pb in ladder(8, e.P):
        a, _ = loop.admission([], Bn, Pb)
        state = prefill.admit(e.cfg, params, state, prefill.Admission(**a), e.sp, version, key,
                              filtered=e.filtered)
    shapes = {slots.resume_shape(r, t, G=e.G, M=e.M, R=e.R)
              for r in [1, e.G * e.M, *(4 ** i for i in range(1, 16) if 4 ** i < e.G * e.M)]
              for t in (1, e.R // 2, e.R)}
    for Br, T in sorted(shapes):
      state = prefill.resume(e.cfg, params, state, slots.resume_rows(Br, T, e.G))
    for Be in ladder(4, e.G * e.M):
      for C in ladder(16, min(e.R, pow2(e.max_obs + 2, 16))):
        x = Extension(np.full(Be, e.G, np.int32), np.zeros(Be, np.int32), np.zeros(Be, np.int32),
                      np.zeros((Be, C), np.int32), np.ones(Be, np.int32), np.zeros(Be, np.int32))
        state, _ = extend(e.cfg, params, state, x, e.sp, version, filtered=e.filtered)
    state, _ = decode_turns(e.cfg, params, state, e.sp, version, jnp.int32(1), jnp.int32(1),
                            filtered=e.filtered)
    jax.block_until_ready(state)
    return sum(kv_cache.TRACE_COUNTS.values()) - before

  def close(self) -> None:
    """Shut the environment pool down."""
    self.pool.close()
