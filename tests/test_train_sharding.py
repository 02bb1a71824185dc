"""Where the mesh meets the step, checked on 8 fake CPU devices from the compiled program:
the RL update's batch is split over (data, fsdp), each device does 1/8 of the 1-device FLOPs,
and the FSDP rule set all-gathers weights inside the step."""

import os
import re

import jax
import numpy as np
import pytest

from rl_jax import config_utils, losses, train

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
G, M, R = 8, 4, 5


def _compiled_update(n_devices, rules="fsdp"):
  config = config_utils.load_config(QUICKSTART, [
      "model.hidden_size=64", "sft.steps=0", f"train.batch_groups={G}", f"rollout.n={M}",
      f"rollout.max_new_tokens={R}", f"mesh.num_devices={n_devices}", f"mesh.rules={rules}",
      "train.eval_every=0", "log.tensorboard=False"])
  setup = train.build_setup(config)
  layout = train.make_layout(setup)
  state = train.init_state(setup)
  rng = np.random.default_rng(0)
  put = layout.put
  inputs = losses.ObjectiveInputs(
      rewards=put(rng.random((G, M)).astype(np.float32)), mask=put(np.ones((G, M, R), bool)),
      old_logp=put(np.full((G, M, R), -1.0, np.float32)),
      behaviour_logp=put(np.full((G, M, R), -1.0, np.float32)))
  batch = train.UpdateBatch(
      put(rng.integers(3, 20, (G, setup.prompt_len)).astype(np.int32)),
      put(np.full((G,), 4, np.int32)), put(rng.integers(3, 20, (G, M, R)).astype(np.int32)),
      inputs, losses.Advantages(put(rng.normal(size=(G, M)).astype(np.float32))))
  update = train.make_rl_update(setup, layout)
  return update.lower(state.params, state.opt_state, state.value_params,
                      state.value_opt_state, batch).compile()


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
