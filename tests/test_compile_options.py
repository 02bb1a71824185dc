"""``rl_jax.compile_options``: the training programs' XLA options on CPU, against the
default compiler's values."""

import types

import jax
import jax.numpy as jnp
import numpy as np

from rl_jax import compile_options, config_utils, train
from rl_jax.train import layout as layout_lib
from tests.tiny import QUICKSTART, TINY_MODEL

TINY = TINY_MODEL + [
    "sft.steps=0", "train.steps=1", "train.batch_groups=2", "rollout.n=4",
    "rollout.max_new_tokens=6", "rollout.temperature=1.0", "train.eval_every=0",
    "log.tensorboard=False", "model.fused_mlp=True"]


def test_fast_compile_options_are_for_cpu_devices_only():
  assert compile_options.fast_compile_options(jax.devices()) == compile_options.CPU_FAST_COMPILE
  gpu = types.SimpleNamespace(platform="gpu")
  assert compile_options.fast_compile_options([jax.devices()[0], gpu]) == {}


def _one_step(fast: bool, monkeypatch):
  """Params after one RL step of a fresh tiny run whose training programs are compiled with
  (``fast``) or without the CPU options; and the lowered update's compiler options."""
  if not fast:
    monkeypatch.setattr(compile_options, "fast_compile_options", lambda devices: {})
  s = train.build_setup(config_utils.load_config(QUICKSTART, TINY))
  t = train.make_trainer(s)
  state = train.begin_rl(s, train.init_state(s))
  probe = layout_lib.jit_on_mesh(lambda x: x + 1, t.layout).lower(jnp.zeros(2))
  state, record, _ = train.rl_step(t, state)
  monkeypatch.undo()
  return jax.device_get(state.params), record, dict(probe._lowering._compiler_options_kvs or ())


def test_training_programs_compile_with_the_cpu_options_to_the_same_values(monkeypatch):
  fast, fast_record, fast_options = _one_step(True, monkeypatch)
  slow, slow_record, slow_options = _one_step(False, monkeypatch)
  assert fast_options == compile_options.CPU_FAST_COMPILE and slow_options == {}
  np.testing.assert_allclose(fast_record["loss"], slow_record["loss"], rtol=1e-6)
  # The same computation from another code generator: equal to float rounding (bit for bit
  # on the hosts measured; the two emitters may vectorise a reduction differently elsewhere).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8), fast, slow)
  changed = jax.tree.leaves(jax.tree.map(lambda a, b: bool((a != b).any()), fast, slow))
  print(f"leaves that differ in any bit: {sum(changed)} of {len(changed)}")


def test_sampler_prefill_compiles_with_the_cpu_options_to_the_same_samples(monkeypatch):
  from rl_jax import models, rollout  # pylint: disable=import-outside-toplevel
  from rl_jax.rollout import sampler  # pylint: disable=import-outside-toplevel
  cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=88, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
  params = models.init_params(cfg, jax.random.key(0), std=0.1)
  prompts = [[1, 5, 9, 3], [1, 7, 2]]
  engine = rollout.RolloutEngine(cfg, n=3, max_slots=2, max_new_tokens=6, max_prompt_len=8)
  fast_admit = sampler.admit_with(tuple(sorted(compile_options.CPU_FAST_COMPILE.items())))
  assert engine.admit_fn is fast_admit and fast_admit is not sampler.admit
  run = lambda: rollout.generate(cfg, params, prompts, n=3, max_new_tokens=6, temperature=1.0,
                                 seed=3)
  fast = run()
  monkeypatch.setattr(compile_options, "fast_compile_options", lambda devices: {})
  assert rollout.RolloutEngine(cfg, n=3, max_slots=2, max_new_tokens=6,
                               max_prompt_len=8).admit_fn is sampler.admit
  slow = run()
  np.testing.assert_array_equal(fast.tokens, slow.tokens)
  np.testing.assert_allclose(fast.logprobs, slow.logprobs, rtol=1e-6, atol=1e-7)
