"""``rl_jax.compile_options`` (``train.cpu_fast_compile``): the training programs' and the
prefill's XLA options on CPU, against the default compiler's values."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import compile_options, config_utils, models, rollout, train
from rl_jax.rollout import sampler
from rl_jax.train import layout as layout_lib
from tests.tiny import QUICKSTART, TINY_MODEL

TINY = TINY_MODEL + [
    "sft.steps=0", "train.steps=1", "train.batch_groups=2", "rollout.n=4",
    "rollout.max_new_tokens=6", "rollout.temperature=1.0", "train.eval_every=0",
    "log.tensorboard=False", "model.fused_mlp=True"]
FAST = tuple(sorted(compile_options.CPU_FAST_COMPILE.items()))


@pytest.fixture(name="fast_compile")
def _fast_compile():
  """Turns the process's setting on for one test, and off again after it."""
  compile_options.use_fast_cpu_compile(True)
  yield
  compile_options.use_fast_cpu_compile(False)


def test_fast_compile_options_only_when_on_and_for_cpu_devices(fast_compile):
  del fast_compile
  assert compile_options.fast_compile_options(jax.devices()) == compile_options.CPU_FAST_COMPILE
  gpu = types.SimpleNamespace(platform="gpu")
  assert compile_options.fast_compile_options([jax.devices()[0], gpu]) == {}
  compile_options.use_fast_cpu_compile(False)
  assert compile_options.fast_compile_options(jax.devices()) == {}


def _one_step(fast: bool):
  """Params and record after one RL step of a fresh tiny run, ``train.cpu_fast_compile`` set
  to ``fast``; and the compiler options of a program ``jit_on_mesh`` makes for it."""
  s = train.build_setup(config_utils.load_config(
      QUICKSTART, TINY + [f"train.cpu_fast_compile={fast}"]))
  t = train.make_trainer(s)
  state = train.begin_rl(s, train.init_state(s))
  probe = layout_lib.jit_on_mesh(lambda x: x + 1, t.layout).lower(jnp.zeros(2))
  state, record, _ = train.rl_step(t, state)
  return jax.device_get(state.params), record, dict(probe._lowering._compiler_options_kvs or ())


def test_training_programs_compile_with_the_cpu_options_to_the_same_values():
  try:
    fast, fast_record, fast_options = _one_step(True)
  finally:
    compile_options.use_fast_cpu_compile(False)
  slow, slow_record, slow_options = _one_step(False)
  assert fast_options == compile_options.CPU_FAST_COMPILE and slow_options == {}
  np.testing.assert_allclose(fast_record["loss"], slow_record["loss"], rtol=1e-6)
  # The same computation from another code generator: equal to float rounding (bit for bit
  # for this model here; a LoRA run's SFT step differs in the last bit).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8), fast, slow)


def test_sampler_prefill_compiles_with_the_cpu_options_to_the_same_samples(fast_compile):
  del fast_compile
  cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=88, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
  params = models.init_params(cfg, jax.random.key(0), std=0.1)
  prompts = [[1, 5, 9, 3], [1, 7, 2]]
  engine = lambda: rollout.RolloutEngine(cfg, n=3, max_slots=2, max_new_tokens=6,
                                         max_prompt_len=8)
  assert engine().admit_fn is sampler.admit_with(FAST) is not sampler.admit
  run = lambda: rollout.generate(cfg, params, prompts, n=3, max_new_tokens=6, temperature=1.0,
                                 seed=3)
  fast = run()
  compile_options.use_fast_cpu_compile(False)
  assert engine().admit_fn is sampler.admit
  slow = run()
  np.testing.assert_array_equal(fast.tokens, slow.tokens)
  np.testing.assert_allclose(fast.logprobs, slow.logprobs, rtol=1e-6, atol=1e-7)
