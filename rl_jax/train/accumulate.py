"""Gradient accumulation: one minibatch's update from several micro-batches of its groups.

An objective's loss is ``loss_sum / denom`` (``losses.Objective.loss``): a sum over tokens or
rows divided by a count of them. The gradient of the whole minibatch is therefore the mean
of the micro-batches' gradients weighted by their denominators,

    g = Σ_i d_i · g_i / Σ_i d_i,    g_i = ∇ (loss_sum_i / d_i),

exact up to float rounding when each micro-batch holds whole groups (advantages are per
group) and the objective takes no statistic over the whole minibatch inside its loss (M2PO's
mask is one; ``losses.Objective.prepare`` computes it on the whole minibatch first). The loss
and the objective's metrics combine the same way, except the sums in ``SUMMED`` (VCPO's
effective sample size is computed from them), which are added. When every denominator so far
is 0 (nothing valid), the micro-batches count equally.

``train.micro_batches`` runs the micro-batches one after another inside the compiled update
(``accumulated``): activations and their gradients are those of one micro-batch at a time,
for one params-sized sum more. The step's forward passes (log-probs, the reference's, the
critic's values) run in the same micro-batches (``train.steps``; ``join_groups`` puts their
rows back). ``rl_jax.api.Trainer.forward_backward`` accumulates the same way across calls.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Accumulated", "SUMMED", "accumulated", "combine", "join_groups", "split_groups",
           "start"]

# metrics of a micro-batch that are sums over its rows: added, not averaged
SUMMED = ("vcpo/sum_w", "vcpo/sum_w2", "vcpo/num_seqs")


class Accumulated(NamedTuple):
  """Gradients of the micro-batches seen so far: their mean weighted by each micro-batch's
  loss denominator, the loss and the averaged metrics likewise, ``SUMMED`` metrics added.

  Attributes:
    denom: float32 [] the denominators' sum.
    count: float32 [] how many micro-batches (the weights when every denominator is 0).
    loss: float32 [] the weighted mean loss.
    grads, value_grads: pytrees, the weighted mean gradients (policy, critic).
    metrics: dict of float32 [] metrics.
  """

  denom: jax.Array
  count: jax.Array
  loss: jax.Array
  grads: Any
  value_grads: Any
  metrics: dict


def start(loss, denom, metrics, grads, value_grads) -> Accumulated:
  """One micro-batch's result (``rl_grads``' outputs) as an accumulation."""
  return Accumulated(jnp.asarray(denom, jnp.float32), jnp.ones((), jnp.float32), loss, grads,
                     value_grads, dict(metrics))


def combine(a: Accumulated, b: Accumulated) -> Accumulated:
  """``a`` and ``b`` as one accumulation: ``x = x_a·w + x_b·(1 − w)`` with
  ``w = d_a / (d_a + d_b)``, or ``n_a / (n_a + n_b)`` when both denominators are 0, for every
  gradient, the loss and every metric but ``SUMMED`` (added). Exact up to float rounding."""
  d, n = a.denom + b.denom, a.count + b.count
  wa = jnp.where(d > 0, a.denom / jnp.where(d > 0, d, 1.0), a.count / jnp.maximum(n, 1.0))
  mix = lambda x, y: (x * wa + y * (1.0 - wa)).astype(x.dtype)
  mets = {k: a.metrics[k] + b.metrics[k] if k in SUMMED else mix(a.metrics[k], b.metrics[k])
          for k in a.metrics}
  return Accumulated(d, n, mix(a.loss, b.loss), jax.tree.map(mix, a.grads, b.grads),
                     jax.tree.map(mix, a.value_grads, b.value_grads), mets)


def split_groups(batch: Any, k: int) -> Any:
  """``batch`` (a pytree of arrays with leading axis G) as ``k`` micro-batches: every leaf
  [G, ...] -> [k, G/k, ...], micro-batch i holding groups i, i+k, i+2k, ... (strided, so a
  batch split over devices in contiguous blocks keeps each micro-batch's rows on the devices
  that hold them when k divides each block). ``k`` must divide G."""
  def one(a):
    g = a.shape[0]
    if g % k:
      raise ValueError(f"{g} groups do not split into {k} micro-batches")
    return jnp.moveaxis(a.reshape((g // k, k) + a.shape[1:]), 1, 0)
  return jax.tree.map(one, batch)


def join_groups(x: jax.Array) -> jax.Array:
  """The inverse of ``split_groups`` for one array: [k, G/k, ...] -> [G, ...]."""
  return jnp.moveaxis(x, 0, 1).reshape((x.shape[0] * x.shape[1],) + x.shape[2:])


def accumulated(grads_fn: Callable, k: int) -> Callable:
  """``grads_fn(params, value_params, batch) -> (loss, denom, metrics, grads, value_grads)``
  (``train.steps.rl_grads``) over ``k`` micro-batches of the batch's groups, run one after
  another (``lax.scan``) and combined by ``combine``; the same signature, ``denom`` the sum.
  ``k == 1`` returns ``grads_fn`` itself."""
  if k == 1:
    return grads_fn

  def fn(params, value_params, batch):
    parts = split_groups(batch, k)
    one = lambda part: start(*grads_fn(params, value_params, part))
    # nothing seen yet: count 0 gives the first micro-batch weight 1 (see ``combine``)
    shapes = jax.eval_shape(one, jax.tree.map(lambda a: a[0], parts))
    empty = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), shapes)._replace(
        count=jnp.zeros((), jnp.float32))
    acc, _ = jax.lax.scan(lambda acc, part: (combine(acc, one(part)), None), empty, parts)
    return acc.loss, acc.denom, acc.metrics, acc.grads, acc.value_grads

  return fn
