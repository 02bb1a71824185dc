"""The rollout stage of a step: prompts -> sampler or engine -> rewards -> objective inputs.

``collect(trainer, state)`` draws G prompts from the seeded sampler (or lets the APRIL engine
draw them lazily), samples M completions each, scores them with the task's verifier (with
several processes, each samples and scores the groups whose rows live on its devices), and
fills the objective's input record with exactly the fields the objective declares it needs
(``Objective.needs``): reference log-probs, critic values, per-trajectory gradient norms,
reward components, lengths. It never looks at which estimator or preset is configured.

Shapes (package legend): G groups, M samples per prompt, P prompt bucket, R new tokens.
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np

from rl_jax import losses
from rl_jax import rollout
from rl_jax.data import rewards as rewards_lib
from rl_jax.data import selection
from rl_jax.train.context import Setup
from rl_jax.train import group_size, selection_stage, speculative_stage
from rl_jax.train.layout import Layout
from rl_jax.train.state import TrainState, held_capacity, place_replicated
from rl_jax.train.steps import StepFns, UpdateBatch
from rl_jax.train.streams import Stream, seed_for

__all__ = ["Trainer", "Sampled", "Scored", "produce", "learner_batch", "collect",
           "objective_inputs", "staleness_metrics", "next_examples", "encode_prompts",
           "pad_prompts", "decode", "score", "generate"]


class Trainer(NamedTuple):
  """A run's static setup, its layout on the mesh, its compiled steps and (for
  ``rollout.partial``) its engine."""

  setup: Setup
  layout: Layout
  steps: StepFns
  engine: rollout.RolloutEngine | None


class Sampled(NamedTuple):
  """One step's sampled groups on the host.

  examples: G ``Example``s; prompts: G token lists; tokens / mask / logprobs [G·M,R]
  (behaviour log-probs); versions int32 [G·M,R] policy version of each token;
  stats: the engine's counters; updates: train-state fields that advance (data position,
  rollout buffer).
  """

  examples: list
  prompts: list[list[int]]
  tokens: np.ndarray
  mask: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray | None
  stats: dict
  updates: dict


# ---------------------------------------------------------------------- host-side helpers
def encode_prompts(s: Setup, examples) -> list[list[int]]:
  return [s.tokenizer.encode(e.prompt) for e in examples]


def pad_prompts(prompts: Sequence[Sequence[int]], P: int,
                pad: int) -> tuple[np.ndarray, np.ndarray]:
  """Right-padded int32 [G,P] prompt tokens and int32 [G] lengths."""
  out = np.full((len(prompts), P), pad, np.int32)
  for i, p in enumerate(prompts):
    out[i, :len(p)] = p
  return out, np.asarray([len(p) for p in prompts], np.int32)


def decode(s: Setup, tokens: np.ndarray, mask: np.ndarray) -> list[str]:
  """The text of each row's valid tokens."""
  return [s.tokenizer.decode([int(t) for t, m in zip(row, mrow) if m])
          for row, mrow in zip(tokens, mask)]


def score(s: Setup, completions: list[str], answers: list[str]) -> tuple[np.ndarray, dict]:
  """The task's verifier on each completion (isolated, time-limited): rewards, counters."""
  return rewards_lib.compute_rewards(s.task.verify, completions, answers,
                                     timeout_s=s.config.data.reward_timeout_s)


def next_indices(s: Setup, data: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
  """The next ``n`` dataset indices of the seeded sampler at position ``data`` (epoch,
  position), and the position after them."""
  state = selection.SamplerState(int(s.config.data.seed), int(data[0]), int(data[1]))
  idx, state = selection.sampler_next(state, len(s.train_examples), n)
  return idx, np.asarray([state.epoch, state.position], np.int32)


def next_examples(s: Setup, data: np.ndarray, n: int) -> tuple[list, np.ndarray]:
  """The next ``n`` training examples of the seeded sampler, and the position after them."""
  idx, data = next_indices(s, data, n)
  return [s.train_examples[i] for i in idx], data


def generate(s: Setup, params, prompts, **kw):
  """``rollout.generate`` on the sampler's mesh with the task's EOS and length budget;
  ``params`` as ``Layout.sampler_params`` places them."""
  return rollout.generate(s.model_cfg, params, prompts,
                          max_new_tokens=s.config.rollout.max_new_tokens,
                          eos_id=s.eos_id, mesh=s.sampler_mesh, rules=s.rules, **kw)


# ---------------------------------------------------------------------- producer side
class Scored(NamedTuple):
  """One step's groups, sampled and scored, on the host: what the rollout producer hands the
  learner (and what an asynchronous run keeps in its checkpointed queue).

  indices int32 [g]: dataset index of each group's prompt; tokens / mask / logprobs
  [g·M,R]: sampled tokens, validity and behaviour log-probs; versions int32 [g·M,R]: the
  policy version (completed steps) that sampled each token; rewards float32 [g,M];
  faults int64 [2]: verifier exceptions and timeouts; rollout_s: sampling wall time;
  version: the policy version the producer held; stats: the engine's counters; groups
  int32 [g]: with adaptive group size, the step's prompt of each row group (chunk), else None.
  g is G with one process, this process's groups with several.
  """

  indices: np.ndarray
  tokens: np.ndarray
  mask: np.ndarray
  logprobs: np.ndarray
  versions: np.ndarray
  rewards: np.ndarray
  faults: np.ndarray
  rollout_s: float
  version: int
  stats: dict
  groups: np.ndarray | None = None


def _sample_fresh(t: Trainer, params, state: TrainState, step: int, version: int, lo: int,
                  hi: int) -> tuple[Sampled, np.ndarray]:
  """Groups ``[lo, hi)`` of step ``step``'s G new prompts (drawn at ``state.data``), M
  samples each from ``params``; each group samples from its own key stream, wherever it is
  sampled. Also returns the groups' dataset indices."""
  s, c = t.setup, t.setup.config
  idx, data = next_indices(s, np.asarray(state.data), c.train.batch_groups)
  idx = idx[lo:hi]
  examples = [s.train_examples[i] for i in idx]
  prompts = encode_prompts(s, examples)
  out = generate(s, params, prompts, n=c.rollout.n, temperature=c.rollout.temperature,
                 top_p=c.rollout.top_p, top_k=c.rollout.top_k, first_index=lo,
                 seed=seed_for(c.train.seed, step, Stream.ROLLOUT))
  tokens = np.asarray(out.tokens)
  return Sampled(examples, prompts, tokens, np.asarray(out.mask), np.asarray(out.logprobs),
                 np.full(tokens.shape, version, np.int32), {}, {"data": data}), idx


def _sample_partial(t: Trainer, params, state: TrainState,
                    version: int) -> tuple[Sampled, np.ndarray]:
  """K complete groups from the APRIL engine, whose held groups live in the train state.

  The engine is reloaded from ``state.rollout_buffer`` and saved back after the call, and
  prompts are drawn lazily from the data sampler, so a resumed run continues exactly.
  """
  s, engine = t.setup, t.engine
  engine.import_held(jax.device_get(state.rollout_buffer))
  position = [np.asarray(state.data)]

  def prompts():
    while True:
      idx, position[0] = next_indices(s, position[0], 1)
      i = int(idx[0])
      yield rollout.Prompt(encode_prompts(s, [s.train_examples[i]])[0], meta=i)

  out = engine.rollout_groups(params, prompts(), s.config.train.batch_groups,
                              policy_version=version)
  held = jax.tree.map(lambda x: place_replicated(s, x), engine.export_held(held_capacity(s)))
  idx = np.asarray(out.group_meta, np.int32)
  return (Sampled([s.train_examples[i] for i in idx], out.prompts, np.asarray(out.tokens),
                  np.asarray(out.mask), np.asarray(out.logprobs), np.asarray(out.versions),
                  dict(out.stats), {"data": position[0], "rollout_buffer": held}), idx)


def produce(t: Trainer, params, state: TrainState, *, step: int, version: int, lo: int,
            hi: int) -> tuple[Scored, dict]:
  """The producer side of a step: sample groups ``[lo, hi)`` of step ``step`` from
  ``params`` (placed for the sampler; policy version ``version``) and score them.

  Reads the prompt position, the engine's held groups and the random streams from
  ``state`` (fresh sampling covers this process's groups; the partial-rollout engine, whose
  held groups are replicated state, runs every group on every process). Returns the scored
  groups and the train-state fields that advance (``data``, ``rollout_buffer``).
  """
  s, M = t.setup, t.setup.config.rollout.n
  if _selecting(s.config):  # every process samples all G groups (replicated selector state)
    return _produce_selected(t, params, state, step=step, version=version)
  t0 = time.perf_counter()
  out, idx = (_sample_fresh(t, params, state, step, version, lo, hi) if t.engine is None
              else _sample_partial(t, params, state, version))
  rollout_s = time.perf_counter() - t0
  completions = decode(s, out.tokens, out.mask)
  rewards, stats = score(s, completions, [e.answer for e in out.examples for _ in range(M)])
  rewards = selection_stage.shape_rewards(s.config, rewards, out.mask.sum(axis=1))
  scored = Scored(idx, out.tokens, out.mask, out.logprobs, out.versions.astype(np.int32),
                  rewards.reshape(len(idx), M).astype(np.float32),
                  np.asarray([stats["exceptions"], stats["timeouts"]], np.int64), rollout_s,
                  version, out.stats)
  return scored, out.updates


def _selecting(c) -> bool:
  """Whether a step's groups go through the selection stage (a selector or SPEC-RL)."""
  return (selection_stage.effective_selector(c) != "none" or bool(c.rollout.speculative)
          or group_size.adaptive(c))


def _roll(t: Trainer, params, drafts: dict, idx: np.ndarray, first_index: int, *, step: int,
          version: int) -> Scored:
  """Sample (speculatively when ``drafts``) and score M completions of each prompt ``idx``
  ([g] dataset indices) from the key streams of prompts ``first_index ..``."""
  s, c = t.setup, t.setup.config
  M = group_size.row_shape(c)[1]  # m with adaptive group size (idx: one chunk per entry)
  prompts = encode_prompts(s, [s.train_examples[i] for i in idx])
  t0 = time.perf_counter()
  if drafts:
    tokens, mask, logprobs, stats = speculative_stage.roll(
        s, params, drafts, idx, prompts, step=step, first_index=first_index, version=version)
  else:
    out = generate(s, params, prompts, n=M, temperature=c.rollout.temperature,
                   top_p=c.rollout.top_p, top_k=c.rollout.top_k, first_index=first_index,
                   seed=seed_for(c.train.seed, step, Stream.ROLLOUT))
    tokens, mask, logprobs, stats = (np.asarray(out.tokens), np.asarray(out.mask),
                                     np.asarray(out.logprobs), {})
  rollout_s = time.perf_counter() - t0
  rewards, faults = score(s, decode(s, tokens, mask),
                          [s.train_examples[i].answer for i in idx for _ in range(M)])
  rewards = selection_stage.shape_rewards(c, rewards, mask.sum(axis=1))
  stats["rollout_tokens"] = float(mask.sum())
  return Scored(np.asarray(idx, np.int32), tokens, mask, logprobs,
                np.full(tokens.shape, version, np.int32),
                rewards.reshape(len(idx), M).astype(np.float32),
                np.asarray([faults["exceptions"], faults["timeouts"]], np.int64), rollout_s,
                version, stats)


def _produce_selected(t: Trainer, params, state: TrainState, *, step: int,
                      version: int) -> tuple[Scored, dict]:
  """``produce`` through the selection stage (``selection_stage.select``) for all G groups:
  the selector's and SPEC-RL's per-prompt state is read from ``state`` and returned in the
  updates (``selector``, ``spec_drafts``) with the new sampler position (``data``)."""
  s = t.setup
  drafts = {k: np.array(v) for k, v in jax.device_get(state.spec_drafts).items()}
  sel = {k: np.array(v) for k, v in jax.device_get(state.selector).items()}
  roll = lambda idx, first: _roll(t, params, drafts, idx, first, step=step, version=version)
  nxt = lambda data, n: next_indices(s, data, n)
  scored, data, new_sel, stats = selection_stage.select(s.config, np.asarray(state.data), sel,
                                                        nxt, roll, step)
  informative = int(np.sum(group_size.prompt_spread(scored.rewards, scored.groups)))
  stats = {**scored.stats, **stats, "informative_groups": float(informative),
           "rollout_tokens_per_informative_group":
               scored.stats["rollout_tokens"] / max(informative, 1),
           "effective_prompts_per_s": informative / max(scored.rollout_s, 1e-9)}
  if drafts:
    reused = stats["spec_reused_tokens"]
    stats["spec_accept_len"] = reused / max(stats["spec_drafted_samples"], 1.0)
    stats["spec_reused_token_fraction"] = reused / max(stats["rollout_tokens"], 1.0)
  updates = {"data": data}
  place = lambda tree: jax.tree.map(lambda x: place_replicated(s, x), tree)
  if new_sel is not None:
    updates["selector"] = place(new_sel)
  if drafts:
    updates["spec_drafts"] = place(drafts)
  return scored._replace(stats=stats), updates


def _everyone(x: np.ndarray, local: bool) -> np.ndarray:
  """The rows of every process (in process order) when ``x`` holds only this process's."""
  return np.asarray(multihost_utils.process_allgather(x, tiled=True)) if local else x


# ---------------------------------------------------------------------- objective inputs
def objective_inputs(t: Trainer, state: TrainState, prompt_tokens, prompt_lengths, tokens,
                     mask, generated_mask, rewards, behaviour_logp) -> losses.ObjectiveInputs:
  """The objective's input record with every field ``Objective.needs`` names.

  ``rewards`` [G,M], ``mask`` (loss tokens) and ``generated_mask`` [G,M,R], the sampler's
  ``behaviour_logp`` and the proximal ``old_logp`` (the current weights, one teacher-forced
  pass) are always filled (``old_logp`` is None when the update takes it from its own
  policy pass, ``StepFns.old_logp_in_update``); the rest only when declared: ``ref_logp``
  (reference pass), ``values`` (critic pass), ``grad_sq_norms`` (per-trajectory gradient norms),
  ``reward_components`` [G,M,C] (C = 1: the verifier's reward) and ``lengths``.
  """
  s, f = t.setup, t.steps
  args = (prompt_tokens, prompt_lengths, tokens, mask)
  own_old = f.old_logp_in_update  # on-policy: the update's own pass gives old_logp
  fields = dict(rewards=rewards, mask=mask, generated_mask=generated_mask,
                old_logp=None if own_old else f.logprobs(state.params, *args),
                behaviour_logp=behaviour_logp)
  producers = {
      "ref_logp": lambda: (f.ref_logprobs or f.logprobs)(state.ref_params, *args),
      "values": lambda: f.values(state.value_params, *args),
      "grad_sq_norms": lambda: f.grad_sq_norms(state.params, *args, jax.random.key(
          seed_for(s.config.train.seed, int(state.step), Stream.GRAD_NORMS))),
      "reward_components": lambda: rewards[..., None],
      "lengths": lambda: jnp.sum(mask, axis=-1).astype(jnp.float32),
  }
  for name in sorted(s.objective.needs & producers.keys()):
    fields[name] = producers[name]()
  return losses.ObjectiveInputs(**fields)


# ---------------------------------------------------------------------- learner side
def staleness_metrics(versions: np.ndarray, mask: np.ndarray, step: int) -> dict[str, float]:
  """Policy lag of the generated tokens trained at step ``step`` (versions int32 [B,R],
  mask bool [B,R]): max and mean token lag, off-policy token fraction, and the lag
  histogram ``token_lag/k`` (fraction of tokens k versions old; the last bucket, ``8+``,
  counts 8 or more)."""
  lag = (step - versions)[mask.astype(bool)]
  if lag.size == 0:
    return {"max_token_lag": 0.0, "mean_token_lag": 0.0, "off_policy_token_fraction": 0.0}
  hist = np.bincount(np.minimum(lag, 8), minlength=9) / lag.size
  out = {"max_token_lag": float(lag.max()), "mean_token_lag": float(lag.mean()),
         "off_policy_token_fraction": float(np.mean(lag > 0))}
  out.update({f"token_lag/{k}" if k < 8 else "token_lag/8+": float(h)
              for k, h in enumerate(hist) if h > 0})
  return out


def learner_batch(t: Trainer, state: TrainState, scored: Scored,
                  max_lag: int = -1) -> tuple[UpdateBatch, dict[str, Any]]:
  """The learner side of a step: scored groups -> objective inputs (proximal log-probs from
  the current weights, and whatever else the objective needs) -> advantages.

  ``max_lag >= 0`` masks tokens sampled more than ``max_lag`` versions before this step
  from the loss (the free-running producer's staleness bound).

  Returns:
    (the update batch, the step's rollout metrics).
  """
  s, c = t.setup, t.setup.config
  (G, M), R = group_size.row_shape(c), c.rollout.max_new_tokens
  lo, hi = t.layout.share(G)  # the groups whose rows live on this process's devices
  g = len(scored.indices)
  loss_mask = scored.mask
  if c.rollout.mask_stale:  # only tokens of the policy the producer held
    loss_mask = scored.mask & (scored.versions >= scored.version)
  if max_lag >= 0:
    loss_mask = loss_mask & (scored.versions >= int(state.step) - max_lag)
  mine = slice(0, g) if g == hi - lo else slice(lo, hi)  # this process's groups of ``scored``
  put = lambda a: t.layout.put(a[mine], G)  # host rows -> global arrays split along batch
  prompts = encode_prompts(s, [s.train_examples[i] for i in scored.indices])
  pt, pl = (put(a) for a in pad_prompts(prompts, s.prompt_len, s.tokenizer.pad_id))
  rt = put(scored.tokens.reshape(g, M, R))
  inputs = objective_inputs(
      t, state, pt, pl, rt, mask=put(loss_mask.reshape(g, M, R)),
      generated_mask=put(scored.mask.reshape(g, M, R)), rewards=put(scored.rewards),
      behaviour_logp=put(scored.logprobs.reshape(g, M, R)))
  advantages = (s.objective.advantages_from(inputs) if scored.groups is None else
                group_size.per_prompt_advantages(s.objective, inputs, scored.groups,
                                                 c.train.batch_groups, group_size.max_chunks(c)))
  local = g < G
  rewards = _everyone(scored.rewards, local)
  n_tok = int(_everyone(scored.mask.reshape(g, -1).sum(axis=1), local).sum())
  faults = _everyone(scored.faults[None], local).sum(axis=0)
  info = {
      "reward_mean": float(rewards.mean()),
      "reward_std": float(rewards.std()),
      "response_length": n_tok / (G * M),
      "rollout_tokens_per_s": n_tok / max(scored.rollout_s, 1e-9),
      "reward_exceptions": int(faults[0]),
      "reward_timeouts": int(faults[1]),
      "zero_variance_groups": group_size.zero_variance_fraction(rewards, scored.groups),
      "local_groups": g,  # groups this process sampled and scored (G with one process)
  }
  info.update({k: float(scored.stats[k]) for k in (
      "off_policy_token_fraction", "max_token_lag", "aborted_groups", "restarted_samples",
      "buffer_size") + selection_stage.METRICS + group_size.METRICS if k in scored.stats})
  if c.train.mode == "async":
    info.update(staleness_metrics(scored.versions, scored.mask, int(state.step)))
  return UpdateBatch(pt, pl, rt, inputs, advantages), info


def collect(t: Trainer, state: TrainState) -> tuple[UpdateBatch, dict[str, Any], dict]:
  """One synchronous step's rollouts: the producer side on the current weights, then the
  learner side.

  Returns:
    (the update batch, the step's rollout metrics, train-state fields to advance).
  """
  step = int(state.step)
  lo, hi = t.layout.share(group_size.row_shape(t.setup.config)[0])
  scored, updates = produce(t, t.layout.sampler_params(state.params), state, step=step,
                            version=step, lo=lo, hi=hi)
  batch, info = learner_batch(t, state, scored)
  return batch, info, updates
