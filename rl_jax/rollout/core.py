"""The rollout engine's core: what the scheduling loop (``loop.Loop``) runs on.

One engine, two faces. ``RolloutEngine`` (single-turn requests: ``GroupRequest`` in,
``Rollout`` out) and ``AgentEngine`` (multi-turn episodes: ``EpisodeSpec`` in,
``AgentRollout`` out) are ``EngineCore``s that differ only in what a request is and how its
samples are checkpointed. Everything the loop reads is set here, once, for both:

* shapes: G group slots of M samples, prompt cache P, response (trajectory) cache R, all
  powers of two (``records.pow2``), inside the model's ``context`` positions;
* the paged KV pool's plan (``records.pool_plan``: page size S, first and largest size,
  fixed or growing) and the decode programs compiled so far (``programs``);
* sampling: ``sp`` (device arrays: temperature, top-k, top-p, end ids) and the static
  ``filtered`` flag;
* the sampler's copy of the weights (``kv_cache.SamplerParams``: one jitted cast and, on a
  mesh, reshard), the prefill program (``prefill.admit_for``) and the mesh context ``ctx``;
* the held groups (``held.HeldGroups``: APRIL's buffer and extras, the staleness bound, the
  uid counter).

The multi-turn face adds an environment pool (``pool``), the time-to-live of a waiting
group's pages (``ttl``), the deterministic schedule and the turn limits; without
environments those keep the values below (``pool`` None: the loop has nothing to poll or
wait for, and each sample's one turn has the whole budget).
"""

from __future__ import annotations

import jax
import numpy as np

from rl_jax import sharding
from rl_jax.models.config import ModelConfig
from rl_jax.rollout import kv_cache, prefill
from rl_jax.rollout.held import HeldGroups, HoldsGroups
from rl_jax.rollout.records import (RolloutError, check_int, check_power_of_two, pool_plan,
                                    pow2, sampling_params)

__all__ = ["EngineCore"]


class EngineCore(HoldsGroups):
  """The engine the loop runs on (module docstring); the two faces call ``_init_core``.

  Attributes (besides ``_init_core``'s arguments): cfg, the sampler's model config (its
  ``dtype``, dropless routing); G, M, P, R; D, the pool's slot shards
  (``kv_cache.pool_shards``: the devices the slots are split over); Q, the sequence shards
  of each (``kv_cache.sequence_shards``); pool_plan, S, fixed_pool, max_pool_pages,
  pool_pages (all D·Q shards together; grows with a growing pool; later calls start there);
  programs, the (live bucket, pages read once per slot, pool pages) triples decoded with;
  sp, filtered; ctx (mesh, rules) or None; admit_fn; held; live, every group not yet
  returned, by uid.
  """

  # without environments (the single-turn face): nothing to poll, no time-to-live, and the
  # loop's one turn per sample has the whole budget (max_turn = max_total, set below)
  pool = None
  deterministic = False
  schedule = "continuous"
  ttl = None
  prefix_cache = 0  # entries the loop's prefix cache keeps (``RolloutEngine``)
  prompt_pages = False  # the prompt's ids after its first on pool pages (both faces' flag)

  def _init_core(self, cfg: ModelConfig, *, n: int, slots: int, samples_per_slot: int,
                 max_prompt_len: int, budget: tuple[str, int], temperature: float,
                 top_p: float, top_k: int, eos_id, stop, over_sampling: float,
                 max_staleness: int | None, mesh, rules, dtype: str | None,
                 context: int | None, page_size: int, kv_pages: int | None,
                 kv_memory_fraction: float | None, prefill_chunk: int | None,
                 share_prefixes: bool) -> None:
    """Checks the shared arguments (one ``RolloutError`` line each) and sets the core.

    Args:
      n: samples per request or episode. slots: group slots (G). samples_per_slot: M (n,
        or 1 for the replicated baseline). budget: (its argument's name, tokens): a
        sample's response or trajectory budget after its prompt (R = its power of two).
      eos_id, stop: ``records.sampling_params``' end ids and stop sequences.
      The rest as the faces' docstrings say.
    """
    budget_name, budget_tokens = budget
    check_int("n", n, 1)
    check_int("max_slots", slots, 1)
    check_int(budget_name, budget_tokens, 1)
    check_int("max_prompt_len", max_prompt_len, 1)
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
      raise RolloutError(f"top_k must be an integer >= 0 (0 disables it), got {top_k!r}")
    if not 0.0 < float(top_p) <= 1.0:
      raise RolloutError(f"top_p must lie in (0, 1], got {top_p!r}")
    if not float(temperature) >= 0.0:
      raise RolloutError(f"temperature must be >= 0 (0 is greedy), got {temperature!r}")
    if not float(over_sampling) >= 1.0:
      raise RolloutError(f"over_sampling must be >= 1, got {over_sampling!r}")
    if max_staleness is not None:
      check_int("max_staleness", max_staleness, 0)
    self.context = int(context or cfg.max_position_embeddings)
    if max_prompt_len + budget_tokens > self.context:
      raise RolloutError(f"max_prompt_len={max_prompt_len} + {budget_name}={budget_tokens} "
                         f"exceeds the context of {self.context} positions")
    if (mesh is None) != (rules is None):
      raise RolloutError("pass both mesh and rules, or neither")
    if prefill_chunk is not None:
      check_power_of_two("prefill_chunk", prefill_chunk)
    # the most tokens of a sample one prefill or re-prefill call computes
    self.prefill_chunk = None if prefill_chunk is None else int(prefill_chunk)
    if dtype is not None:
      cfg = cfg.replace(dtype=dtype, param_dtype=dtype)
    self.cfg = cfg.replace(moe_capacity_factor=0.0)  # the sampler routes every token
    self.n, self.G, self.M = int(n), int(slots), int(samples_per_slot)
    self.max_prompt_len = int(max_prompt_len)
    self.P, self.R = pow2(self.max_prompt_len, 8), pow2(int(budget_tokens), 8)
    self.over_sampling = float(over_sampling)
    self.max_staleness = None if max_staleness is None else int(max_staleness)
    self.share_prefixes = bool(share_prefixes)
    devices = jax.devices()[:1] if mesh is None else list(mesh.devices.flat)
    self.ctx = None if mesh is None else (mesh, sharding.get_rules(rules))
    self.D = kv_cache.pool_shards(self.G, self.ctx)  # the pool's slot shards
    # the sequence devices (the plan keeps them where they divide a sample's page entries)
    Q = kv_cache.sequence_shards(self.G, self.ctx)
    self.pool_plan = pool_plan(
        self.cfg, G=self.G, M=self.M, R=self.R, page_size=page_size, kv_pages=kv_pages,
        kv_memory_fraction=kv_memory_fraction, devices=devices,
        budget=f"{budget_name}={budget_tokens}", shards=self.D, sequence=Q)
    self.Q = self.pool_plan.sequence  # sequence shards of each slot shard
    self.S = self.pool_plan.S  # tokens per page
    self.fixed_pool, self.max_pool_pages = self.pool_plan.fixed, self.pool_plan.most
    self.pool_pages = self.pool_plan.pages
    self.programs: set[tuple[int, int, int]] = set()
    self.sp, self.filtered = sampling_params(self.cfg, temperature, top_k, top_p, eos_id, stop)
    self._params = kv_cache.SamplerParams(self.cfg, self.ctx)
    # prefill + first tokens: with the training programs' CPU options when
    # ``train.cpu_fast_compile`` is on (the decode loop keeps XLA's defaults: compile_options)
    self.admit_fn = prefill.admit_for(devices, prefill_chunk)
    self.held = HeldGroups()
    self.live: dict = {}
    # a sample's turn and whole budget in response-cache ids; with the prompt on pages the
    # faces set max_total to the budget after the whole prompt (``loop.total_tokens``)
    self.max_turn = self.max_total = int(budget_tokens)

  def prepare_params(self, params):
    """Trainer parameters -> sampler parameters, on device (``kv_cache.SamplerParams``: one
    jitted cast + reshard on a mesh; a no-op when they already match)."""
    return self._params(params)
