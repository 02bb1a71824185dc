"""Low-rank adapters (LoRA) of the decoder's projections, kept beside the frozen base.

The adapters of a model with ``cfg.lora_rank = r > 0`` live in the parameter tree itself, at
``params["layers"]["lora"]``: for each adapted projection ``t`` (``cfg.lora_targets``) a pair
``{"a": [L, <inputs of W>, r], "b": [L, r, <outputs of W>]}``, stacked over layers like the
weight W they adapt, so the layer scan, the sampler's per-layer loops and the checkpoints
carry them with no special case. A projection computes

    y = x·W + (α / r) · (x·A)·B            (delta W = (α/r)·A·B; PEFT: B_hf·A_hf)

and the forward pass needs nothing but ``params`` and ``cfg``: the trainer, the reference
(``strip``: adapters off) and the sampler call the same model function. With ``r = 0`` the
tree has no adapters and the model computes exactly what it did without them.

Axis letters: the legend of ``rl_jax/__init__.py``; r is the adapter rank (logical axis
``lora_rank``, never sharded: A and B shard like the axes of W they keep).

References: Hu et al. 2021, "LoRA: Low-Rank Adaptation of Large Language Models".
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax.models import quant
from rl_jax.models.config import LORA_TARGETS, ModelConfig

__all__ = ["LORA_INITS", "LORA_TARGETS", "KEY", "adapter_axes", "adapter_shapes", "combine",
           "adapted", "delta", "init_adapters", "layer_merges", "merge", "merge_layerwise",
           "merge_weight",
           "parse_targets", "project", "split", "strip", "trainable", "untrainable"]

KEY = "lora"  # params["layers"][KEY]
LORA_INITS = ("gaussian", "kaiming")  # A's init (B is zero): PEFT's "gaussian" / default

# target -> (axes of W without the layer axis, number of leading input axes of W)
_WEIGHT_AXES = {
    "q": (("embed", "q_heads", "head_dim"), 1),
    "k": (("embed", "kv_heads", "head_dim"), 1),
    "v": (("embed", "kv_heads", "head_dim"), 1),
    "o": (("q_heads", "head_dim", "embed"), 2),
    "gate": (("embed", "mlp"), 1),
    "up": (("embed", "mlp"), 1),
    "down": (("mlp", "embed"), 1),
}


def parse_targets(targets: str | tuple[str, ...] | list[str]) -> tuple[str, ...]:
  """``"q,v"`` or ``("q", "v")`` -> ``("q", "v")`` in ``LORA_TARGETS`` order; raises
  ValueError naming an unknown or repeated target."""
  names = [t.strip() for t in (targets.split(",") if isinstance(targets, str) else targets)]
  names = [t for t in names if t]
  bad = [t for t in names if t not in LORA_TARGETS]
  if bad or not names or len(set(names)) != len(names):
    raise ValueError(f"LoRA targets must be distinct names from {','.join(LORA_TARGETS)}, "
                     f"got {targets!r}")
  return tuple(t for t in LORA_TARGETS if t in names)


def _weight_shape(cfg: ModelConfig, target: str) -> tuple[int, ...]:
  D, F, N, K, H = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads,
                   cfg.head_dim)
  return {"q": (D, N, H), "k": (D, K, H), "v": (D, K, H), "o": (N, H, D), "gate": (D, F),
          "up": (D, F), "down": (F, D)}[target]


def adapter_axes(cfg: ModelConfig) -> dict[str, dict[str, tuple]]:
  """Logical axes of the adapters: target -> {"a": (layers, <in axes>, lora_rank),
  "b": (layers, lora_rank, <out axes>)}."""
  out = {}
  for t in cfg.lora_targets:
    axes, n_in = _WEIGHT_AXES[t]
    out[t] = {"a": ("layers", *axes[:n_in], "lora_rank"),
              "b": ("layers", "lora_rank", *axes[n_in:])}
  return out


def adapter_shapes(cfg: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
  """Shapes of the adapters (the tree of ``adapter_axes``): A [L,<in>,r], B [L,r,<out>]."""
  L, r = cfg.num_layers, cfg.lora_rank
  out = {}
  for t in cfg.lora_targets:
    shape, n_in = _weight_shape(cfg, t), _WEIGHT_AXES[t][1]
    out[t] = {"a": (L, *shape[:n_in], r), "b": (L, r, *shape[n_in:])}
  return out


def adapter_dtype(cfg: ModelConfig) -> jnp.dtype:
  """Storage dtype of the adapters: ``cfg.lora_dtype``, or ``cfg.param_dtype`` (the base's)
  when that is empty."""
  return jnp.dtype(cfg.lora_dtype or cfg.param_dtype)


def init_adapters(cfg: ModelConfig, rng: jax.Array, init: str = "gaussian") -> dict:
  """Fresh adapters: B = 0 (the adapted model equals the base) and A random:
  ``"gaussian"`` N(0, 1/r²) (PEFT's ``init_lora_weights="gaussian"``), ``"kaiming"``
  U(±1/sqrt(fan_in)) (PEFT's default, Kaiming-uniform with a = sqrt(5)). In
  ``adapter_dtype(cfg)``."""
  if init not in LORA_INITS:
    raise ValueError(f"LoRA init must be one of {LORA_INITS}, got {init!r}")
  dtype = adapter_dtype(cfg)
  shapes = adapter_shapes(cfg)
  out = {}
  for i, t in enumerate(cfg.lora_targets):
    sa, key = shapes[t]["a"], jax.random.fold_in(rng, i)
    fan_in = int(np.prod(sa[1:-1]))
    if init == "gaussian":
      a = jax.random.normal(key, sa, jnp.float32) / cfg.lora_rank
    else:
      bound = 1.0 / np.sqrt(fan_in)
      a = jax.random.uniform(key, sa, jnp.float32, -bound, bound)
    out[t] = {"a": a.astype(dtype), "b": jnp.zeros(shapes[t]["b"], dtype)}
  return out


# ------------------------------------------------------------------------------ the trees
def split(params: dict) -> tuple[dict, dict]:
  """(base without adapters, adapters) of a parameter tree (adapters ``{}`` if none)."""
  layers = dict(params["layers"])
  adapters = layers.pop(KEY, {})
  return {**params, "layers": layers}, adapters


def combine(base: dict, adapters: dict) -> dict:
  """The parameter tree of ``base`` with ``adapters`` (the inverse of ``split``)."""
  if not adapters:
    return base
  return {**base, "layers": {**base["layers"], KEY: adapters}}


def strip(params: dict) -> dict:
  """``params`` with the adapters off: the frozen base (the KL reference)."""
  return split(params)[0]


def trainable(cfg: ModelConfig, params: dict) -> tuple[dict, dict]:
  """(frozen, trained) parts of ``params``: (base, adapters) with LoRA on, ({}, params)
  off; ``untrainable(cfg, frozen, trained)`` puts them back together."""
  if cfg.lora_rank:
    return split(params)
  return {}, params


def untrainable(cfg: ModelConfig, frozen: dict, trained: dict) -> dict:
  """The parameter tree of ``trainable``'s two parts."""
  return combine(frozen, trained) if cfg.lora_rank else trained


def merge(cfg: ModelConfig, params: dict) -> dict:
  """The base with each adapted weight replaced by W + (α/r)·A·B (in W's dtype; a quantised
  W is dequantised first, to ``cfg.param_dtype``, and the sum stays unquantised); adapters
  removed. A tree without adapters is returned as is."""
  base, adapters = split(params)
  if not adapters:
    return base
  scale = cfg.lora_alpha / cfg.lora_rank
  layers = dict(base["layers"])
  for t, ab in adapters.items():
    w = layers[t]
    if quant.is_quantized(w):
      w = quant.dequantize(w, jnp.dtype(cfg.param_dtype))
    a = ab["a"].astype(jnp.float32).reshape(w.shape[0], -1, cfg.lora_rank)
    b = ab["b"].astype(jnp.float32).reshape(w.shape[0], cfg.lora_rank, -1)
    delta = jnp.einsum("lir,lro->lio", a, b).reshape(w.shape)
    layers[t] = (w.astype(jnp.float32) + scale * delta).astype(w.dtype)
  return {**base, "layers": layers}


def merge_weight(cfg: ModelConfig, name: str, w, ab: dict) -> jax.Array:
  """``merge`` of one adapted weight: ``w`` (``params["layers"][name]``, or rows of it) plus
  its adapter ``ab`` (the matching rows of ``{"a", "b"}``), as ``merge`` makes it."""
  return merge(cfg, {"layers": {name: w, KEY: {name: ab}}})["layers"][name]


def layer_merges(cfg: ModelConfig, params: dict) -> dict[str, tuple]:
  """What ``merge`` with a dequantised base (``quant.dequantize_base``) makes of each layer
  weight it changes, one layer at a time: ``{name: (shape [L, ...], dtype, layer)}`` for every
  weight of ``params["layers"]`` that has an adapter or is quantised, where ``layer(i)`` is
  layer i's merged (dequantised) weight as a host array. The float32 temporaries
  (dequantised weight, delta, sum) then exist for one layer at a time, not for whole stacks
  (12 bytes per value of a projection: more than the host holds for the HF export of a
  4B-parameter QLoRA base). The same values as the whole-stack computation
  (tests/test_qlora.py)."""
  base, adapters = split(params)
  dtype = jnp.dtype(cfg.param_dtype)
  row = lambda x, i: jax.tree.map(lambda a: a[i:i + 1], x)
  out = {}
  for t, w in base["layers"].items():
    ab = adapters.get(t)
    if ab is None and not quant.is_quantized(w):
      continue

    @jax.jit
    def one(w_l, ab_l, t=t):  # [1, ...] slices of one layer
      if ab_l is None:
        return quant.dequantize(w_l, dtype)
      return merge_weight(cfg, t, w_l, ab_l)

    def layer(i, w=w, ab=ab, one=one) -> np.ndarray:
      return np.asarray(jax.device_get(one(row(w, i), None if ab is None else row(ab, i))))[0]

    out[t] = (tuple(w.shape), np.dtype(dtype if quant.is_quantized(w) else w.dtype), layer)
  return out


def merge_layerwise(cfg: ModelConfig, params: dict) -> dict:
  """``merge`` of the dequantised base, its merged weights built layer by layer
  (``layer_merges``) into host arrays [L, ...]; the rest of the tree as it is."""
  base, _ = split(params)
  layers = dict(base["layers"])
  for t, (shape, dtype, layer) in layer_merges(cfg, params).items():
    layers[t] = np.empty(shape, dtype)
    for i in range(shape[0]):
      layers[t][i] = layer(i)
  return {**base, "layers": layers}


# ------------------------------------------------------------------------------ the forward
def project(cfg: ModelConfig, lp: dict[str, Any], name: str, spec: str,
            x: jax.Array) -> jax.Array:
  """``einsum(spec, x, W)`` of one layer's weight ``lp[name]`` (plain or quantised,
  ``rl_jax.models.quant``) in the compute dtype, plus
  the adapter's (α/r)·(x·A)·B when ``lp`` holds one for ``name``.

  Args:
    lp: one layer's parameters (a slice of ``params["layers"]``).
    spec: the projection's einsum, e.g. ``"btd,dnh->btnh"`` (x letters, W letters -> out).
    x: the input, e.g. [B,T,D].
  Returns:
    the projection, e.g. [B,T,N,H].
  """
  dt = jnp.dtype(cfg.dtype)
  w = quant.gathered(name, lp[name])  # a quantised W: gathered as 8-bit values and scales
  y = quant.matmul(spec, x, w, dt)  # ... and dequantised inside the matmul
  d = delta(cfg, lp, name, spec, x)
  return y if d is None else y + d


def adapted(lp: dict[str, Any], names: tuple[str, ...]) -> bool:
  """Whether one layer's parameters ``lp`` hold an adapter for any of ``names``."""
  adapters = lp.get(KEY) or {}
  return any(n in adapters for n in names)


def delta(cfg: ModelConfig, lp: dict[str, Any], name: str, spec: str,
          x: jax.Array) -> jax.Array | None:
  """The adapter's part (α/r)·(x·A)·B of ``project`` (None when ``name`` has no adapter),
  for callers that compute the base product ``einsum(spec, x, W)`` themselves.

  Args and shapes as ``project``; returns the out shape of ``spec``, e.g. [B,T,F].
  """
  adapters = lp.get(KEY)
  if not adapters or name not in adapters:
    return None
  dt = jnp.dtype(cfg.dtype)
  ins, out = spec.split("->")
  xs, ws = ins.split(",")
  w_in = "".join(c for c in ws if c in xs)
  w_out = "".join(c for c in ws if c not in xs)
  batch = "".join(c for c in xs if c not in ws)
  a, b = adapters[name]["a"].astype(dt), adapters[name]["b"].astype(dt)
  u = jnp.einsum(f"{xs},{w_in}r->{batch}r", x, a)
  scale = jnp.asarray(cfg.lora_alpha / cfg.lora_rank, dt)
  return jnp.einsum(f"{batch}r,r{w_out}->{out}", u * scale, b)
