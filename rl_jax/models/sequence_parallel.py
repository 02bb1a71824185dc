"""Sequence parallelism for grouped responses: the work of one long row split along length.

Taken only while tracing inside ``sharding.use`` with a mesh whose ``sequence`` axis has
size S > 1 and whose rules map the activations' ``length`` axis to ``sequence``; otherwise
``plan`` returns None and the callers in ``grouped.py`` run their single-shard code unchanged.

Packed (prompt-once) layout, shard-major row: shard s of the ``sequence`` axis holds a
contiguous chunk of the row made of prompt tokens s·P/S .. (s+1)·P/S − 1 followed by the
M/S responses s·M/S .. (s+1)·M/S − 1 (R tokens each)::

    [prompt chunk 0][resp 0 .. M/S−1] ... [prompt chunk S−1][resp M−M/S .. M−1]

so the activations' plain length sharding gives every shard its prompt slice and its own
responses. Per-token work (projections, MLP, norms, RoPE by explicit positions) does not care
about the order. Attention runs per shard under ``jax.shard_map``: the prompt K/V (the
context) is all-gathered over ``sequence``; the shard's prompt queries attend causally to
it and its responses run the shared-prefix attention against it and their own keys. The
backward of the all-gather is a reduce-scatter of the context dK/dV.

Replicated layout: G·M rows of P + R tokens with queries split along length over
``sequence`` and the keys/values gathered, so the score matrices are split by query rows.

Axis letters: the legend of ``rl_jax/__init__.py``; here S is the size of the
``sequence`` mesh axis and Pl = P/S, Ml = M/S the per-shard prompt and response counts.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec

from rl_jax import sharding
from rl_jax.models import transformer as tx

import pallas_kernels

__all__ = ["Plan", "gather_context", "packed_attend", "packed_rows", "plan", "replicated_attend",
           "split_packed", "token_rows"]

_AXIS = "sequence"


@dataclasses.dataclass(frozen=True)
class Plan:
  """An active sequence-parallel split: the mesh, the rules and S = mesh.shape['sequence']."""

  mesh: Any
  rules: sharding.Rules
  S: int

  def spec(self, axes, shape) -> PartitionSpec:
    return sharding.logical_to_spec(axes, self.rules, self.mesh, shape)

  def constrain(self, x, spec: PartitionSpec):
    return jax.lax.with_sharding_constraint(x, NamedSharding(self.mesh, spec))


def plan(length: int, divisible=()) -> Plan | None:
  """The active split for a row of ``length`` tokens, or None (single-shard path).

  None unless tracing inside ``sharding.use`` on a mesh with ``sequence`` > 1, the rules put
  exactly ``sequence`` on the activations' ``length`` axis, and S divides ``length`` and
  every number in ``divisible``.
  """
  active = sharding.active()  # the (mesh, rules) pinned by sharding.use, if any
  if active is None:
    return None
  mesh, rules = active
  S = int(mesh.shape.get(_AXIS, 1))
  if S <= 1 or rules.lookup("length") != (_AXIS,):
    return None
  if any(n % S for n in (length, *divisible)):
    return None
  return Plan(mesh, rules, S)


# ------------------------------------------------------------------------------ packed layout
def packed_rows(prompt: jax.Array, responses: jax.Array, S: int) -> jax.Array:
  """Shard-major packed row. prompt [G,P,...], responses [G,M,R,...] -> [G,P+M·R,...]."""
  G, P = prompt.shape[:2]
  M, R = responses.shape[1:3]
  rest = prompt.shape[2:]
  p = prompt.reshape(G, S, P // S, *rest)
  r = responses.reshape(G, S, (M // S) * R, *rest)
  return jnp.concatenate([p, r], axis=2).reshape(G, P + M * R, *rest)


def split_packed(h: jax.Array, P: int, M: int, R: int, S: int) -> tuple[jax.Array, jax.Array]:
  """Inverse of ``packed_rows``: [G,P+M·R,...] -> prompt [G,P,...], responses [G,M,R,...]."""
  G, rest = h.shape[0], h.shape[2:]
  Pl = P // S
  h = h.reshape(G, S, Pl + (M // S) * R, *rest)
  return h[:, :, :Pl].reshape(G, P, *rest), h[:, :, Pl:].reshape(G, M, R, *rest)


def _head_specs(pl: Plan, q_shape, k_shape):
  """Specs of q [G,T,N,H], k/v [G,T,K,H] and lengths [G] for the per-shard attention."""
  qs = pl.spec(("batch", "length", "act_heads", None), q_shape)
  ks = pl.spec(("batch", "length", "act_kv_heads", None), k_shape)
  heads = qs[2] if qs[2] == ks[2] else None  # GQA groups must stay whole on every shard
  batch = qs[0]
  q_spec = PartitionSpec(batch, _AXIS, heads, None)
  k_spec = PartitionSpec(batch, _AXIS, heads, None)
  return q_spec, k_spec, PartitionSpec(batch)


def gather_context(x: jax.Array) -> jax.Array:
  """Inside ``shard_map``: the shards' [G,Pl,K,H] context slices -> the whole [G,P,K,H]."""
  return jax.lax.all_gather(x, _AXIS, axis=1, tiled=True)


def packed_attend(pl: Plan, prompt_lengths: jax.Array, P: int, M: int, R: int):
  """AttendFn for the shard-major packed row (see the module docstring).

  q [G,P+M·R,N,H], k and v [G,P+M·R,K,H] -> [G,P+M·R,N,H], each shard computing the
  attention of its own prompt slice and its own M/S responses.
  """
  S = pl.S
  Pl, Ml = P // S, M // S

  def local(q, k, v, lengths):
    G = q.shape[0]
    k_ctx, v_ctx = gather_context(k[:, :Pl]), gather_context(v[:, :Pl])
    pos_q = jax.lax.axis_index(_AXIS) * Pl + jnp.arange(Pl)
    pos_k = jnp.arange(P)
    mask = ((pos_k[None, None, :] <= pos_q[None, :, None])
            & (pos_k[None, :] < lengths[:, None])[:, None, :])
    out_p = tx.dense_attention(q[:, :Pl], k_ctx, v_ctx, mask)
    split = lambda a: a[:, Pl:].reshape(G, Ml, R, *a.shape[2:])
    out_r = pallas_kernels.shared_prefix_attention(split(q), k_ctx, v_ctx, split(k), split(v),
                                                   ctx_lengths=lengths)
    return jnp.concatenate([out_p, out_r.reshape(G, Ml * R, *out_r.shape[3:])], axis=1)

  def attend(q, k, v, state):
    q_spec, k_spec, l_spec = _head_specs(pl, q.shape, k.shape)
    fn = jax.shard_map(local, mesh=pl.mesh, in_specs=(q_spec, k_spec, k_spec, l_spec),
                       out_specs=q_spec)
    return fn(q, k, v, prompt_lengths.astype(jnp.int32)), state

  return attend


def token_rows(pl: Plan, h: jax.Array, targets: jax.Array) -> tuple[jax.Array, jax.Array]:
  """[G,M,R,D] hidden and [G,M,R] targets -> [G·S, Ml·R, ...] rows, one block per shard.

  The log-prob pass scans its token chunks along the row; splitting the row into S rows
  whose leading axis is sharded over (batch axes, sequence) keeps the LM head on each
  shard's own responses.
  """
  G, M, R, D = h.shape
  batch = pl.spec(("batch",), (G,))[0]
  batch = () if batch is None else (batch if isinstance(batch, tuple) else (batch,))
  rows = PartitionSpec((*batch, _AXIS))
  h = pl.constrain(h.reshape(G * pl.S, (M // pl.S) * R, D), PartitionSpec(*rows, None, None))
  t = pl.constrain(targets.reshape(G * pl.S, (M // pl.S) * R), PartitionSpec(*rows, None))
  return h, t


# ------------------------------------------------------------------------------ replicated
def replicated_attend(pl: Plan, mask: jax.Array):
  """AttendFn for [B,T] rows: queries (and the mask's query rows) split along length over
  ``sequence``, keys and values gathered whole. q [B,T,N,H], k/v [B,T,K,H], mask [B,T,T]."""

  def attend(q, k, v, state):
    q_spec, k_spec, _ = _head_specs(pl, q.shape, k.shape)
    kv_spec = PartitionSpec(k_spec[0], None, k_spec[2], None)
    k, v = pl.constrain(k, kv_spec), pl.constrain(v, kv_spec)
    m = pl.constrain(mask, PartitionSpec(q_spec[0], _AXIS, None))
    out = tx.dense_attention(pl.constrain(q, q_spec), k, v, m)
    return pl.constrain(out, q_spec), state

  return attend
