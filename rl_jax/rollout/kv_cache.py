"""Device state of the sampler's slots: the prompt-once KV cache layout and token records.

Axis letters: the legend of ``rl_jax/__init__.py`` (here G group slots, M samples
per slot, P prefix (prompt) cache length, R response (suffix) cache length, L layers,
K kv heads, H head dim).

Each slot g holds one prompt, prefilled once into the prefix cache ``prefix_k/v`` (L arrays
per layer: keys [G,K,H,P], values [G,K,P,H]), and M samples whose own response K/V lives on
pages of the response pool ``suffix_k/v`` (L arrays per layer: keys [Pg,K,H,S], values
[Pg,K,S,H]) through the page table ``pages`` [G,M,NP] (``rl_jax.rollout.pages``: pages are
taken as tokens are written and returned when the group leaves its slot). Kv heads stay ahead
of the length and head axes, and keys keep the cache length last, so both of the decode
query's products are plain [rows, contracted] x [contracted, columns] matmuls: q·K contracts
the head dim H, p·V the cache length (``decode.decode_attention``); on XLA's CPU backend keys
stored [.., R, H] made the decode attention 1.5-2x slower per layer
(``scripts/bench_decode_attention.py``). Page size S = R (one page per sample) is the
worst-case slot layout.

Sharding: caches carry logical axes (``CACHE_AXES``): slots over ``batch`` (data/fsdp), kv
heads over ``act_kv_heads`` (tensor), the prompt cache's length over ``kv_length``
(sequence). The response pool's pages are split over the same devices as the slots
(``pool_shards``: D shards, each holding the pages of its own slots' samples, ``pages``'
"Shards"), and each slot shard's pages over the ``kv_length`` (sequence) axis as well
(``sequence_shards``: Q, a sample's table entries round-robin over them), and its kv heads
over ``tensor``, so a device holds 1/(D·Q) of the pool.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import models, sharding
from rl_jax.models.config import ModelConfig
from rl_jax.rollout import pages, sampling

__all__ = ["CACHE_AXES", "EOS", "LENGTH", "REASON_NAMES", "RUNNING", "STOP", "TRACE_COUNTS",
           "DecodeState", "cast_leaf", "cast_params", "constrain_state", "empty_routing",
           "fork_rows", "fork_samples", "grow_pool", "hold_pages", "init_state", "kv_cache_bytes",
           "mesh_context", "pool_bytes", "pool_page_axes", "pool_shards", "record",
           "sampler_storage", "sequence_axes",
           "sequence_shards", "state_shards", "release_slots", "resize_pool", "SamplerParams"]

# Number of times each jitted entry point was traced (a retrace means a recompile).
TRACE_COUNTS: collections.Counter = collections.Counter()

# finish-reason codes stored in DecodeState.reason
RUNNING, EOS, STOP, LENGTH = 0, 1, 2, 3
REASON_NAMES = {RUNNING: "running", EOS: "eos", STOP: "stop", LENGTH: "length"}


class DecodeState(NamedTuple):
  """Device state of all slots (a pytree; every field has a logical-axes entry).

  Attributes:
    prefix_k, prefix_v: tuples of L arrays, prompt K/V, one copy per slot: keys [G,K,H,P],
      values [G,K,P,H].
    prefix_len: int32 [G] prompt length of each slot.
    suffix_k, suffix_v: tuples of L arrays, the response page pool: keys [Pg,K,H,S],
      values [Pg,K,S,H] (response token j of sample (g, m) on page ``pages[g,m,j // S]`` at
      offset ``j % S``).
    tokens: int32 [G,M,R] response tokens (index j = j-th generated token).
    logprobs: float32 [G,M,R] behaviour log-prob of each token.
    versions: int32 [G,M,R] policy version that sampled each token.
    length: int32 [G,M] tokens generated so far (the last one is not yet in the cache).
    budget: int32 [G,M] maximum response length of each sample.
    reason: int32 [G,M] RUNNING, EOS, STOP or LENGTH.
    active: bool [G] slot holds a group.
    request_id: int32 [G]; sample_id: int32 [G,M] (PRNG stream identifiers).
    stream: uint32 [G,M,2] key words of each sample's random stream.
    routing: mixture-of-experts models: int32 [G,M,R,Y,X] the experts each MoE layer chose
      for response token j when the decode step (or, for a turn's last model token,
      ``extend``) fed it (-1 until then, for the last token, which is never fed, and for a
      multi-turn trajectory's observation tokens); None for dense models.
    pages: int32 [G,M,NP] page table (NP = R / S; -1 = no page yet).
    refs: int32 [D·Q,Pl] table entries naming each pool page (0 = free), per pool shard
      (``pool_shards`` D times ``sequence_shards`` Q; Pg = D·Q·Pl; page ``s·Pl + i`` is
      entry i of shard s).
    skip: int32 [G,M] leading response positions that hold prompt ids on the sample's
      pages (a prompt on pool pages: ``RolloutEngine(prompt_pages=True)``) rather than
      sampled tokens: the token at index j draws its uniform at index j - skip of its
      stream and stop sequences match from index skip on, so the sample draws the tokens
      it draws with its whole prompt in the slot's cache.
  """

  prefix_k: jax.Array
  prefix_v: jax.Array
  prefix_len: jax.Array
  suffix_k: jax.Array
  suffix_v: jax.Array
  tokens: jax.Array
  logprobs: jax.Array
  versions: jax.Array
  length: jax.Array
  budget: jax.Array
  reason: jax.Array
  active: jax.Array
  request_id: jax.Array
  sample_id: jax.Array
  stream: jax.Array
  routing: jax.Array | None = None
  pages: jax.Array | None = None
  refs: jax.Array | None = None
  skip: jax.Array | None = None


CACHE_AXES = DecodeState(
    prefix_k=("batch", "act_kv_heads", None, "kv_length"),  # each layer's array
    prefix_v=("batch", "act_kv_heads", "kv_length", None),
    prefix_len=("batch",),
    suffix_k=pages.POOL_AXES,
    suffix_v=pages.POOL_AXES,
    tokens=("batch", None, None),
    logprobs=("batch", None, None),
    versions=("batch", None, None),
    length=("batch", None),
    budget=("batch", None),
    reason=("batch", None),
    active=("batch",),
    request_id=("batch",),
    sample_id=("batch", None),
    stream=("batch", None, None),
    routing=("batch", None, None, None, None),
    pages=("batch", None, None),
    refs=(None, None),
    skip=("batch", None),
)


def mesh_context(ctx):
  """``sharding.use(mesh, rules)`` for ``ctx = (mesh, rules)``; a no-op for None."""
  return sharding.use(*ctx) if ctx is not None else contextlib.nullcontext()


def _constrain(x, axes):
  if x is None:  # routing of a dense model
    return x
  if isinstance(x, tuple):  # per-layer caches
    return tuple(sharding.constrain(c, axes) for c in x)
  return sharding.constrain(x, axes)


def _slot_axes(G: int, active) -> str | tuple[str, ...] | None:
  """The mesh axes the ``batch`` rule splits G slots over (``sharding.logical_to_spec``)."""
  mesh, rules = active
  return sharding.logical_to_spec(("batch",), rules, mesh, (G,))[0]


def pool_shards(G: int, ctx=None) -> int:
  """D, the shards of the response pool: the number of devices the mesh's batch axes split
  the G slots over (``ctx`` = (mesh, rules), else the active ``sharding.use``; 1 off a mesh)."""
  active = ctx if ctx is not None else sharding.active()
  if active is None:
    return 1
  axes = _slot_axes(G, (active[0], sharding.get_rules(active[1])))
  axes = (axes,) if isinstance(axes, str) else (axes or ())
  return math.prod(active[0].shape[a] for a in axes)


def sequence_axes(G: int, active) -> tuple[str, ...]:
  """The mesh axes of the ``kv_length`` rule that the slots' batch axes leave free."""
  mesh, rules = active
  axes = sharding.logical_to_spec(("batch", "kv_length"), rules, mesh, (G, mesh.size))[1]
  return (axes,) if isinstance(axes, str) else tuple(axes or ())


def sequence_shards(G: int, ctx=None, entries: int | None = None) -> int:
  """Q, the sequence shards of each slot shard of the response pool: the devices of the
  mesh's ``kv_length`` (sequence) axes (``ctx`` = (mesh, rules), else the active
  ``sharding.use``; 1 off a mesh), when they divide a sample's ``entries`` if given (NP =
  R / S page-table entries; else 1: a budget of fewer pages than sequence devices is not
  split, and the pool is replicated over them). A sample's table entry e is served by
  sequence shard e mod Q (``pages.entry_shard``)."""
  active = ctx if ctx is not None else sharding.active()
  if active is None:
    return 1
  mesh = active[0]
  Q = math.prod(mesh.shape[a] for a in sequence_axes(G, (mesh, sharding.get_rules(active[1]))))
  return Q if entries is None or entries % Q == 0 else 1


def state_shards(state: DecodeState) -> tuple[int, int]:
  """(D, Q) of ``state``'s pool: its slot shards (``pool_shards`` of the active mesh) and
  the sequence shards of each (its reference counts have D·Q rows)."""
  D = pool_shards(state.tokens.shape[0])
  return D, state.refs.shape[0] // D


def pool_page_axes(G: int, active, seq: int = 1) -> tuple[str, ...]:
  """The mesh axes of the pool's page axis: the slots' batch axes, then, with ``seq`` Q > 1
  sequence shards, the sequence axes (shard ``d·Q + q`` on slot shard d's q-th sequence
  device)."""
  slot = _slot_axes(G, active)
  slot = (slot,) if isinstance(slot, str) else tuple(slot or ())
  return slot + (sequence_axes(G, active) if seq > 1 else ())


def _constrain_pool(pool: tuple, G: int, seq: int) -> tuple:
  """Each layer's pool with its pages over the slots' batch axes and, with ``seq`` Q > 1,
  the sequence axes (shard d·Q + q's pages on the q-th sequence device of slots ``d·G/D
  ..``: ``pool_shards``, ``sequence_shards``) and its kv heads over ``act_kv_heads``."""
  active = sharding.active()
  if active is None or active[0].size == 1:
    return pool
  mesh, rules = active
  heads = sharding.logical_to_spec(pages.POOL_AXES, rules, mesh, pool[0].shape)[1]
  spec = jax.sharding.PartitionSpec(pool_page_axes(G, active, seq) or None, heads, None, None)
  return tuple(jax.lax.with_sharding_constraint(p, jax.sharding.NamedSharding(mesh, spec))
               for p in pool)


def constrain_state(state: DecodeState) -> DecodeState:
  """Every field of ``state`` constrained to its ``CACHE_AXES`` sharding, the pool's pages
  to the slots' devices (``_constrain_pool``)."""
  out = DecodeState(*[_constrain(x, a) for x, a in zip(state, CACHE_AXES)])
  G = state.tokens.shape[0]
  Q = state_shards(state)[1]
  return out._replace(suffix_k=_constrain_pool(state.suffix_k, G, Q),
                      suffix_v=_constrain_pool(state.suffix_v, G, Q))


def pool_bytes(cfg: ModelConfig, pages: int, page_size: int) -> int:
  """Bytes of a response pool of ``pages`` pages of ``page_size`` tokens (K and V, all layers)."""
  return int(2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * page_size * pages
             * jnp.dtype(cfg.dtype).itemsize)


def kv_cache_bytes(cfg: ModelConfig, groups: int, samples: int, prompt_len: int,
                   response_len: int, prompt_once: bool = True) -> int:
  """Bytes of K and V held for ``groups`` prompts with ``samples`` responses each.

  Prompt-once keeps ``G·P + G·M·R`` token positions, replicated ``G·M·(P + R)``.
  """
  per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * jnp.dtype(cfg.dtype).itemsize
  if prompt_once:
    positions = groups * prompt_len + groups * samples * response_len
  else:
    positions = groups * samples * (prompt_len + response_len)
  return int(per_token * positions)


def record(state: DecodeState, tok, lp, take, version, sp: sampling.SamplingParams):
  """Append token ``tok`` [G,M] (log-prob ``lp``) to rows where ``take``; update reasons."""
  G, M, R = state.tokens.shape
  at = (jnp.arange(G)[:, None], jnp.arange(M)[None, :], jnp.where(take, state.length, R))
  # one entry per row written in place (rows not taken index R and are dropped)
  tokens = state.tokens.at[at].set(tok.astype(jnp.int32), mode="drop")
  logprobs = state.logprobs.at[at].set(lp.astype(jnp.float32), mode="drop")
  versions = state.versions.at[at].set(jnp.asarray(version, jnp.int32), mode="drop")
  length = state.length + take.astype(jnp.int32)
  sampled = length - state.skip  # prompt ids on the sample's pages are not sampled ones
  is_eos = jnp.any(tok[..., None] == sp.eos_ids, axis=-1)
  w = sp.stop_seqs.shape[-1]  # stop-sequence window (a local letter)
  window_idx = length[..., None] - w + jnp.arange(w)  # [G,M,w]
  window = jnp.take_along_axis(tokens, jnp.clip(window_idx, 0, R - 1), axis=-1)
  match = (sp.stop_seqs[None, None] < 0) | (window[:, :, None, :] == sp.stop_seqs[None, None])
  is_stop = jnp.any(jnp.all(match, axis=-1) & (sp.stop_lens > 0)
                    & (sp.stop_lens <= sampled[..., None]), axis=-1)
  reason = jnp.where(is_eos, EOS, jnp.where(is_stop, STOP, jnp.where(
      length >= state.budget, LENGTH, RUNNING)))
  reason = jnp.where(take, reason, state.reason)
  return state._replace(tokens=tokens, logprobs=logprobs, versions=versions, length=length,
                        reason=reason)


def _init_state(cfg: ModelConfig, G: int, M: int, P: int, R: int, S: int, Pg: int,
                identity: bool, D: int) -> DecodeState:
  L, K, H = cfg.num_layers, cfg.num_kv_heads, cfg.head_dim
  dt = jnp.dtype(cfg.dtype)
  NP = R // S
  layers = lambda shape: tuple(jnp.zeros(shape, dt) for _ in range(L))
  if identity:  # entry (g, m, p) owns page p·G·M + g·M + m of its shard for good
    table = pages.identity_table(G, M, NP, D)
    refs = jnp.broadcast_to((jnp.arange(Pg // D) < G // D * M * NP).astype(jnp.int32),
                            (D, Pg // D))
  else:
    table, refs = jnp.full((G, M, NP), -1, jnp.int32), jnp.zeros((D, Pg // D), jnp.int32)
  return DecodeState(
      prefix_k=layers((G, K, H, P)), prefix_v=layers((G, K, P, H)),
      prefix_len=jnp.ones((G,), jnp.int32),
      suffix_k=layers((Pg, K, H, S)), suffix_v=layers((Pg, K, S, H)),
      tokens=jnp.zeros((G, M, R), jnp.int32), logprobs=jnp.zeros((G, M, R), jnp.float32),
      versions=jnp.full((G, M, R), -1, jnp.int32), length=jnp.zeros((G, M), jnp.int32),
      budget=jnp.zeros((G, M), jnp.int32), reason=jnp.full((G, M), LENGTH, jnp.int32),
      active=jnp.zeros((G,), bool), request_id=jnp.zeros((G,), jnp.int32),
      sample_id=jnp.zeros((G, M), jnp.int32), stream=jnp.zeros((G, M, 2), jnp.uint32),
      routing=empty_routing(cfg, (G, M, R)), pages=table, refs=refs,
      skip=jnp.zeros((G, M), jnp.int32))


def empty_routing(cfg: ModelConfig, lead: tuple[int, ...]) -> jax.Array | None:
  """-1 routing records int32 [*lead,Y,X] of an MoE model (None for dense models)."""
  if not cfg.is_moe:
    return None
  return jnp.full((*lead, len(cfg.moe_layers), cfg.num_experts_per_tok), -1, jnp.int32)


@functools.partial(jax.jit, static_argnames=("cfg", "G", "M", "P", "R", "S", "pages",
                                             "identity", "ctx"))
def init_state(cfg: ModelConfig, G: int, M: int, P: int, R: int, ctx=None, *,
               S: int | None = None, pages: int | None = None,
               identity: bool = False) -> DecodeState:
  """Empty state for G slots of M samples, prefix length P, response length R.

  S: page size (default R: one page per sample); a power of two dividing R. pages: pool
  pages Pg (default G·M·R/S, every sample's whole budget), a multiple of the pool's shards
  D·Q (``pool_shards``, ``sequence_shards``: Pg / (D·Q) pages per device). Every table
  entry starts without a page and every page free; ``identity``: the table is
  ``pages.identity_table`` (entry (g, m, p) owns page ``p·G·M + g·M + m`` for good): a
  pool of every whole budget read in place, the programs' ``identity`` fast path; needs
  Pg >= G·M·NP.
  """
  TRACE_COUNTS["init_state"] += 1
  S = R if S is None else S
  Pg = G * M * (R // S) if pages is None else pages
  Q = sequence_shards(G, ctx, R // S)
  D = pool_shards(G, ctx) * Q
  if Pg % D:
    raise ValueError(f"a pool of {Pg} pages does not split over its {D} shards")
  if identity and Q > 1:
    raise ValueError("the identity page table keeps a sample's pages on one shard; a pool "
                     f"split over {Q} sequence shards takes them round-robin")
  with mesh_context(ctx):
    return constrain_state(_init_state(cfg, G, M, P, R, S, Pg, identity, D))


@functools.partial(jax.jit, static_argnames=("identity", "ctx"), donate_argnames=("state",))
def release_slots(state: DecodeState, rows, identity: bool = False, ctx=None) -> DecodeState:
  """Slots where ``rows`` (bool [G]) is True: pages back to the pool (an ``identity`` table
  keeps them), slot inactive."""
  TRACE_COUNTS["release_slots"] += 1
  with mesh_context(ctx):
    if identity:
      return constrain_state(state._replace(active=state.active & ~rows))
    table, refs = pages.release(state.pages, state.refs, rows)
    return constrain_state(state._replace(pages=table, refs=refs, active=state.active & ~rows))


@functools.partial(jax.jit, static_argnames=("identity", "ctx"), donate_argnames=("state",))
def fork_samples(state: DecodeState, slot, src, dst, cached, src_slot=None, given=None,
                 use_given=None, identity: bool = False, ctx=None) -> DecodeState:
  """Response K/V of sample ``dst`` of slot ``slot`` forked from sample ``src`` of slot
  ``src_slot`` (default ``slot``; on the same pool shard), or from the pages ``given``
  where ``use_given`` (a prefix cache's), its first ``cached`` positions (``pages.fork``:
  whole pages shared, the partial last page copied); rows int32 [F], padding rows with
  slot >= G. Tokens, lengths and the rest of the samples' records are the admission's;
  only the pages change."""
  TRACE_COUNTS["fork_samples"] += 1
  with mesh_context(ctx):
    return constrain_state(fork_rows(state, slot, src, dst, cached, identity, src_slot, given,
                                     use_given))


def fork_rows(state: DecodeState, slot, src, dst, cached, identity: bool, src_slot=None,
              given=None, use_given=None) -> DecodeState:
  """``fork_samples``' page work inside a caller's program (``pages.fork``, then the
  partial pages copied, ``pages.copy_pages``); the same arguments."""
  S = state.suffix_v[0].shape[2]
  table, refs, frm, to = pages.fork(state.pages, state.refs, slot, src, dst, cached, S,
                                    identity, state_shards(state)[1], src_slot, given,
                                    use_given)
  return state._replace(suffix_k=pages.copy_pages(state.suffix_k, frm, to),
                        suffix_v=pages.copy_pages(state.suffix_v, frm, to), pages=table,
                        refs=refs)


@functools.partial(jax.jit, static_argnames=("delta", "ctx"), donate_argnames=("state",))
def hold_pages(state: DecodeState, ids, delta: int, ctx=None) -> DecodeState:
  """``pages.hold`` on the state's reference counts: pool pages ``ids`` int32 [N] (entries
  >= Pg skipped) gain (``delta`` 1) or lose (-1) a holder that is no table entry."""
  TRACE_COUNTS["hold_pages"] += 1
  with mesh_context(ctx):
    return constrain_state(state._replace(refs=pages.hold(state.refs, ids, delta)))


@functools.partial(jax.jit, static_argnames=("pages_", "ctx"))
def resize_pool(state: DecodeState, pages_: int, ctx=None) -> DecodeState:
  """The response pool grown to ``pages_`` pages, each shard alike (new pages free; the
  pages in use keep their contents, their ids renumbered per shard: ``pages.regrown_ids``)."""
  TRACE_COUNTS["resize_pool"] += 1
  with mesh_context(ctx):
    D, old = state.refs.shape[0], state.refs.size
    refs = jnp.pad(state.refs, [(0, 0), (0, (pages_ - old) // D)])
    return constrain_state(state._replace(
        suffix_k=pages.grow(state.suffix_k, pages_, D),
        suffix_v=pages.grow(state.suffix_v, pages_, D), refs=refs,
        pages=pages.regrown_ids(state.pages, old, pages_, D)))


def grow_pool(state: DecodeState, want, most: int, ctx=None) -> DecodeState:
  """``state`` with its pool doubled (``pages.grown_size``, up to ``most`` pages) until
  ``want`` pages (int, or int [D] per shard) are free; unchanged when they are."""
  size = state.refs.size
  new = pages.grown_size(size, pages.free_pages(state.refs), want, most)
  return resize_pool(state, new, ctx=ctx) if new > size else state


def cast_leaf(x, dtype):
  """One parameter in the sampler's storage dtype: floating arrays cast, integer and 8-bit
  float ones (a quantised base's values, ``rl_jax.models.quant``) kept."""
  floating = jnp.issubdtype(x.dtype, jnp.floating) and jnp.dtype(x.dtype).itemsize > 1
  return x.astype(dtype) if floating else x


@functools.partial(jax.jit, static_argnames=("dtype",))
def cast_params(params, dtype: str):
  """Jitted cast of the trainer's parameters to the sampler's storage dtype (``cast_leaf``)."""
  return jax.tree.map(lambda x: cast_leaf(x, dtype), params)


def sampler_storage(cfg: ModelConfig, params):
  """``params`` in the sampler's storage dtypes: floats in ``cfg.param_dtype``
  (``cast_leaf``), except projection matrices that arrive in the narrower compute dtype
  ``cfg.dtype`` (a copy made for the sampler by ``models.cast_projections``), which stay
  in it. The model casts each projection to ``cfg.dtype`` before its product, so the
  numbers are the same either way, and a decode step reads the narrow bytes."""
  want = jnp.dtype(cfg.param_dtype)
  cast = jax.tree.map(lambda x: cast_leaf(x, want), params)
  narrow = models.cast_projections(cfg, cast)
  return jax.tree.map(lambda x, c, n: n if x.dtype == n.dtype != c.dtype else c,
                      params, cast, narrow)


_storage = jax.jit(sampler_storage, static_argnums=0)


@functools.lru_cache(maxsize=64)
def _in_storage(cfg: ModelConfig, tree, avals: tuple) -> bool:
  """Whether parameters of this tree and these (shape, dtype) leaves are in the sampler's
  storage dtypes already. Cached per process: the check traces ``sampler_storage``, and a
  trace after the first steps would count as a compile (a new engine asks again)."""
  specs = jax.tree.unflatten(tree, [jax.ShapeDtypeStruct(shape, dt) for shape, dt in avals])
  stored = jax.tree.leaves(jax.eval_shape(functools.partial(sampler_storage, cfg), specs))
  return all(dt == y.dtype for (_, dt), y in zip(avals, stored))


class SamplerParams:
  """Trainer parameters -> sampler parameters on device, for one engine (its
  ``prepare_params``): cast to ``cfg.param_dtype`` (a copy's projections in the compute
  dtype kept so: ``sampler_storage``) and, with a mesh (``ctx`` = (mesh, rules)), placed in
  the sampler's layout.

  With a mesh, one jitted program casts and reshards (``out_shardings``), so XLA moves shards
  device to device (collectives), never through host memory; compiled once per input layout.
  A no-op when the parameters are already in the sampler's dtype and layout. Parameters on
  devices outside the sampler's mesh (disaggregated trainer / sampler) are copied over with
  ``jax.device_put`` first. LoRA weights the trainer merged for the sampler get the layout
  without the adapters.
  """

  def __init__(self, cfg: ModelConfig, ctx=None):
    self.cfg, self.ctx = cfg, ctx
    self._target = self._sync = None  # the sampler's layout and its jitted cast + reshard

  def __call__(self, params):
    leaves, tree = jax.tree.flatten(params)
    same_dtypes = _in_storage(self.cfg, tree, tuple((np.shape(x), jnp.dtype(x.dtype))
                                                    for x in leaves))
    if self.ctx is None:
      return params if same_dtypes else _storage(self.cfg, params)
    mesh, rules = self.ctx
    if self._target is None:
      self._target = models.param_shardings(self.cfg, mesh, rules)
      if not models.lora.split(params)[1]:  # LoRA weights merged for the sampler
        self._target = models.lora.strip(self._target)
      self._sync = jax.jit(functools.partial(sampler_storage, self.cfg),
                           out_shardings=self._target)
    targets = jax.tree.leaves(self._target)
    if same_dtypes and all(isinstance(leaf, jax.Array) and leaf.sharding.is_equivalent_to(
        t, leaf.ndim) for leaf, t in zip(leaves, targets)):
      return params
    devices = set(mesh.devices.flat)
    if not all(isinstance(leaf, jax.Array) and leaf.sharding.device_set <= devices
               for leaf in leaves):
      params = jax.device_put(params, self._target)
    return self._sync(params)
