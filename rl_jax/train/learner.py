"""The learner side of a step: ``Scored`` -> objective inputs -> advantages -> update.

``learner_batch`` turns the producer's scored groups into the ``UpdateBatch`` on the training
mesh: the loss mask (stale tokens masked), the objective's inputs (each made as the one
table ``inputs.INPUTS`` says: proximal log-probs from the current weights, and whatever else
the objective declares it needs) and the advantages. ``apply_update`` runs the
``train.minibatches`` optimizer updates on it, ``train.epochs`` times over (each pass in a
fresh order of the groups, ``pass_orders``). Neither looks at which estimator, preset or
runner is configured.

Shapes (the package legend, ``rl_jax/__init__.py``): G row groups (g: this process's),
M samples per group, P prompt bucket, R new tokens.
"""

from __future__ import annotations

import math
from typing import Any

import jax
from jax.experimental import multihost_utils
import numpy as np

from rl_jax import losses
from rl_jax.errors import RLJaxError
from rl_jax.models import grouped, packing as packing_lib
from rl_jax.models.hf import release_host_memory
from rl_jax.rollout.records import pow2
from rl_jax.train import agent_stage, group_size, replay_stage
from rl_jax.train.inputs import Source, make_inputs
from rl_jax.train.records import STATS, Scored
from rl_jax.train.rollouts import TrainParts
from rl_jax.train.state import TrainState
from rl_jax.train.steps import UpdateBatch

__all__ = ["objective_inputs", "staleness_metrics", "trained_length", "learner_batch",
           "apply_update", "pass_orders", "trims_host_memory", "PASS_METRICS",
           "TRIM_MIN_PARAM_BYTES"]

# metrics also reported per pass (``<name>_pass<p>``, p = 1..μ) when ``train.epochs`` = μ > 1
PASS_METRICS = ("loss", "clip_frac", "approx_kl", "ratio_mean", "grad_norm", "masked_frac",
                "update_skipped")


def objective_inputs(t: TrainParts, state: TrainState, prompt_tokens, prompt_lengths, tokens,
                     mask, generated_mask, rewards, behaviour_logp,
                     turns=None, routing=None, components=None,
                     packing=None) -> losses.ObjectiveInputs:
  """The objective's input record with every field ``Objective.needs`` names, each made as
  ``inputs.INPUTS`` declares (``old_logp`` is None when the update takes it from its own
  policy pass, ``StepFns.old_logp_in_update``); ``turns``: the per-turn arrays of a
  multi-turn batch; ``routing``: the sampler's experts [G,M,R,Y,X] that the log-prob passes
  replay (``model.router_replay``); ``components``: the named reward components [G,M,C]
  (``Setup.reward_names``), the objective's ``reward_components``; ``packing``: the step's
  rows of several responses (``update_packing``), which the passes (log-probs, values) run
  on."""
  src = Source(t.steps, state, (prompt_tokens, prompt_lengths, tokens, mask), rewards,
               generated_mask, behaviour_logp, t.setup.train.seed, turns, routing,
               t.teacher, components=components, packing=packing)
  return make_inputs(t.setup.objective.needs, src)


_reverse_kl = jax.jit(losses.sampled_reverse_kl)  # one program, a replicated scalar


def _everyone(x: np.ndarray, local: bool) -> np.ndarray:
  """The rows of every process (in process order) when ``x`` holds only this process's."""
  return np.asarray(multihost_utils.process_allgather(x, tiled=True)) if local else x


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


def trained_length(longest: int, budget: int, floor: int) -> int:
  """The response length R' the learner's passes run at (``train.trim_floor``): the smallest
  power of two that is at least ``longest`` (the step's longest response, in tokens) and
  ``floor``, at most ``budget`` (R, the response budget); ``budget`` with ``floor`` 0.

  Tokens past every response are padding: masked out of every loss term, and, as attention
  is causal, never read by a token that counts, so cutting them changes no loss, gradient or
  metric beyond float rounding. Powers of two keep the programs few: at most
  log2(R / floor) + 1 lengths."""
  if floor <= 0 or budget <= floor:
    return budget
  return min(budget, pow2(max(int(longest), int(floor))))


def _extent(mask: np.ndarray) -> np.ndarray:
  """int [rows]: one past the last True of each row of ``mask`` bool [rows, R] (0 if none)."""
  R = mask.shape[-1]
  return np.where(mask.any(axis=-1), R - np.argmax(mask[..., ::-1], axis=-1), 0)


def update_packing(t: TrainParts, lengths: np.ndarray, every: np.ndarray, R: int):
  """The step's rows of several responses (``train.pack_floor``, ``models.packing``) for
  this process's groups' ``lengths`` int [g,M] (each response's tokens to its end, at most
  the trained length ``R``), ``every`` the job's [G,M]: the plan, or None where the usual
  one-response rows stay (off, under the floor, a layout or model that cannot take
  several, or fewer than a quarter of the rows saved)."""
  s, M = t.setup, lengths.shape[1]
  floor = s.train.pack_floor
  if (floor <= 0 or R < floor or not s.train.shared_prefix or not grouped.packs_rows(s.model_cfg)
      or t.layout.mesh.shape.get("sequence", 1) > 1):
    return None
  rows = packing_lib.row_count(every, R)
  return packing_lib.plan(lengths, R, rows) if 4 * rows <= 3 * M else None


def learner_batch(t: TrainParts, state: TrainState, scored: Scored, max_lag: int = -1,
                  staleness: bool = False) -> tuple[UpdateBatch, dict[str, Any]]:
  """Scored groups -> objective inputs -> advantages, on the training mesh.

  ``max_lag >= 0`` masks tokens sampled more than ``max_lag`` versions before this step
  from the loss (the free-running producer's staleness bound); ``staleness`` adds the
  token-lag metrics (``staleness_metrics``).

  Returns:
    (the update batch, the step's rollout metrics).
  """
  s, geo = t.setup, t.setup.geometry
  G, M, R = geo.rows, geo.row_size, geo.new_tokens
  lo, hi = t.layout.share(G)  # the groups whose rows live on this process's devices
  g = len(scored.indices)
  loss_mask = scored.mask
  if s.rollout.mask_stale:  # only tokens of the policy the producer held
    loss_mask = scored.mask & (scored.versions >= scored.version)
  if max_lag >= 0:
    loss_mask = loss_mask & (scored.versions >= int(state.step) - max_lag)
  mine = slice(0, g) if g == hi - lo else slice(lo, hi)  # this process's groups of ``scored``
  put = lambda a: t.layout.put(a[mine], G)  # host rows -> global arrays split along batch
  local = g < G
  turns = None
  if scored.turns is not None and s.objective.needs & set(losses.TURN_FIELDS):
    turns = {k: put(v.reshape(g, M, -1)) for k, v in scored.turns.items()}
  # the passes' response length (train.trim_floor), the same on every process; a batch with
  # per-turn inputs keeps the whole budget
  longest = int(_everyone(_extent(scored.mask.reshape(g * M, R)), local).max(initial=0))
  Rt = R if turns is not None else trained_length(longest, R, s.train.trim_floor)
  cut = lambda a: a.reshape(g, M, R, *a.shape[2:])[:, :, :Rt]  # [g,M·R,..] -> [g,M,Rt,..]
  pt, pl = put(scored.prompts), put(scored.prompt_lens)  # as the producer encoded them
  rt = put(cut(scored.tokens))
  routing = None  # mixture of experts: the sampler's expert records
  if scored.routing is not None:
    routing = put(cut(scored.routing))
  elif s.model.router_replay:
    raise RLJaxError("model.router_replay=True: this batch has no expert records")
  replay = routing if s.model.router_replay else None
  pack = None  # the update's rows of several responses each (train.pack_floor)
  if turns is None:
    ends = _extent(cut(scored.mask).reshape(g * M, Rt)).reshape(g, M)
    pack = update_packing(t, ends, _everyone(ends, local), Rt)
    pack = None if pack is None else tuple(put(a) for a in pack)
  components = None  # named reward components, for an objective that reads them
  if scored.components is not None and "reward_components" in s.objective.needs:
    components = put(scored.components)
  inputs = objective_inputs(
      t, state, pt, pl, rt, mask=put(cut(loss_mask)), generated_mask=put(cut(scored.mask)),
      rewards=put(scored.rewards), behaviour_logp=put(cut(scored.logprobs)), turns=turns,
      routing=replay, components=components, packing=pack)
  estimate = t.steps.advantages  # the objective's estimator, jitted
  if estimate is None:
    raise RLJaxError("the objective has no advantage estimator: chain one (losses.chain) to "
                     "train with it")
  advantages = (estimate(inputs) if scored.groups is None else
                group_size.per_prompt_advantages(estimate, inputs, scored.groups, geo.groups,
                                                 geo.max_chunks))
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
      "update_length": Rt,  # the response length the learner's passes ran at (trim_floor)
      "update_rows": M if pack is None else pack[0].shape[1],  # per group (pack_floor)
  }
  if scored.components is not None:  # each named component's mean, as reward/<name>
    means = _everyone(scored.components, local).reshape(-1, len(s.reward_names)).mean(axis=0)
    info.update({f"reward/{n}": float(v) for n, v in zip(s.reward_names, means)})
  info.update({k: float(scored.stats[k]) for k in STATS if k in scored.stats})
  info.update({k: float(v) for k, v in scored.stats.items()  # multi-turn batches
               if k in agent_stage.METRICS or k in replay_stage.METRICS
               or k.startswith("tool_errors_")})
  if inputs.teacher_logp is not None:  # on-policy distillation: what it minimises
    info["distill_reverse_kl"] = float(_reverse_kl(inputs.teacher_logp, inputs.behaviour_logp,
                                                   inputs.mask))
  if staleness:
    info.update(staleness_metrics(_everyone(scored.versions, local),  # the job's tokens
                                  _everyone(scored.mask, local), int(state.step)))
  return UpdateBatch(pt, pl, rt, inputs, advantages, routing, pack), info


def pass_orders(seed: int, step: int, groups: int, epochs: int) -> list[np.ndarray | None]:
  """The order of a step's ``groups`` (row groups) in each of its ``epochs`` passes: one pass
  keeps the collected order (None, the update of a single pass is unchanged); several draw
  a permutation per pass from ``(seed, step, pass)``, the same on every process."""
  if epochs == 1:
    return [None]
  return [np.random.default_rng([seed % 2**32, step, p]).permutation(groups)
          for p in range(epochs)]


def _minibatches(t: TrainParts, b: UpdateBatch, k: int,
                order: np.ndarray | None = None) -> list[UpdateBatch]:
  """``k`` consecutive slices of the groups (taken in ``order``, a permutation of them, when
  given), each split along ``batch`` again."""
  size = b.tokens.shape[0] // k
  if order is not None:
    b = jax.device_put(jax.tree.map(lambda a: a[order], b), t.layout.rows(b.tokens.shape[0]))
  if k == 1:
    return [b]
  rows = t.layout.rows(size)
  return [jax.device_put(jax.tree.map(lambda a: a[i * size:(i + 1) * size], b), rows)
          for i in range(k)]


# Policies of at least this many parameter bytes hand the host memory that sampling and
# scoring freed back to the OS before each update (``release_host_memory``): a 0.6B model's
# run peaks 0.36 GiB lower with it. A smaller policy's freed buffers are a few MB that its next
# allocations reuse; trimming them costs more than it saves (the trim, then the kernel
# refilling the pages: 4-6% of a GRPO step of the 3.7M-parameter ``scripts/bench_step.py``).
TRIM_MIN_PARAM_BYTES = 256 << 20


def trims_host_memory(params) -> bool:
  """Whether ``apply_update`` trims the host heap before updating ``params`` (a pytree of
  arrays): their bytes, all shards counted, reach ``TRIM_MIN_PARAM_BYTES``."""
  return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
             for x in jax.tree.leaves(params)) >= TRIM_MIN_PARAM_BYTES


def apply_update(t: TrainParts, state: TrainState, batch: UpdateBatch) -> tuple[TrainState, dict]:
  """The learner's step: ``train.epochs`` = μ passes over ``batch``, each
  ``train.minibatches`` optimizer updates (minibatches in the pass's order, ``pass_orders``);
  (state, the metrics averaged over the minibatches).

  Every pass reads the same objective inputs, so the proximal log-probs are those computed
  before the first pass (``on_policy``: the update never takes them from its own pass when
  μ > 1). With μ > 1 the metrics are the last pass's, and the ``PASS_METRICS`` of every pass
  are added as ``<name>_pass<p>``.
  """
  tr = t.setup.train
  carry = (state.params, state.opt_state, state.value_params, state.value_opt_state)
  if trims_host_memory(state.params):
    release_host_memory()  # host buffers freed by sampling and scoring, before the peak
  step = int(state.step) if tr.epochs > 1 else 0
  passes = []
  for order in pass_orders(tr.seed, step, batch.tokens.shape[0], tr.epochs):
    mets_all = []
    for mb in _minibatches(t, batch, tr.minibatches, order):
      *carry, mets = t.steps.rl_update(*carry, mb)  # steps.rl_update, compiled
      mets_all.append(jax.device_get(mets))
    passes.append({k: float(np.mean([m[k] for m in mets_all])) for k in mets_all[0]})
  state = state._replace(params=carry[0], opt_state=carry[1], value_params=carry[2],
                         value_opt_state=carry[3])
  out = dict(passes[-1])
  if len(passes) > 1:
    for p, mets in enumerate(passes, 1):
      out.update({f"{k}_pass{p}": v for k, v in mets.items() if k in PASS_METRICS})
  return state, out
