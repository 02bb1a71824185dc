"""A frozen base stored quantised (QLoRA): int8 or int4 weights with per-block scales.

With ``cfg.quant`` set (``"int8"``, ``"int4"`` or ``"fp8"``: float8_e4m3fn) each dense projection of
``params["layers"]`` (q, k, v, o and, in dense models, gate, up, down; ``targets``) is a
``qwix.QArray``: integer values ``qvalue`` of W's shape and float32 scales ``scale`` with one
entry per block of ``cfg.quant_block`` consecutive entries along W's last contraction axis
(D for q/k/v/gate/up, H for o, F for down) and per index of every other axis:

    W[l, .., i, ..] ≈ qvalue[l, .., i, ..] · scale[l, .., i // block, ..]      (symmetric absmax:
    scale = max |W| over the block / (qmax + 1/2), qmax = 127 (int8) or 7 (int4); fp8
    scales the block's max |W| to float8_e4m3fn's largest value and rounds to it)

``project`` (``rl_jax.models.lora``) multiplies by the dequantised weight inside the matmul
(``qwix.einsum``: the dequantisation fuses into the dot), so the trainer, the sampler and the
reference (adapters off) all run the quantised base. Embeddings, norms, biases, the LM head
and MoE experts stay in ``cfg.param_dtype``. A QArray is a pytree of two arrays, so the layer
scan slices it, the checkpoints save it, and shardings lay it out like W (its scales keep
W's logical axes except the blocked one, which stays replicated).

Axis letters: the legend of ``rl_jax/__init__.py``.

References: Dettmers et al. 2023, "QLoRA: Efficient Finetuning of Quantized LLMs" (block-wise
quantisation of the frozen base, adapters in higher precision).
"""

from __future__ import annotations

import dataclasses
import sys
from typing import Any, Iterable

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import sharding
from rl_jax.models.config import QUANTS, ModelConfig

__all__ = ["QUANTS", "dequantize", "dequantize_base", "gathered", "is_quantized", "layer_axes",
           "layer_shapes", "matmul", "projection", "quantize", "quantize_base",
           "quantize_layers", "targets"]

_QTYPES = {"int8": jnp.int8, "int4": jnp.int4, "fp8": jnp.float8_e4m3fn}
# projection -> axis of the stacked weight [L, ...] that is blocked (its last contraction axis)
_BLOCK_AXIS = {"q": 1, "k": 1, "v": 1, "o": 2, "gate": 1, "up": 1, "down": 1}


def targets(cfg: ModelConfig) -> tuple[str, ...]:
  """The projections of ``params["layers"]`` stored quantised (none with ``cfg.quant=""``)."""
  if not cfg.quant:
    return ()
  return ("q", "k", "v", "o") if cfg.is_moe else tuple(_BLOCK_AXIS)


def _qwix():
  import qwix  # imported on first use: a model without quantisation never loads it
  return qwix


def is_quantized(x: Any) -> bool:
  """Whether ``x`` is a quantised weight (a ``qwix.QArray``; none exist before qwix loads)."""
  qwix = sys.modules.get("qwix")
  return qwix is not None and isinstance(x, qwix.QArray)


def quantize(w: jax.Array, quant: str, axis: int, block: int) -> Any:
  """``w`` as symmetric ``quant`` integers with float32 scales per ``block`` entries along
  ``axis`` (and per index of every other axis).

  Args:
    w: a weight, e.g. [L,D,N,H].
    quant: ``"int8"`` or ``"int4"``.
    axis: the blocked axis; ``block`` must divide ``w.shape[axis]``.
  Returns:
    QArray with ``qvalue`` of w's shape and ``scale`` of w's shape with ``axis`` divided by
    ``block``.
  """
  others = tuple(i for i in range(w.ndim) if i != axis)
  return _qwix().quantize(w.astype(jnp.float32), _QTYPES[quant], channelwise_axes=others,
                       tiled_axes={axis: block})


def dequantize(w, dtype) -> jax.Array:
  """qvalue · scale (scales broadcast over their blocks), in ``dtype``."""
  return _qwix().dequantize(w).astype(dtype)


def quantize_base(cfg: ModelConfig, params: dict) -> dict:
  """``params`` with each of ``targets(cfg)`` quantised (weights already quantised are kept:
  quantising twice changes nothing)."""
  layers = dict(params["layers"])
  for t in targets(cfg):
    if not is_quantized(layers[t]):
      layers[t] = quantize(layers[t], cfg.quant, _BLOCK_AXIS[t], cfg.quant_block)
  return {**params, "layers": layers}


def quantize_layers(cfg: ModelConfig, t: str, layers: Iterable[np.ndarray],
                    sharding: Any = None) -> Any:
  """``quantize`` of the stacked weight of projection ``t`` computed one layer at a time:
  what ``quantize_base`` makes of ``np.stack(layers)``, bit for bit (each layer is quantised
  by the same program on a stack of one: the blocks never span layers), without the float
  stack ever existing.

  Args:
    layers: the L layers' weights of ``t`` (host arrays, e.g. [D,N,H]), consumed one by one.
    sharding: None (the default device), or the stack's placement: a ``QArray`` of the
      qvalue's and the scale's NamedShardings (``param_shardings`` of a quantised config), or
      W's NamedSharding (the scale then takes it with the blocked axis replicated).
  Returns:
    QArray: ``qvalue`` [L, ...] and ``scale`` [L, ...] (the blocked axis divided by
    ``cfg.quant_block``), placed on ``sharding``.
  """
  axis, L = _BLOCK_AXIS[t], cfg.num_layers
  one = jax.jit(lambda w: quantize(w[None], cfg.quant, axis, cfg.quant_block))
  first, q_host, s_host, n = None, None, None, 0
  for w in layers:
    if n == L:
      raise ValueError(f"quantize_layers: more than {L} layers of {t!r}")
    q = one(w)
    if first is None:
      first = q
      q_host = _host_empty((L, *q.qvalue.shape[1:]), q.qvalue.dtype)
      s_host = _host_empty((L, *q.scale.shape[1:]), q.scale.dtype)
    q_host[n], s_host[n] = np.asarray(q.qvalue)[0], np.asarray(q.scale)[0]
    n += 1
  if n != L:
    raise ValueError(f"quantize_layers: {n} layers of {t!r}, the model has {L}")
  q_sh, s_sh = _split_sharding(sharding, axis, s_host.ndim)
  put = lambda x, sh: jax.device_put(x, sh) if sh is not None else jax.device_put(x)
  return dataclasses.replace(first, qvalue=put(q_host, q_sh), scale=put(s_host, s_sh))


def _host_empty(shape: tuple[int, ...], dtype) -> np.ndarray:
  """An uninitialised C-contiguous host array aligned to 64 bytes: the CPU backend's
  ``device_put`` adopts such a buffer without copying it."""
  dtype = np.dtype(dtype)
  nbytes = int(np.prod(shape)) * dtype.itemsize
  raw = np.empty(nbytes + 64, np.uint8)
  off = (-raw.ctypes.data) % 64
  return raw[off:off + nbytes].view(dtype).reshape(shape)


def _split_sharding(sharding: Any, axis: int, ndim: int) -> tuple[Any, Any]:
  """(qvalue's, scale's) sharding of a quantised weight placed on ``sharding``."""
  if sharding is None or is_quantized(sharding):
    return (None, None) if sharding is None else (sharding.qvalue, sharding.scale)
  spec = list(sharding.spec) + [None] * (ndim - len(sharding.spec))
  spec[axis] = None
  return sharding, jax.sharding.NamedSharding(sharding.mesh, jax.sharding.PartitionSpec(*spec))


def dequantize_base(cfg: ModelConfig, params: dict) -> dict:
  """``params`` with every quantised weight dequantised to ``cfg.param_dtype`` (the float
  base the quantised one stands for: what HF exports write)."""
  dtype = jnp.dtype(cfg.param_dtype)
  return jax.tree.map(lambda x: dequantize(x, dtype) if is_quantized(x) else x, params,
                      is_leaf=is_quantized)


def _blocked(cfg: ModelConfig, t: str, shape: tuple[int, ...]) -> tuple[int, ...]:
  a = _BLOCK_AXIS[t]
  return (*shape[:a], shape[a] // cfg.quant_block, *shape[a + 1:])


def layer_shapes(cfg: ModelConfig, layer: dict) -> dict:
  """The layer shape table (``param_shapes(cfg)["layers"]``) with each quantised weight's
  shape as ``QArray(qvalue=<W's shape>, scale=<blocked shape>)``."""
  out = dict(layer)
  for t in targets(cfg):
    out[t] = _qwix().QArray(layer[t], _blocked(cfg, t, layer[t]), None, _QTYPES[cfg.quant])
  return out


def _replicated(axes: tuple, a: int) -> tuple:
  """``axes`` with axis ``a`` replicated: the axes of the scales of a weight of ``axes``
  blocked along ``a``."""
  return (*axes[:a], None, *axes[a + 1:])


def layer_axes(cfg: ModelConfig, layer: dict) -> dict:
  """The layer axis table (``param_axes(cfg)["layers"]``) with each quantised weight's axes
  as ``QArray(qvalue=<W's axes>, scale=<W's axes, the blocked one None>)``."""
  out = dict(layer)
  for t in targets(cfg):
    axes = layer[t]
    out[t] = _qwix().QArray(axes, _replicated(axes, _BLOCK_AXIS[t]), None, _QTYPES[cfg.quant])
  return out


# projection -> logical axes of one layer's weight gathered for its matmul: the FSDP-sharded
# ``embed`` axis whole, the tensor-parallel axes as they are (``transformer.param_axes``)
_GATHERED_AXES = {"q": (None, "q_heads", "head_dim"), "k": (None, "kv_heads", "head_dim"),
                  "v": (None, "kv_heads", "head_dim"), "o": ("q_heads", "head_dim", None),
                  "gate": (None, "mlp"), "up": (None, "mlp"), "down": ("mlp", None)}
# ... and as stored (``transformer.param_axes`` without the layer axis): ``embed`` sharded
_STORED_AXES = {t: tuple("embed" if a is None else a for a in axes)
                for t, axes in _GATHERED_AXES.items()}


def _scale_axes(name: str, axes: tuple) -> tuple:
  """The axes of one layer's scales of projection ``name`` given its weight's ``axes``."""
  return _replicated(axes, _BLOCK_AXIS[name] - 1)  # the layer axis is gone


def gathered(name: str, w):
  """One layer's quantised weight ``w`` of projection ``name`` with its values and scales
  constrained to the layout its matmul reads (``embed`` whole): under FSDP the 8-bit values
  and their scales are all-gathered, and dequantised after, instead of XLA dequantising each
  shard first and gathering the wider dequantised weight. Unchanged outside a mesh, for a
  plain weight, or for a name without gathered axes.

  The values and scales are first pinned to their stored layout (``_STORED_AXES``), so the
  all-gather happens here, where the layer is used. Without that pin, sharding propagation
  carries the gathered layout back to where ``w`` was made: in the sampler's decode, the
  per-layer slices made before the ``while_loop`` (``transformer.unstack_layers``) became
  gathered loop operands, so every layer's gathered weights were held for the whole loop
  (Qwen3-32B int4 on 8 chips: 0.23 GiB per layer per chip, 15 GiB for 64 layers) instead
  of one layer's while it runs."""
  axes = _GATHERED_AXES.get(name)
  if not is_quantized(w) or axes is None or w.qvalue.ndim != len(axes):
    return w
  stored = _STORED_AXES[name]
  qvalue = sharding.constrain(sharding.constrain(w.qvalue, stored), axes)
  scale = sharding.constrain(sharding.constrain(w.scale, _scale_axes(name, stored)),
                             _scale_axes(name, axes))
  return dataclasses.replace(w, qvalue=qvalue, scale=scale)


def matmul(spec: str, x: jax.Array, w, dtype) -> jax.Array:
  """``einsum(spec, x, W)`` in ``dtype``; a quantised W is dequantised inside the matmul
  (``qwix.einsum``), e.g. x [B,T,D], W [D,N,H] -> [B,T,N,H]."""
  if is_quantized(w):
    return _qwix().einsum(spec, x, w.astype(dtype))
  return projection(spec, x, w.astype(dtype))


def projection(spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
  """``einsum(spec, x, w)`` for a projection spec whose output is x's free axes then w's
  (``"btnh,nhd->btd"``), as one ``dot_general`` contracting the shared axes in x's order.

  ``jnp.einsum`` orders several contracted axes its own way ((h, n) for the example), and
  XLA then transposes both operands, the weight included, to make them adjacent, on every
  call; contracting in storage order (n, h) is a plain [rows, N·H] x [N·H, D] matmul. Other
  specs go to ``jnp.einsum``.
  """
  ins, out = spec.split("->")
  xs, ws = ins.split(",")
  shared = [c for c in xs if c in ws]
  if (len(shared) < 2 or any(c in out for c in shared)
      or out != "".join(c for c in xs if c not in ws) + "".join(c for c in ws if c not in xs)):
    return jnp.einsum(spec, x, w)
  dims = ((tuple(xs.index(c) for c in shared), tuple(ws.index(c) for c in shared)), ((), ()))
  return jax.lax.dot_general(x, w, dims, preferred_element_type=jnp.result_type(x, w))

