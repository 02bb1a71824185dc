"""Llama / Qwen2 / Qwen3 / Qwen3-MoE / Gemma 3 decoders as pure functions over a parameter pytree.

Axis letters: the package legend (``rl_jax/__init__.py``).

Parameters are a nested dict; layer weights are stacked along a leading L axis and the
layers run under ``lax.scan`` (one compiled layer, fast compiles, per-layer remat;
``cfg.scan_layers=False`` unrolls it).
Every parameter has a logical-axes tuple in ``param_axes(cfg)`` that ``rl_jax.sharding``
maps to the mesh.

Attention is pluggable: the trunk takes ``attend(q, k, v, layer_state) -> (out, layer_state)``
so the same layer code serves dense masked attention (training), the KV-cache sampler and the
shared-prefix (prompt-once) layout. Where attention differs between layers
(``cfg.per_layer_attention``: Gemma 3's sliding-window layers), the trunk calls
``attend(q, k, v, layer_state, spec)`` with an ``AttnSpec``.

Families:
  llama / qwen2 / qwen3: pre-norm blocks, SwiGLU MLP (qwen2 q/k/v biases, qwen3 q/k norms).
  qwen3_moe: qwen3 attention; the MLP of the layers flagged in ``cfg.sparse_layers`` is a
    mixture of experts (``moe.py``). Their weights live in ``params["moe"]`` stacked over the
    Y MoE layers ([Y,E,...]); dense MLPs of the other layers (if any) in ``params["mlp"]``
    ([L−Y,...]); ``params["layers"]`` holds the attention and norms of all L layers. The trunk
    scans each run of consecutive layers of one kind.
  gemma3: embeddings times sqrt(D); RMSNorm with (1 + weight); norms before and after both
    attention and MLP; q/k norms; GeGLU (tanh gelu) MLP; sliding-window and global layers
    (``cfg.layer_types``) with their own RoPE bases; query_pre_attn_scalar scaling; optional
    final-logit soft-capping; tied embeddings.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import sharding
from rl_jax.models import lora, moe, quant
from rl_jax.models.config import ModelConfig, rope_frequencies
import pallas_kernels

__all__ = ["AttendFn", "AttnSpec", "PROJECTIONS", "Params", "apply_rope", "cast_projections",
           "causal_mask", "dense_attention",
           "embed", "gemma_rms_norm", "softcap", "window_mask",
           "forward", "hidden_states", "init_params", "init_sharded", "lm_head_weight",
           "logits_from_hidden", "mask_attend", "param_axes", "param_shapes", "param_shardings",
           "rms_norm", "rope_tables", "sequence_logprobs", "swiglu_mlp", "token_logprobs",
           "trunk", "trunk_unrolled", "unstack_layers"]

Params = dict[str, Any]
AttendFn = Callable[..., tuple[jax.Array, Any]]


class AttnSpec(NamedTuple):
  """Per-layer attention settings, the fifth argument of an AttendFn when
  ``cfg.per_layer_attention``.

  Attributes:
    sliding: this layer attends only within the window: a bool scalar (traced under the
      layer scan) or a Python bool (unrolled layer loops).
    window: key s is visible to query t only if pos_q[t] − pos_k[s] < window (sliding
      layers; None = no window anywhere).
  """

  sliding: Any
  window: int | None


def window_mask(spec: AttnSpec | None, mask: jax.Array, delta: jax.Array) -> jax.Array:
  """``mask`` restricted to the sliding window in sliding layers.

  Args:
    mask: bool [..]; delta: int, broadcastable to mask, query position minus key position.
  """
  if spec is None or spec.window is None or spec.sliding is False:
    return mask
  inside = mask & (delta < spec.window)
  if spec.sliding is True:
    return inside
  return jnp.where(spec.sliding, inside, mask)


def softcap(x: jax.Array, cap: float | None) -> jax.Array:
  """``cap · tanh(x / cap)`` (identity for cap None)."""
  return x if cap is None else jnp.tanh(x / cap) * cap


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
  if cfg.architecture == "gemma3":
    layer.update(post_attn_norm=("layers", "norm"), post_mlp_norm=("layers", "norm"))
  axes = {"embed": ("vocab", "embed"), "layers": layer, "final_norm": ("norm",)}
  if cfg.is_moe:
    mlp = {k: layer.pop(k) for k in ("gate", "up", "down")}
    if cfg.dense_layers:
      axes["mlp"] = mlp
    axes["moe"] = {"router": ("layers", "embed", None),
                   "expert_gate": ("layers", "expert", "embed", "mlp"),
                   "expert_up": ("layers", "expert", "embed", "mlp"),
                   "expert_down": ("layers", "expert", "mlp", "embed")}
  if not cfg.tie_word_embeddings:
    axes["lm_head"] = ("embed", "vocab")
  if cfg.quant:
    axes["layers"] = layer = quant.layer_axes(cfg, layer)
  if cfg.lora_rank:
    layer[lora.KEY] = lora.adapter_axes(cfg)
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
  if cfg.architecture == "gemma3":
    layer.update(post_attn_norm=(L, D), post_mlp_norm=(L, D))
  shapes = {"embed": (V, D), "layers": layer, "final_norm": (D,)}
  if cfg.is_moe:
    for k in ("gate", "up", "down"):
      del layer[k]
    Ld, Y, E, Fe = len(cfg.dense_layers), len(cfg.moe_layers), cfg.num_experts, \
        cfg.moe_intermediate_size
    if Ld:
      shapes["mlp"] = {"gate": (Ld, D, F), "up": (Ld, D, F), "down": (Ld, F, D)}
    shapes["moe"] = {"router": (Y, D, E), "expert_gate": (Y, E, D, Fe),
                     "expert_up": (Y, E, D, Fe), "expert_down": (Y, E, Fe, D)}
  if not cfg.tie_word_embeddings:
    shapes["lm_head"] = (D, V)
  if cfg.quant:
    shapes["layers"] = layer = quant.layer_shapes(cfg, layer)
  if cfg.lora_rank:
    layer[lora.KEY] = lora.adapter_shapes(cfg)
  return shapes


# the projection matrices, which every use casts to the compute dtype before its product
# (``lora.project``, ``_mlp``'s ``w``)
PROJECTIONS = ("q", "k", "v", "o", "gate", "up", "down", "expert_gate", "expert_up",
               "expert_down")


def cast_projections(cfg: ModelConfig, params: Params) -> Params:
  """``params`` with their projection matrices (``PROJECTIONS`` of ``params["layers"]``,
  ``["mlp"]`` and ``["moe"]``) in the compute dtype ``cfg.dtype`` where they are a wider
  float; norms, embeddings, the LM head, the router, biases, adapters and quantised weights
  as they are. The model computes the same numbers bit for bit from either (each use casts
  its matrix to that dtype first); a copy kept for sampling in a narrower compute dtype
  holds, and every decode step reads, that dtype's bytes instead of the stored ones."""
  dt = jnp.dtype(cfg.dtype)

  def narrow(x):
    if not (isinstance(x, jax.Array | jax.ShapeDtypeStruct | np.ndarray)
            and jnp.issubdtype(x.dtype, jnp.floating) and x.dtype.itemsize > dt.itemsize):
      return x  # a quantised weight, or no wider than the compute dtype
    if isinstance(x, jax.ShapeDtypeStruct):
      return jax.ShapeDtypeStruct(x.shape, dt, sharding=x.sharding)
    return x.astype(dt)

  out = dict(params)
  for group in ("layers", "mlp", "moe"):
    if group in params:
      out[group] = {k: narrow(v) if k in PROJECTIONS else v for k, v in params[group].items()}
  return out


def init_params(cfg: ModelConfig, rng: jax.Array, std: float = 0.02,
                lora_init: str = "gaussian") -> Params:
  """Random parameters: normal(std) matrices, zero biases, unit norms (zero for Gemma's
  (1 + weight) norms). Pure; jit it with ``out_shardings`` (see ``init_sharded``) to create
  weights directly on their devices. With ``cfg.lora_rank`` the base is the same as without
  adapters and the adapters are ``lora.init_adapters(cfg, fold_in(rng, 1), lora_init)``.
  With ``cfg.quant`` that base is then quantised (``quant.quantize_base``)."""
  if cfg.quant:
    return quant.quantize_base(cfg, init_params(cfg.replace(quant=""), rng, std, lora_init))
  if cfg.lora_rank:
    base = init_params(cfg.replace(lora_rank=0), rng, std)
    return lora.combine(base, lora.init_adapters(cfg, jax.random.fold_in(rng, 1), lora_init))
  shapes = param_shapes(cfg)
  dtype = jnp.dtype(cfg.param_dtype)
  leaves, treedef = jax.tree.flatten(shapes, is_leaf=lambda s: isinstance(s, tuple))
  paths = [jax.tree_util.keystr(p) for p, _ in
           jax.tree_util.tree_flatten_with_path(shapes, is_leaf=lambda s: isinstance(s, tuple))[0]]
  keys = jax.random.split(rng, len(leaves))
  out = []
  for path, shape, key in zip(paths, leaves, keys):
    if "norm" in path:
      out.append((jnp.zeros if cfg.architecture == "gemma3" else jnp.ones)(shape, dtype))
    elif "bias" in path:
      out.append(jnp.zeros(shape, dtype))
    else:
      out.append((std * jax.random.normal(key, shape, jnp.float32)).astype(dtype))
  return jax.tree.unflatten(treedef, out)


def param_shardings(cfg: ModelConfig, mesh, rules) -> Params:
  """NamedShardings of every parameter under ``rules`` on ``mesh``."""
  return sharding.logical_to_sharding(param_axes(cfg), mesh, rules, param_shapes(cfg))


def init_sharded(cfg: ModelConfig, rng: jax.Array, mesh, rules, std: float = 0.02,
                 lora_init: str = "gaussian") -> Params:
  """Parameters created already sharded: ``jit(init, out_shardings=...)``."""
  return jax.jit(functools.partial(init_params, cfg, std=std, lora_init=lora_init),
                 out_shardings=param_shardings(cfg, mesh, rules))(rng)


# ------------------------------------------------------------------------------ layers
def rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """RMSNorm in float32, result in x's dtype (Zhang & Sennrich 2019). x [..., D]."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return weight.astype(x.dtype) * y.astype(x.dtype)


def gemma_rms_norm(x: jax.Array, weight: jax.Array, eps: float) -> jax.Array:
  """Gemma's RMSNorm: float32 normalisation times (1 + weight), result in x's dtype."""
  x32 = x.astype(jnp.float32)
  y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + eps)
  return (y * (1.0 + weight.astype(jnp.float32))).astype(x.dtype)


def _norm_fn(cfg: ModelConfig):
  return gemma_rms_norm if cfg.architecture == "gemma3" else rms_norm


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


def local_rope_tables(cfg: ModelConfig, positions: jax.Array) -> tuple[jax.Array, jax.Array]:
  """cos, sin [B,T,H] of the sliding-window layers (base ``rope_local_theta``, no scaling)."""
  return rope_tables(cfg.replace(rope_theta=cfg.rope_local_theta, rope_scaling=None), positions)


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


def concat_prefix_attention(q: jax.Array, k_ctx: jax.Array, v_ctx: jax.Array,
                            k_resp: jax.Array, v_resp: jax.Array,
                            ctx_lengths: jax.Array,
                            segments: jax.Array | None = None) -> jax.Array:
  """Shared-prefix attention as one masked softmax over [context | own] keys.

  Response query j of response i in group g sees context keys 0..ctx_lengths[g]-1 and keys
  0..j of response i (the contract of ``pallas_kernels.shared_prefix_attention``). With
  ``segments`` int [G,M,R] each row holds several responses (``models.packing``): query j then
  sees the row's keys 0..j of its own segment only. The
  group's P context keys are placed in front of each response's R own keys and the scores
  are laid out head-major, [G,M,K,J,R,P+R], so both score products and the softmax run on
  the scores without transposing them; the mask is an additive 0 / -1e30 bias (every query
  sees at least its own key, so no row is empty). Computed in float32; equal to the
  two-region reference to float rounding (``tests/test_prefix_attention.py``).

  Args:
    q [G,M,R,N,H]; k_ctx, v_ctx [G,P,K,H]; k_resp, v_resp [G,M,R,K,H]; ctx_lengths int [G];
    segments: None, or int [G,M,R] the segment of each row position.
  Returns:
    [G,M,R,N,H] in the dtype of q.
  """
  G, M, R, N, H = q.shape
  P, K = k_ctx.shape[1], k_ctx.shape[2]
  f32 = lambda a: a.astype(jnp.float32)
  keys = lambda ctx, own: jnp.concatenate(
      [jnp.broadcast_to(f32(ctx)[:, None], (G, M, P, K, H)), f32(own)], axis=2)
  k, v = keys(k_ctx, k_resp), keys(v_ctx, v_resp)  # [G,M,P+R,K,H]
  qg = f32(q).reshape(G, M, R, K, N // K, H) / np.float32(np.sqrt(H))
  ctx = jnp.arange(P)[None, None, :] < ctx_lengths[:, None, None]  # [G,1,P]
  own = jnp.arange(R)[None, :] <= jnp.arange(R)[:, None]  # [R,R]
  if segments is None:
    mask = jnp.concatenate([jnp.broadcast_to(ctx, (G, R, P)),
                            jnp.broadcast_to(own, (G, R, R))], axis=-1)  # [G,R,P+R]
    bias = jnp.where(mask, 0.0, -1e30).astype(jnp.float32)[:, None, None, None]
  else:  # [G,M,R,P+R]: the context, then the row's keys of the query's own segment
    own = own & (segments[..., :, None] == segments[..., None, :])
    mask = jnp.concatenate([jnp.broadcast_to(ctx[:, None], (G, M, R, P)), own], axis=-1)
    bias = jnp.where(mask, 0.0, -1e30).astype(jnp.float32)[:, :, None, None]
  scores = jnp.einsum("gmtkjh,gmskh->gmkjts", qg, k) + bias
  probs = jax.nn.softmax(scores, axis=-1)
  out = jnp.einsum("gmkjts,gmskh->gmtkjh", probs, v)
  return out.reshape(G, M, R, N, H).astype(q.dtype)


def causal_mask(positions_q: jax.Array, positions_k: jax.Array,
                valid_k: jax.Array | None = None) -> jax.Array:
  """mask [B,T,S]: key s visible to query t iff pos_k[s] <= pos_q[t] (and key valid)."""
  mask = positions_k[:, None, :] <= positions_q[:, :, None]
  if valid_k is not None:
    mask &= valid_k[:, None, :]
  return mask


def mask_attend(mask: jax.Array, delta: jax.Array | None = None) -> AttendFn:
  """Stateless AttendFn using one boolean mask [B,T,S] for every layer.

  ``delta`` int [B,T,S] (query minus key position) restricts sliding-window layers to their
  window when the trunk passes an ``AttnSpec``.
  """

  def attend(q, k, v, state, spec=None):
    if spec is None:
      return dense_attention(q, k, v, mask), state
    m = mask if delta is None else window_mask(spec, mask, delta)
    return dense_attention(q, k, v, m), state

  return attend


def _attention(cfg: ModelConfig, lp: Params, x: jax.Array, cos: jax.Array, sin: jax.Array,
               attend: AttendFn, state: Any, spec: AttnSpec | None):
  """Attention sub-block (every family). x [B,T,D] -> residual update [B,T,D]."""
  dt = jnp.dtype(cfg.dtype)
  w = lambda name: lp[name].astype(dt)
  norm = _norm_fn(cfg)
  h = norm(x, lp["attn_norm"], cfg.rms_norm_eps)
  q = lora.project(cfg, lp, "q", "btd,dnh->btnh", h)
  k = lora.project(cfg, lp, "k", "btd,dkh->btkh", h)
  v = lora.project(cfg, lp, "v", "btd,dkh->btkh", h)
  if cfg.qkv_bias:
    q, k, v = q + w("q_bias"), k + w("k_bias"), v + w("v_bias")
  if cfg.qk_norm:
    q = norm(q, lp["q_norm"], cfg.rms_norm_eps)
    k = norm(k, lp["k_norm"], cfg.rms_norm_eps)
  q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
  if cfg.query_pre_attn_scalar is not None:  # attention divides by sqrt(H)
    q = q * jnp.asarray(np.sqrt(cfg.head_dim / cfg.query_pre_attn_scalar), q.dtype)
  q = sharding.constrain(q, ("batch", "length", "act_heads", None))
  k = sharding.constrain(k, ("batch", "length", "act_kv_heads", None))
  out, state = attend(q, k, v, state) if spec is None else attend(q, k, v, state, spec)
  o = lora.project(cfg, lp, "o", "btnh,nhd->btd", out)
  if cfg.o_bias:
    o = o + w("o_bias")
  if cfg.architecture == "gemma3":
    o = norm(o, lp["post_attn_norm"], cfg.rms_norm_eps)
  return o, state


def fused_mlp_on(cfg: ModelConfig) -> bool:
  """Whether ``cfg.fused_mlp`` fuses the MLP: True / False as set; "auto" for a program
  compiled for CPUs (``pallas_kernels.current_platform``: the mesh's platform that
  ``sharding.use`` entered, else JAX's default backend), where it measures 1.1-1.2x on the
  update (docs/BENCHMARKS.md, "Fused MLP"); TPUs and GPUs keep XLA's two matmuls."""
  if cfg.fused_mlp == "auto":
    return pallas_kernels.current_platform() == "cpu"
  return bool(cfg.fused_mlp)


def _gate_up(cfg: ModelConfig, lp: Params, h: jax.Array) -> tuple[jax.Array, jax.Array]:
  """The MLP's gate and up projections of h [B,T,D] (weights [D,F]): two [B,T,F].

  ``cfg.fused_mlp`` (``fused_mlp_on``): one matmul against [D,2F] (the two weights concatenated here, so the
  parameters keep their names and layout), split after; adapters on gate/up add their
  ``lora.delta`` to the split outputs, and autodiff gives the adapter gradients. Otherwise,
  or with a quantised base (``cfg.quant``), ``lora.project`` twice.
  """
  if not fused_mlp_on(cfg) or cfg.quant:
    return (lora.project(cfg, lp, "gate", "btd,df->btf", h),
            lora.project(cfg, lp, "up", "btd,df->btf", h))
  dt = jnp.dtype(cfg.dtype)
  gate, up = _fused_gate_up(h, lp["gate"].astype(dt), lp["up"].astype(dt))
  dg, du = (lora.delta(cfg, lp, n, "btd,df->btf", h) for n in ("gate", "up"))
  return (gate if dg is None else gate + dg), (up if du is None else up + du)


def _fused_gate_up(h: jax.Array, w_gate: jax.Array, w_up: jax.Array):
  """h [B,T,D] · [w_gate | w_up] ([D,2F]) as one matmul, split into gate, up [B,T,F]."""
  F = w_gate.shape[-1]
  gu = jnp.einsum("btd,df->btf", h, jnp.concatenate([w_gate, w_up], axis=-1))
  return gu[..., :F], gu[..., F:]


def _swiglu(h, w_gate, w_up, w_down):
  """Forward of ``swiglu_mlp``: (y [B,T,D], (gate, up) [B,T,F] pre-activations)."""
  gate, up = _fused_gate_up(h, w_gate, w_up)
  act = sharding.constrain(jax.nn.silu(gate) * up, ("batch", "length", "act_mlp"))
  return jnp.einsum("btf,fd->btd", act, w_down), (gate, up)


@jax.custom_vjp
def swiglu_mlp(h: jax.Array, w_gate: jax.Array, w_up: jax.Array,
               w_down: jax.Array) -> jax.Array:
  """SwiGLU MLP ``(silu(h·W_gate) * h·W_up)·W_down`` with a hand-written backward.

  Args:
    h [B,T,D]; w_gate, w_up [D,F]; w_down [F,D].
  Returns:
    [B,T,D].

  The forward is one gate/up matmul (``_fused_gate_up``). The backward keeps only h and the
  two pre-activations (autodiff saves products of the silu as well), recomputes the sigmoid,
  and forms the gate and up gradients as one [B,T,2F] array, so dh is one product over 2F and
  the two weight gradients one [D,2F] product. Equal to autodiff of the two-matmul MLP to
  float rounding (``tests/test_fused_layers.py``).
  """
  return _swiglu(h, w_gate, w_up, w_down)[0]


def _swiglu_fwd(h, w_gate, w_up, w_down):
  y, (gate, up) = _swiglu(h, w_gate, w_up, w_down)
  return y, (h, gate, up, w_gate, w_up, w_down)


def _swiglu_bwd(res, dy):
  """d/dgate silu(gate) = σ(gate)·(1 + gate·(1 − σ(gate)))."""
  h, gate, up, w_gate, w_up, w_down = res
  F = w_gate.shape[-1]
  sig = jax.nn.sigmoid(gate)
  silu = gate * sig
  # [D,F] then transposed: contracting both [B,T,·] operands with the activation as the
  # right-hand side keeps it in its own layout (XLA's CPU backend otherwise writes the whole
  # [F,B·T] activation transposed, strided, for the product)
  d_down = jnp.einsum("btd,btf->df", dy, silu * up).T
  dact = jnp.einsum("btd,fd->btf", dy, w_down)
  dgu = jnp.concatenate([dact * up * (sig * (1 + gate * (1 - sig))), dact * silu], axis=-1)
  dh = jnp.einsum("btf,df->btd", dgu, jnp.concatenate([w_gate, w_up], axis=-1))
  dw = jnp.einsum("btd,btf->df", h, dgu)
  return dh, dw[:, :F], dw[:, F:], d_down


swiglu_mlp.defvjp(_swiglu_fwd, _swiglu_bwd)


def _mlp(cfg: ModelConfig, lp: Params, x: jax.Array, routing: jax.Array | None):
  """MLP sub-block (every family): (update [B,T,D], (ids, logits, dropped fraction) or None).

  MoE layers: dropless grouped matmuls, or with ``cfg.moe_capacity_factor`` > 0 the capacity
  (expert-parallel) path of ``moe.capacity_mlp``. Dense SwiGLU with ``cfg.fused_mlp``, a
  float base and no adapter on gate/up/down: ``swiglu_mlp``; otherwise ``_gate_up`` (fused
  or not, adapter deltas added) and autodiff.
  """
  dt = jnp.dtype(cfg.dtype)
  w = lambda name: lp[name].astype(dt)
  norm = _norm_fn(cfg)
  h = norm(x, lp["mlp_norm"], cfg.rms_norm_eps)
  if "router" in lp:
    weights, ids, logits = moe.route(h, lp["router"], cfg.num_experts_per_tok,
                                     cfg.norm_topk_prob, routing)
    experts = (w("expert_gate"), w("expert_up"), w("expert_down"))
    if cfg.moe_capacity_factor:
      y, dropped = moe.capacity_mlp(h, weights, ids, *experts, cfg.moe_capacity_factor)
      dropped = dropped.astype(jnp.float32) / ids.size
    else:
      y, dropped = moe.expert_mlp(h, weights, ids, *experts), jnp.zeros((), jnp.float32)
    return y, (ids, logits, dropped)
  if (fused_mlp_on(cfg) and not cfg.quant and cfg.architecture != "gemma3"
      and not lora.adapted(lp, ("gate", "up", "down"))):
    return swiglu_mlp(h, w("gate"), w("up"), w("down")), None
  gate, up = _gate_up(cfg, lp, h)
  if cfg.architecture == "gemma3":
    act = jax.nn.gelu(gate, approximate=True) * up
  else:
    act = jax.nn.silu(gate) * up
  act = sharding.constrain(act, ("batch", "length", "act_mlp"))
  y = lora.project(cfg, lp, "down", "btf,fd->btd", act)
  if cfg.architecture == "gemma3":
    y = norm(y, lp["post_mlp_norm"], cfg.rms_norm_eps)
  return y, None


def _layer_ext(cfg: ModelConfig, lp: Params, x: jax.Array, cos: jax.Array, sin: jax.Array,
               attend: AttendFn, state: Any, spec: AttnSpec | None, routing: jax.Array | None):
  """One decoder block: x [B,T,D] -> ([B,T,D], state, routing or None). Gemma 3 adds norms
  after both sub-blocks; MoE layers replace the MLP by the experts."""
  with jax.named_scope("attention"):
    o, state = _attention(cfg, lp, x, cos, sin, attend, state, spec)
    x = x + o
  with jax.named_scope("moe" if "router" in lp else "mlp"):
    y, route = _mlp(cfg, lp, x, routing)
    x = x + y
  return sharding.constrain(x, ("batch", "length", None)), state, route


def _extended(cfg: ModelConfig) -> bool:
  """Families with per-layer differences (experts, layer types) or Gemma's block layout."""
  return cfg.is_moe or cfg.architecture == "gemma3"


def _layer(cfg: ModelConfig, lp: Params, x: jax.Array, cos: jax.Array, sin: jax.Array,
           attend: AttendFn, state: Any) -> tuple[jax.Array, Any]:
  """One pre-norm decoder block of the dense families. x [B,T,D] -> [B,T,D]."""
  x, state, _ = _layer_ext(cfg, lp, x, cos, sin, attend, state, None, None)
  return x, state


@jax.custom_jvp
def _from_bits(w: jax.Array, bits: jax.Array) -> jax.Array:
  """``bits`` (the uint16 view of the same slice as ``w``) in ``w``'s dtype: ``w``, bit for
  bit. Differentiable as the identity in ``w``, which the primal never reads (so XLA drops
  the slice that made it)."""
  return jax.lax.bitcast_convert_type(bits, w.dtype)


@_from_bits.defjvp
def _from_bits_jvp(primals, tangents):
  return _from_bits(*primals), tangents[0]


def _half_float(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.floating) and jnp.dtype(dtype).itemsize == 2


def _sub_byte(dtype) -> bool:
  return jnp.issubdtype(dtype, jnp.integer) and jnp.iinfo(dtype).bits < 8


def _frozen_stacks(cfg: ModelConfig, stack: Params) -> list | None:
  """The frozen 16-bit float and sub-byte integer (int4) leaves of a stacked layer tree (None
  per other leaf; None if there are none, or off the CPU backend), for ``_read_frozen`` and
  ``_reread_frozen``.

  The CPU backend has no 16-bit float slicing: it converts the whole stacked operand of a
  bf16 dynamic slice to float32 and slices that (an int4 stack: to int8), and XLA hoists that
  convert of the loop-invariant stack out of the layer loop, so a program that scans the
  layers would hold a float32 copy of every layer's weights (twice the bf16 base; int4: the
  values once more). Frozen leaves: the base of a LoRA model (everything but the adapters),
  which is never trained.
  """
  if not cfg.lora_rank or sharding.platform() != "cpu":  # the compiled program's platform
    return None
  flat = jax.tree_util.tree_flatten_with_path(stack)[0]
  adapter = lambda path: any(getattr(k, "key", None) == lora.KEY for k in path)
  out = [a if not adapter(path) and (_half_float(a.dtype) or _sub_byte(a.dtype)) else None
         for path, a in flat]
  return out if any(a is not None for a in out) else None


def _read_frozen(lp: Params, stacks: list | None, i: jax.Array) -> Params:
  """One layer's parameters ``lp`` (the scan's slice, row ``i`` of the stacks) with each frozen
  leaf (``_frozen_stacks``) read as a uint16 slice of its stack, bitcast back (int4: sliced
  from the stack in the loop body): the same values, bit for bit, but a slice the CPU backend
  makes without converting the whole stack. The stacks pass through an optimisation barrier
  with the loop index, so nothing is hoisted out of the loop: the bitcast (or int8 widening)
  is fused into the slice and only one layer is converted at a time."""
  if stacks is None:
    return lp
  frozen, i = jax.lax.optimization_barrier(([a for a in stacks if a is not None], i))
  frozen = iter(frozen)
  leaves, treedef = jax.tree.flatten(lp)
  out = []
  for a, stack in zip(leaves, stacks):
    out.append(a if stack is None else _frozen_row(a, next(frozen), i))
  return jax.tree.unflatten(treedef, out)


def _frozen_row(a: jax.Array, stack: jax.Array, i: jax.Array) -> jax.Array:
  """Row ``i`` of a ``stack`` (``_frozen_stacks``, ``_sharded_stacks``) with ``a``'s values,
  bit for bit: a 16-bit float stack as its uint16 view, bitcast back; any other (int4,
  float32) sliced as it is."""
  if not _half_float(a.dtype):
    return jax.lax.dynamic_index_in_dim(stack, i, keepdims=False)
  bits = jax.lax.bitcast_convert_type(stack, jnp.uint16)
  return _from_bits(a, jax.lax.dynamic_index_in_dim(bits, i, keepdims=False))


_REMAT = {
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def trunk(cfg: ModelConfig, params: Params, x: jax.Array, positions: jax.Array,
          attend: AttendFn, layer_state: Any = None, *, routing: jax.Array | None = None,
          return_routing: bool = False):
  """Run all layers and the final norm.

  Args:
    x: input embeddings [B,T,D]. positions: int [B,T] RoPE positions.
    attend: AttendFn; ``layer_state`` is a pytree with a leading L axis (e.g. a KV cache)
      that is scanned alongside the layer weights and returned updated.
    routing: MoE models only: int [Y,B,T,X] experts to use in each MoE layer (router
      replay; weights recomputed from the router, see ``moe.py``).
    return_routing: MoE models only: also return the ``moe.Routing`` of this pass.
  Returns:
    hidden [B,T,D] after the final RMSNorm, updated layer_state (and the Routing if asked).
  """
  if _extended(cfg):
    return _trunk_ext(cfg, params, x, positions, attend, layer_state, routing, return_routing)
  if routing is not None or return_routing:
    raise ValueError(f"routing is only defined for mixture-of-experts models, not "
                     f"{cfg.architecture!r}")
  cos, sin = rope_tables(cfg, positions)
  x = x.astype(jnp.dtype(cfg.dtype))

  def body(carry, xs):
    lp, st, i = xs
    y, st = _layer(cfg, _read_frozen(lp, stacks, i), carry, cos, sin, attend, st)
    return y, st

  if cfg.remat != "none":
    body = jax.checkpoint(body, policy=_REMAT[cfg.remat], prevent_cse=False)
  stacks = _frozen_stacks(cfg, params["layers"]) if cfg.scan_layers else None
  x, layer_state = jax.lax.scan(body, x, (params["layers"], layer_state,
                                          jnp.arange(cfg.num_layers)),
                                unroll=not cfg.scan_layers)
  return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), layer_state


def _segments(cfg: ModelConfig) -> list[tuple[int, int, str, int]]:
  """Runs of consecutive layers of one kind: (first, end, kind, offset in the kind's stack).

  kind "layers": the MLP is in ``params["layers"]`` (dense families, gemma3); "moe" / "mlp":
  the MLP weights are rows offset.. of ``params["moe"]`` / ``params["mlp"]``.
  """
  if not cfg.is_moe:
    return [(0, cfg.num_layers, "layers", 0)]
  out, counts = [], {"moe": 0, "mlp": 0}
  for i, sparse in enumerate(cfg.sparse_layers):
    kind = "moe" if sparse else "mlp"
    if out and out[-1][2] == kind:
      first, _, _, off = out[-1]
      out[-1] = (first, i + 1, kind, off)
    else:
      out.append((i, i + 1, kind, counts[kind]))
    counts[kind] += 1
  return out


def _rows(tree: Any, lo: int, hi: int, total: int) -> Any:
  """Leading-axis slice lo:hi of every leaf (no slice when it is the whole stack)."""
  if tree is None or (lo == 0 and hi == total):
    return tree
  return jax.tree.map(lambda a: a[lo:hi], tree)


def _layer_tables(cfg: ModelConfig, positions: jax.Array):
  """(global cos, sin) and, with sliding layers, (local cos, sin) or None; each [B,T,H]."""
  glob = rope_tables(cfg, positions)
  local = local_rope_tables(cfg, positions) if cfg.rope_local_theta is not None else None
  return glob, local


def _select_tables(tables, sliding):
  glob, local = tables
  if local is None or sliding is False:
    return glob
  if sliding is True:
    return local
  return tuple(jnp.where(sliding, l, g) for l, g in zip(local, glob))


def _spec(cfg: ModelConfig, sliding) -> AttnSpec | None:
  if not cfg.per_layer_attention:
    return None
  return AttnSpec(sliding, cfg.sliding_window)


def _trunk_ext(cfg, params, x, positions, attend, layer_state, routing, return_routing):
  """``trunk`` for the extended families: one ``lax.scan`` per run of same-kind layers."""
  if (routing is not None or return_routing) and not cfg.is_moe:
    raise ValueError(f"routing is only defined for mixture-of-experts models, not "
                     f"{cfg.architecture!r}")
  tables = _layer_tables(cfg, positions)
  x = x.astype(jnp.dtype(cfg.dtype))
  sliding = jnp.asarray(cfg.sliding_layers)
  L, Y = cfg.num_layers, len(cfg.moe_layers)
  states, routes = [], []
  scan = cfg.scan_layers
  layer_stacks = _frozen_stacks(cfg, params["layers"]) if scan else None
  for first, end, kind, off in _segments(cfg):
    stacks = (layer_stacks, _frozen_stacks(cfg, params[kind])
              if scan and kind != "layers" else None)
    n = end - first
    mlp = {} if kind == "layers" else _rows(params[kind], off, off + n,
                                             Y if kind == "moe" else L - Y)
    replay = None if (routing is None or kind != "moe") else routing[off:off + n]

    def body(carry, xs, stacks=stacks):
      lp, mp, st, flag, rt, i, j = xs
      lp, mp = _read_frozen(lp, stacks[0], i), _read_frozen(mp, stacks[1], j)
      cos, sin = _select_tables(tables, flag)
      y, st, route = _layer_ext(cfg, {**lp, **mp}, carry, cos, sin, attend, st,
                                _spec(cfg, flag), rt)
      return y, (st, route if return_routing else None)

    if cfg.remat != "none":
      body = jax.checkpoint(body, policy=_REMAT[cfg.remat], prevent_cse=False)
    xs = (_rows(params["layers"], first, end, L), mlp, _rows(layer_state, first, end, L),
          sliding[first:end], replay, jnp.arange(first, end), jnp.arange(off, off + n))
    x, (st, route) = jax.lax.scan(body, x, xs, unroll=not cfg.scan_layers)
    states.append(st)
    if route is not None:
      routes.append(route)
  layer_state = states[0] if len(states) == 1 else jax.tree.map(
      lambda *a: jnp.concatenate(a, axis=0), *states)
  h = _norm_fn(cfg)(x, params["final_norm"], cfg.rms_norm_eps)
  if not return_routing:
    return h, layer_state
  ids, logits, dropped = (routes[0] if len(routes) == 1 else
                          [jnp.concatenate(parts, axis=0) for parts in zip(*routes)])
  return h, layer_state, moe.Routing(ids, logits, dropped)


def unstack_layers(params: Params, cfg: ModelConfig | None = None) -> list[Params]:
  """The stacked layer weights as a list of L per-layer dicts.

  Mixture-of-experts models (``params["moe"]``) need ``cfg``: each layer's dict then also
  holds its MLP (its experts or its dense MLP).
  """
  if cfg is not None and cfg.is_moe:
    base = unstack_layers({"layers": params["layers"]})
    counts = {"moe": 0, "mlp": 0}
    for i, sparse in enumerate(cfg.sparse_layers):
      kind = "moe" if sparse else "mlp"
      base[i].update(jax.tree.map(lambda a, j=counts[kind]: a[j], params[kind]))
      counts[kind] += 1
    return base
  if "moe" in params:
    raise ValueError("unstack_layers of a mixture-of-experts model needs its cfg")
  layers = params["layers"]
  L = jax.tree.leaves(layers)[0].shape[0]
  return [jax.tree.map(lambda a, i=i: a[i], layers) for i in range(L)]


# ``trunk_unrolled`` re-reads the frozen stacks in the loop body (``_reread_frozen``) only when
# the float32 copies XLA would otherwise hoist out of a decode loop reach this many bytes:
# re-reading costs decode time (an int4 base is dequantised again at every step, about 5x
# slower decode on the CPU), which a small model's few hoisted megabytes do not justify.
REREAD_MIN_BYTES = 1 << 30


def _sharded_stacks(cfg: ModelConfig, stack: Params) -> list | None:
  """The leaves of a stacked layer tree that the program being traced shards over its
  devices (None per other leaf; None if there are none, or outside a mesh of several
  devices): those whose logical axes (``param_axes``) other than the layer axis map to a
  mesh axis under the active rules (``sharding.use``), e.g. every projection under FSDP.

  In the sampler's decode each layer's matmuls all-gather these weights in the loop body.
  The gathers read slices made outside the loop (``unstack_layers``), so nothing in the
  body orders them after the layers before: XLA:TPU's scheduler issued most layers'
  gathers at the top of the body, and their gathered weights were live at once (bf16
  LoRA of Qwen3-32B on 8 v5e chips: 0.78 GiB more temporaries per layer).
  ``_reread_frozen`` reads each from its stack at an index computed from the layer's input
  instead, so a layer's weights are gathered once the layer before has run (the index
  costs a scalar all-reduce per layer: the element of ``x`` it reads is on one device).

  In a program compiled for TPU or GPU every leaf is re-read, replicated ones too: there
  each layer's slice of a replicated stack was a copy made before the loop and held through
  it (a copy of every layer's weights: 2.7 GiB per chip for Qwen3-1.7B's decode on a mesh of
  ``sequence`` alone; ``scripts/tpu_sequence_pool.py``)."""
  active = sharding.active()
  if active is None or active[0].size == 1:
    return None
  mesh, rules = active

  def like(axes, tree):  # the axes of the entries ``tree`` has (a merged LoRA base: none
    if isinstance(tree, dict):  # of the adapters ``cfg.lora_rank`` gives it)
      return {k: like(axes[k], v) for k, v in tree.items()}
    return axes

  try:
    shardings = sharding.logical_to_sharding(like(param_axes(cfg)["layers"], stack), mesh,
                                             rules, stack)
  except (KeyError, TypeError, ValueError):  # not the tree of cfg's layers: left as they are
    return None
  specs = jax.tree.leaves(shardings, is_leaf=lambda s: isinstance(s, jax.sharding.Sharding))
  # on an accelerator a replicated stack's layer slices would be held as copies too
  every = pallas_kernels.current_platform() != "cpu"
  out = [a if every or any(p is not None for p in s.spec[1:]) else None
         for a, s in zip(jax.tree.leaves(stack), specs)]
  return out if any(a is not None for a in out) else None


def _reread_stacks(cfg: ModelConfig, stack: Params) -> list | None:
  """The stacks ``trunk_unrolled`` re-reads its layers' leaves from (``_reread_frozen``), one
  entry per leaf of ``stack`` (None: the leaf is used as sliced), or None for none: the
  leaves sharded over the program's devices (``_sharded_stacks``) and, on the CPU backend,
  ``_frozen_stacks`` from ``REREAD_MIN_BYTES`` of float32 copies (4 bytes per frozen
  value)."""
  frozen = _frozen_stacks(cfg, stack)
  hoisted = 4 * sum(a.size for a in frozen or () if a is not None)
  frozen = frozen if hoisted >= REREAD_MIN_BYTES else None
  sharded = _sharded_stacks(cfg, stack)
  if frozen is None or sharded is None:
    return frozen or sharded
  return [f if f is not None else s for f, s in zip(frozen, sharded)]


def _reread_frozen(params: Params, stacks: list | None, lp: Params, i: int,
                   x: jax.Array) -> Params:
  """Layer ``i``'s parameters ``lp`` (an ``unstack_layers`` slice, made outside any loop) with
  each leaf that has a stack in ``stacks`` (``_reread_stacks`` of ``params["layers"]``)
  re-read from it once the layer's input ``x`` exists: the same values, bit for bit.

  In a ``while_loop`` body (the sampler's decode) per-layer slices made outside the loop are
  loop invariant, and on the CPU backend so are their conversion for the float32 dots (and
  the dequantisation of a quantised base), which XLA hoists out of the loop: the loop would
  hold a float32 copy of every layer (the float32 dequantised weights of an int4 base); on a
  mesh, nothing orders the all-gathers of sharded slices after the layers before them
  (``_sharded_stacks``). Read through an optimisation barrier at an index computed from
  ``x``, each layer is sliced, converted and gathered in the loop body when it runs, one
  layer at a time, and the slices made outside the loop are dropped."""
  if stacks is None:
    return lp
  # a value of x, so that the reads depend on x (x itself does not pass the barrier: that
  # would change how XLA rounds it); the index below is i itself, but computed from it: the
  # barrier is gone when XLA schedules the loop body, and without a data dependence on x
  # every layer's read would be scheduled (and live) at once
  nonzero = (x.reshape(-1)[0] != 0).astype(jnp.int32)
  frozen, nonzero = jax.lax.optimization_barrier(([a for a in stacks if a is not None], nonzero))
  i = jnp.minimum(i, i + nonzero)
  frozen = iter(frozen)
  own = {k: lp[k] for k in params["layers"]}
  leaves, treedef = jax.tree.flatten(own)
  read = []
  for a, stack in zip(leaves, stacks):
    read.append(a if stack is None else _frozen_row(a, next(frozen), i))
  return {**lp, **jax.tree.unflatten(treedef, read)}


def trunk_unrolled(cfg: ModelConfig, params: Params, layers: list[Params], x: jax.Array,
                   positions: jax.Array, attend: AttendFn, layer_states: list[Any], *,
                   return_routing: bool = False):
  """``trunk`` with a Python loop over per-layer weights (``unstack_layers``).

  For decode steps inside a ``while_loop``: no per-step slicing of stacked weights or caches.
  Layer kinds are static here: attention functions get ``AttnSpec.sliding`` as a Python bool.

  Args:
    layers: L per-layer parameter dicts (``unstack_layers(params, cfg)``); layer_states: L
      per-layer attention states.
    return_routing: MoE models only: also return the chosen experts, int32 [Y,B,T,X].
  Returns:
    hidden [B,T,D] after the final RMSNorm, list of L updated states (and the expert ids).
  """
  if return_routing and not cfg.is_moe:
    raise ValueError(f"routing is only defined for mixture-of-experts models, not "
                     f"{cfg.architecture!r}")
  stacks = _reread_stacks(cfg, params["layers"])
  if _extended(cfg):
    tables = _layer_tables(cfg, positions)
    x = x.astype(jnp.dtype(cfg.dtype))
    out, ids = [], []
    for i, (lp, st, flag) in enumerate(zip(layers, layer_states, cfg.sliding_layers)):
      lp = _reread_frozen(params, stacks, lp, i, x)
      cos, sin = _select_tables(tables, flag)
      x, st, route = _layer_ext(cfg, lp, x, cos, sin, attend, st, _spec(cfg, flag), None)
      out.append(st)
      if route is not None:
        ids.append(route[0])
    h = _norm_fn(cfg)(x, params["final_norm"], cfg.rms_norm_eps)
    return (h, out, jnp.stack(ids)) if return_routing else (h, out)
  cos, sin = rope_tables(cfg, positions)
  x = x.astype(jnp.dtype(cfg.dtype))
  out = []
  for i, (lp, st) in enumerate(zip(layers, layer_states)):
    lp = _reread_frozen(params, stacks, lp, i, x)
    x, st = _layer(cfg, lp, x, cos, sin, attend, st)
    out.append(st)
  return rms_norm(x, params["final_norm"], cfg.rms_norm_eps), out


def embed(cfg: ModelConfig, params: Params, tokens: jax.Array) -> jax.Array:
  """tokens int [B,T] -> embeddings [B,T,D] in the compute dtype (Gemma: times sqrt(D),
  rounded to the embedding's dtype first)."""
  x = jnp.take(params["embed"], tokens, axis=0)
  if cfg.architecture == "gemma3":
    x = x * jnp.asarray(np.float32(np.sqrt(cfg.hidden_size)), x.dtype)
  x = x.astype(jnp.dtype(cfg.dtype))
  return sharding.constrain(x, ("batch", "length", None))


def lm_head_weight(cfg: ModelConfig, params: Params) -> jax.Array:
  """[D,V] output projection (the transposed embedding when tied)."""
  w = params["embed"].T if cfg.tie_word_embeddings else params["lm_head"]
  return w.astype(jnp.dtype(cfg.dtype))


def logits_from_hidden(cfg: ModelConfig, params: Params, hidden: jax.Array) -> jax.Array:
  """hidden [...,D] -> float32 logits [...,V] (soft-capped where ``cfg.final_softcap``)."""
  logits = jnp.einsum("...d,dv->...v", hidden, lm_head_weight(cfg, params),
                      preferred_element_type=jnp.float32)
  return softcap(logits, cfg.final_softcap)


def hidden_states(cfg: ModelConfig, params: Params, tokens: jax.Array,
                  positions: jax.Array | None = None,
                  attention_mask: jax.Array | None = None, *,
                  routing: jax.Array | None = None, return_routing: bool = False):
  """Final hidden states [B,T,D] of a causal pass.

  Args:
    tokens int [B,T]; positions int [B,T] (default 0..T-1); attention_mask bool [B,T]
      marks valid keys (padding excluded); causality follows ``positions``.
    routing, return_routing: MoE router replay / recorded routing (see ``trunk``).
  Returns:
    hidden [B,T,D] (and the ``moe.Routing`` if ``return_routing``).
  """
  B, T = tokens.shape
  if positions is None:
    positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
  mask = causal_mask(positions, positions, attention_mask)
  if not _extended(cfg):
    if routing is not None or return_routing:
      raise ValueError(f"routing is only defined for mixture-of-experts models, not "
                       f"{cfg.architecture!r}")
    h, _ = trunk(cfg, params, embed(cfg, params, tokens), positions, mask_attend(mask))
    return h
  delta = positions[:, :, None] - positions[:, None, :] if cfg.per_layer_attention else None
  out = trunk(cfg, params, embed(cfg, params, tokens), positions, mask_attend(mask, delta),
              routing=routing, return_routing=return_routing)
  return (out[0], out[2]) if return_routing else out[0]


def forward(cfg: ModelConfig, params: Params, tokens: jax.Array,
            positions: jax.Array | None = None,
            attention_mask: jax.Array | None = None, *,
            routing: jax.Array | None = None, return_routing: bool = False):
  """Logits of a causal LM. tokens int32 [B,T] -> float32 [B,T,V]; positions 0..T-1 by default.

  MoE models: ``routing`` int [Y,B,T,X] replays the given experts (router replay: the
  weights are recomputed from the current router's probabilities of those experts);
  ``return_routing=True`` returns ``(logits, moe.Routing)`` with the chosen ids and the
  router logits (for ``moe.load_balancing_loss``).
  """
  if not return_routing and routing is None:
    return logits_from_hidden(cfg, params,
                              hidden_states(cfg, params, tokens, positions, attention_mask))
  h, route = hidden_states(cfg, params, tokens, positions, attention_mask, routing=routing,
                           return_routing=True)
  logits = logits_from_hidden(cfg, params, h)
  return (logits, route) if return_routing else logits


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
    z = jnp.einsum("bcd,dv->bcv", hc, w, preferred_element_type=jnp.float32)
    z = softcap(z, cfg.final_softcap) / temperature
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
