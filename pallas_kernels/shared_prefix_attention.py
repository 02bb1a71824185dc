"""Shared-prefix (DualKV) attention for GRPO-style groups: one prompt, M samples.

The prompt of a group is stored once (the context); each of its M responses attends to the
context and, causally, to its own tokens. Response query j of response i sees context keys
0..ctx_len-1 and response i's keys 0..j, with one softmax over both regions.

Layouts (axis letters: the legend of ``rl_jax/__init__.py``; here G groups,
M responses per group, R response length, P padded context length, N query heads, K kv
heads (N a multiple of K, grouped-query attention), H head dim):
  q              [G,M,R,N,H]
  k_ctx, v_ctx   [G,P,K,H]        context (prompt) keys and values, right-padded
  k_resp, v_resp [G,M,R,K,H]      each response's own keys and values
  ctx_lengths    int32 [G]        valid context length of each group (None = P)
  out            [G,M,R,N,H]      lse float32 [G,M,R,N]

Backends (one function, chosen by ``backend``):
  "tpu"        Mosaic kernels; key tiles walked by the grid, state in VMEM scratch
               (shared_prefix_tpu.py).
  "gpu"        Triton kernels; key tiles walked by an in-kernel loop (shared_prefix_gpu.py).
  "reference"  the pure-jnp two-region computation of ``lse_attention.py``, the fast path
               on CPU.
  "auto"       by the platform the program is compiled for: ``target_platform``'s inside
               that context (``rl_jax.sharding.use`` enters it with its mesh's platform,
               so a program traced for a mesh of TPU devices takes the TPU kernel on any
               host), else ``jax.default_backend()``; on CPU the reference, or the TPU
               kernel in the Pallas interpreter when ``interpret=True``.
The kernels are differentiable through ``jax.custom_vjp``: the backward recomputes
probabilities from the saved log-sum-exp; context dK/dV are summed over the M responses in
float32 in a fixed order.

References: DualKV shared-prefix attention (amazon-science/dualkv-flash-attn-for-rl);
FlashAttention-2 (Dao, 2023).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from pallas_kernels import block_sizes as _bs
from pallas_kernels import shared_prefix_gpu, shared_prefix_tpu
from pallas_kernels.block_sizes import BlockSizes
from pallas_kernels.lse_attention import two_region_attention

__all__ = ["BACKENDS", "current_platform", "resolve_backend", "shared_prefix_attention",
           "shared_prefix_attention_lse", "shared_prefix_attention_reference",
           "target_platform"]

BACKENDS = ("auto", "tpu", "gpu", "reference")
_KERNELS = {"tpu": shared_prefix_tpu, "gpu": shared_prefix_gpu}
_DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)
_PLATFORM: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "pallas_kernels_platform", default=None)


@contextlib.contextmanager
def target_platform(platform: str | None):
  """Within this context (at trace time) ``backend="auto"`` picks the kernel for
  ``platform`` ("tpu", "gpu"/"cuda"/"rocm", "cpu"; None: ``jax.default_backend()``), the
  platform of the devices the traced program is compiled for, which need not be this
  host's (a program compiled for an abstract TPU topology on a CPU host)."""
  token = _PLATFORM.set(platform)
  try:
    yield
  finally:
    _PLATFORM.reset(token)


def current_platform() -> str:
  """The platform ``backend="auto"`` resolves against: ``target_platform``'s, else
  ``jax.default_backend()``."""
  return _PLATFORM.get() or jax.default_backend()


# ---------------------------------------------------------------------------------------
# Validation (static shapes and dtypes; context lengths when they are concrete).


def _check_inputs(q, k_ctx, v_ctx, k_resp, v_resp, ctx_lengths):
  """Raises ValueError naming the first problem with the inputs."""
  names = ("q", "k_ctx", "v_ctx", "k_resp", "v_resp")
  arrays = (q, k_ctx, v_ctx, k_resp, v_resp)
  for name, x, ndim in zip(names, arrays, (5, 4, 4, 5, 5)):
    if not hasattr(x, "shape") or len(x.shape) != ndim:
      raise ValueError(f"{name} must have {ndim} dims, got shape {getattr(x, 'shape', None)}")
  g, m, r, n, h = q.shape
  p, k = k_ctx.shape[1], k_ctx.shape[2]
  if v_ctx.shape != k_ctx.shape:
    raise ValueError(f"v_ctx shape {v_ctx.shape} != k_ctx shape {k_ctx.shape}")
  if k_ctx.shape[0] != g or k_ctx.shape[3] != h:
    raise ValueError(f"k_ctx shape {k_ctx.shape} must be [G={g}, P, K, H={h}]")
  for name, x in (("k_resp", k_resp), ("v_resp", v_resp)):
    if x.shape != (g, m, r, k, h):
      raise ValueError(f"{name} shape {x.shape} must be [G,M,R,K,H] = {(g, m, r, k, h)}")
  if min(g, m, r, n, h, p, k) < 1:
    raise ValueError(f"all dims must be >= 1, got q {q.shape} and k_ctx {k_ctx.shape}")
  if n % k:
    raise ValueError(f"query heads ({n}) must be a multiple of kv heads ({k})")
  dtypes = {jnp.dtype(x.dtype) for x in arrays}
  if len(dtypes) != 1:
    raise ValueError(f"q, k_ctx, v_ctx, k_resp, v_resp must share one dtype, got "
                     f"{[str(jnp.dtype(x.dtype)) for x in arrays]}")
  if dtypes.pop() not in {jnp.dtype(t) for t in _DTYPES}:
    raise ValueError(f"dtype must be float32, bfloat16 or float16, got {q.dtype}")
  if ctx_lengths is None:
    return
  if not hasattr(ctx_lengths, "shape"):
    ctx_lengths = np.asarray(ctx_lengths)
  if ctx_lengths.shape != (g,):
    raise ValueError(f"ctx_lengths must have shape [G] = ({g},), got {ctx_lengths.shape}")
  if not jnp.issubdtype(ctx_lengths.dtype, jnp.integer):
    raise ValueError(f"ctx_lengths must be integers, got {ctx_lengths.dtype}")
  if not isinstance(ctx_lengths, jax.core.Tracer):
    lengths = np.asarray(ctx_lengths)
    if lengths.min() < 0 or lengths.max() > p:
      raise ValueError(f"ctx_lengths must lie in [0, P={p}], got {lengths.tolist()}")


def _lengths(q, k_ctx, ctx_lengths):
  """int32 [G] context lengths (all P when ``ctx_lengths`` is None)."""
  g, p = q.shape[0], k_ctx.shape[1]
  return (jnp.full((g,), p, jnp.int32) if ctx_lengths is None
          else jnp.asarray(ctx_lengths).astype(jnp.int32))


def resolve_backend(backend: str = "auto", interpret: bool = False) -> str:
  """The backend ``shared_prefix_attention(..., backend=backend, interpret=interpret)``
  runs when traced here: "tpu", "gpu" or "reference" (see the module docstring)."""
  return _resolve_backend(backend, interpret)


def _resolve_backend(backend: str, interpret: bool) -> str:
  if backend not in BACKENDS:
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
  if not isinstance(interpret, bool):
    raise ValueError(f"interpret must be a bool, got {interpret!r}")
  if backend != "auto":
    return backend
  platform = current_platform()
  if platform == "tpu":
    return "tpu"
  if platform in ("gpu", "cuda", "rocm"):
    return "gpu"
  return "tpu" if interpret else "reference"


def _fit_blocks(backend, block_sizes, r, p, h, interpret):
  sizes = _bs.DEFAULT_BLOCK_SIZES[backend] if block_sizes is None else block_sizes
  if not isinstance(sizes, BlockSizes):
    raise ValueError(f"block_sizes must be a BlockSizes, got {type(sizes).__name__}")
  sizes.check(backend)
  if backend == "gpu" and (h < 16 or h & (h - 1)):
    raise ValueError(f"the GPU kernel needs a power-of-two head dim >= 16, got H={h}")
  fitted = _bs.fit(sizes, r=r, p=p, backend=backend)
  # Mosaic: the log-sum-exp rows have the query block as their lane (last) dim.
  bqs = (fitted.sizes.block_q, fitted.sizes.block_q_bwd)
  if backend == "tpu" and not interpret and any(b % 128 and b != fitted.r_pad for b in bqs):
    raise ValueError(f"TPU query blocks must be multiples of 128 (or cover all of R), got "
                     f"{fitted.sizes}")
  return fitted


# ---------------------------------------------------------------------------------------
# Public API.


def shared_prefix_attention_lse(q, k_ctx, v_ctx, k_resp, v_resp, ctx_lengths=None,
                                interpret=False, *, backend="auto",
                                block_sizes: BlockSizes | None = None):
  """Shared-prefix attention and its log-sum-exp (both differentiable).

  Args:
    q: [G,M,R,N,H] response queries.
    k_ctx, v_ctx: [G,P,K,H] context keys/values (right-padded to P).
    k_resp, v_resp: [G,M,R,K,H] response keys/values.
    ctx_lengths: int [G] valid context lengths in [0, P]; None means all P.
    interpret: run the Pallas kernel in the interpreter (any platform, slow).
    backend: "auto" | "tpu" | "gpu" | "reference" (see the module docstring).
    block_sizes: kernel block sizes; None takes the backend's defaults (block_sizes.py).

  Returns:
    out [G,M,R,N,H] in the dtype of q, and lse float32 [G,M,R,N], the log of each query's
    softmax denominator over both regions.

  Raises:
    ValueError: on inconsistent shapes, mixed or unsupported dtypes, N not a multiple of K,
      concrete ctx_lengths outside [0, P], or an unknown backend / bad block sizes.

  References: DualKV (amazon-science/dualkv-flash-attn-for-rl).
  """
  _check_inputs(q, k_ctx, v_ctx, k_resp, v_resp, ctx_lengths)
  backend = _resolve_backend(backend, interpret)
  lengths = _lengths(q, k_ctx, ctx_lengths)
  if backend == "reference":
    return _reference_jit(q, k_ctx, v_ctx, k_resp, v_resp, lengths)
  fitted = _fit_blocks(backend, block_sizes, q.shape[2], k_ctx.shape[1], q.shape[4], interpret)
  return _kernel_attention(q, k_ctx, v_ctx, k_resp, v_resp, lengths, backend=backend,
                           fitted=fitted, interpret=interpret)


def shared_prefix_attention(q, k_ctx, v_ctx, k_resp, v_resp, ctx_lengths=None,
                            interpret=False, *, backend="auto",
                            block_sizes: BlockSizes | None = None):
  """Shared-prefix attention: each response attends to its group's context and itself.

  Response query j of response i in group g attends to context keys 0..ctx_lengths[g]-1
  and to keys 0..j of response i, softmax(q k^T / sqrt(H)) over both regions.

  Args and Raises: as in ``shared_prefix_attention_lse``.

  Returns:
    [G,M,R,N,H] in the dtype of q. Differentiable in q, k_ctx, v_ctx, k_resp, v_resp.

  References: DualKV (amazon-science/dualkv-flash-attn-for-rl).
  """
  return shared_prefix_attention_lse(q, k_ctx, v_ctx, k_resp, v_resp, ctx_lengths,
                                     interpret, backend=backend, block_sizes=block_sizes)[0]


# ---------------------------------------------------------------------------------------
# Kernel path: pad to whole blocks, custom_vjp over the backend's kernels, slice back.


@functools.partial(jax.jit, static_argnames=("backend", "fitted", "interpret"))
def _kernel_attention(q, k_ctx, v_ctx, k_resp, v_resp, lengths, *, backend, fitted,
                      interpret):
  r, p = q.shape[2], k_ctx.shape[1]
  pad_r = lambda x: jnp.pad(x, [(0, 0), (0, 0), (0, fitted.r_pad - r), (0, 0), (0, 0)])
  pad_p = lambda x: jnp.pad(x, [(0, 0), (0, fitted.p_pad - p), (0, 0), (0, 0)])
  # Padded response rows only see real and padded response keys (never a real query sees
  # them: they come after every real position); padded context keys are past ctx_lengths.
  out, lse = _attention_vjp(pad_r(q), pad_p(k_ctx), pad_p(v_ctx), pad_r(k_resp),
                            pad_r(v_resp), lengths, backend, fitted,
                            1.0 / math.sqrt(q.shape[-1]), interpret)
  return out[:, :, :r], lse[:, :, :r]


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _attention_vjp(q, k_ctx, v_ctx, k_resp, v_resp, lengths, backend, fitted, scale,
                   interpret):
  return _KERNELS[backend].forward(q, k_ctx, v_ctx, k_resp, v_resp, lengths, fitted=fitted,
                                   scale=scale, interpret=interpret)


def _attention_fwd(q, k_ctx, v_ctx, k_resp, v_resp, lengths, backend, fitted, scale,
                   interpret):
  out, lse = _attention_vjp(q, k_ctx, v_ctx, k_resp, v_resp, lengths, backend, fitted, scale,
                            interpret)
  return (out, lse), (q, k_ctx, v_ctx, k_resp, v_resp, lengths, out, lse)


def _attention_bwd(backend, fitted, scale, interpret, residuals, cotangents):
  q, k_ctx, v_ctx, k_resp, v_resp, lengths, out, lse = residuals
  d_out, d_lse = cotangents
  # d lse / d s = p, so the lse cotangent folds into the usual rowsum(dO * O) term.
  di = jnp.sum(d_out.astype(jnp.float32) * out.astype(jnp.float32), axis=-1) - d_lse
  grads = _KERNELS[backend].backward(q, k_ctx, v_ctx, k_resp, v_resp, lengths,
                                     d_out.astype(q.dtype), lse, di, fitted=fitted,
                                     scale=scale, interpret=interpret)
  return (*grads, None)


_attention_vjp.defvjp(_attention_fwd, _attention_bwd)


# ---------------------------------------------------------------------------------------
# Pure-jnp reference: the two regions merged by log-sum-exp (lse_attention.py).


def shared_prefix_attention_reference(q, k_ctx, v_ctx, k_resp, v_resp, ctx_lengths=None, *,
                                      return_lse=False):
  """Pure-jnp shared-prefix attention (same contract as ``shared_prefix_attention``).

  ``lse_attention.two_region_attention`` over the context (all M responses' queries against
  the group's context in one matmul) and each response's own causal block, merged by
  log-sum-exp. Computed in float32.

  Args:
    q, k_ctx, v_ctx, k_resp, v_resp, ctx_lengths: as in ``shared_prefix_attention``.
    return_lse: also return the log-sum-exp float32 [G,M,R,N].

  Returns:
    out [G,M,R,N,H] in the dtype of q (and lse if ``return_lse``).

  References: DualKV (amazon-science/dualkv-flash-attn-for-rl).
  """
  _check_inputs(q, k_ctx, v_ctx, k_resp, v_resp, ctx_lengths)
  lengths = _lengths(q, k_ctx, ctx_lengths)
  out, lse = _reference_jit(q, k_ctx, v_ctx, k_resp, v_resp, lengths)
  return (out, lse) if return_lse else out


@jax.jit
def _reference_jit(q, k_ctx, v_ctx, k_resp, v_resp, lengths):
  g, m, r, n, _ = q.shape
  p = k_ctx.shape[1]
  ctx_mask = (jnp.arange(p) < lengths[:, None])[:, None, None, :]  # [G,1,1,P]
  causal = (jnp.arange(r)[None, :] <= jnp.arange(r)[:, None])[None, None]  # [1,1,R,R]
  out, lse = two_region_attention(q, k_resp, v_resp, causal, k_ctx, v_ctx, ctx_mask,
                                  layout="query_major")
  return out.reshape(q.shape).astype(q.dtype), lse.reshape(g, m, r, n)
