"""Multi-turn (agentic) rollouts: continuous batching across turns, exact token ids, KV-cache
time-to-live.

A group is one episode's opening messages × M samples; its first prompt is prefilled once
into the slot's prefix cache (prompt-once). Everything after it (model tokens and observation
tokens) lives in each sample's response region, so R (the response cache) is the longest
trajectory. With ``prompt_pages`` the slot holds the prompt's first id and the rest opens
every trajectory on pool pages, written once and forked by the group's other samples. The
engine is the multi-turn face of the one rollout engine (``core.EngineCore``, as
``RolloutEngine`` is), and the scheduling loop both faces run (``loop.Loop``) drives the
jitted pieces of ``kv_cache``, ``prefill``, ``decode`` and ``extend``:

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
export/import by environment replay, below). With ``mesh`` and ``rules`` every program runs
sharded on the sampler's mesh as the single-turn engine's do (weights as the mesh rules
say, group slots over the batch axes, kv heads over ``tensor``).

Mixture of experts: every trajectory keeps the experts the sampler chose for each model
token it fed (``Trajectory.routing``; ``decode`` records them, ``extend`` those of a turn's
last token), -1 for observation tokens and the final token; ``AgentRollout.routing`` is
what router replay feeds the trainer. A sample re-prefilled after an eviction or a
preemption keeps the records of the tokens fed before (``slots.merged_routing``), and held
groups keep theirs through ``export_held`` / ``import_held``.

Held groups. ``rollout_groups`` returns exactly K complete groups and holds the unfinished rest:
a sample may be held mid-turn (its partial turn is kept with per-token versions), waiting on its
environment (the step keeps running; its outcome is applied at the next call) or with an
observation not yet appended. Held groups resume first at the next call, re-prefilled from their
full history with the new weights. A held sample with a model token more than η versions old is
restarted (a fresh environment, reset with the same seed).

``export_held`` writes the held groups as fixed-shape arrays plus the recorded actions;
``import_held`` rebuilds each environment by ``reset`` + replay of its actions (episodes are
deterministic given example, seed and actions: ``rl_jax.envs.base``), so a resumed run
continues exactly. A step that timed out is recorded as such (``Trajectory.turn_timeouts``)
and replayed as recorded: the environment steps (the late step ran in the background, so its
effects are kept) and the sample sees the time-out's error observation again.

Axis letters: the legend of ``rl_jax/__init__.py`` (G slots, M samples, P prompt
cache length, R trajectory cache length); U turns (``agent_records``).

References: "Continuum: Efficient and Robust Multi-Turn LLM Agent Scheduling with KV Cache
Time-to-Live" (2025); Yu et al. 2022, "Orca" (iteration-level scheduling).
"""

from __future__ import annotations

import concurrent.futures as cf
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from rl_jax.envs.base import Message, StepResult, opening_messages
from rl_jax.models.config import ModelConfig
from rl_jax.rollout.agent_records import AgentRollout, EpisodeSpec, Trajectory, env_seed
from rl_jax.rollout.env_pool import EnvPool, StepOutcome, error_message, observation_ids
from rl_jax.rollout.loop import (DONE, READY, RUN, WAIT, Group, Loop, apply_outcome,
                                 poll_outcomes, turn_tokens, warmup)
from rl_jax.rollout.core import EngineCore
from rl_jax.rollout.held import lag_stats, rows
from rl_jax.rollout.records import RolloutError, check_int, pow2

__all__ = ["AgentEngine", "SCHEDULES"]

SCHEDULES = ("continuous", "turn_sync")
_STATUS = (RUN, WAIT, READY, DONE)
_FINISH = ("", "done", "max_turns", "max_tokens")  # export code of ``Trajectory.finish``
_COUNTERS = ("tool_calls", "tool_errors", "timeouts", "env_errors", "truncated_obs",
             "truncated_turn")


class AgentEngine(EngineCore):
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
    deterministic: a schedule that is a function of the seeds and token counts alone: the
      result of an environment step joins the batch ``result_delay`` decode steps after the
      step was submitted (the loop waits for it only if the tool is later), results due
      together join in (submission step, group, sample) order, and the time-to-live is
      ``ttl_steps`` decode steps. Tools overlap those decode steps, yet which samples decode
      together at every step, which groups complete first and everything held depend on
      nothing measured in seconds (a resumed trainer continues exactly).
    result_delay: decode steps between an environment step's submission and its result
      joining the batch (``deterministic`` only; size it to the tools' latency in steps).
    ttl_steps: the time-to-live of ``deterministic`` in decode steps (None: never evict).
    dtype: sampler dtype (None = cfg's). context: maximum positions.
    mesh, rules: run every program sharded on this mesh with these rules.
    page_size: tokens per page of the trajectory cache (``rollout.pages``; >= the
      trajectory budget is one worst-case page per sample).
    prefill_chunk: prompts longer than this many tokens are prefilled in chunks
      (``prefill.prefill_prompts``), and evicted or preempted trajectories re-prefilled in
      chunks (``slots.tail_rounds``); None: whole.
    kv_pages: a fixed pool of this many pages (at least one group's whole budget). When the
      resident groups need more, the most recently admitted one is preempted: its partial
      turns are kept, it goes back to the front of the queue and resumes by recompute
      (drawing the same tokens), and no group is admitted until another leaves its slot.
      None: the pool grows as trajectories need it (never preempts).
    kv_memory_fraction: with kv_pages None, a fixed pool of this fraction of the free
      memory of the sampler's devices (``records.fixed_pool_pages``; devices that report no
      capacity, e.g. CPU, keep the growing pool).
    share_prefixes: a re-prefilled sample whose tokens begin those of another sample with
      its K/V (of its group, or of a group with its prompt on the same pool shard) is forked
      from it (``slots.forks``) instead; False re-prefills every one.
    prompt_pages: the first prompt's ids after its first go onto pool pages, opening every
      trajectory as ids it did not sample (``Group.skip``), as ``RolloutEngine``'s: the
      admission's prefill writes them onto the group's first sample's pages and the others
      fork them; the samples draw the tokens they draw with the prompt in the slot's cache,
      with log-probs equal to float rounding. The trajectory cache holds
      ``max_prompt_len - 1 + max_total_tokens`` ids; what the engine returns and exports is
      the slot layout's (the prompt's ids cut off).
  """

  def __init__(self, cfg: ModelConfig, renderer, detokenize: Callable[[list[int]], str], *,
               n: int = 1, max_slots: int = 8, max_prompt_len: int = 128,
               max_total_tokens: int = 256, max_turn_tokens: int = 64, max_turns: int = 4,
               max_obs_tokens: int = 64, temperature: float = 1.0, top_p: float = 1.0,
               top_k: int = 0, stop_ids: Sequence[int] | None = None, seed: int = 0,
               ttl: float | None = 1.0, step_timeout: float | None = 30.0, workers: int = 16,
               schedule: str = "continuous", poll_steps: int = 8,
               over_sampling: float = 2.0, max_staleness: int | None = None,
               deterministic: bool = False, result_delay: int = 16,
               ttl_steps: int | None = None, dtype: str | None = None,
               context: int | None = None, mesh=None, rules=None, page_size: int = 64,
               prefill_chunk: int | None = 2048, kv_pages: int | None = None,
               kv_memory_fraction: float | None = None, share_prefixes: bool = True,
               prompt_pages: bool = False):
    for name, v in dict(max_turn_tokens=max_turn_tokens, max_turns=max_turns,
                        max_obs_tokens=max_obs_tokens, workers=workers,
                        poll_steps=poll_steps, result_delay=result_delay).items():
      check_int(name, v, 1)
    if schedule not in SCHEDULES:
      raise RolloutError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if ttl is not None and not float(ttl) >= 0:
      raise RolloutError(f"ttl must be >= 0 seconds or None, got {ttl!r}")
    if ttl_steps is not None:
      check_int("ttl_steps", ttl_steps, 0)
    stop = list(stop_ids) if stop_ids is not None else list(renderer.end_of_turn_ids[:1])
    if not stop:
      raise RolloutError("no stop id: pass stop_ids or a renderer with end_of_turn_ids")
    # with the prompt on pages the slot's cache holds its first id and the trajectory cache
    # its other ids before the trajectory
    self.prompt_pages = bool(prompt_pages)
    check_int("max_prompt_len", max_prompt_len, 1)
    check_int("max_total_tokens", max_total_tokens, 1)
    budget = (("max_prompt_len - 1 + max_total_tokens", max_prompt_len - 1 + max_total_tokens)
              if self.prompt_pages else ("max_total_tokens", max_total_tokens))
    # the trajectory cache is paged as the single-turn engine's response cache: a pool that
    # starts with room for 256 tokens per sample and doubles as trajectories need it
    # (``loop.Loop.room``), up to every whole budget, or a fixed one that preempts
    # (``loop.Loop.fit``); the stop ids end a turn
    self._init_core(
        cfg, n=n, slots=max_slots, samples_per_slot=n,
        max_prompt_len=1 if self.prompt_pages else max_prompt_len, budget=budget,
        temperature=temperature, top_p=top_p,
        top_k=top_k, eos_id=stop, stop=None, over_sampling=over_sampling,
        max_staleness=max_staleness, mesh=mesh, rules=rules, dtype=dtype, context=context,
        page_size=page_size, kv_pages=kv_pages, kv_memory_fraction=kv_memory_fraction,
        prefill_chunk=prefill_chunk, share_prefixes=share_prefixes)
    self.renderer, self.detokenize = renderer, detokenize
    self.max_prompt_len = int(max_prompt_len)  # the longest first prompt accepted
    self.max_total = int(max_total_tokens)  # after the whole prompt (``loop.total_tokens``)
    self.max_turn, self.max_turns = int(max_turn_tokens), int(max_turns)
    self.max_obs, self.seed, self.schedule = int(max_obs_tokens), int(seed), schedule
    self.deterministic, self.result_delay = bool(deterministic), int(result_delay)
    # the time-to-live in the loop's clock: decode steps (deterministic) or seconds
    if self.deterministic:
      self.ttl = None if ttl_steps is None else int(ttl_steps)
    else:
      self.ttl = None if ttl is None else float(ttl)
    self.poll_steps = int(poll_steps)
    self.stop = set(stop)
    self.pool = EnvPool(int(workers), step_timeout)

  # ---------------------------------------------------------------- requests
  def new_group(self, spec: EpisodeSpec, uid: int | None = None) -> Group:
    """Reset M fresh environments (seeds ``env_seed(seed, uid, m)``) and render the prompt.

    The M samples share one first prompt (prompt-once); environments whose opening
    messages render differently raise RolloutError.
    """
    return self.new_groups([spec], [uid])[0]

  def new_groups(self, specs: Sequence[EpisodeSpec], uids: Sequence[int | None]) -> list[Group]:
    """``new_group`` of each (spec, uid); uids None are drawn in order. Environments whose
    class sets ``concurrent_reset`` (an agent session waits in ``reset`` for its first
    request) are reset in threads, all at once."""
    uids = [self.held.new_uid() if u is None else int(u) for u in uids]
    jobs = [(spec, uid, m, spec.make_env()) for spec, uid in zip(specs, uids)
            for m in range(self.M)]

    def reset(job):
      spec, uid, m, env = job
      return env, opening_messages(env, spec.example, env_seed(self.seed, uid, m))

    if len(jobs) > 1 and any(getattr(env, "concurrent_reset", False) for *_, env in jobs):
      with cf.ThreadPoolExecutor(min(len(jobs), 64), thread_name_prefix="reset") as pool:
        opened = list(pool.map(reset, jobs))
    else:
      opened = [reset(job) for job in jobs]
    return [self._group(spec, uid, opened[i * self.M:(i + 1) * self.M])
            for i, (spec, uid) in enumerate(zip(specs, uids))]

  def _group(self, spec: EpisodeSpec, uid: int, opened) -> Group:
    """A group from its M (environment, opening messages); the prompt checks."""
    trajs, prompt = [], None
    for m, (env, messages) in enumerate(opened):
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
    head = 1 if self.prompt_pages else len(prompt)
    grp = Group(uid, prompt[:head], trajs, spec)
    grp.skip = len(prompt) - head
    for m in range(self.M):
      self._open(grp, m, prompt[head:])
    return grp

  def _open(self, grp, m: int, rest: list[int]) -> None:
    """Open sample m's fresh trajectory with the prompt's ids after the slot's (``rest``:
    ``Group.skip`` of them, with the prompt on pages; none in the slot layout, where
    ``loop.admission`` sets a fresh sample's first turn)."""
    if rest:
      k = len(rest)
      grp.trajs[m].append(rest, [0.0] * k, [-1] * k, False, -1)
      grp.budget[m] = k + min(turn_tokens(self, grp), self.max_total)
      grp.turn_start[m] = k

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
    groups = self.new_groups(episodes, [None if first_uid is None else first_uid + i
                                        for i in range(len(episodes))])
    self.live.update((g.uid, g) for g in groups)
    loop = Loop(self, params, policy_version)
    loop.run(groups)
    for g in groups:
      self.live.pop(g.uid, None)
    return loop.result(groups)

  def warmup(self, params) -> int:
    """Compile every shape the loop can meet (``loop.warmup``: admission, re-prefill,
    extension and decode buckets) on padding rows, so no ``rollout`` call compiles. Returns
    the programs traced."""
    return warmup(self, self.prepare_params(params))

  def close(self) -> None:
    """Shut the environment pool down."""
    self.pool.close()

  # ---------------------------------------------------------------- held groups (APRIL)
  def rollout_groups(self, params, episodes: Iterable[EpisodeSpec], k_groups: int, *,
                     policy_version: int = 0) -> AgentRollout:
    """Return exactly ``k_groups`` complete groups, holding the unfinished rest.

    Serving order: complete extras of the previous call, held groups (FIFO), then new
    episodes from ``episodes`` until ``ceil(over_sampling·K)`` groups are in flight (at most
    ``(η+1)·K`` under the staleness bound). Pass an iterator to keep its position.

    Returns:
      AgentRollout of K·M rows; stats add ``held_groups`` (= ``buffer_size``), ``resumed_groups``,
      ``restarted_samples``, ``max_token_lag`` and ``off_policy_token_fraction``.
    """
    check_int("k_groups", k_groups, 1)
    params = self.prepare_params(params)
    it = iter(episodes)
    restarted = self.held.enforce_staleness(policy_version, self.max_staleness,
                                            self._restart_stale)

    def new():
      spec = next(it, None)
      if spec is None:
        return None
      grp = self.new_group(spec)
      self.live[grp.uid] = grp
      return grp

    result, submit, need = self.held.serve(k_groups, self.over_sampling, self.max_staleness, new)
    loop = Loop(self, params, policy_version)
    if submit:
      complete, unfinished = loop.run(submit, min_complete=need)
      self.held.settle(result, complete, unfinished, need)
    for grp in result:
      self.live.pop(grp.uid, None)
    out = loop.result(result)
    out.stats.update(held_groups=len(self.buffer), buffer_size=len(self.buffer),
                     restarted_samples=restarted,
                     resumed_groups=sum(1 for g in result if g.resumed),
                     **lag_stats(out.versions, out.model_mask, policy_version))
    return out

  def _restart(self, grp, m: int) -> None:
    """Start sample m of ``grp`` over: a fresh environment reset with the same seed."""
    env = grp.spec.make_env()
    messages = opening_messages(env, grp.spec.example, env_seed(self.seed, grp.uid, m))
    rest = grp.first_prompt[len(grp.prompt):]
    grp.trajs[m] = Trajectory(env, messages)
    self._open(grp, m, rest)
    grp.status[m], grp.chunk[m], grp.cut[m], grp.evicted[m] = RUN, None, False, False
    grp.epoch[m] += 1  # a step still running for the old episode is discarded

  def _restart_stale(self, grp, oldest: int) -> int:
    """Restart the samples of ``grp`` holding a model token of a version below ``oldest``;
    how many (the staleness bound's restart, ``HeldGroups.enforce_staleness``)."""
    restarted = 0
    for m, t in enumerate(grp.trajs):
      if any(model and v < oldest for v, model in zip(t.versions, t.model)):
        self._restart(grp, m)
        restarted += 1
    return restarted

  # ---------------------------------------------------------------- checkpoints
  def export_held(self, capacity: int) -> dict[str, Any]:
    """The held groups (complete extras, then the buffer) as arrays for a checkpoint.

    Finished environment steps are applied first; steps still running are not waited for
    (with ``deterministic``, they are, so the arrays depend on the seeds alone): their samples
    are exported as waiting and ``import_held`` re-runs the step in replay.

    Args:
      capacity: rows of the arrays (>= number of held groups).
    Returns:
      dict of arrays: valid, ready bool [capacity]; uid, resumed, meta, prompt_len int32
      [capacity]; prompt int32 [capacity,P]; tokens, versions, turn int32 [capacity,M,R];
      logprobs float32 [capacity,M,R]; model bool [capacity,M,R]; length, status, budget,
      turn_start, cut, n_rewards, epoch, finish and the counters int32 [capacity,M]
      (``status`` indexes run/wait/ready/done, ``finish`` "", done, max_turns, max_tokens);
      turn_rewards float32 [capacity,M,U]; turn_ends int32 [capacity,M,U]; timed_out bool
      [capacity,M,U] (the applied step ran past the time-out); env_time float32
      [capacity,M]; next_uid int32 []; mixture-of-experts models also routing int32
      [capacity,M,R,Y,X] (``Trajectory.routing``, -1 where none was recorded). Numbers only
      (a checkpoint holds them as they are): the actions to replay are the decoded model
      tokens of each ended turn.
    """
    if self.deterministic:
      self.pool.wait_all()
    poll_outcomes(self)
    d, held = self.held.export(capacity, self.max_prompt_len, lambda g: g.first_prompt)
    # the slot layout's R (``Loop.result``'s): the prompt's ids are not exported
    C, M, R, U = capacity, self.M, pow2(self.max_total, 8), self.max_turns
    z = lambda shape, dt, fill=0: np.full(shape, fill, dt)
    d.update(tokens=z((C, M, R), np.int32),
             versions=z((C, M, R), np.int32, -1), turn=z((C, M, R), np.int32, -1),
             logprobs=z((C, M, R), np.float32), model=z((C, M, R), bool),
             turn_rewards=z((C, M, U), np.float32), turn_ends=z((C, M, U), np.int32, -1),
             timed_out=z((C, M, U), bool),
             env_time=z((C, M), np.float32),
             **{k: z((C, M), np.int32) for k in ("length", "status", "budget", "turn_start",
                                                 "cut", "n_rewards", "epoch", "finish",
                                                 *_COUNTERS)})
    if self.cfg.is_moe:
      d["routing"] = z((C, M, R, len(self.cfg.moe_layers), self.cfg.num_experts_per_tok),
                       np.int32, -1)
    for h, grp in enumerate(held):
      skip = grp.skip  # the slot layout's record: without the prompt's ids
      for m, t in enumerate(grp.trajs):
        t = t.after(skip)
        n, u = len(t.tokens), len(t.turn_rewards)
        for k in ("tokens", "versions", "turn", "logprobs", "model"):
          d[k][h, m, :n] = getattr(t, k)
        if "routing" in d and t.routing is not None:
          d["routing"][h, m, :len(t.routing)] = t.routing
        d["turn_rewards"][h, m, :u] = t.turn_rewards
        d["timed_out"][h, m, :u] = t.turn_timeouts
        d["turn_ends"][h, m, :len(t.turn_ends)] = t.turn_ends
        d["length"][h, m], d["status"][h, m] = n, _STATUS.index(grp.status[m])
        d["budget"][h, m] = grp.budget[m] - skip
        d["turn_start"][h, m] = grp.turn_start[m] - skip
        d["cut"][h, m], d["n_rewards"][h, m] = grp.cut[m], len(t.turn_rewards)
        d["epoch"][h, m], d["env_time"][h, m] = grp.epoch[m], t.env_time
        d["finish"][h, m] = _FINISH.index(t.finish or "")
        for k in _COUNTERS:
          d[k][h, m] = getattr(t, k)
    return d

  def import_held(self, d, spec_of: Callable[[Any], EpisodeSpec]) -> None:
    """Replace the held groups with ``export_held``'s, rebuilding every environment.

    ``spec_of(meta)`` returns the EpisodeSpec of a group's tag (e.g. a dataset index).
    Each sample's environment is reset with its seed and replays its recorded actions (the
    detokenized model tokens of its ended turns, as the loop decoded them); a sample exported
    while its step was running gets that step's outcome from the replay. Steps of the
    replaced groups still running in the pool are dropped.
    """
    self.pool.drop()
    self.live.clear()
    held = []
    for row in rows(d):
      grp = self.new_group(spec_of(row.meta), uid=row.uid)
      grp.resumed = row.resumed
      if grp.first_prompt != row.prompt:
        raise RolloutError(f"held group {grp.uid}: the rebuilt first prompt differs")
      for m in range(self.M):
        self._replay(grp, m, d, row.h, self._actions(d, row.h, m))
      self.live[grp.uid] = grp
      held.append((grp, row.ready))
    self.held.replace(held, int(d["next_uid"]))

  def _actions(self, d, h: int, m: int) -> list[str]:
    """The actions of sample m of row h: each ended turn's model tokens, decoded without
    the stop id that ended it (as ``loop`` decoded them when the turn ended)."""
    n = int(d["length"][h, m])
    tokens, model = np.asarray(d["tokens"][h, m, :n]), np.asarray(d["model"][h, m, :n], bool)
    turn = np.asarray(d["turn"][h, m, :n])
    out = []
    for u in range(int(np.sum(np.asarray(d["turn_ends"][h, m]) >= 0))):
      ids = tokens[model & (turn == u)].tolist()
      out.append(self.detokenize(ids[:-1] if ids and ids[-1] in self.stop else ids))
    return out

  def _replay(self, grp, m: int, d, h: int, actions) -> None:
    """Restore sample m's record from row h and replay its actions on its environment. The
    record is the slot layout's: with the prompt on pages it follows the prompt's ids that
    open the trajectory (``k`` = ``Group.skip``)."""
    t, n, k = grp.trajs[m], int(d["length"][h, m]), grp.skip
    t.append(d["tokens"][h, m, :n], d["logprobs"][h, m, :n], d["versions"][h, m, :n], False, 0)
    t.model = t.model[:k] + np.asarray(d["model"][h, m, :n]).tolist()
    t.turn = t.turn[:k] + np.asarray(d["turn"][h, m, :n]).tolist()
    if "routing" in d and n:
      routing = np.array(d["routing"][h, m, :n], np.int32)
      t.routing = np.concatenate([np.full((k, *routing.shape[1:]), -1, np.int32), routing])
    u = int(np.sum(np.asarray(d["turn_ends"][h, m]) >= 0))
    t.turn_ends = [k + int(x) for x in np.asarray(d["turn_ends"][h, m, :u])]
    t.env_time = float(d["env_time"][h, m])
    t.finish = _FINISH[int(d["finish"][h, m])] or None
    for c in _COUNTERS:
      setattr(t, c, type(getattr(t, c))(d[c][h, m]))
    grp.status[m] = _STATUS[int(d["status"][h, m])]
    if n:  # a sample with nothing after the prompt keeps its opening turn (``_open``)
      grp.budget[m] = k + int(d["budget"][h, m])
      grp.turn_start[m] = k + int(d["turn_start"][h, m])
    grp.cut[m], grp.epoch[m] = bool(d["cut"][h, m]), int(d["epoch"][h, m])
    applied = int(d["n_rewards"][h, m])
    rewards = np.asarray(d["turn_rewards"][h, m, :applied]).tolist()
    timed_out = np.asarray(d["timed_out"][h, m, :applied], bool).tolist()
    for i, action in enumerate(actions):
      t.actions.append(action)
      t.messages.append(Message("assistant", action))
      if i < applied and timed_out[i]:  # as recorded: the step runs, its result is not seen
        res = StepResult((error_message(self.pool.replay_late(t.env.step, action)),))
      else:
        try:
          res = t.env.step(action)
        except Exception as e:  # as in the pool: an error observation
          res = StepResult((error_message(f"{type(e).__name__}: {e}"),))
      ids, msgs, cut = observation_ids(self.renderer, tuple(t.messages), res.messages
                                       if not res.done else (), self.max_obs)
      if i < applied:
        t.messages.extend(msgs)
        if i == applied - 1 and grp.status[m] == READY:
          grp.chunk[m] = (list(self.renderer.end_of_turn_ids[:1]) if grp.cut[m] else []) + ids
      else:  # the step that was running at export: apply its replayed outcome now
        t.turn_rewards, t.turn_timeouts = rewards, timed_out
        apply_outcome(self, grp, m, StepOutcome(res, ids, msgs, cut, 0.0))
        return
    t.turn_rewards, t.turn_timeouts = rewards, timed_out
