"""The producer side of a step: prompt source -> rollout -> scoring -> ``Scored``.

``produce(t, params, producer, step=, version=, lo=, hi=)`` runs one batch from the weights
``params`` (policy version ``version``) and returns it scored, with the producer's next
position (``ProducerState``). Where the prompts come from and how the groups are chosen is
decided once per run (``source``), never inside a step:

* ``fresh``: the seeded sampler's next G prompts, M samples each from ``rollout.generate``
  (with several processes each samples the groups ``[lo, hi)`` whose rows live on its
  devices);
* ``engine``: APRIL (``rollout.partial``): the rollout engine draws prompts lazily and
  returns G complete groups; its held groups travel in ``ProducerState.held`` (with S
  engine shares, ``rollout.partial_shares``, each process runs its own shares' groups
  ``[lo, hi)`` and holds only theirs);
* ``agentic``: multi-turn episodes (``env.name``): G groups of the env task's train
  split, rolled out by the ``AgentEngine`` (``agent_stage``) to their end; the response
  tokens are the trajectories (model and observation ids as sampled / appended), the loss
  mask the model tokens, the rewards the trajectory returns, plus the per-turn inputs (and,
  for mixture-of-experts models, the experts the sampler chose for the model tokens);
* ``selected``: the selection stage (``selection_stage.select``: DAPO dynamic sampling,
  GRESO, Beta, adaptive group size) picks the prompts and rolls them out through the
  producer's ``roll`` stage, sampling speculatively from ``ProducerState.drafts`` with
  SPEC-RL (``speculative_stage``).

With experience replay (``train.replay``; the fresh source only) part of the G groups come
from a buffer of earlier steps' scored groups (``replay_stage``) and only the rest are
sampled; the buffer travels in ``ProducerState.replay``.

Every single-turn source ends in the same scoring stage (the task's verifier per row, or the
group function per group, ``reward.group_fn``; named reward components; DAPO overlong
shaping); the agentic source's rewards are the environments' returns.

Shapes (the package legend, ``rl_jax/__init__.py``): G groups (row groups: W chunks with
adaptive group size), M samples per group, R new tokens.
"""

from __future__ import annotations

import time
from typing import Callable

import jax
import numpy as np

from rl_jax import rollout
from rl_jax.errors import RLJaxError
from rl_jax.train import (agent_stage, group_size, replay_stage, selection_stage,
                          speculative_stage)
from rl_jax.train.records import ENGINE_STATS, ProducerState, Scored
from rl_jax.train.rollouts import (Sampled, TrainParts, decode, encode_prompts, generate,
                                   next_indices, pad_prompts, score_groups)
from rl_jax.train import state as state_lib
from rl_jax.train.state import held_capacity, place_replicated
from rl_jax.train.streams import Stream, seed_for

__all__ = ["SOURCES", "source", "produce", "host_producer", "share_prompts", "merge_stats"]


def host_producer(p: ProducerState) -> ProducerState:
  """``p`` as writable host arrays (the stages update them in place)."""
  return jax.tree.map(np.array, jax.device_get(p))


def _placed(t: TrainParts, p: ProducerState) -> ProducerState:
  """``p`` replicated on the mesh, like the rest of the train state."""
  return jax.tree.map(lambda x: place_replicated(t.setup, x), p)


def _scored(t: TrainParts, out: Sampled, idx: np.ndarray, rollout_s: float, version: int,
            M: int) -> Scored:
  """The scoring stage: the verifier on each completion (or the group function on each
  group, ``reward.group_fn``), DAPO overlong shaping (with named components, its penalty is
  the component ``overlong``); the groups keep the prompts they were sampled from
  (``out.prompts``, padded to P)."""
  s = t.setup
  rewards, comps, faults = score_groups(s, decode(s, out.tokens, out.mask),
                                        [s.train_examples[i] for i in idx], M)
  lengths = out.mask.sum(axis=1)
  penalty = selection_stage.overlong_penalties(s.selection, lengths)
  rewards = rewards + penalty
  if comps is not None and s.reward_names[-1] == "overlong":
    comps = np.concatenate([comps, penalty[:, None]], axis=1)
  g = len(idx)
  prompts, prompt_lens = pad_prompts(out.prompts, s.prompt_len, s.tokenizer.pad_id)
  return Scored(np.asarray(idx, np.int32), prompts, prompt_lens, out.tokens, out.mask,
                out.logprobs, out.versions.astype(np.int32),
                rewards.reshape(g, M).astype(np.float32),
                np.asarray([faults["exceptions"], faults["timeouts"]], np.int64), rollout_s,
                version, out.stats, routing=out.routing,
                components=None if comps is None else
                comps.reshape(g, M, -1).astype(np.float32))


def _fresh(t: TrainParts, params, p: ProducerState, *, step: int, version: int, lo: int,
           hi: int, groups: int | None = None) -> tuple[Scored, ProducerState]:
  """Groups ``[lo, hi)`` of step ``step``'s G new prompts (drawn at ``p.data``; ``groups``
  of them when given), M samples each; each group samples from its own key stream,
  wherever it is sampled."""
  s, geo = t.setup, t.setup.geometry
  t0 = time.perf_counter()
  idx, data = next_indices(s, np.asarray(p.data), geo.groups if groups is None else groups)
  idx = idx[lo:hi]
  examples = [s.train_examples[i] for i in idx]
  prompts = encode_prompts(s, examples)
  out = generate(s, params, prompts, n=geo.samples, temperature=s.rollout.temperature,
                 top_p=s.rollout.top_p, top_k=s.rollout.top_k, first_index=lo,
                 seed=seed_for(s.train.seed, step, Stream.ROLLOUT))
  tokens = np.asarray(out.tokens)
  out = Sampled(examples, prompts, tokens, np.asarray(out.mask), np.asarray(out.logprobs),
                np.full(tokens.shape, version, np.int32), engine_stats(out.stats),
                p._replace(data=data), out.routing)
  rollout_s = time.perf_counter() - t0
  return _scored(t, out, idx, rollout_s, version, geo.samples), _placed(t, out.producer)


def share_prompts(s, data: np.ndarray, j: int, S: int, drawn: list[int]):
  """Engine share ``j``'s prompts (of S): its k-th is draw number ``j + k·S`` of the prompt
  sampler from position ``data`` [2], k counted on from ``drawn[0]`` (advanced per prompt
  handed out, so it counts what the engine took)."""
  E = len(s.train_examples)
  base = int(data[0]) * E + int(data[1])
  while True:
    o = base + j + drawn[0] * S
    idx, _ = next_indices(s, np.asarray([o // E, o % E], np.int32), 1)
    drawn[0] += 1
    i = int(idx[0])
    yield rollout.Prompt(encode_prompts(s, [s.train_examples[i]])[0], meta=i)


def engine_stats(stats: dict) -> dict:
  """The engine counters (``ENGINE_STATS``) among a rollout's ``stats``, as floats."""
  return {k: float(stats[k]) for k in ENGINE_STATS if k in stats}


def merge_stats(stats: list[dict], tokens: list[int]) -> dict:
  """The engine counters of several shares' rollouts as one batch's: lags, KV bytes and
  decode programs the largest, the off-policy fraction weighted by each share's ``tokens``, counts summed."""
  out = {}
  for k in stats[0]:
    v = [float(x[k]) for x in stats]
    if k in ("max_token_lag", "kv_bytes", "decode_buckets"):
      out[k] = max(v)
    elif k == "off_policy_token_fraction":
      out[k] = sum(a * n for a, n in zip(v, tokens)) / max(sum(tokens), 1)
    else:
      out[k] = sum(v)
  return out


def _engine_shares(t: TrainParts, params, p: ProducerState, *, version: int, lo: int,
                   hi: int) -> tuple[Scored, ProducerState]:
  """The groups ``[lo, hi)`` of G from this process's engine shares (S > 1,
  ``state.engine_shares``): share j returns groups ``[j·G/S, (j+1)·G/S)`` of the step, from
  its own held groups (``p.held[i]``, i-th of this process's; or the job's S shares of a
  resumed state) and prompt stream (``share_prompts``). Sampling needs no collective."""
  s, engine = t.setup, t.engine
  S, G = state_lib.engine_shares(s), s.geometry.rows
  first, last = lo * S // G, hi * S // G
  t0 = time.perf_counter()
  held = jax.device_get(p.held)
  if len(held["valid"]) == S:  # the job-wide form: this process's shares of it
    held = state_lib.take_shares(held, first, last)
  outs, kept = [], []
  for i, j in enumerate(range(first, last)):
    h = {k: v[i] for k, v in held.items()}
    engine.import_held(h)
    drawn = [int(h["drawn"])]
    outs.append(engine.rollout_groups(params, share_prompts(s, p.data, j, S, drawn), G // S,
                                      policy_version=version))
    kept.append({**engine.export_held(held_capacity(s)), "drawn": np.int32(drawn[0])})
  cat = lambda f: np.concatenate([np.asarray(getattr(o, f)) for o in outs])
  idx = np.asarray([m for o in outs for m in o.group_meta], np.int32)
  routing = None if outs[0].routing is None else cat("routing")
  stats = merge_stats([o.stats for o in outs], [int(o.mask.sum()) for o in outs])
  sampled = Sampled([s.train_examples[i] for i in idx], [q for o in outs for q in o.prompts],
                    cat("tokens"), cat("mask"), cat("logprobs"), cat("versions"), stats,
                    p._replace(held=state_lib.stack_shares(kept)), routing)
  rollout_s = time.perf_counter() - t0
  return (_scored(t, sampled, idx, rollout_s, version, s.geometry.samples),
          _placed(t, sampled.producer))


def _engine(t: TrainParts, params, p: ProducerState, *, step: int, version: int, lo: int,
            hi: int) -> tuple[Scored, ProducerState]:
  """G complete groups from the APRIL engine, reloaded from ``p.held`` and saved back after
  the call; prompts are drawn lazily from the data sampler, so a resumed run continues
  exactly. With S > 1 engine shares (``rollout.partial_shares``; by default one per
  process) each process runs and holds only its own (``_engine_shares``)."""
  del step
  if state_lib.engine_shares(t.setup) > 1:
    return _engine_shares(t, params, p, version=version, lo=lo, hi=hi)
  s, engine = t.setup, t.engine
  t0 = time.perf_counter()
  engine.import_held(jax.device_get(p.held))
  position = [np.asarray(p.data)]

  def prompts():
    while True:
      idx, position[0] = next_indices(s, position[0], 1)
      i = int(idx[0])
      yield rollout.Prompt(encode_prompts(s, [s.train_examples[i]])[0], meta=i)

  out = engine.rollout_groups(params, prompts(), s.geometry.groups, policy_version=version)
  held = engine.export_held(held_capacity(s))
  idx = np.asarray(out.group_meta, np.int32)
  sampled = Sampled([s.train_examples[i] for i in idx], out.prompts, np.asarray(out.tokens),
                    np.asarray(out.mask), np.asarray(out.logprobs), np.asarray(out.versions),
                    dict(out.stats), p._replace(data=position[0], held=held), out.routing)
  rollout_s = time.perf_counter() - t0
  return (_scored(t, sampled, idx, rollout_s, version, s.geometry.samples),
          _placed(t, sampled.producer))


def _agentic(t: TrainParts, params, p: ProducerState, *, step: int, version: int, lo: int,
             hi: int) -> tuple[Scored, ProducerState]:
  """Step ``step``'s G groups of multi-turn episodes (every process runs every group): each
  run to its end (the position is the prompt sampler's), or with ``rollout.partial`` the
  first G to complete, the rest held in ``p.held`` (APRIL across turns; prompts drawn lazily
  from the data sampler)."""
  del lo, hi
  s, geo = t.setup, t.setup.geometry
  t0 = time.perf_counter()
  if s.rollout.partial:
    position = [np.asarray(p.data)]

    def next_index() -> int:
      i, position[0] = next_indices(s, position[0], 1)
      return int(i[0])

    out, held = agent_stage.roll_partial(s, t.agent[0], params, jax.device_get(p.held),
                                         next_index, version=version,
                                         capacity=held_capacity(s))
    idx, data = np.asarray(out.group_meta, np.int32), position[0]
    p = p._replace(held=held)
  else:
    idx, data = next_indices(s, np.asarray(p.data), geo.groups)
    out = agent_stage.roll(s, t.agent[0], params, idx, step=step, version=version)
  rollout_s = time.perf_counter() - t0
  want = encode_prompts(s, [s.train_examples[i] for i in idx])
  if out.prompts != want:
    if s.env.agent:  # the agent's first request opens the episode
      g = next((i for i, (a, b) in enumerate(zip(out.prompts, want)) if a != b), 0)
      raise RLJaxError(
          f"env.agent={s.env.agent!r}: the first request of example {int(idx[g])}'s sessions "
          f"does not render to the prompt env.name={s.env.name!r} gives that example "
          f"({len(out.prompts[g])} tokens against {len(want[g])}): open each session with "
          "the task's messages for its example (docs/AGENTS.md)")
    raise RLJaxError("env: the engine's first prompts differ from the packed layout's "
                     "(the chat format does not tokenize like the tokenizer)")
  R, G, M = geo.new_tokens, geo.groups, geo.samples
  turns = agent_stage.turn_fields(out, geo.turns, R)
  stats = {**agent_stage.rollout_metrics(out),
           **(s.task.stats() if s.task.stats is not None else {}),
           **engine_stats(out.stats),
           "rollout_tokens": float(out.model_mask.sum())}
  prompts, prompt_lens = pad_prompts(out.prompts, s.prompt_len, s.tokenizer.pad_id)
  scored = Scored(np.asarray(idx, np.int32), prompts, prompt_lens, out.tokens[:, :R],
                  out.model_mask[:, :R], out.logprobs[:, :R], out.versions[:, :R],
                  out.reward.reshape(G, M).astype(np.float32),
                  np.asarray([out.env_errors.sum(), out.timeouts.sum()], np.int64), rollout_s,
                  version, stats, turns=turns,
                  routing=None if out.routing is None else out.routing[:, :R])
  return scored, _placed(t, p._replace(data=data))


def _roll(t: TrainParts, params, drafts: dict, idx: np.ndarray, first_index: int, *, step: int,
          version: int) -> Scored:
  """The selection stage's rollout: sample (speculatively when ``drafts``) and score the
  groups of prompts ``idx`` ([g] dataset indices; one chunk each with adaptive group size)
  from the key streams of prompts ``first_index ..``."""
  s = t.setup
  M = s.geometry.row_size
  prompts = encode_prompts(s, [s.train_examples[i] for i in idx])
  t0 = time.perf_counter()
  routing = None  # SPEC-RL's drafts keep no expert records
  if drafts:
    tokens, mask, logprobs, stats = speculative_stage.roll(
        s, params, drafts, idx, prompts, step=step, first_index=first_index, version=version)
  else:
    out = generate(s, params, prompts, n=M, temperature=s.rollout.temperature,
                   top_p=s.rollout.top_p, top_k=s.rollout.top_k, first_index=first_index,
                   seed=seed_for(s.train.seed, step, Stream.ROLLOUT))
    tokens, mask, logprobs, stats = (np.asarray(out.tokens), np.asarray(out.mask),
                                     np.asarray(out.logprobs), engine_stats(out.stats))
    routing = out.routing
  rollout_s = time.perf_counter() - t0
  stats["rollout_tokens"] = float(mask.sum())
  sampled = Sampled(None, prompts, tokens, mask, logprobs,
                    np.full(tokens.shape, version, np.int32), stats, None, routing)
  return _scored(t, sampled, idx, rollout_s, version, M)


def _selected(t: TrainParts, params, p: ProducerState, *, step: int, version: int, lo: int,
              hi: int) -> tuple[Scored, ProducerState]:
  """All G groups through the selection stage (every process samples all of them: the
  selector state is replicated); the selector's and SPEC-RL's per-prompt state travel in
  ``p.selector`` and ``p.drafts``."""
  del lo, hi
  s = t.setup
  p = host_producer(p)
  drafts = p.drafts
  roll = lambda idx, first: _roll(t, params, drafts, idx, first, step=step, version=version)
  nxt = lambda data, n: next_indices(s, data, n)
  scored, data, new_sel, stats = selection_stage.select(s.selection, s.geometry, p.data,
                                                        p.selector, nxt, roll, step)
  informative = int(np.sum(group_size.prompt_spread(scored.rewards, scored.groups)))
  stats = {**scored.stats, **stats, "informative_groups": float(informative),
           "rollout_tokens_per_informative_group":
               scored.stats["rollout_tokens"] / max(informative, 1),
           "effective_prompts_per_s": informative / max(scored.rollout_s, 1e-9)}
  if drafts:
    reused = stats["spec_reused_tokens"]
    stats["spec_accept_len"] = reused / max(stats["spec_drafted_samples"], 1.0)
    stats["spec_reused_token_fraction"] = reused / max(stats["rollout_tokens"], 1.0)
  p = p._replace(data=data, selector=p.selector if new_sel is None else new_sel)
  return scored._replace(stats=stats), _placed(t, p)


# source name -> the producer of one batch
SOURCES: dict[str, Callable[..., tuple[Scored, ProducerState]]] = {
    "fresh": _fresh, "engine": _engine, "selected": _selected, "agentic": _agentic}


def source(t: TrainParts) -> str:
  """The run's prompt source (see the module docstring)."""
  if t.agent is not None:
    return "agentic"
  if t.engine is not None:
    return "engine"
  if (t.setup.selection.kind != "none" or t.setup.rollout.speculative
      or t.setup.geometry.adaptive):
    return "selected"
  return "fresh"


def _replayed(t: TrainParts, params, p: ProducerState, *, step: int, version: int, lo: int,
              hi: int) -> tuple[Scored, ProducerState]:
  """Experience replay (``train.replay``, ``replay_stage``; the fresh source, one process):
  once ``p.replay`` holds k groups, G - k fresh groups and k drawn from it (seeded by
  (train.seed, step)); without, G fresh ones. The fresh informative groups are then added."""
  del lo, hi
  s = t.setup
  G, k = s.geometry.groups, s.train.replay_groups
  buffer = jax.device_get(p.replay)
  part = replay_stage.draw(buffer, k, seed_for(s.train.seed, step, Stream.REPLAY))
  n = G if part is None else G - k
  fresh, p = _fresh(t, params, p, step=step, version=version, lo=0, hi=n, groups=n)
  buffer = replay_stage.add(buffer, fresh)
  return (replay_stage.merge(fresh, part, buffer, version),
          p._replace(replay=_placed(t, buffer)))


def produce(t: TrainParts, params, producer: ProducerState, *, step: int, version: int, lo: int,
            hi: int) -> tuple[Scored, ProducerState]:
  """One batch of step ``step``: groups ``[lo, hi)`` sampled from ``params`` (placed for the
  sampler; policy version ``version``) and scored; and the producer's next position."""
  if replay_stage.enabled(t.setup.train):
    return _replayed(t, params, producer, step=step, version=version, lo=lo, hi=hi)
  return SOURCES[source(t)](t, params, producer, step=step, version=version, lo=lo, hi=hi)
