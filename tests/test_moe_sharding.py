"""Expert parallelism on 8 fake CPU devices, checked from the compiled programs.

The ``fsdp`` rule set maps the ``expert`` axis of the expert weights [Y,E,D,F] to the fsdp
mesh axis, so each of 8 devices holds E/8 experts. Tokens are batch-sharded. XLA partitions
the grouped matmuls along the expert axis: the routing is all-gathered, the dispatched rows
and the partial expert-matmul outputs are all-reduced, and each device runs its own experts;
the expert weights themselves are never gathered and there is no all-to-all (see
``rl_jax/models/moe.py``, "Sharding").

FLOPs: on CPU, ``jax.lax.ragged_dot`` lowers to a masked dense matmul per expert group (TPU
and GPU have a native grouped matmul), so the 1-device expert matmuls cost E times the active
share 3·2·A·D·F (A = B·T·X assignments); what the mesh changes is measured as a ratio: each
of 8 devices does 1/8 of the 1-device FLOPs, i.e. E/8 experts' share each.
"""

import re

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding

from rl_jax import sharding
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


def _moe_layer(x, w_router, w_gate, w_up, w_down):
  weights, ids, _ = moe.route(x, w_router, X, True)
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
