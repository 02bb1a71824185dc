"""Expert parallelism on 8 fake CPU devices, checked from the compiled programs.

The ``fsdp`` rule set maps the ``expert`` axis of the expert weights [Y,E,D,F] to the fsdp
mesh axis, so each of 8 devices holds E/8 experts. Tokens are batch-sharded. A large batch
is left to XLA, which partitions the grouped matmuls along the expert axis on CPU: the
routing is all-gathered, the dispatched rows and the partial expert-matmul outputs are
all-reduced, and each device runs its own experts. A small batch (the sampler's) moves its
tokens to the experts' devices itself: the tokens are all-gathered, each device runs its own
experts, and the outputs are reduce-scattered back. Either way the expert weights are never
gathered and there is no all-to-all (see ``rl_jax/models/moe.py``, "Sharding").

FLOPs: on CPU, ``jax.lax.ragged_dot`` lowers to a masked dense matmul per expert group (TPU
and GPU have a native grouped matmul), so the 1-device expert matmuls cost E times the active
share 3·2·A·D·F (A = B·T·X assignments); what the mesh changes is measured as a ratio: each
of 8 devices does 1/8 of the 1-device FLOPs, i.e. E/8 experts' share each.
"""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding

from rl_jax import models, rollout, sharding
from rl_jax.models import moe
from tests.test_moe_rl import MOE_QUICKSTART
from tests.tiny import TINY_MODEL, compiled_rl_update

B, T, D, E, X, F = 16, 8, 32, 8, 2, 16  # tokens B·T = 128, A = B·T·X = 256 assignments
G, M, R = 8, 4, 5  # the RL update: 8 groups (one per device) of 4 samples of 5 tokens
TOL = 0.15  # relative tolerance of the FLOP ratios (router, sort and combine are extra)


def _flops(compiled):
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"]


def _collectives(hlo):
  """{op: [result types, layouts dropped]} of the cross-device ops in an HLO text (a
  combined op's tuple type is one string)."""
  ops = ("all-to-all", "all-gather", "reduce-scatter", "all-reduce", "collective-permute")
  found = {op: re.findall(rf"= (\([^)]*\)|\S+) {op}(?:-start)?\(", hlo) for op in ops}
  return {op: [re.sub(r"\{[^}]*\}", "", t) for t in types] for op, types in found.items()}


def _moe_layer(x, w_router, w_gate, w_up, w_down, top_k=X):
  weights, ids, _ = moe.route(x, w_router, top_k, True)
  return moe.expert_mlp(x, weights, ids, w_gate, w_up, w_down)


@pytest.fixture(scope="module")
def layer():
  rng = np.random.default_rng(0)
  shapes = [(B, T, D), (D, E), (E, D, F), (E, D, F), (E, F, D)]
  args = [rng.normal(size=s).astype(np.float32) for s in shapes]
  one = jax.jit(_moe_layer).lower(*args).compile()
  mesh = sharding.make_mesh({"fsdp": 8})
  axes = [("batch", "length", None), (None, None)] + [("expert", None, None)] * 3
  shardings = [NamedSharding(mesh, sharding.logical_to_spec(a, "fsdp", mesh, x.shape))
               for a, x in zip(axes, args)]
  eight = jax.jit(_moe_layer, in_shardings=shardings).lower(*args).compile()
  return args, one, eight


def test_moe_layer_runs_one_eighth_of_the_experts_per_device(layer):
  args, one, eight = layer
  assert not moe._moves_tokens(B * T, X, args[2])  # pylint: disable=protected-access
  active = 3 * 2 * (B * T * X) * D * F  # gate, up, down over the A assignments only
  f1, f8 = _flops(one), _flops(eight)
  # the CPU lowering of ragged_dot: every expert's matmul over all A rows, masked
  assert E * active <= f1 <= (1 + TOL) * E * active, (f1, active)
  # expert parallel: E/8 = 1 expert's share per device
  assert abs(f8 - f1 / 8) <= TOL * f1 / 8, (f1, f8)
  # the same numbers on both meshes
  np.testing.assert_allclose(np.asarray(eight(*args)), np.asarray(one(*args)),
                             atol=1e-4, rtol=1e-4)


def test_moe_layer_moves_tokens_not_expert_weights(layer):
  _, one, eight = layer
  assert eight.input_shardings[0][2].spec[0] == "fsdp"  # [E,D,F]: E/8 experts per device
  ops = _collectives(eight.as_text())
  assert not ops["all-to-all"], ops
  # all-reduced: the dispatched rows and the down matmul's partial outputs [A,D], the
  # gate/up matmuls' partial outputs [A,F]
  assert any(f"f32[{B * T * X},{D}]" in t for t in ops["all-reduce"]), ops
  assert any(f"f32[{B * T * X},{F}]" in t for t in ops["all-reduce"]), ops
  # gathers carry routing only (expert ids, probabilities, group sizes), never a weight
  assert ops["all-gather"], ops
  weight = E * D * F
  for t in ops["all-gather"]:
    for dims in re.findall(r"\[([\d,]*)\]", t):
      assert np.prod([int(n) for n in dims.split(",") if n]) < weight, (t, ops)
  assert not any(_collectives(one.as_text()).values())


# the decode of 16 sequences: 16 tokens x 4 experts each against 16 experts, 64 wide
DECODE = dict(B=16, D=32, E=16, X=4, F=64)


def _sharded_layer(mesh_shape, args, top_k):
  """The layer jitted on a mesh with the ``fsdp`` rules active (as the sampler runs it)."""
  mesh = sharding.make_mesh(mesh_shape)
  axes = [("batch", "length", None), (None, None)] + [("expert", None, "mlp")] * 2 + [
      ("expert", "mlp", None)]
  shardings = [NamedSharding(mesh, sharding.logical_to_spec(a, "fsdp", mesh, x.shape))
               for a, x in zip(axes, args)]

  def layer_on_mesh(*a):
    with sharding.use(mesh, "fsdp"):
      return _moe_layer(*a, top_k=top_k)
  return layer_on_mesh, shardings


def test_a_decode_batch_moves_its_tokens_to_the_experts():
  """At the decode's shape on data=2 x fsdp=4 the tokens go to the experts' devices: every
  collective of the forward and of the gradient moves less than one device's expert
  weights (the tokens and routing gathered over fsdp, the outputs reduce-scattered, the
  weight gradients reduced over data), and outputs and gradients equal one device's."""
  c, mesh_shape = DECODE, {"data": 2, "fsdp": 4}
  rng = np.random.default_rng(1)
  shapes = [(c["B"], 1, c["D"]), (c["D"], c["E"]), (c["E"], c["D"], c["F"]),
            (c["E"], c["D"], c["F"]), (c["E"], c["F"], c["D"])]
  args = [(0.3 * rng.normal(size=s)).astype(np.float32) for s in shapes]
  cotangent = rng.normal(size=shapes[0]).astype(np.float32)
  assert moe._moves_tokens(c["B"], c["X"], args[2])  # pylint: disable=protected-access
  fn, shardings = _sharded_layer(mesh_shape, args, c["X"])
  loss = lambda f: lambda *a: jnp.sum(f(*a) * cotangent)
  grad_on_mesh = jax.jit(jax.grad(loss(fn), argnums=(0, 2, 3, 4)), in_shardings=shardings)
  forward = jax.jit(fn, in_shardings=shardings).lower(*args).compile()
  backward = grad_on_mesh.lower(*args).compile()
  local_weights = c["E"] // mesh_shape["fsdp"] * c["D"] * c["F"]
  for compiled in (forward, backward):
    ops = _collectives(compiled.as_text())
    assert not ops["all-to-all"], ops
    assert f"f32[{c['B'] // 8},{c['D']}]" in ops["reduce-scatter"], ops  # each device's rows
    sizes = {op: [np.prod([int(n) for n in dims.split(",") if n])
                  for t in ts for dims in re.findall(r"\[([\d,]*)\]", t)]
             for op, ts in ops.items()}
    assert sizes["all-gather"] and max(sizes["all-gather"]) < local_weights, ops
    # all-reduced: at most the weight gradients of one device's experts over the data axis
    assert all(n <= local_weights for n in sizes["all-reduce"]), ops
  one = np.asarray(jax.jit(lambda *a: _moe_layer(*a, top_k=c["X"]))(*args))
  np.testing.assert_allclose(np.asarray(forward(*args)), one, rtol=0,
                             atol=1e-6 * np.abs(one).max())
  g1 = jax.jit(jax.grad(loss(lambda *a: _moe_layer(*a, top_k=c["X"])), argnums=(0, 2, 3, 4)))(
      *args)  # one program, not op by op
  for a, b in zip(g1, backward(*args)):
    np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=0,
                               atol=1e-5 * np.abs(np.asarray(a)).max())


def test_moe_sampler_on_8_devices_equals_1(monkeypatch):
  """``rollout.generate`` of a MoE policy with its experts over fsdp=8 (its programs trace
  the token path, counted by a pass-through wrapper): one device's tokens, log-probs and
  expert records."""
  from tests.test_moe_rl import CFG, PROMPTS  # pylint: disable=import-outside-toplevel
  traced = []
  real = moe._local_experts_mlp  # pylint: disable=protected-access
  monkeypatch.setattr(moe, "_local_experts_mlp", lambda *a, **kw: traced.append(1) or real(
      *a, **kw))
  params = models.init_params(CFG, jax.random.key(0), std=0.3)
  kw = dict(n=2, max_new_tokens=6, temperature=1.0, seed=3)
  one = rollout.generate(CFG, params, PROMPTS, **kw)
  assert not traced  # one device: the plain grouped matmuls
  eight = rollout.generate(CFG, params, PROMPTS, mesh=sharding.make_mesh({"fsdp": 8}),
                           rules="fsdp", **kw)
  assert traced
  np.testing.assert_array_equal(eight.tokens, one.tokens)
  np.testing.assert_array_equal(eight.mask, one.mask)
  np.testing.assert_array_equal(eight.routing, one.routing)
  np.testing.assert_allclose(eight.logprobs, one.logprobs, atol=1e-5, rtol=0)


def _update(n_devices):
  compiled, args, setup = compiled_rl_update(MOE_QUICKSTART, list(TINY_MODEL) + [
      f"model.hidden_size={D}", f"model.num_experts={E}", f"model.moe_intermediate_size={F}",
      f"mesh.num_devices={n_devices}", "mesh.rules=fsdp"], G, M, R)
  return compiled, compiled(*args)[0], setup.prompt_len


def test_moe_rl_update_on_8_devices_equals_1():
  """The whole RL update of a one-layer MoE policy (E = 8, top 2): 1/8 of the FLOPs per
  device, expert weights sharded over the experts, the layer's all-reduces in the program
  (an all-to-all there belongs to the packed layout's gathers, never to the expert rows), the
  same new weights as on 1 device."""
  (c1, p1, _), (c8, p8, P) = _update(1), _update(8)
  assert p8["moe"]["expert_gate"].sharding.spec[:2] == (None, "fsdp")
  assert len(p8["moe"]["expert_gate"].sharding.device_set) == 8
  f1, f8 = _flops(c1), _flops(c8)
  assert abs(f8 - f1 / 8) <= TOL * f1 / 8, (f1, f8)
  ops = _collectives(c8.as_text())
  A = G * (P + M * R) * X  # assignments of the packed P + M·R tokens of each group
  for width in (D, F):  # the expert layer's all-reduces: rows, gate/up/down partial outputs
    assert any(f"f32[{A},{width}]" in t for t in ops["all-reduce"]), (A, ops)
  assert not any(f"[{A}," in t for t in ops["all-to-all"]), ops
  jax.tree.map(lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b),
                                                       atol=2e-5, rtol=1e-4), p1, p8)
