"""Llama / Qwen2 / Qwen3 decoder as pure functions over a parameter pytree.

Axis letters: the one legend for shapes in docstrings, comments and einsums across
``rl_jax.models``, ``rl_jax.rollout`` and ``pallas_kernels`` (other modules refer here)::

  B batch rows                      L layers
  T tokens (query length)           D model width
  S kv (key/value) length           F ffw (MLP) width
  G groups (prompts)                V vocab
  M samples per prompt (group size) N query heads
  P prompt (context) length         K kv heads
  R response length                 H head dim
  J query heads per kv head (N = K·J, grouped-query attention)
  U turns of a multi-turn trajectory (max over the batch)

A prime marks a padded length (R', P'); products are written with a dot (G·M rows). A
module that needs a letter outside the legend defines it where it is used.

Parameters are a nested dict; layer weights are stacked along a leading L axis and the
layers run under ``lax.scan`` (one compiled layer, fast compiles, per-layer remat).
Every parameter has a logical-axes tuple in ``param_axes(cfg)`` that ``rl_jax.sharding``
maps to the mesh.

Attention is pluggable: the trunk takes ``attend(q, k, v, layer_state) -> (out, layer_state)``
so the same layer code serves dense masked attention (training), the KV-cache sampler and the
shared-prefix (prompt-once) layout.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import sharding
from rl_jax.models.config import ModelConfig, rope_frequencies

__all__ = ["AttendFn", "Params", "apply_rope", "causal_mask", "dense_attention", "embed",
           "forward", "hidden_states", "init_params", "init_sharded", "lm_head_weight",
           "logits_from_hidden", "mask_attend", "param_axes", "param_shapes", "param_shardings",
           "rms_norm", "rope_tables", "sequence_logprobs", "token_logprobs", "trunk",
           "trunk_unrolled", "unstack_layers"]

Params = dict[str, Any]
AttendFn = Callable[[jax.Array, jax.Array, jax.Array, Any], tuple[jax.Array, Any]]


# ------------------------------------------------------------------------------ parameters
def param_axes(cfg: ModelConfig) -> Params:
  """Logical axis names of every parameter (same tree structure as ``init_params``)."""
  layer = {
      "attn_norm": ("layers", "norm"),
      "q": ("layers", "embed", "q_heads", "head_dim"),
      "k": ("layers", "embed", "kv_heads", "head_dim"),
      "v": ("layers", "embed", "kv_heads", "head_dim"),
      "o": ("layers", "q_heads", "head_dim", "embed"),
      "mlp_norm": ("layers", "norm"),
      "gate": ("layers", "embed", "mlp"),
      "up": ("layers", "embed", "mlp"),
      "down": ("layers", "mlp", "embed"),
  }
  if cfg.qkv_bias:
    layer.update(q_bias=("layers", "q_heads", "head_dim"), k_bias=("layers", "kv_heads", "head_dim"),
                 v_bias=("layers", "kv_heads", "head_dim"))
  if cfg.o_bias:
    layer["o_bias"] = ("layers", "norm")
  if cfg.qk_norm:
    layer.update(q_norm=("layers", "head_dim"), k_norm=("layers", "head_dim"))
  axes = {"embed": ("vocab", "embed"), "layers": layer, "final_norm": ("norm",)}
  if not cfg.tie_word_embeddings:
    axes["lm_head"] = ("embed", "vocab")
  return axes


def param_shapes(cfg: ModelConfig) -> Params:
  """Shapes of every parameter (same tree structure as ``param_axes``)."""
  L, D, F = cfg.num_layers, cfg.hidden_size, cfg.intermediate_size
  N, K, H, V = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.vocab_size
  layer = {"attn_norm": (L, D), "q": (L, D, N, H), "k": (L, D, K, H), "v": (L, D, K, H),
           "o": (L, N, H, D), "mlp_norm": (L, D), "gate": (L, D, F), "up": (L, D, F),
           "down": (L, F, D)}
  if cfg.qkv_bias:
    layer.update(q_bias=(L, N, H), k_bias=(L, K, H), v_bias=(L, K, H))
  if cfg.o_bias:
    layer["o_bias"] = (L, D)
  if cfg.qk_norm:
    layer.update(q_norm=(L, H), k_norm=(L, H))
  shapes = {"embed": (V, D), "layers": layer, "final_norm": (D,)}
  if not cfg.tie_word_embeddings:
    shapes["lm_head"] = (D, V)
  return shapes


def init_params(cfg: ModelConfig, rng: jax.Array, std: float = 0.02) -> Params:
  """Random parameters: normal(std) matrices, zero biases, unit norms. Pure; jit it with
  ``out_shardings`` (see ``init_sharded``) to create weights directly on their devices."""
  shapes = param_shapes(cfg)
  dtype = jnp.dtype(cfg.param_dtype)
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda s: isinstance(s, tuple))[0]]
  keys = jax.random.split(rng, len(leaves))
  out = []
  for path, shape, key in zip(paths, leaves, keys):
    if "norm" in path:
      out.append(jnp.ones(shape, dtype))
    elif "bias" in path:
      out.append(jnp.zeros(shape, dtype))
    else:
      out.append((std * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
  return jax.tree.unflatten(treedef, out)


def param_shardings(cfg: ModelConfig, mesh, rules) -> Params:
  """NamedShardings of every parameter under ``rules`` on ``mesh``."""
  return sharding.logical_to_sharding(param_axes(cfg), mesh, rules, param_shapes(cfg))


def init_sharded(cfg: ModelConfig, rng: jax.Array, mesh, rules, std: float = 0.02) -> Params:
  """Parameters created already sharded: ``jit(init, out_shardings=...)``."""
  return jax.jit(functools.partial(init_params, cfg, std=std),
                 out_shardings=param_shardings(cfg, mesh, rules))(rng)


# ------------------------------------------------------------------------------ layers
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm in float32, result in x's dtype (Zhang & Sennrich 2019). x [..., D]."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * y.astype(x.dtype)


def rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos, sin [B,T,H] (float32) for integer positions [B,T]."""
  inv, attn_factor = rope_frequencies(cfg)
  freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv)
  emb = jnp.concatenate([freqs, freqs], axis=-1)
  return jnp.cos(emb) * attn_factor, jnp.sin(emb) * attn_factor


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
  """Rotate-half RoPE. x [B,T,N,H] (or [B,T,K,H]); cos/sin [B,T,H]."""
  half = x.shape[-1] // 2
  rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
  c, s = cos[:, :, None, :].astype(x.dtype), sin[:, :, None, :].astype(x.dtype)
  return x * c + rotated * s


def dense_attention(q: jax.Array, k: jax.Array, v: jax.Array, mask: jax.Array) -> jax.Array:
  """Softmax attention with GQA and an explicit boolean mask.

  Args:
    q [B,T,N,H]; k, v [B,S,K,H]; mask bool [B,T,S] (True = may attend).
  Returns:
    [B,T,N,H]. Rows with no allowed key return zeros (never NaN).
  """
  B, T, N, H = q.shape
  K = k.shape[2]
  qg = q.reshape(B, T, K, N // K, H)
  scores = jnp.einsum("btkjh,bskh->bkjts", qg, k,
                      preferred_element_type=jnp.float32) / np.sqrt(H).astype(np.float32)
  m = mask[:, None, None, :, :]
  scores = jnp.where(m, scores, -1e30)
  probs = jax.nn.softmax(scores, axis=-1)
  probs = jnp.where(m, probs, 0.0)
  out = jnp.einsum("bkjts,bskh->btkjh", probs.astype(v.dtype), v,
                   preferred_element_type=jnp.float32)
  return out.reshape(B, T, N, H).astype(q.dtype)


def causal_mask(positions_q: jax.Array, positions_k: jax.Array,
                valid_k: jax.Array | None = None) -> jax.Array:
  """mask [B,T,S]: key s visible to query t iff pos_k[s] <= pos_q[t] (and key valid)."""
  mask = positions_k[:, None, :] <= positions_q[:, :, None]
  if valid_k is not None:
    mask &= valid_k[:, None, :]
  return mask


def mask_attend(mask: jax.Array) -> AttendFn:
  """Stateless AttendFn using one boolean mask [B,T,S] for every layer."""

  def attend(q, k, v, state):
    return dense_attention(q, k, v, mask), state

  return attend


def _layer(cfg: ModelConfig, lp: Params, x: jax.Array, cos: jax.Array, sin: jax.Array,
           attend: AttendFn, state: Any) -> tuple[jax.Array, Any]:
  """One pre-norm decoder block. x [B,T,D] -> [B,T,D]."""
  dt = jnp.dtype(cfg.dtype)
  w = lambda name: lp[name].astype(dt)
  with jax.named_scope("attention"):
    h = rms_norm(x, lp["attn_norm"], cfg.rms_norm_eps)
    q = jnp.einsum("btd,dnh->btnh", h, w("q"))
    k = jnp.einsum("btd,dkh->btkh", h, w("k"))
    v = jnp.einsum("btd,dkh->btkh", h, w("v"))
    if cfg.qkv_bias:
      q, k, v = q + w("q_bias"), k + w("k_bias"), v + w("v_bias")
    if cfg.qk_norm:
      q = rms_norm(q, lp["q_norm"], cfg.rms_norm_eps)
      k = rms_norm(k, lp["k_norm"], cfg.rms_norm_eps)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    q = sharding.constrain(q, ("batch", "length", "act_heads", None))
    k = sharding.constrain(k, ("batch", "length", "act_kv_heads", None))
    out, state = attend(q, k, v, state)
    o = jnp.einsum("btnh,nhd->btd", out, w("o"))
    if cfg.o_bias:
      o = o + w("o_bias")
    x = x + o
  with jax.named_scope("mlp"):
    h = rms_norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
    gate = jnp.einsum("btd,df->btf", h, w("gate"))
    up = jnp.einsum("btd,df->btf", h, w("up"))
    act = sharding.constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
    x = x + jnp.einsum("btf,fd->btd", act, w("down"))
  return sharding.constrain(x, ("batch", "length", None)), state


_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def trunk(cfg: ModelConfig, params: Params, x: jax.Array, positions: jax.Array,
          attend: AttendFn, layer_state: Any = None) -> tuple[jax.Array, Any]:
  """Run all layers and the final norm.

  Args:
    x: input embeddings [B,T,D]. positions: int [B,T] RoPE positions.
    attend: AttendFn; ``layer_state`` is a pytree with a leading L axis (e.g. a KV cache)
      that is scanned alongside the layer weights and returned updated.
  Returns:
    hidden [B,T,D] after the final RMSNorm, updated layer_state.
  """
  cos, sin = rope_tables(cfg, positions)
  x = x.astype(jnp.dtype(cfg.dtype))

  def body(carry, xs):
    lp, st = xs
    y, st = _layer(cfg, lp, carry, cos, sin, attend, st)
    return y, st

  if cfg.remat != "none":
    body = jax.checkpoint(body, policy=_REMAT[cfg.remat], prevent_cse=False)
  x, layer_state = jax.lax.scan(body, x, (params["layers"], layer_state))
  return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), layer_state


def unstack_layers(params: Params) -> list[Params]:
  """The stacked ``params["layers"]`` ([L,...] leaves) as a list of L per-layer dicts."""
  layers = params["layers"]
  L = jax.tree.leaves(layers)[0].shape[0]
  return [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(L)]


def trunk_unrolled(cfg: ModelConfig, params: Params, layers: list[Params], x: jax.Array,
                   positions: jax.Array, attend: AttendFn,
                   layer_states: list[Any]) -> tuple[jax.Array, list[Any]]:
  """``trunk`` with a Python loop over per-layer weights (``unstack_layers``).

  For decode steps inside a ``while_loop``: no per-step slicing of stacked weights or caches.

  Args:
    layers: L per-layer parameter dicts; layer_states: L per-layer attention states.
  Returns:
    hidden [B,T,D] after the final RMSNorm, list of L updated states.
  """
  cos, sin = rope_tables(cfg, positions)
  x = x.astype(jnp.dtype(cfg.dtype))
  out = []
  for lp, st in zip(layers, layer_states):
    x, st = _layer(cfg, lp, x, cos, sin, attend, st)
    out.append(st)
  return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), out


def embed(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
  """tokens int [B,T] -> embeddings [B,T,D] in the compute dtype."""
  x = jnp.take(params["embed"], tokens, axis=0).astype(jnp.dtype(cfg.dtype))
  return sharding.constrain(x, ("batch", "length", None))


def lm_head_weight(cfg: ModelConfig, params: Params) -> jax.Array:
  """[D,V] output projection (the transposed embedding when tied)."""
  w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  return w.astype(jnp.dtype(cfg.dtype))


def logits_from_hidden(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
  """hidden [...,D] -> float32 logits [...,V]."""
  return jnp.einsum("...d,dv->...v", hidden, lm_head_weight(cfg, params),
                    preferred_element_type=jnp.float32)


def hidden_states(cfg: ModelConfig, params: Params, tokens: jax.Array,
                  positions: jax.Array | None = None,
                  attention_mask: jax.Array | None = None) -> jax.Array:
  """Final hidden states [B,T,D] of a causal pass.

  Args:
    tokens int [B,T]; positions int [B,T] (default 0..T-1); attention_mask bool [B,T]
      marks valid keys (padding excluded); causality follows ``positions``.
  """
  B, T = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  mask = causal_mask(positions, positions, attention_mask)
  h, _ = trunk(cfg, params, embed(cfg, params, tokens), positions, mask_attend(mask))
  return h


def forward(cfg: ModelConfig, params: Params, tokens: jax.Array,
            positions: jax.Array | None = None,
            attention_mask: jax.Array | None = None) -> jax.Array:
  """Logits of a causal LM. tokens int32 [B,T] -> float32 [B,T,V]; positions 0..T-1 by default."""
  return logits_from_hidden(cfg, params,
                            hidden_states(cfg, params, tokens, positions, attention_mask))


# ------------------------------------------------------------------------------ log-probs
def token_logprobs(cfg: ModelConfig, params: Params, hidden: jax.Array, targets: jax.Array,
                   temperature: float = 1.0, with_entropy: bool = False):
  """log softmax(logits/temperature)[target] computed in sequence chunks.

  The [T,V] logits exist one ``cfg.logits_chunk`` slice at a time (and are recomputed in the
  backward pass), so 150K vocabularies fit.

  Args:
    hidden [B,T,D]; targets int [B,T]; temperature > 0.
  Returns:
    logp float32 [B,T] (and entropy float32 [B,T] of the tempered distribution if asked).
  """
  B, T, D = hidden.shape
  C = min(cfg.logits_chunk, T)
  pad = (-T) % C
  h = jnp.pad(hidden, ((0, 0), (0, pad), (0, 0)))
  t = jnp.pad(targets, ((0, 0), (0, pad)))
  nc = (T + pad) // C
  h = h.reshape(B, nc, C, D).swapaxes(0, 1)
  t = t.reshape(B, nc, C).swapaxes(0, 1)
  w = lm_head_weight(cfg, params)

  @jax.checkpoint
  def chunk(hc, tc):
    z = jnp.einsum("bcd,dv->bcv", hc, w, preferred_element_type=jnp.float32) / temperature
    lse = jax.nn.logsumexp(z, axis=-1)
    lp = jnp.take_along_axis(z, tc[..., None], axis=-1)[..., 0] - lse
    if not with_entropy:
      return lp, jnp.zeros_like(lp)
    ent = lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)
    return lp, ent

  lp, ent = jax.lax.map(lambda a: chunk(*a), (h, t))
  lp = lp.swapaxes(0, 1).reshape(B, nc * C)[:, :T]
  ent = ent.swapaxes(0, 1).reshape(B, nc * C)[:, :T]
  return (lp, ent) if with_entropy else lp


def sequence_logprobs(cfg: ModelConfig, params: Params, tokens: jax.Array,
                      attention_mask: jax.Array | None = None,
                      temperature: float = 1.0) -> jax.Array:
  """Teacher-forced log p(tokens[:, t] | tokens[:, :t]) for t >= 1; [B,T] with column 0 = 0."""
  h = hidden_states(cfg, params, tokens, attention_mask=attention_mask)
  lp = token_logprobs(cfg, params, h[:, :-1], tokens[:, 1:], temperature)
  return jnp.pad(lp, ((0, 0), (1, 0)))
