"""Optimizers of the trainer: AdamW behind an optional global-norm clip, with a schedule.

``make_optimizer(optim_config, lr, steps)`` builds the transform every stage uses (the
supervised warm start, the RL policy update and the PPO critic) from the ``optim`` section
of the config; only the learning rate and the number of steps differ between stages.

Schedules (``optim.schedule``): ``constant`` (linear warm-up over ``optim.warmup_steps``, then
``lr``) and ``cosine`` (warm-up, then cosine decay to 0 at ``steps``). Both count optimizer
updates: the trainer passes a stage's updates as ``steps`` (``config.stage_updates``: an RL
step makes ``train.minibatches`` x ``train.epochs`` of them).

The clip (``clip_by_global_norm``) reads the global norm from the ``grad_norm=`` keyword when
the caller has it: the trainer reduces its gradients once per update, for the skip check, the
clip and the ``grad_norm`` metric (``train.steps.finite_update``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax

__all__ = ["SCHEDULES", "clip_by_global_norm", "make_optimizer", "stochastic_round",
           "apply_updates", "update_count"]

SCHEDULES = ("constant", "cosine")


def make_optimizer(o: Any, lr: float, steps: int) -> optax.GradientTransformation:
  """AdamW (``o.b1, o.b2, o.eps, o.weight_decay``) at ``lr`` after a global-norm clip.

  Args:
    o: the ``optim`` config section (``schedule``, ``warmup_steps``, ``grad_clip`` ...).
    lr: peak learning rate (η).
    steps: optimizer updates of the stage (the cosine schedule decays over them).

  ``o.mu_dtype`` (None: the parameters' dtype) stores Adam's first moment in that dtype
  (``bfloat16`` halves it); the second moment stays in the parameters' dtype, since its
  squared gradients underflow bfloat16's range far sooner.

  Returns:
    An optax transformation; ``grad_clip == 0`` drops the clip.
  """
  if o.schedule == "cosine":  # (a stage that never runs has steps 0: any decay will do)
    decay = max(steps, o.warmup_steps + 1, 2)
    sched = optax.warmup_cosine_decay_schedule(0.0, lr, max(o.warmup_steps, 1), decay)
  elif o.warmup_steps:
    sched = optax.join_schedules(
        [optax.linear_schedule(0.0, lr, o.warmup_steps), optax.constant_schedule(lr)],
        [o.warmup_steps])
  else:
    sched = lr
  parts = [clip_by_global_norm(o.grad_clip)] if o.grad_clip > 0 else []
  parts.append(optax.adamw(sched, b1=o.b1, b2=o.b2, eps=o.eps, weight_decay=o.weight_decay,
                           mu_dtype=o.get("mu_dtype")))
  return optax.chain(*parts)


def clip_by_global_norm(max_norm: float) -> optax.GradientTransformationExtraArgs:
  """Scales the updates by ``max_norm / ‖g‖`` when their global norm ‖g‖ reaches
  ``max_norm`` (Pascanu et al., 2013, "On the difficulty of training recurrent neural
  networks").

  The same values as ``optax.clip_by_global_norm``; the norm can come in as the keyword
  ``grad_norm=`` (``optax.tree.norm`` of the same updates), so a trainer that has already
  reduced the gradients for its skip check and its ``grad_norm`` metric
  (``train.steps.finite_update``) does not reduce them again. Without it the norm is computed here.
  """

  def update_fn(updates, state, params=None, *, grad_norm=None, **extra_args):
    del params, extra_args
    norm = optax.tree.norm(updates) if grad_norm is None else grad_norm
    keep = jnp.squeeze(norm < max_norm)
    scale = lambda t: jax.lax.select(keep, t, (t / norm.astype(t.dtype)) * max_norm)
    return jax.tree.map(scale, updates), state

  return optax.GradientTransformationExtraArgs(optax.init_empty_state, update_fn)


def stochastic_round(x: jax.Array, dtype, key: jax.Array) -> jax.Array:
  """float32 ``x`` -> bfloat16, rounded up or down at random so that the result is unbiased.

  A float32 whose low 16 bits are dropped is a bfloat16 (the same sign, exponent and top 7
  mantissa bits). Adding a uniform random integer in [0, 2^16) to the bit pattern before
  dropping them carries into the kept bits with probability (x - down) / (up - down), where
  down / up are the bfloat16 neighbours of ``x`` (truncation toward zero and away from it):
  E[result] = x (stochastic rounding; Gupta et al., 2015, "Deep learning with limited
  numerical precision"). Exact bfloat16 values are returned unchanged. Non-finite values
  are not handled (the update that uses this is skipped when anything is non-finite).

  Args:
    x: float32 array (any shape). dtype: ``bfloat16`` (anything else: plain ``astype``).
    key: a PRNG key; the same key gives the same rounding.
  """
  if jnp.dtype(dtype) != jnp.dtype(jnp.bfloat16):
    return x.astype(dtype)
  bits = jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
  noise = jax.random.bits(key, x.shape, jnp.uint32) >> 16  # uniform in [0, 2^16)
  kept = (bits + noise) & jnp.uint32(0xFFFF0000)
  return jax.lax.bitcast_convert_type(kept, jnp.float32).astype(jnp.bfloat16)


def apply_updates(params: Any, updates: Any, key: jax.Array | None = None) -> Any:
  """``optax.apply_updates``; with ``key`` (``optim.stochastic_rounding``), each bfloat16
  parameter is updated in float32 and rounded back stochastically (``stochastic_round``,
  one key per leaf), so updates smaller than half a bfloat16 step still move the weights
  in expectation instead of rounding away. Other dtypes are added as optax does."""
  if key is None:
    return optax.apply_updates(params, updates)
  leaves, treedef = jax.tree.flatten(params)
  keys = jax.random.split(key, len(leaves))
  ups = treedef.flatten_up_to(updates)
  out = [stochastic_round(p.astype(jnp.float32) + u.astype(jnp.float32), p.dtype, k)
         if p.dtype == jnp.bfloat16 else (p + u).astype(p.dtype)
         for p, u, k in zip(leaves, ups, keys)]
  return jax.tree.unflatten(treedef, out)


def update_count(opt_state: Any) -> jax.Array:
  """The number of updates an optax state has applied (the first ``count`` leaf: Adam's),
  checkpointed with it; int32 []."""
  found = optax.tree_utils.tree_get_all_with_path(opt_state, "count")
  if not found:
    raise ValueError("the optimizer state has no update count")
  return found[0][1]
