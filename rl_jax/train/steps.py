"""The jitted functions of the trainer: supervised step, RL update, log-prob, value and
per-trajectory gradient-norm passes.

Each is compiled with explicit ``in_shardings`` / ``out_shardings`` from the run's ``Layout``
(state as the sharding table lays it out, batches split along ``batch`` -> (data, fsdp)) and
traced inside ``sharding.use``, so the activation constraints of the model and the losses
apply.

Shapes (the package legend): G groups (prompts) per step, M samples per prompt
(``Setup.geometry``), P prompt bucket, R = ``rollout.max_new_tokens``, B = G·M rows, T tokens.
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import optax

from rl_jax import losses
from rl_jax import models
from rl_jax import optim
from rl_jax.train import accumulate
from rl_jax.train import offload
from rl_jax.train import teacher as teacher_lib
from rl_jax.train.context import Setup
from rl_jax.train.layout import Layout, jit_on_mesh
from rl_jax.train.on_policy import old_logp_in_update
from rl_jax.train.streams import Stream, seed_for

__all__ = ["UpdateBatch", "StepFns", "make_step_fns", "finite_update", "make_sft_step",
           "make_logprob_fn", "make_ref_logprob_fn", "make_teacher_logprob_fn", "make_value_fn",
           "make_rl_update", "rl_update",
           "rl_grads", "rl_apply", "make_grad_norm_fn", "make_advantage_fn", "rounding_key",
           "routing_mismatch"]


class UpdateBatch(NamedTuple):
  """One step's groups ready for the update (device arrays; sliceable along G).

  prompt_tokens int32 [G,P] right-padded; prompt_lengths int32 [G]; tokens int32 [G,M,R];
  inputs: the objective's input record (``inputs.mask`` bool [G,M,R] is the loss mask);
  advantages: what the objective's estimator returned for ``inputs``.
  routing: mixture-of-experts models: int32 [G,M,R,Y,X] the sampler's experts of each
  response token (-1: none recorded), or None (dense models, rollouts without records).
  packing: ``(src [G,M',R], dst [G,M,R])`` of ``models.packing.plan``: the update's policy
  and critic passes (and the step's other passes) run on M' < M rows of several responses
  each (``train.pack_floor``), or None.
  """

  prompt_tokens: jax.Array
  prompt_lengths: jax.Array
  tokens: jax.Array
  inputs: losses.ObjectiveInputs
  advantages: losses.Advantages
  routing: jax.Array | None = None
  packing: tuple[jax.Array, jax.Array] | None = None


class StepFns(NamedTuple):
  """The compiled steps of one run, built by ``make_step_fns``; each field names the
  function that makes it, whose docstring gives its signature and what it computes."""

  sft: Callable  # make_sft_step: one supervised step
  rl_update: Callable  # make_rl_update: rl_update (rl_grads, rl_apply) compiled, per minibatch
  logprobs: Callable  # make_logprob_fn: the policy's log-probs of the sampled tokens
  values: Callable  # make_value_fn: the critic's values (PPO)
  grad_sq_norms: Callable  # make_grad_norm_fn: per-trajectory squared gradient norms (VCPO)
  old_logp_in_update: bool = False  # rl_update takes old_logp from its own policy pass
  # make_ref_logprob_fn: the reference's pass when it lives in host memory
  ref_logprobs: Callable | None = None
  ref_from_policy: bool = False  # LoRA: ref_logprobs takes the policy (runs its base)
  # make_advantage_fn: the objective's advantage estimator as one program (ObjectiveInputs
  # -> Advantages); None when the objective has none
  advantages: Callable | None = None
  # make_teacher_logprob_fn: on-policy distillation's teacher pass (teacher params first);
  # None without one
  teacher_logprobs: Callable | None = None


def rounding_key(s: Setup, opt_state, stage: int) -> jax.Array | None:
  """The stochastic-rounding key of the next update (``optim.stochastic_rounding``; None
  without it): the run's ``ROUNDING`` stream, the optimizer (``stage``: 0 supervised, 1 RL,
  2 critic) and its update count, which the checkpoint holds, so a resumed run rounds
  exactly as the uninterrupted one."""
  if not s.optim.stochastic_rounding:
    return None
  key = jax.random.key(seed_for(s.train.seed, 0, Stream.ROUNDING))
  return jax.random.fold_in(jax.random.fold_in(key, stage), optim.update_count(opt_state))


def finite_update(tx, params, opt_state, grads, loss, *, key=None, grad_norm=None, **extra):
  """One optax update, skipped (params and state unchanged) if the loss or the gradients'
  global norm is not finite. ``key``: round bfloat16 weights stochastically
  (``optim.apply_updates``). ``grad_norm``: ``optax.tree.norm(grads)`` when the caller has
  it (the ``grad_norm`` metric); computed here otherwise.

  The one norm decides the skip and is handed to the optimizer (``grad_norm=``, read by
  ``optim.clip_by_global_norm``), so the gradients are reduced once, not once for the check,
  once for the clip and once for the metric. A NaN or infinite entry makes the norm
  non-finite; so does a sum of squares past float32's range, whose clipped update would be
  all zeros.

  Not ``optax.apply_if_finite``: that wrapper applies the update anyway after
  ``max_consecutive_errors`` skips (the loop stops the run instead, ``train.max_bad_steps``),
  looks at gradients only (the loss is checked too, and the policy and critic skip together),
  and adds a counter to the optimizer state, which would change the checkpoint layout.

  Returns:
    (params, opt_state, finite bool []).
  """
  if grad_norm is None:
    grad_norm = optax.tree.norm(grads)
  finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)

  def apply(carry):
    p, o = carry
    updates, new_o = tx.update(grads, o, p, grad_norm=grad_norm, **extra)
    return optim.apply_updates(p, updates, key), new_o

  # a branch, not a select of new and old values: the select kept both copies of the
  # parameters and optimizer state alive (~1.2x the parameters' bytes more at the peak)
  new_params, new_opt = jax.lax.cond(finite, apply, lambda carry: carry, (params, opt_state))
  return new_params, new_opt, finite


def _aux_coef(s: Setup) -> float:
  """``model.router_aux_loss_coef`` (0.0: off; dense models never have it, the config
  checks reject it there). The checkpoint's own ``ModelConfig.router_aux_loss_coef`` is not
  read."""
  return s.model.router_aux_loss_coef if s.model_cfg.is_moe else 0.0


def make_sft_step(s: Setup, layout: Layout) -> Callable:
  """``sft(params, opt_state, tokens [B,T], attn_mask [B,T], loss_mask [B,T])`` ->
  ``(params, opt_state, metrics)``: next-token loss on the answer tokens only. Donates the
  params and optimizer state.

  Mixture of experts with ``model.router_aux_loss_coef`` c > 0: the loss adds c × the
  load-balancing loss of the router over the valid tokens (``attn_mask``), metric
  ``moe_aux_loss`` (the loss before c); ``sft_loss`` stays the next-token loss."""
  cfg = s.model_cfg
  host_opt = "sft_opt_state" in offload.offloaded_fields(s)
  aux_coef = _aux_coef(s)

  def step(params, opt_state, tokens, attn_mask, loss_mask):
    opt_state = offload.to_device(opt_state, host_opt)  # train.offload: into device memory
    frozen, trained = models.lora.trainable(cfg, params)  # LoRA: the adapters only

    def loss_fn(p):
      p = models.lora.untrainable(cfg, frozen, p)
      if not aux_coef:
        lp = models.sequence_logprobs(cfg, p, tokens, attention_mask=attn_mask)
        return -jnp.sum(lp * loss_mask) / jnp.maximum(jnp.sum(loss_mask), 1.0), {}
      h, route = models.hidden_states(cfg, p, tokens, attention_mask=attn_mask,
                                      return_routing=True)
      lp = jnp.pad(models.token_logprobs(cfg, p, h[:, :-1], tokens[:, 1:]), ((0, 0), (1, 0)))
      nll = -jnp.sum(lp * loss_mask) / jnp.maximum(jnp.sum(loss_mask), 1.0)
      aux = models.load_balancing_loss(route.logits, cfg.num_experts_per_tok, attn_mask)
      return nll + aux_coef * aux, {"sft_loss": nll, "moe_aux_loss": aux}

    (loss, mets), grads = jax.value_and_grad(loss_fn, has_aux=True)(trained)
    norm = optax.tree.norm(grads)
    trained, opt_state, finite = finite_update(s.optimizers.sft, trained, opt_state, grads, loss,
                                               key=rounding_key(s, opt_state, 0), grad_norm=norm)
    params = models.lora.untrainable(cfg, frozen, trained)
    return params, opt_state, {"sft_loss": loss, **mets, "grad_norm": norm,
                               "update_skipped": 1 - finite.astype(jnp.int32)}

  st, rows = layout.state, layout.rows(s.sft.batch_size)
  return jit_on_mesh(step, layout, donate_argnums=(0, 1),
                     in_shardings=(st.params, st.sft_opt_state, rows, rows, rows),
                     out_shardings=(st.params, st.sft_opt_state, layout.replicated))


def _groups(s: Setup) -> int:
  """Row groups of a step's batch: G, or W chunks with adaptive group size."""
  return s.geometry.rows


def _micro(s: Setup) -> int:
  """``train.micro_batches``: the batch passes and the update run in this many pieces."""
  return s.train.micro_batches


def _temperature(s: Setup) -> float:
  return s.rollout.sample_temperature


def _group_pass(layout: Layout, weights, groups: int, fn: Callable, extra=(),
                micro_batches: int = 1, load: Callable = lambda w: w,
                packs: bool = False) -> Callable:
  """A jitted pass ``fn(load(weights), prompt_tokens, prompt_lengths, tokens, mask, *extra)``
  over ``groups`` groups: batch inputs and the output split along ``batch``; ``load`` brings
  the weights where ``fn`` reads them (once per call). ``micro_batches`` = k > 1
  (``train.micro_batches``) runs ``fn`` on k micro-batches of the groups one after another
  (``lax.map``; the extras laid out like the batch are split with it) and puts the rows back
  in order: the same values for the activations of one micro-batch. ``packs``: ``fn`` also
  takes ``packing=(src, dst)`` (``UpdateBatch.packing``), and the jitted pass carries a twin,
  ``.on_rows(weights, prompt_tokens, prompt_lengths, tokens, mask, src, dst, *extra)``: the
  same pass on rows of several responses each (``models.packing``), compiled on first use."""
  rows = layout.rows(groups)
  body = fn if micro_batches == 1 else _in_micro_batches(
      fn, micro_batches, [True] * 4 + [e == rows for e in extra])

  @functools.wraps(fn)  # the program keeps the pass's name (compile logs, profiles)
  def run(w, *args):
    return body(load(w), *args)

  plain = jit_on_mesh(run, layout, in_shardings=(weights, rows, rows, rows, rows, *extra),
                      out_shardings=rows)
  if not packs:
    return plain

  def on_rows(w, pt, pl, rt, rm, src, dst, *more):
    return fn(w, pt, pl, rt, rm, *more, packing=(src, dst))

  body_rows = on_rows if micro_batches == 1 else _in_micro_batches(
      on_rows, micro_batches, [True] * 6 + [e == rows for e in extra])

  @functools.wraps(fn)
  def run_rows(w, *args):
    return body_rows(load(w), *args)

  plain.on_rows = jit_on_mesh(run_rows, layout, out_shardings=rows, in_shardings=(
      weights, rows, rows, rows, rows, rows, rows, *extra))
  return plain


def _in_micro_batches(fn: Callable, k: int, is_batch: list[bool]) -> Callable:
  """``fn(weights, *args)`` with the args marked in ``is_batch`` (leading axis G) split into
  k micro-batches of whole groups (``accumulate.split_groups``), one ``fn`` call each, and the
  outputs (leading axis G/k) joined back into [G, ...] rows in the original order."""

  def run(weights, *args):
    parts = [accumulate.split_groups(a, k) for a, b in zip(args, is_batch) if b]

    def one(part):
      it = iter(part)
      return fn(weights, *[next(it) if b else a for a, b in zip(args, is_batch)])

    return jax.tree.map(accumulate.join_groups, jax.lax.map(one, parts))

  return run


def _replay(s: Setup) -> bool:
  """``model.router_replay``: the passes route response tokens as the sampler did."""
  return s.model.router_replay


def routing_mismatch(used: jax.Array, recorded: jax.Array, mask: jax.Array) -> jax.Array:
  """Fraction of the tokens with a record whose expert set differs in some MoE layer.

  Args:
    used, recorded: int [G,M,R,Y,X] experts of the trainer's pass and of the sampler
      (recorded -1: none); mask bool [G,M,R] tokens to count.
  Returns:
    float32 scalar (0 when no token counts).
  """
  counted = mask & jnp.all(recorded[..., 0] >= 0, axis=-1)
  differ = jnp.any(jnp.sort(used, axis=-1) != jnp.sort(recorded, axis=-1), axis=(-2, -1))
  return (jnp.sum(differ & counted) / jnp.maximum(jnp.sum(counted), 1)).astype(jnp.float32)


def make_logprob_fn(s: Setup, layout: Layout) -> Callable:
  """``logprobs(params, prompt_tokens [G,P], prompt_lengths [G], tokens [G,M,R],
  mask [G,M,R]) -> [G,M,R]`` at the sampling temperature (packed layout by default); with
  ``model.router_replay`` a sixth argument, the sampler's routing [G,M,R,Y,X]."""
  temp, shared = _temperature(s), s.train.shared_prefix
  rows = layout.rows(_groups(s))
  return _group_pass(layout, layout.state.params, _groups(s),
                     lambda p, pt, pl, rt, rm, *routing, packing=None: models.response_logprobs(
                         s.model_cfg, p, pt, pl, rt, rm, shared_prefix=shared,
                         temperature=temp, routing=routing[0] if routing else None,
                         packing=packing),
                     extra=(rows,) if _replay(s) else (), micro_batches=_micro(s), packs=True)


def make_ref_logprob_fn(s: Setup, layout: Layout) -> Callable | None:
  """``make_logprob_fn`` for a reference kept in host memory (``train.offload`` naming it):
  compiled for that placement, the weights brought to the device inside the pass. With
  LoRA the pass takes the policy's params and runs the base with the adapters off
  (``StepFns.ref_from_policy``). None when the reference is on the device: ``logprobs``
  serves it."""
  temp, shared = _temperature(s), s.train.shared_prefix
  if s.model_cfg.lora_rank:  # with router replay it takes the records like the others
    return _group_pass(layout, layout.state.params, _groups(s),
                       lambda p, pt, pl, rt, rm, *routing, packing=None: models.response_logprobs(
                           s.model_cfg, models.lora.strip(p), pt, pl, rt, rm,
                           shared_prefix=shared, temperature=temp,
                           routing=routing[0] if routing else None, packing=packing),
                       extra=(layout.rows(_groups(s)),) if _replay(s) else (),
                       micro_batches=_micro(s), packs=True)
  if "ref_params" not in offload.offloaded_fields(s):
    return None
  weights = jax.tree.map(offload.host_sharding, layout.state.params)  # laid out like the policy
  return _group_pass(layout, weights, _groups(s),
                     lambda p, pt, pl, rt, rm, *routing, packing=None: models.response_logprobs(
                         s.model_cfg, p, pt, pl, rt, rm, shared_prefix=shared,
                         temperature=temp, routing=routing[0] if routing else None,
                         packing=packing),
                     extra=(layout.rows(_groups(s)),) if _replay(s) else (),
                     micro_batches=_micro(s), load=lambda p: offload.to_device(p, True),
                     packs=True)


def make_teacher_logprob_fn(s: Setup, layout: Layout) -> Callable | None:
  """``teacher_logprobs(teacher_params, prompt_tokens [G,P], prompt_lengths [G],
  tokens [G,M,R], mask [G,M,R]) -> [G,M,R]``: on-policy distillation's teacher
  (``distill.teacher_path``, ``train.teacher``) scoring the sampled tokens, at the sampling
  temperature like the policy's pass, its weights laid out by ``teacher.teacher_shardings``
  (in host memory with ``train.offload=teacher``, brought to the device inside the pass).
  None without a teacher."""
  if s.teacher_cfg is None:
    return None
  cfg, temp, shared = s.teacher_cfg, _temperature(s), s.train.shared_prefix
  host = teacher_lib.offloaded(s)
  return _group_pass(layout, teacher_lib.teacher_shardings(s), _groups(s),
                     lambda p, pt, pl, rt, rm, packing=None: models.response_logprobs(
                         cfg, p, pt, pl, rt, rm, shared_prefix=shared, temperature=temp,
                         packing=packing),
                     micro_batches=_micro(s), load=lambda p: offload.to_device(p, host),
                     packs=True)


def make_value_fn(s: Setup, layout: Layout) -> Callable:
  """``values(value_params, prompt_tokens, prompt_lengths, tokens, mask) -> [G,M,R]``."""
  shared = s.train.shared_prefix
  return _group_pass(layout, layout.state.value_params, _groups(s),
                     lambda v, pt, pl, rt, rm, packing=None: models.response_values(
                         s.model_cfg, v, pt, pl, rt, rm, shared_prefix=shared,
                         packing=packing),
                     micro_batches=_micro(s), packs=True)


def rl_grads(s: Setup, obj: losses.Objective | None = None) -> Callable:
  """The gradient half of the RL update (not jitted): ``grads(params, value_params,
  b: UpdateBatch) -> (loss, denom, metrics, grads, value_grads)``.

  ``obj`` (default the run's objective) gives ``loss_sum`` and ``denom``; ``loss`` is
  ``loss_sum / denom`` (``losses.finalize``), the gradients are those of ``loss``, and
  ``denom`` is returned so that gradients of several micro-batches can be combined weighted
  by their denominators. ``value_grads`` are the critic's (zeros-shaped ``{}`` without one).
  See ``make_rl_update`` for the on-policy ``old_logp`` and the entropy pass.

  Mixture of experts with the sampler's records (``b.routing``): ``model.router_replay``
  routes the response tokens with them, and the metric ``routing_mismatch``
  (``routing_mismatch``) compares the experts this pass used with them. With
  ``model.moe_capacity_factor`` > 0 the metric ``moe_dropped_tokens`` is the fraction of this
  pass's (token, expert) assignments dropped for capacity, averaged over the MoE layers.
  With ``model.router_aux_loss_coef`` c > 0, ``loss`` adds c × ``moe.load_balancing_loss`` of
  this pass's router logits (the current router's probabilities and own top-X, also under
  router replay: that is what trains the router) over the valid prompt tokens and the
  generated response tokens (``generated_mask``), each of the G·M sequences counted once;
  metric ``moe_aux_loss`` (before c). The gradient-accumulation denominator ``denom`` is the
  objective's, so micro-batches average the term weighted like the objective.
  """
  cfg, obj = s.model_cfg, s.objective if obj is None else obj
  replay = _replay(s)
  temp, shared = _temperature(s), s.train.shared_prefix
  with_critic = "values" in obj.needs
  with_entropy = "entropy" in obj.needs  # an entropy bonus: per-token entropy of this pass
  own_old = old_logp_in_update(s.train, s.schedule.overlapped, s.rollout.partial, obj)
  capacity = cfg.is_moe and bool(cfg.moe_capacity_factor)  # metric moe_dropped_tokens
  aux_coef = _aux_coef(s)  # load-balancing loss, metric moe_aux_loss

  def grads_fn(params, value_params, b: UpdateBatch):
    G, M, R = b.tokens.shape
    outer_batch = None if own_old else obj.prepare(losses.loss_batch(b.inputs, b.advantages))
    mask = b.inputs.mask
    frozen, trained = models.lora.trainable(cfg, params)  # LoRA: the adapters only

    def loss_fn(p, v):
      p = models.lora.untrainable(cfg, frozen, p)
      routed = {} if b.routing is None else dict(routing=b.routing if replay else None,
                                                 return_routing=True)
      if capacity:
        routed["return_dropped"] = True
      if aux_coef:
        gen = b.inputs.generated_mask
        routed["balance_mask"] = mask if gen is None else gen
      out = models.response_logprobs(cfg, p, b.prompt_tokens, b.prompt_lengths, b.tokens,
                                     mask, shared_prefix=shared, temperature=temp,
                                     with_entropy=with_entropy, packing=b.packing, **routed)
      out = list(out) if isinstance(out, tuple) else [out]
      lp = out.pop(0)
      entropy = out.pop(0) if with_entropy else None
      used = out.pop(0) if b.routing is not None else None
      dropped = out.pop(0) if capacity else None
      aux = out.pop(0) if aux_coef else None
      if own_old:
        inputs = b.inputs._replace(old_logp=jax.lax.stop_gradient(lp))
        batch = obj.prepare(losses.loss_batch(inputs, b.advantages))
      else:
        batch = outer_batch
      values = None
      if with_critic:
        values = models.response_values(cfg, v, b.prompt_tokens, b.prompt_lengths, b.tokens,
                                        mask, shared_prefix=shared,
                                        packing=b.packing).reshape(G * M, R)
      rows = lambda a: None if a is None else a.reshape(G * M, R)
      loss_sum, denom, mets = obj.loss(rows(lp), batch, values=values, entropy=rows(entropy))
      if b.routing is not None:
        mets = dict(mets, routing_mismatch=routing_mismatch(
            used, b.routing, b.inputs.generated_mask))
      if capacity:  # mean over the MoE layers of the fraction of assignments dropped
        mets = dict(mets, moe_dropped_tokens=jnp.mean(dropped))
      loss = losses.finalize(loss_sum, denom)
      if aux_coef:
        loss = loss + aux_coef * aux
        mets = dict(mets, moe_aux_loss=aux)
      return loss, (mets, denom)

    (loss, (mets, denom)), (grads, vgrads) = jax.value_and_grad(
        loss_fn, argnums=(0, 1), has_aux=True)(trained, value_params)
    return loss, denom, mets, grads, vgrads

  return grads_fn


def rl_apply(s: Setup) -> Callable:
  """The optimizer half of the RL update (not jitted): ``apply(params, opt_state,
  value_params, value_opt_state, grads, value_grads, loss, metrics)`` -> the four updated
  and the metrics with ``loss``, ``grad_norm``, ``ess_ratio`` and ``update_skipped`` added.
  With LoRA, ``grads`` are the adapters' (``rl_grads``) and only the adapters change.

  VCPO: ρ = ESS/B from the sums ``vcpo/sum_w``, ``vcpo/sum_w2``, ``vcpo/num_seqs`` in
  ``metrics`` scales the update. The critic is updated when the objective reads values.
  """
  cfg = s.model_cfg
  with_critic = "values" in s.objective.needs
  host = offload.offloaded_fields(s)

  def apply(params, opt_state, value_params, value_opt_state, grads, vgrads, loss, mets):
    opt_state = offload.to_device(opt_state, "opt_state" in host)  # train.offload
    value_opt_state = offload.to_device(value_opt_state, "value_opt_state" in host)
    frozen, trained = models.lora.trainable(cfg, params)  # LoRA: the adapters only
    ess = (losses.ess_ratio_from_sums(mets["vcpo/sum_w"], mets["vcpo/sum_w2"],
                                      mets["vcpo/num_seqs"]) if "vcpo/sum_w" in mets else 1.0)
    norm = optax.tree.norm(grads)
    trained, opt_state, finite = finite_update(s.optimizers.rl, trained, opt_state, grads,
                                               loss, key=rounding_key(s, opt_state, 1),
                                               grad_norm=norm, ess_ratio=ess)
    params = models.lora.untrainable(cfg, frozen, trained)
    if with_critic:
      value_params, value_opt_state, vfinite = finite_update(
          s.optimizers.value, value_params, value_opt_state, vgrads, loss,
          key=rounding_key(s, value_opt_state, 2))
      finite &= vfinite
    mets = dict(mets, loss=loss, grad_norm=norm, ess_ratio=ess,
                update_skipped=1 - finite.astype(jnp.int32))
    return params, opt_state, value_params, value_opt_state, mets

  return apply


def rl_update(grads_fn: Callable, apply: Callable, params, opt_state, value_params,
              value_opt_state, b: UpdateBatch):
  """The RL update of one minibatch ``b``: ``grads_fn`` (``rl_grads``, accumulated over
  micro-batches) gives the loss, metrics and the policy's and critic's gradients, then
  ``apply`` (``rl_apply``) steps both optimizers. Returns (params, opt_state, value_params,
  value_opt_state, metrics). ``make_rl_update`` compiles it for the run's mesh."""
  loss, _, mets, grads, vgrads = grads_fn(params, value_params, b)
  return apply(params, opt_state, value_params, value_opt_state, grads, vgrads, loss, mets)


def make_rl_update(s: Setup, layout: Layout) -> Callable:
  """``rl_update`` compiled for the run:
  ``update(params, opt_state, value_params, value_opt_state, batch: UpdateBatch)`` -> the
  four updated and a metrics dict; one optimizer step on one minibatch of groups
  (``rl_grads`` then ``rl_apply``, one program).

  The objective's loss runs over the flattened rows (``losses.loss_batch``); the critic is
  updated alongside when the objective reads values, and the policy pass also returns the
  per-token entropy when the objective has an entropy bonus. A non-finite loss or policy gradient
  skips the policy update, a non-finite critic gradient the critic update; either counts as
  a skipped step. VCPO: ρ = ESS/B of the minibatch scales the final update (the objective's
  update transform reads ``ess_ratio``).

  When ``on_policy.old_logp_in_update`` holds, ``b.inputs.old_logp`` is None and the
  proximal log-probs are ``stop_gradient`` of this pass's own log-probs (same weights).

  ``train.micro_batches`` = k > 1: the gradients are those of k micro-batches of the groups,
  one after another, combined by their loss denominators (``train.accumulate``).
  """
  grads_fn, apply = accumulate.accumulated(rl_grads(s), _micro(s)), rl_apply(s)

  def update(params, opt_state, value_params, value_opt_state, b: UpdateBatch):
    # rl_update with this run's passes; the program is named jit_update in profiles
    return rl_update(grads_fn, apply, params, opt_state, value_params, value_opt_state, b)

  st = layout.state
  weights = (st.params, st.opt_state, st.value_params, st.value_opt_state)
  rows = layout.rows(_groups(s) // s.train.minibatches)
  return jit_on_mesh(update, layout, donate_argnums=(0, 1, 2, 3),
                     in_shardings=(*weights, rows), out_shardings=(*weights, layout.replicated))


def make_grad_norm_fn(s: Setup, layout: Layout) -> Callable:
  """``grad_sq_norms(params, prompt_tokens, prompt_lengths, tokens, mask, key) -> [G,M]``:
  squared gradient norm of each trajectory's summed log-probs (VCPO's off-policy optimal
  baseline), by ``loss_extra.grad_norm_method``."""
  cfg, temp = s.model_cfg, _temperature(s)
  method = s.loss_extra.grad_norm_method
  chunk = s.loss_extra.grad_norm_chunk

  def row_logp(p, x):
    pt, pl, rt, rm = x
    lp = models.response_logprobs(cfg, p, pt, pl, rt[:, None], rm[:, None], shared_prefix=False,
                                  temperature=temp)
    return lp.sum(axis=(1, 2))

  def fn(params, pt, pl, rt, rm, key):
    G, M, R = rt.shape
    x = (jnp.repeat(pt, M, axis=0), jnp.repeat(pl, M, axis=0), rt.reshape(G * M, R),
         rm.reshape(G * M, R))
    frozen, trained = models.lora.trainable(cfg, params)  # gradients of what is trained
    sq = losses.per_row_grad_sq_norms(
        lambda p, x: row_logp(models.lora.untrainable(cfg, frozen, p), x), trained, x,
        method=method, key=key, chunk_size=chunk if method == "map" else None)
    return sq.reshape(G, M)

  return _group_pass(layout, layout.state.params, _groups(s), fn,
                     extra=(layout.replicated,))


def make_step_fns(s: Setup, layout: Layout) -> StepFns:
  """Every jitted step of the run (compiled lazily, on first call)."""
  return StepFns(sft=make_sft_step(s, layout), rl_update=make_rl_update(s, layout),
                 logprobs=make_logprob_fn(s, layout), values=make_value_fn(s, layout),
                 grad_sq_norms=make_grad_norm_fn(s, layout),
                 old_logp_in_update=old_logp_in_update(s.train, s.schedule.overlapped,
                                                       s.rollout.partial, s.objective),
                 ref_logprobs=make_ref_logprob_fn(s, layout),
                 ref_from_policy=bool(s.model_cfg.lora_rank),
                 advantages=make_advantage_fn(s),
                 teacher_logprobs=make_teacher_logprob_fn(s, layout))


def make_advantage_fn(s: Setup) -> Callable | None:
  """``Objective.advantages_from`` jitted: one compiled program per batch shape instead of
  a dispatch (and, on the first step, a compile) per array operation of the estimator.
  Values are the eager call's, bit for bit (``tests/test_losses_objective.py``); the
  inputs' shardings carry over to the result. None when the objective has no estimator."""
  fn = s.objective.advantages_from
  return None if fn is None else jax.jit(fn)
