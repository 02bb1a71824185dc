"""Mixture-of-experts MLP (Qwen3-MoE): softmax router, top-X experts per token, grouped matmuls.

Axis letters: the legend of ``rl_jax/__init__.py`` (E experts, X experts per token,
Y layers with experts); here A = B·T·X (token, expert) assignments.

Routing: ``softmax(x W_r)`` in float32 over the E experts, the X largest kept, optionally
renormalised to sum to one (``norm_topk_prob``). Router replay: given expert ids (e.g. those
the sampler recorded), the same experts are used and their weights are recomputed from the
current router's probabilities of exactly those experts (renormalised over them when
``norm_topk_prob``), so gradients still reach the router. A token whose given ids are -1
(nothing recorded: prompt tokens, a response's last token) is routed by the router itself.

Dispatch: every (token, expert) assignment is one row; rows are sorted by expert so each
expert's rows are contiguous, and the three expert matmuls are ``jax.lax.ragged_dot`` over
those groups: compute is proportional to A (with a native grouped matmul, see Lowering), no
[tokens, E] one-hot, no capacity and no dropped tokens. Outputs are put back in token order and
summed over each token's X experts with its routing weights. Dropless by design: no capacity
factor, so training and sampling route every token exactly as the router says (what router
replay needs). The price is static shapes sized for the worst case: a buffer holds all A rows
whatever the balance.

Lowering: on TPU and GPU ``ragged_dot`` is a native grouped matmul (work ∝ A). On CPU JAX
lowers it to one masked dense matmul per expert over all A rows, E times the active FLOPs;
the numbers are equal, only the cost differs (``tests/test_moe_sharding.py`` measures it).

Sharding (expert parallelism): the ``expert`` logical axis of the weights [Y,E,D,F] maps to
the ``fsdp`` mesh axis (``rl_jax/sharding.py``), so n devices hold E/n experts each and the
weights are never gathered; tokens stay batch-sharded outside the layer. As compiled on 8
fake CPU devices (``tests/test_moe_sharding.py``), XLA partitions the grouped matmuls along
the expert axis: the routing (ids, probabilities, group sizes) is all-gathered, the
dispatched rows [A,D] are all-reduced (each device sees every assignment), each device runs
its own experts, and the partial matmul outputs ([A,F] gate/up, [A,D] down) are summed with
all-reduces. No all-to-all: exact and simple, at A·(2D + 2F) words per device per layer. An
all-to-all dispatch would move ~A/n rows but needs a capacity (static per-device buffers)
or a ragged all-to-all; not done here. The TPU/GPU partitioning of the native grouped
matmul is not checked on hardware.

References: Shazeer et al. 2017 (sparsely-gated MoE); Fedus et al. 2021 (Switch
Transformer, the load-balancing loss).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["ROUTERS", "Routing", "expert_mlp", "load_balancing_loss", "route"]

ROUTERS = ("softmax_topk",)  # routing schemes (``model.router``): softmax, top X


class Routing(NamedTuple):
  """Router outputs of the Y MoE layers of one pass.

  Attributes:
    ids: int32 [Y,B,T,X] experts chosen for every token (replay them with ``routing=ids``;
      -1 rows in a replayed routing are routed by the router).
    logits: float32 [Y,B,T,E] router logits (for ``load_balancing_loss``).
  """

  ids: jax.Array
  logits: jax.Array


def route(x: jax.Array, w_router: jax.Array, top_k: int, norm_topk_prob: bool,
          ids: jax.Array | None = None):
  """Routing weights of one MoE layer.

  Args:
    x [B,T,D] (compute dtype); w_router [D,E]; top_k: X.
    ids: optional int [B,T,X] experts to use (router replay) instead of the top X; a token
      whose first id is -1 takes the router's own top X.
  Returns:
    weights [B,T,X] in x's dtype, ids int32 [B,T,X], logits float32 [B,T,E].
  """
  with jax.named_scope("router"):
    logits = jnp.einsum("btd,de->bte", x, w_router.astype(x.dtype))
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    if ids is None:
      top, ids = jax.lax.top_k(probs, top_k)
    else:
      own = jax.lax.top_k(probs, top_k)[1]
      ids = jnp.where(ids[..., :1] >= 0, ids.astype(own.dtype), own)
      top = jnp.take_along_axis(probs, ids, axis=-1)
    if norm_topk_prob:
      top = top / jnp.sum(top, axis=-1, keepdims=True)
    return top.astype(x.dtype), ids.astype(jnp.int32), logits.astype(jnp.float32)


def _sort_by_expert(ids: jax.Array, num_experts: int):
  """Assignment order grouping rows by expert: (order [A], token of each row [A], rows per
  expert int32 [E]). ``ids`` int [B,T,X]."""
  flat = ids.reshape(-1)
  order = jnp.argsort(flat, stable=True)
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  return order, order // ids.shape[-1], sizes


def expert_mlp(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array,
               w_up: jax.Array, w_down: jax.Array) -> jax.Array:
  """SwiGLU experts on the sorted assignments (grouped matmuls).

  Args:
    x [B,T,D]; weights [B,T,X]; ids int [B,T,X]; w_gate, w_up [E,D,F]; w_down [E,F,D]
      (F = moe_intermediate_size here).
  Returns:
    [B,T,D] = sum over the X chosen experts of weight · down(silu(gate(x)) · up(x)).
  """
  B, T, D = x.shape
  X = ids.shape[-1]
  with jax.named_scope("dispatch"):
    order, token, sizes = _sort_by_expert(ids, w_gate.shape[0])
    rows = jnp.take(x.reshape(B * T, D), token, axis=0)  # [A,D]
  with jax.named_scope("experts"):
    gate = jax.lax.ragged_dot(rows, w_gate, sizes)  # [A,F]
    up = jax.lax.ragged_dot(rows, w_up, sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, sizes)  # [A,D]
  with jax.named_scope("combine"):
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    out = jnp.take(out, inverse, axis=0).reshape(B, T, X, D)
    return jnp.einsum("btxd,btx->btd", out, weights)


def load_balancing_loss(router_logits: jax.Array, top_k: int,
                        mask: jax.Array | None = None) -> jax.Array:
  """Switch-style auxiliary loss over all MoE layers, as ``transformers`` computes it.

  ``E · sum_e f_e · p_e`` with f_e the fraction of (token, layer) assignments to expert e
  (counting all X choices, so sum_e f_e = X) and p_e the mean router probability of e, both
  averaged over every valid token of every layer. Multiply by ``cfg.router_aux_loss_coef``.

  Args:
    router_logits: float32 [Y,B,T,E] (``Routing.logits``). top_k: X.
    mask: optional bool [B,T] of valid tokens (padding excluded).
  Returns:
    float32 scalar.
  """
  Y, B, T, E = router_logits.shape
  probs = jax.nn.softmax(router_logits.astype(jnp.float32), axis=-1)
  _, ids = jax.lax.top_k(probs, top_k)
  chosen = jnp.sum(jax.nn.one_hot(ids, E, dtype=jnp.float32), axis=-2)  # [Y,B,T,E]
  w = jnp.ones((B, T), jnp.float32) if mask is None else mask.astype(jnp.float32)
  rows = Y * jnp.sum(w)
  f = jnp.einsum("ubte,bt->e", chosen, w) / rows
  p = jnp.einsum("ubte,bt->e", probs, w) / rows
  return E * jnp.sum(f * p)
