"""Mixture-of-experts MLP (Qwen3-MoE): softmax router, top-X experts per token, grouped matmuls.

Axis letters: the legend of ``rl_jax/__init__.py`` (E experts, X experts per token,
Y layers with experts); here A = B·T·X (token, expert) assignments.

Routing: ``softmax(x W_r)`` in float32 over the E experts, the X largest kept, optionally
renormalised to sum to one (``norm_topk_prob``). Router replay: given expert ids (e.g. those
the sampler recorded), the same experts are used and their weights are recomputed from the
current router's probabilities of exactly those experts (renormalised over them when
``norm_topk_prob``), so gradients still reach the router. A token whose given ids are -1
(nothing recorded: prompt tokens, a response's last token) is routed by the router itself.

Dispatch (dropless, ``expert_mlp``; capacity factor 0): every (token, expert) assignment is
one row; rows are sorted by expert so each expert's rows are contiguous, and the three
expert matmuls are ``jax.lax.ragged_dot`` over those groups: compute is proportional to A
(with a native grouped matmul, see Lowering), no [tokens, E] one-hot, no capacity and no
dropped tokens. Outputs are put back in token order and summed over each token's X experts
with its routing weights. Dropless by design: training and sampling route every token exactly
as the router says (what router replay needs). The price is static shapes sized for the worst
case: a buffer holds all A rows whatever the balance.

Lowering: on TPU and GPU ``ragged_dot`` is a native grouped matmul (work ∝ A). On CPU JAX
lowers it to one masked dense matmul per expert over all A rows, E times the active FLOPs;
the numbers are equal, only the cost differs (``tests/test_moe_sharding.py`` measures it).

Sharding (expert parallelism): the ``expert`` logical axis of the weights [Y,E,D,F] maps to
the ``fsdp`` mesh axis (``rl_jax/sharding.py``), so n devices hold E/n experts each; tokens
stay batch-sharded outside the layer. Which of the two moves, tokens or weights, follows the
batch's size (``_moves_tokens``):

* A small batch (the sampler's decode and prefill: the step's A rows and activations,
  A·(D + 2F) words, fewer than the layer's 3·E·D·F expert weights) moves its tokens to the
  experts inside ``jax.shard_map`` (``_local_experts_mlp``): the tokens of the n devices
  that together hold every expert are all-gathered with their routing, each device runs
  its own E/n experts over the assignments that chose them (sorted ahead of the others,
  which are masked to zero), and each token's weighted sum is reduce-scattered back to the
  device that holds it. Per layer and device that moves N·D words in and out (N: the
  expert group's tokens). XLA's TPU partitioner, left to itself, all-gathers every expert
  weight of the grouped matmuls instead (compiled for v5e, ``tests/test_tpu_compile.py``):
  at Qwen3-30B-A3B's shape, the whole model's experts on every chip at every decode step.
* A large batch (a learner's micro-batch of long sequences) is left to XLA's partitioner.
  As compiled on 8 fake CPU devices (``tests/test_moe_sharding.py``), it partitions the
  grouped matmuls along the expert axis: the routing (ids, probabilities, group sizes) is
  all-gathered, the dispatched rows [A,D] are all-reduced (each device sees every
  assignment), each device runs its own experts, and the partial matmul outputs ([A,F]
  gate/up, [A,D] down) are summed with all-reduces, at A·(2D + 2F) words per device per
  layer. The token path would hold every assignment's [A,F] activations on every device
  there, n times a device's share. On TPU this is the weight-gathering partition above, as
  an FSDP learner gathers its other weights.

Neither drops a token or changes a number beyond float rounding (the order of the sum over
a token's experts). The capacity path below moves only ~capacity_factor·A/n rows per device
by all-to-all, at the price of dropping overflow.

Capacity and expert-parallel dispatch (``capacity_factor`` > 0, config field
``model.moe_capacity_factor``): the tokens are cut into shards (on a mesh, the shards of the
batch along the mesh axes that hold the experts; without one, a single shard). Each shard may
send at most C = ceil(capacity_factor · N · X / E) assignments to each expert (N: the shard's
tokens). Priority is by position: the shard's assignments in row-major (token, choice) order,
so an earlier token wins a full expert over a later one, and a token's first choice over its
second. An assignment past its expert's C is dropped: it contributes zero to the token's
output (the residual stream passes it unchanged); the token's other experts still add their
weighted outputs, the weights are not renormalised. Dispatch is sort based: the shard's
assignments are stably sorted by expert, which gives every assignment its rank within its
expert, and the buffer [E,C,D] is gathered from those ranks (no [tokens, E] one-hot). The
buffers of the n shards of an expert group are exchanged with one all-to-all inside
``jax.shard_map``, each device runs its E/n experts as a dense batched matmul over
[E/n, n·C, D] (FLOPs ∝ capacity: ≈ capacity_factor × the active share), and a second
all-to-all returns the outputs, combined with the routing weights where they came from. The
dropped count is returned (the trainer's metric ``moe_dropped_tokens``). Router replay is
unchanged: the replayed ids choose the dispatch. The samplers (rollout and agent engines,
speculative verification) always use the dropless path; the capacity applies to the
trainer's passes (the supervised stage included).

References: Shazeer et al. 2017 (sparsely-gated MoE); Lepikhin et al. 2020 (GShard: expert
capacity and all-to-all dispatch); Fedus et al. 2021 (Switch Transformer, the capacity factor
and the load-balancing loss).
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from rl_jax import sharding

__all__ = ["ROUTERS", "Routing", "capacity", "capacity_mlp", "expert_mlp", "load_balancing_loss",
           "route"]

ROUTERS = ("softmax_topk",)  # routing schemes (``model.router``): softmax, top X


class Routing(NamedTuple):
  """Router outputs of the Y MoE layers of one pass.

  Attributes:
    ids: int32 [Y,B,T,X] experts chosen for every token (replay them with ``routing=ids``;
      -1 rows in a replayed routing are routed by the router).
    logits: float32 [Y,B,T,E] router logits (for ``load_balancing_loss``).
    dropped: float32 [Y] fraction of each layer's assignments dropped for capacity (zeros on
      the dropless path; None where not computed).
  """

  ids: jax.Array
  logits: jax.Array
  dropped: jax.Array | None = None


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
  y = _expert_parallel_mlp(x, weights, ids, w_gate, w_up, w_down)
  if y is not None:
    return y
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


def _axes(entry) -> tuple[str, ...]:
  return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def _local_experts_mlp(x, weights, ids, w_gate, w_up, w_down, gather_axes, ep_axes,
                       sum_axes):
  """One device's share of the dropless MLP when the tokens move to the experts (inside
  ``jax.shard_map``).

  The tokens of the devices that together hold all E experts are all-gathered over
  ``gather_axes`` (whose order does not matter: the reduce-scatter below returns every
  device its own rows). This device runs its E/n experts (``ep_axes``: the mesh axes of the
  expert dim, in the weights' order) over the (token, expert) assignments that chose them,
  with the other assignments sorted behind its groups and masked to zero; each token's
  weighted sum over its local experts is then summed over the expert group and the expert
  width's axes (``sum_axes``) and scattered back over ``gather_axes``.

  Args (local shards): x [..,D]; weights, ids [..,X]; w_gate, w_up [E/n,D,F']; w_down
    [E/n,F',D] (F' = F over the width's mesh axes).
  Returns:
    [..,D] this device's tokens' MLP output.
  """
  D, X = x.shape[-1], ids.shape[-1]
  lead = x.shape[:-1]
  x, weights, ids = x.reshape(-1, D), weights.reshape(-1, X), ids.reshape(-1, X)
  if gather_axes:
    x, weights, ids = (jax.lax.all_gather(a, gather_axes, axis=0, tiled=True)
                       for a in (x, weights, ids))
  E_local = w_gate.shape[0]
  local = ids - jax.lax.axis_index(ep_axes) * E_local
  mine = (local >= 0) & (local < E_local)  # [N,X]
  with jax.named_scope("dispatch"):
    order, token, sizes = _sort_by_expert(jnp.where(mine, local, E_local), E_local + 1)
    rows = jnp.take(x, token, axis=0)  # [A,D]: this device's assignments first, by expert
  with jax.named_scope("experts"):
    sizes = sizes[:E_local]
    gate = jax.lax.ragged_dot(rows, w_gate, sizes)
    up = jax.lax.ragged_dot(rows, w_up, sizes)
    out = jax.lax.ragged_dot(jax.nn.silu(gate) * up, w_down, sizes)  # [A,D]
  with jax.named_scope("combine"):
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))
    out = jnp.take(out, inverse, axis=0).reshape(*ids.shape, D)
    out = jnp.where(mine[..., None], out, jnp.zeros((), out.dtype))
    y = jnp.einsum("nxd,nx->nd", out, weights)
    if sum_axes:
      y = jax.lax.psum(y, sum_axes)
    if gather_axes:
      y = jax.lax.psum_scatter(y, gather_axes, scatter_dimension=0, tiled=True)
  return y.reshape(*lead, D)


def _moves_tokens(tokens: int, top_k: int, w_gate: jax.Array) -> bool:
  """Whether the dropless MLP moves the tokens to the experts rather than leaving the layer
  to XLA: when the rows and activations a device holds for every assignment of the step
  (A·(D + 2F) for A = tokens·X) are fewer than the layer's expert weights (3·E·D·F), as in
  the sampler's decode and prefill; a learner's batch of long sequences stays with XLA."""
  E, D, F = w_gate.shape
  return tokens * top_k * (D + 2 * F) < 3 * E * D * F


def _expert_parallel_mlp(x, weights, ids, w_gate, w_up, w_down):
  """``_local_experts_mlp`` under ``jax.shard_map`` on the active mesh, or None where it does
  not apply: no mesh, experts not split over it, a batch too large (``_moves_tokens``), or
  the expert width on a mesh axis that also splits the tokens."""
  active = sharding.active()
  if active is None or active[0].size == 1:
    return None
  mesh, rules = active
  x_spec = sharding.logical_to_spec(("batch", "length", None), rules, mesh, x.shape)
  w_spec = sharding.logical_to_spec(("expert", None, "mlp"), rules, mesh, w_gate.shape)
  ep_axes, mlp_axes = _axes(w_spec[0]), _axes(w_spec[2])
  token_axes = _axes(x_spec[0]) + _axes(x_spec[1])
  if (all(mesh.shape[a] == 1 for a in ep_axes) or set(mlp_axes) & set(token_axes)
      or not _moves_tokens(math.prod(x.shape[:-1]), ids.shape[-1], w_gate)):
    return None
  gather_axes = tuple(a for a in token_axes if a in ep_axes)
  sum_axes = tuple(a for a in ep_axes if a not in token_axes) + mlp_axes
  body = lambda *a: _local_experts_mlp(*a, gather_axes=gather_axes, ep_axes=ep_axes,
                                       sum_axes=sum_axes)
  return jax.shard_map(body, mesh=mesh,
                       in_specs=(x_spec, x_spec, x_spec, w_spec, w_spec,
                                 P(w_spec[0], w_spec[2], None)),
                       out_specs=x_spec)(x, weights, ids, w_gate, w_up, w_down)


def capacity(tokens: int, top_k: int, num_experts: int, capacity_factor: float) -> int:
  """C = ceil(capacity_factor · tokens · X / E), at least 1: a shard's slots per expert (the
  1e-9 keeps float rounding of an exact product from adding a slot)."""
  return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts - 1e-9))


def _ranks(ids: jax.Array, num_experts: int, cap: int):
  """Sort-based slot assignment of one shard's assignments in priority (row-major) order.

  Args:
    ids int [N,X]; num_experts: E; cap: C.
  Returns:
    rank int32 [N,X]: position of each assignment in its expert's queue (kept iff < C);
    source int32 [E,C]: the flat assignment (token·X + choice) filling each slot; filled bool
    [E,C]: whether the slot is used.
  """
  flat = ids.reshape(-1)
  A = flat.shape[0]
  order = jnp.argsort(flat, stable=True).astype(jnp.int32)
  sizes = jnp.bincount(flat, length=num_experts).astype(jnp.int32)
  starts = jnp.cumsum(sizes) - sizes  # [E] first sorted row of each expert
  rank_sorted = jnp.arange(A, dtype=jnp.int32) - starts[flat[order]]
  rank = jnp.zeros((A,), jnp.int32).at[order].set(rank_sorted, unique_indices=True)
  slot = jnp.arange(cap, dtype=jnp.int32)
  filled = slot[None, :] < sizes[:, None]
  source = order[jnp.minimum(starts[:, None] + slot[None, :], A - 1)]
  return rank.reshape(ids.shape), source, filled


def _dispatch(x: jax.Array, ids: jax.Array, num_experts: int, cap: int):
  """x [N,D], ids int [N,X] -> (buffer [E,C,D] of each expert's kept tokens, zeros in empty
  slots; rank int32 [N,X])."""
  rank, source, filled = _ranks(ids, num_experts, cap)
  rows = jnp.take(x, source // ids.shape[-1], axis=0)  # [E,C,D]
  return jnp.where(filled[..., None], rows, jnp.zeros((), x.dtype)), rank


def _combine(out: jax.Array, ids: jax.Array, rank: jax.Array, weights: jax.Array) -> jax.Array:
  """out [E,C,D] expert outputs; ids, rank int [N,X]; weights [N,X] -> [N,D] = sum over the
  kept assignments of weight · output (a dropped assignment adds zero)."""
  E, C, D = out.shape
  kept = rank < C
  rows = jnp.take(out.reshape(E * C, D), ids * C + jnp.minimum(rank, C - 1), axis=0)  # [N,X,D]
  return jnp.einsum("nxd,nx->nd", rows, jnp.where(kept, weights, jnp.zeros((), weights.dtype)))


def _swiglu_experts(buf: jax.Array, w_gate: jax.Array, w_up: jax.Array,
                    w_down: jax.Array) -> jax.Array:
  """Dense batched SwiGLU over each expert's slots: buf [E,S,D], w_gate/w_up [E,D,F],
  w_down [E,F,D] -> [E,S,D] (2·E·S·D·F·3 FLOPs)."""
  gate = jnp.einsum("esd,edf->esf", buf, w_gate)
  up = jnp.einsum("esd,edf->esf", buf, w_up)
  return jnp.einsum("esf,efd->esd", jax.nn.silu(gate) * up, w_down)


def _shard_mlp(x, weights, ids, w_gate, w_up, w_down, capacity_factor, ep_axes=None,
               mlp_axes=None):
  """One shard's capacity MLP: x [..,D], weights/ids [..,X] -> ([..,D], dropped int32).

  With ``ep_axes`` (inside ``shard_map``) the local weights hold E/n of the experts and the
  expert buffers go through all-to-all over those mesh axes; ``mlp_axes``: the mesh axes the
  expert width F is split over (the down matmul's partial sums are psum-ed).
  """
  D, X = x.shape[-1], ids.shape[-1]
  lead = x.shape[:-1]
  x, ids, weights = x.reshape(-1, D), ids.reshape(-1, X), weights.reshape(-1, X)
  E_local = w_gate.shape[0]
  n = 1 if ep_axes is None else jax.lax.axis_size(ep_axes)
  E = E_local * n
  cap = capacity(x.shape[0], X, E, capacity_factor)
  with jax.named_scope("dispatch"):
    buf, rank = _dispatch(x, ids, E, cap)  # [E,C,D]
    if n > 1:  # [n (expert device), E/n, C, D] -> [n (source shard), E/n, C, D]
      buf = jax.lax.all_to_all(buf.reshape(n, E_local, cap, D), ep_axes, 0, 0, tiled=True)
      buf = jnp.swapaxes(buf, 0, 1).reshape(E_local, n * cap, D)
  with jax.named_scope("experts"):
    out = _swiglu_experts(buf, w_gate, w_up, w_down)  # [E/n, n·C, D]
    if mlp_axes:
      out = jax.lax.psum(out, mlp_axes)
  with jax.named_scope("combine"):
    if n > 1:
      out = jnp.swapaxes(out.reshape(E_local, n, cap, D), 0, 1)
      out = jax.lax.all_to_all(out, ep_axes, 0, 0, tiled=True).reshape(E, cap, D)
    y = _combine(out, ids, rank, weights)
  return y.reshape(*lead, D), jnp.sum(rank >= cap).astype(jnp.int32)


def capacity_mlp(x: jax.Array, weights: jax.Array, ids: jax.Array, w_gate: jax.Array,
                 w_up: jax.Array, w_down: jax.Array, capacity_factor: float):
  """SwiGLU experts with a per-expert capacity, expert parallel on the active mesh.

  Inside ``sharding.use`` on a mesh whose rules shard the expert axis (``expert``) of the
  weights, and whose batch split covers those mesh axes, runs in ``jax.shard_map``: each
  device dispatches its own tokens, all-to-all to the experts' devices and back (module
  docstring). Elsewhere (no mesh, or the batch not split over the expert axes) the whole
  batch is one shard, same arithmetic without collectives.

  Args:
    x [B,T,D]; weights [B,T,X]; ids int [B,T,X]; w_gate, w_up [E,D,F]; w_down [E,F,D];
    capacity_factor > 0.
  Returns:
    ([B,T,D], dropped int32 scalar: assignments dropped over all shards).
  """
  run = lambda *a, **kw: _shard_mlp(*a, capacity_factor=capacity_factor, **kw)
  active = sharding.active()
  if active is None or active[0].size == 1:
    return run(x, weights, ids, w_gate, w_up, w_down)
  mesh, rules = active
  x_spec = sharding.logical_to_spec(("batch", "length", None), rules, mesh, x.shape)
  w_spec = sharding.logical_to_spec(("expert", None, "mlp"), rules, mesh, w_gate.shape)
  ep_axes, mlp_axes = _axes(w_spec[0]), _axes(w_spec[2])
  token_axes = _axes(x_spec[0]) + _axes(x_spec[1])
  if not ep_axes or not set(ep_axes) <= set(token_axes):
    return run(x, weights, ids, w_gate, w_up, w_down)
  down_spec = P(w_spec[0], w_spec[2], None)
  body = lambda *a: (lambda y, d: (y, jax.lax.psum(d, token_axes)))(
      *run(*a, ep_axes=ep_axes, mlp_axes=mlp_axes))
  return jax.shard_map(body, mesh=mesh, in_specs=(x_spec, x_spec, x_spec, w_spec, w_spec,
                                                  down_spec),
                       out_specs=(x_spec, P()))(x, weights, ids, w_gate, w_up, w_down)


def load_balancing_loss(router_logits: jax.Array, top_k: int,
                        mask: jax.Array | None = None) -> jax.Array:
  """Switch-style auxiliary loss over all MoE layers, as ``transformers`` computes it.

  ``E · sum_e f_e · p_e`` with f_e the fraction of (token, layer) assignments to expert e
  (counting all X choices, so sum_e f_e = X) and p_e the mean router probability of e, both
  averaged over every valid token of every layer. Only p carries a gradient (to the router
  weights and, through the router's input, the layers below). The trainer multiplies it by
  ``model.router_aux_loss_coef`` (``rl_jax.train.steps``; off by default).

  Args:
    router_logits: float32 [Y,B,T,E] (``Routing.logits``). top_k: X.
    mask: optional bool [B,T] of valid tokens (padding excluded), or float [B,T] token
      weights (a token of weight k counts as k copies).
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
