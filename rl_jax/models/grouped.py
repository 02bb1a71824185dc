"""Grouped responses: M responses per prompt, in the packed prompt-once layout or replicated.

Axis letters: the legend of ``rl_jax/__init__.py`` (G groups (prompts), M responses
per group, P padded prompt length, R padded response length, D model width).

Packed (DualKV) layout, one row per group of length P + M·R::

    [prompt_g (P, right-padded)][resp_1 (R)]...[resp_M (R)]

Prompt token t has position t; token j of every response has position len_g + j (RoPE
positions as in the unpacked sequence). Prompt queries attend causally to the valid prompt;
response query j of response i attends to the valid prompt and to response i's tokens 0..j.
Per-token work (projections, MLP, norms, LM head) runs on the prompt once per group instead
of M times: the whole-model token reduction is rho = M(P+R)/(P+M·R).

Replicated layout: G·M rows of [prompt_g (P)][resp_i (R)] with the prompt padding masked out.
Both give identical log-probs and gradients (tests/test_grouped.py).

Rows of several responses (``packing=`` of ``response_logprobs``; the host's plan in
``models.packing``): the packed row holds M' < M rows of R positions, each with several whole
responses, every one at its own positions len_g + j and attending to the prompt and its own
segment (``row_states``, the "concat" response attention with segments). The logits come
out in row order and ``from_rows`` puts them back in [G,M,R] order; the same log-probs and
gradients to float rounding (tests/test_packing.py).

Inside ``sharding.use`` on a mesh with ``sequence`` > 1 both layouts split along length
(``sequence_parallel.py``): the packed row is laid out shard-major (each shard a slice of
the prompt and M/S whole responses) and attends per shard against the all-gathered prompt
K/V; the replicated rows split their queries along length. Same numbers up to float32
rounding (tests/test_sequence_parallel.py).

The logit that predicts response token 0 sits at the last *valid* prompt position len_g − 1,
the one predicting token j > 0 at response position j − 1: a plain shift-by-one over the packed
row would be wrong at every segment boundary.

Sliding-window layers (Gemma 3, ``cfg.per_layer_attention``): key s is visible to query t
only if pos_q − pos_k < window, in both layouts. The Pallas shared-prefix kernel takes no
window, so a model with sliding layers runs the response part of the packed layout with the
pure-jnp two-region reference (``pallas_kernels.lse_attention``) in every layer, windowed or
not. Sequence parallelism does not support sliding windows (ModelError).

Mixture of experts (router replay): ``routing`` int [G,M,R,Y,X] gives the experts of every
response token (as the sampler recorded them when it fed the token; -1 where nothing was
recorded); prompt tokens are always routed by the router. ``return_routing`` returns the
experts this pass used for the response tokens in the same layout; ``return_dropped`` the
fraction of each MoE layer's assignments dropped for capacity (float32 [Y], zeros when
``cfg.moe_capacity_factor`` is 0; see ``moe.py``). ``balance_mask`` bool [G,M,R] returns
the load-balancing loss of the pass (``moe.load_balancing_loss`` of the current router's
logits) over every valid prompt token and the response tokens it marks, each sequence
counted as in the replicated layout (a packed prompt token stands for its M copies), so both
layouts give the same loss. Not with sequence parallelism (ModelError).

References: DualKV (shared-prompt flash attention for RL training, 2025).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

from rl_jax import sharding
from rl_jax.errors import ModelError
from rl_jax.models import moe
from rl_jax.models import sequence_parallel as sp
from rl_jax.models import transformer as tx
from rl_jax.models.config import ModelConfig

import pallas_kernels
from pallas_kernels.lse_attention import two_region_attention

__all__ = ["from_rows", "last_prompt_state", "packed_hidden", "packs_rows", "replicated_hidden",
           "response_hidden", "response_logprobs", "row_states", "runs_on_rows",
           "token_reduction"]


def _check_group_inputs(prompt_tokens, prompt_lengths, response_tokens, response_mask):
  if prompt_tokens.ndim != 2:
    raise ModelError(f"prompt_tokens must be [G,P], got shape {prompt_tokens.shape}")
  G, P = prompt_tokens.shape
  if prompt_lengths.shape != (G,):
    raise ModelError(f"prompt_lengths must be [G]={G}, got shape {prompt_lengths.shape}")
  if response_tokens.ndim != 3 or response_tokens.shape[0] != G:
    raise ModelError(f"response_tokens must be [G,M,R] with G={G}, got {response_tokens.shape}")
  if response_mask is not None and response_mask.shape != response_tokens.shape:
    raise ModelError(f"response_mask shape {response_mask.shape} != response_tokens shape "
                     f"{response_tokens.shape}")
  if not jnp.issubdtype(prompt_tokens.dtype, jnp.integer) or not jnp.issubdtype(
      response_tokens.dtype, jnp.integer):
    raise ModelError("prompt_tokens and response_tokens must be integer token ids")
  if not isinstance(prompt_lengths, jax.core.Tracer):
    lengths = jax.device_get(prompt_lengths)
    if (lengths < 1).any() or (lengths > P).any():
      raise ModelError(f"prompt_lengths must lie in [1, P={P}], got {lengths.tolist()}")


def prefix_attention_path(prefix_attention: str) -> str:
  """The path ``ModelConfig.prefix_attention`` names: "auto" is "concat" for a program
  compiled for CPUs and "kernel" for TPUs and GPUs (``pallas_kernels.current_platform``:
  the platform of the mesh ``sharding.use`` entered, else JAX's default backend)."""
  if prefix_attention != "auto":
    return prefix_attention
  return "concat" if pallas_kernels.current_platform() == "cpu" else "kernel"


def _packed_attend(prompt_lengths: jax.Array, P: int, M: int, R: int,
                   prefix_attention: str = "auto", segments: jax.Array | None = None):
  """AttendFn for the packed layout: causal prompt + shared-prefix responses.

  q [G,P+M·R,N,H], k and v [G,P+M·R,K,H] -> [G,P+M·R,N,H]. ``prefix_attention``
  (``ModelConfig.prefix_attention``, resolved by ``prefix_attention_path``): "kernel" runs
  the responses through ``pallas_kernels.shared_prefix_attention``, "concat" through
  ``tx.concat_prefix_attention`` (layers without a window). ``segments`` int [G,M,R]: rows
  of several responses (``models.packing``; "concat", no windows), each attending its own.
  """
  if segments is not None:
    responses = functools.partial(tx.concat_prefix_attention, segments=segments)
  elif prefix_attention_path(prefix_attention) == "kernel":
    responses = _per_shard(pallas_kernels.shared_prefix_attention)
  else:
    responses = tx.concat_prefix_attention

  def attend(q, k, v, state, spec=None):
    G = q.shape[0]
    pos = jnp.arange(P)
    valid = pos[None, :] < prompt_lengths[:, None]
    prompt_mask = (pos[None, None, :] <= pos[None, :, None]) & valid[:, None, :]
    if spec is not None:
      prompt_mask = tx.window_mask(spec, prompt_mask, (pos[:, None] - pos[None, :])[None])
    out_p = tx.dense_attention(q[:, :P], k[:, :P], v[:, :P], prompt_mask)
    split = lambda a: a[:, P:].reshape(G, M, R, *a.shape[2:])
    if spec is None:
      out_r = responses(split(q), k[:, :P], v[:, :P], split(k), split(v), prompt_lengths)
    else:
      out_r = _windowed_responses(spec, split(q), k[:, :P], v[:, :P], split(k), split(v),
                                  prompt_lengths)
    return jnp.concatenate([out_p, out_r.reshape(G, M * R, *out_r.shape[3:])], axis=1), state

  return attend


def _per_shard(attention):
  """``attention`` (``pallas_kernels.shared_prefix_attention``'s positional signature) run
  per shard with ``shard_map`` when it runs a Pallas kernel inside ``sharding.use`` on a
  mesh of several devices: XLA cannot partition a kernel's custom call ("Mosaic kernels
  cannot be automatically partitioned"), so each device attends its own groups (the rules'
  ``batch`` axes) and, when the rules split both query and kv heads alike, its own heads
  (GQA groups stay whole). The jnp reference (CPU) is left to XLA's partitioner."""

  def run(q, k_ctx, v_ctx, k_resp, v_resp, lengths):
    active = sharding.active()
    if (active is None or active[0].size == 1
        or pallas_kernels.resolve_backend() == "reference"):
      return attention(q, k_ctx, v_ctx, k_resp, v_resp, lengths)
    mesh, rules = active
    one = lambda axes, n: sharding.logical_to_spec((axes,), rules, mesh, (n,))[0]
    batch = one("batch", q.shape[0])
    q_heads, kv_heads = one("act_heads", q.shape[3]), one("act_kv_heads", k_ctx.shape[2])
    heads = q_heads if q_heads == kv_heads else None
    q_spec = PartitionSpec(batch, None, None, heads, None)
    ctx_spec = PartitionSpec(batch, None, heads, None)
    # check_vma=False: a pallas_call's outputs carry no varying-axes type
    fn = jax.shard_map(attention, mesh=mesh, out_specs=q_spec, check_vma=False,
                       in_specs=(q_spec, ctx_spec, ctx_spec, q_spec, q_spec,
                                 PartitionSpec(batch)))
    return fn(q, k_ctx, v_ctx, k_resp, v_resp, lengths.astype(jnp.int32))

  return run


def _windowed_responses(spec, q, k_ctx, v_ctx, k_resp, v_resp, prompt_lengths):
  """Shared-prefix attention of the responses with the layer's window (jnp reference).

  q [G,M,R,N,H]; k_ctx, v_ctx [G,P,K,H]; k_resp, v_resp [G,M,R,K,H] -> [G,M,R,N,H].
  Response token j has position len_g + j, prompt token p position p.
  """
  R, P = q.shape[2], k_ctx.shape[1]
  j, p = jnp.arange(R), jnp.arange(P)
  ctx_mask = (p[None, None, :] < prompt_lengths[:, None, None])  # [G,1,P]
  ctx_delta = prompt_lengths[:, None, None] + j[None, :, None] - p[None, None, :]  # [G,R,P]
  ctx_mask = tx.window_mask(spec, ctx_mask, ctx_delta)[:, None]  # [G,1,R,P]
  own_delta = j[:, None] - j[None, :]
  own_mask = tx.window_mask(spec, own_delta >= 0, own_delta)[None, None]  # [1,1,R,R]
  out, _ = two_region_attention(q, k_resp, v_resp, own_mask, k_ctx, v_ctx, ctx_mask,
                                layout="query_major")
  return out.reshape(q.shape).astype(q.dtype)


def _check_sequence_plan(cfg: ModelConfig, pl) -> None:
  if pl is not None and cfg.per_layer_attention:
    raise ModelError(f"sequence parallelism does not support the sliding-window layers of "
                     f"{cfg.architecture!r} (layer_types); use a mesh with sequence=1")


def _check_routing(cfg: ModelConfig, pl, routing, return_routing: bool) -> None:
  if (routing is not None or return_routing) and not cfg.is_moe:
    raise ModelError(f"routing is only defined for mixture-of-experts models, not "
                     f"{cfg.architecture!r}")
  if (routing is not None or return_routing) and pl is not None:
    raise ModelError("router replay / returned routing / the load-balancing loss is not "
                     "supported with sequence parallelism; use a mesh with sequence=1")


def _trunk_routing(routing, rows: int, P: int):
  """Recorded response routing [G,M,R,Y,X] -> the trunk's [Y,rows,P+(M·R·G/rows),X] with
  the P prompt positions of every row set to -1 (routed by the router)."""
  if routing is None:
    return None
  G, M, R, Y, X = routing.shape
  resp = jnp.moveaxis(routing.astype(jnp.int32), 3, 0).reshape(Y, rows, -1, X)
  return jnp.concatenate([jnp.full((Y, rows, P, X), -1, jnp.int32), resp], axis=2)


def _with_routing(cfg, pred, out, G, M, R, P, return_routing: bool, return_dropped: bool,
                  balance=None):
  """pred, then the response ids [G,M,R,Y,X], the dropped fraction [Y] and the
  load-balancing loss (``balance``: float32 [rows,T] token weights of the trunk's rows) as
  asked."""
  extra = (_response_ids(out[2], G, M, R, P),) if return_routing else ()
  extra += (out[2].dropped,) if return_dropped else ()
  if balance is not None:
    extra += (moe.load_balancing_loss(out[2].logits, cfg.num_experts_per_tok, balance),)
  return (pred, *extra) if extra else pred


def _balance_weights(prompt_lengths, P: int, balance_mask, copies: int):
  """Token weights [rows, P+..] of the trunk's rows for the load-balancing loss: ``copies``
  on the valid prompt positions, the response positions' ``balance_mask`` (rows · .. = G·M·R
  response tokens)."""
  prompt = (jnp.arange(P)[None] < prompt_lengths[:, None]).astype(jnp.float32) * copies
  resp = balance_mask.astype(jnp.float32).reshape(prompt.shape[0], -1)
  return jnp.concatenate([prompt, resp], axis=1)


def _response_ids(route, G: int, M: int, R: int, P: int):
  """The trunk's expert ids [Y,rows,P+..,X] at the response positions -> [G,M,R,Y,X]."""
  ids = route.ids[:, :, P:]
  return jnp.moveaxis(ids.reshape(ids.shape[0], G, M, R, ids.shape[-1]), 0, 3)


def last_prompt_state(h, prompt_lengths, P: int):
  """The hidden state at each row's last valid prompt position: h [rows,T,D] (T >= P, the
  prompt in the first P positions), prompt_lengths int [rows] in [1, P] -> [rows,1,D].

  A masked sum over the P prompt positions rather than a gather: the same values on every
  backend (one x plus exact zeros; no matmul, whose default precision on TPU would round
  float32 to bf16), and a transpose that XLA's SPMD partitioner gets right where the rows do
  not divide the batch devices. There the gather's transpose (a scatter-add) came out wrong:
  the packed layout's gradient for 2 groups x 4 samples x 8 tokens on 8 devices (fsdp) was
  off by 0.25% in norm
  (``tests/test_grouped.py::test_packed_gradient_on_eight_devices_with_two_groups``)."""
  at = jnp.arange(P)[None, :] == (prompt_lengths - 1)[:, None]  # [rows,P]
  return jnp.sum(jnp.where(at[..., None], h[:, :P], 0), axis=1, keepdims=True)


def packed_hidden(cfg: ModelConfig, params, prompt_tokens, prompt_lengths, response_tokens,
                  routing=None, return_routing: bool = False, return_dropped: bool = False,
                  balance_mask=None):
  """Hidden states at the predictor position of every response token, packed layout.

  Args:
    prompt_tokens int [G,P] right-padded; prompt_lengths int [G]; response_tokens int [G,M,R].
    routing, return_routing, return_dropped, balance_mask: MoE router replay, the dropped
      fraction and the load-balancing loss (see the module docstring).
  Returns:
    [G,M,R,D]: the hidden state whose logits predict response_tokens[g,i,j] (and the
    response tokens' expert ids int32 [G,M,R,Y,X] if ``return_routing``, then the dropped
    fraction float32 [Y] if ``return_dropped``, then the load-balancing loss float32 [] if
    ``balance_mask`` is given).
  """
  G, P = prompt_tokens.shape
  _, M, R = response_tokens.shape
  resp_pos = prompt_lengths[:, None, None] + jnp.arange(R)[None, None, :]
  pl = sp.plan(P + M * R, (P, M))
  _check_sequence_plan(cfg, pl)
  routed = return_routing or return_dropped or balance_mask is not None
  _check_routing(cfg, pl, routing, routed)
  if pl is not None:
    return _packed_hidden_split(cfg, params, pl, prompt_tokens, prompt_lengths,
                                response_tokens, resp_pos)
  tokens = jnp.concatenate([prompt_tokens, response_tokens.reshape(G, M * R)], axis=1)
  positions = jnp.concatenate(
      [jnp.broadcast_to(jnp.arange(P), (G, P)), jnp.broadcast_to(resp_pos, (G, M, R)).reshape(G, -1)],
      axis=1).astype(jnp.int32)
  kw = {} if not cfg.is_moe else dict(routing=_trunk_routing(routing, G, P),
                                      return_routing=routed)
  out = tx.trunk(cfg, params, tx.embed(cfg, params, tokens), positions,
                 _packed_attend(prompt_lengths, P, M, R, cfg.prefix_attention), **kw)
  h = out[0]
  first = last_prompt_state(h, prompt_lengths, P)  # [G,1,D]
  resp = h[:, P:].reshape(G, M, R, -1)
  first = jnp.broadcast_to(first[:, None], (G, M, 1, h.shape[-1]))
  pred = jnp.concatenate([first, resp[:, :, :-1]], axis=2)
  balance = (None if balance_mask is None else
             _balance_weights(prompt_lengths, P, balance_mask, M))
  return _with_routing(cfg, pred, out, G, M, R, P, return_routing, return_dropped, balance)


def _packed_hidden_split(cfg, params, pl, prompt_tokens, prompt_lengths, response_tokens,
                         resp_pos):
  """``packed_hidden`` on the shard-major row of ``sequence_parallel`` (S = pl.S > 1)."""
  G, P = prompt_tokens.shape
  _, M, R = response_tokens.shape
  tokens = sp.packed_rows(prompt_tokens, response_tokens, pl.S)
  positions = sp.packed_rows(jnp.broadcast_to(jnp.arange(P), (G, P)),
                             jnp.broadcast_to(resp_pos, (G, M, R)), pl.S).astype(jnp.int32)
  h, _ = tx.trunk(cfg, params, tx.embed(cfg, params, tokens), positions,
                  sp.packed_attend(pl, prompt_lengths, P, M, R))
  prompt_h, resp = sp.split_packed(h, P, M, R, pl.S)
  first = last_prompt_state(prompt_h, prompt_lengths, P)  # [G,1,D]
  first = jnp.broadcast_to(first[:, None], (G, M, 1, h.shape[-1]))
  return jnp.concatenate([first, resp[:, :, :-1]], axis=2)


def replicated_hidden(cfg: ModelConfig, params, prompt_tokens, prompt_lengths, response_tokens,
                      routing=None, return_routing: bool = False, return_dropped: bool = False,
                      balance_mask=None):
  """Same as ``packed_hidden`` computed on G·M rows of [prompt (P)][response (R)]."""
  G, P = prompt_tokens.shape
  _, M, R = response_tokens.shape
  prompts = jnp.repeat(prompt_tokens, M, axis=0)  # [G·M,P]
  lengths = jnp.repeat(prompt_lengths, M, axis=0)
  tokens = jnp.concatenate([prompts, response_tokens.reshape(G * M, R)], axis=1)
  positions = jnp.concatenate(
      [jnp.broadcast_to(jnp.arange(P), (G * M, P)), lengths[:, None] + jnp.arange(R)[None]],
      axis=1).astype(jnp.int32)
  valid = jnp.concatenate([jnp.arange(P)[None] < lengths[:, None],
                           jnp.ones((G * M, R), bool)], axis=1)
  mask = tx.causal_mask(positions, positions, valid)
  pl = sp.plan(P + R)
  _check_sequence_plan(cfg, pl)
  routed = return_routing or return_dropped or balance_mask is not None
  _check_routing(cfg, pl, routing, routed)
  delta = positions[:, :, None] - positions[:, None, :] if cfg.per_layer_attention else None
  attend = tx.mask_attend(mask, delta) if pl is None else sp.replicated_attend(pl, mask)
  kw = {} if not cfg.is_moe else dict(routing=_trunk_routing(routing, G * M, P),
                                      return_routing=routed)
  out = tx.trunk(cfg, params, tx.embed(cfg, params, tokens), positions, attend, **kw)
  h = out[0]
  first = last_prompt_state(h, lengths, P)  # [G·M,1,D]
  pred = jnp.concatenate([first, h[:, P:P + R - 1]], axis=1).reshape(G, M, R, -1)
  balance = (None if balance_mask is None else
             _balance_weights(lengths, P, balance_mask, 1))
  return _with_routing(cfg, pred, out, G, M, R, P, return_routing, return_dropped, balance)


def packs_rows(cfg: ModelConfig, prefix_attention: str | None = None) -> bool:
  """Whether the packed layout can take several responses per row (``models.packing``) for
  ``cfg``: the "concat" response attention (``prefix_attention``, default
  ``cfg.prefix_attention``, resolved for the current platform), a dense model without
  sliding-window layers. Sequence-parallel meshes are checked when the pass runs."""
  path = prefix_attention_path(cfg.prefix_attention if prefix_attention is None
                               else prefix_attention)
  return path == "concat" and not cfg.is_moe and not cfg.per_layer_attention


def runs_on_rows(cfg: ModelConfig, packing, P: int, R: int, shared_prefix: bool = True,
                 routed: bool = False) -> bool:
  """Whether a pass given ``packing`` (``models.packing``) runs on its rows: the packed
  layout (``shared_prefix``), ``packs_rows(cfg)``, no MoE outputs (``routed``), and no
  sequence-parallel split of the rows' length P + M'·R."""
  return (packing is not None and shared_prefix and not routed and packs_rows(cfg)
          and sp.plan(P + packing[0].shape[1] * R) is None)


def row_states(cfg: ModelConfig, params, prompt_tokens, prompt_lengths, response_tokens,
               src):
  """The trunk on the rows of ``src`` (``packing.Packing.src`` int [G,M',R]); returns the
  hidden states [G,M+M'·R,D] whose logits are wanted and their targets int [G,M+M'·R]:
  first the last prompt state M times (each response's token 0), then every row position
  (predicting the next position of its segment; target 0 where none follows)."""
  G, P = prompt_tokens.shape
  _, M, R = response_tokens.shape
  Mp = src.shape[1]
  held = src.reshape(G, Mp * R)
  pad = held < 0
  at = jnp.maximum(held, 0)
  toks = jnp.where(pad, 0, jnp.take_along_axis(response_tokens.reshape(G, M * R), at, axis=1))
  segments = jnp.where(pad, -1, at // R)
  tokens = jnp.concatenate([prompt_tokens, toks], axis=1)
  positions = jnp.concatenate([jnp.broadcast_to(jnp.arange(P), (G, P)),
                               prompt_lengths[:, None] + at % R], axis=1).astype(jnp.int32)
  attend = _packed_attend(prompt_lengths, P, Mp, R, "concat",
                          segments.reshape(G, Mp, R))
  h, _ = tx.trunk(cfg, params, tx.embed(cfg, params, tokens), positions, attend)
  first = jnp.broadcast_to(last_prompt_state(h, prompt_lengths, P), (G, M, h.shape[-1]))
  follows = (segments[:, 1:] == segments[:, :-1]) & ~pad[:, 1:]
  nxt = jnp.concatenate([jnp.where(follows, toks[:, 1:], 0), jnp.zeros((G, 1), toks.dtype)],
                        axis=1)
  return (jnp.concatenate([first, h[:, P:]], axis=1),
          jnp.concatenate([response_tokens[:, :, 0], nxt], axis=1))


def from_rows(out, dst):
  """Per-position values [G,M+M'·R] of ``row_states``' order -> [G,M,R] response order:
  token 0 of response i from entry i, token j > 0 from the row position before it
  (``packing.Packing.dst`` int [G,M,R])."""
  G, M, R = dst.shape
  j = jnp.arange(R)[None, None, :]
  idx = jnp.where(j == 0, jnp.arange(M)[None, :, None], M + dst - 1)
  return jnp.take_along_axis(out, idx.reshape(G, M * R), axis=1).reshape(G, M, R)


def response_hidden(cfg, params, prompt_tokens, prompt_lengths, response_tokens,
                    shared_prefix: bool = True, routing=None, return_routing: bool = False,
                    return_dropped: bool = False, balance_mask=None):
  """Predictor hidden states [G,M,R,D] in the packed (default) or replicated layout (and the
  response tokens' expert ids [G,M,R,Y,X] if ``return_routing``, the dropped fraction [Y] if
  ``return_dropped``, the load-balancing loss [] if ``balance_mask`` is given)."""
  fn = packed_hidden if shared_prefix else replicated_hidden
  if routing is None and not return_routing and not return_dropped and balance_mask is None:
    return fn(cfg, params, prompt_tokens, prompt_lengths, response_tokens)
  return fn(cfg, params, prompt_tokens, prompt_lengths, response_tokens, routing,
            return_routing, return_dropped, balance_mask)


def response_logprobs(cfg: ModelConfig, params, prompt_tokens, prompt_lengths, response_tokens,
                      response_mask=None, shared_prefix: bool = True, temperature: float = 1.0,
                      with_entropy: bool = False, *, routing=None, return_routing: bool = False,
                      return_dropped: bool = False, balance_mask=None, packing=None):
  """Per-token log-probs of grouped responses.

  Args:
    prompt_tokens int32 [G,P] right-padded; prompt_lengths int32 [G] in [1,P];
    response_tokens int32 [G,M,R]; response_mask bool [G,M,R] (None = all valid);
    shared_prefix: packed P+M·R layout (True) or replicated M·(P+R) (False); equal results.
    temperature: log-probs of softmax(logits / temperature) (the sampling distribution).
    routing: MoE only: int [G,M,R,Y,X] experts of each response token (router replay; -1 =
      the router decides). return_routing: MoE only: also return the experts used.
    return_dropped: MoE only: also return each layer's dropped fraction float32 [Y].
    balance_mask: MoE only: bool [G,M,R] response tokens that count (with every valid prompt
      token) in the returned load-balancing loss (module docstring).
    packing: None, or ``(src, dst)`` of a ``models.packing.plan`` over the responses'
      lengths: the packed layout runs on those rows of several responses each, with the same
      log-probs to float rounding. Ignored (the usual rows) where ``runs_on_rows`` does not
      hold: ``packs_rows`` false, ``shared_prefix=False``, a sequence-parallel mesh, MoE
      outputs.
  Returns:
    float32 [G,M,R], zero where response_mask is False (and entropy [G,M,R] if asked; then
    the response tokens' expert ids int32 [G,M,R,Y,X] if ``return_routing``, then the
    dropped fraction [Y] if ``return_dropped``, then the load-balancing loss float32 [] if
    ``balance_mask`` is given).
  """
  _check_group_inputs(prompt_tokens, prompt_lengths, response_tokens, response_mask)
  G, M, R = response_tokens.shape
  mask = jnp.ones((G, M, R), bool) if response_mask is None else response_mask
  routed = routing is not None or return_routing or return_dropped or balance_mask is not None
  if runs_on_rows(cfg, packing, prompt_tokens.shape[1], R, shared_prefix, routed):
    h, targets = row_states(cfg, params, prompt_tokens, prompt_lengths, response_tokens,
                            packing[0])
    out = tx.token_logprobs(cfg, params, h, targets, temperature, with_entropy)
    out = tuple(from_rows(o, packing[1]) for o in (out if with_entropy else (out,)))
    res = tuple(jnp.where(mask, o, 0.0) for o in out)
    return res if with_entropy else res[0]
  h = response_hidden(cfg, params, prompt_tokens, prompt_lengths, response_tokens, shared_prefix,
                      routing, return_routing, return_dropped, balance_mask)
  h, *extra = h if (return_routing or return_dropped or balance_mask is not None) else (h,)
  pl = sp.plan(M * R, (M,))
  if pl is None:
    h, targets = h.reshape(G, M * R, -1), response_tokens.reshape(G, M * R)
  else:  # one row per (group, sequence shard): the LM head stays on each shard's responses
    h, targets = sp.token_rows(pl, h, response_tokens)
  out = tx.token_logprobs(cfg, params, h, targets, temperature, with_entropy)
  if with_entropy:
    lp, ent = out
    res = (jnp.where(mask, lp.reshape(G, M, R), 0.0), jnp.where(mask, ent.reshape(G, M, R), 0.0))
  else:
    res = jnp.where(mask, out.reshape(G, M, R), 0.0)
  if not extra:
    return res
  return (*res, *extra) if with_entropy else (res, *extra)


def token_reduction(M: int, P: int, R: int) -> float:
  """rho = M(P+R)/(P+M·R): tokens of the replicated layout over tokens of the packed one."""
  return M * (P + R) / (P + M * R)
