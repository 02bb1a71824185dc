"""Where the mesh meets the step, checked on 8 fake CPU devices from the compiled program:
the RL update's batch is split over (data, fsdp), each device does 1/8 of the 1-device FLOPs,
and the FSDP rule set all-gathers weights inside the step."""

import re

import jax
import pytest

from tests.tiny import QUICKSTART, compiled_rl_update

G, M, R = 8, 4, 5


def _compiled_update(n_devices, rules="fsdp"):
  return compiled_rl_update(QUICKSTART, ["model.hidden_size=64", f"mesh.num_devices={n_devices}",
                                         f"mesh.rules={rules}"], G, M, R)[0]


def _flops(compiled):
  cost = compiled.cost_analysis()
  return (cost[0] if isinstance(cost, list) else cost)["flops"]


@pytest.fixture(scope="module")
def compiled():
  return {n: _compiled_update(n) for n in (1, 8)}


def test_batch_inputs_are_split_over_data_and_fsdp(compiled):
  batch_shardings = compiled[8].input_shardings[0][-1]
  for sh in jax.tree.leaves(batch_shardings):
    assert tuple(sh.spec)[:1] in ((("data", "fsdp"),), ("fsdp",)), sh.spec
    assert len(sh.device_set) == 8


def test_per_device_flops_are_an_eighth(compiled):
  one, eight = _flops(compiled[1]), _flops(compiled[8])
  assert abs(eight - one / 8) <= 0.15 * one / 8, (one, eight)


def test_fsdp_gathers_weights_inside_the_step(compiled):
  hlo = compiled[8].as_text()
  assert len(re.findall(r"all-gather(-start)?\(", hlo)) >= 2  # per-layer weight gathers
  assert not re.search(r"all-gather(-start)?\(", compiled[1].as_text())
