"""``rl_jax.compile_options`` (``train.cpu_fast_compile``, ``train.cpu_xla_reductions``,
``train.cpu_temp_block_mib``): the training programs' and the prefill's XLA options on CPU,
against the default compiler's values."""

import functools
import glob
import os
import re
import types
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from rl_jax import compile_options, config_utils, models, rollout, train
from rl_jax.rollout import sampler
from rl_jax.train import layout as layout_lib
from rl_jax.train import startup
from tests.tiny import QUICKSTART, TINY_MODEL

TINY = TINY_MODEL + [
    "sft.steps=0", "train.steps=1", "train.batch_groups=2", "rollout.n=4",
    "rollout.max_new_tokens=6", "rollout.temperature=1.0", "train.eval_every=0",
    "log.tensorboard=False", "model.fused_mlp=True"]
FAST = tuple(sorted(compile_options.CPU_FAST_COMPILE.items()))


@pytest.fixture(autouse=True)
def _restore_process_settings(monkeypatch):
  """Each test may switch the process's settings; they are the defaults again after it. The
  suite's ``XLA_FLAGS`` name an optimisation level (conftest), which would keep it out of the
  options: here they do not."""
  flags = os.environ.get("XLA_FLAGS", "").split()
  monkeypatch.setenv("XLA_FLAGS", " ".join(
      f for f in flags if not f.startswith("--xla_backend_optimization_level")))
  yield
  compile_options.use_fast_cpu_compile(True)
  compile_options.use_cpu_xla_reductions(True)
  compile_options.use_cpu_temp_blocks(0)


@pytest.fixture(name="fast_compile")
def _fast_compile():
  """The process's fast-compile setting on for one test (the default)."""
  compile_options.use_fast_cpu_compile(True)


def test_both_options_are_the_defaults():
  """A run set up from the default config compiles its training programs with both CPU
  option sets, and its prefill with the fast-compile set."""
  compile_options.use_fast_cpu_compile(False)
  compile_options.use_cpu_xla_reductions(False)
  config = config_utils.load_config(QUICKSTART, TINY)
  assert config.train.cpu_fast_compile and config.train.cpu_xla_reductions
  train.build_setup(config)
  assert compile_options.training_options(jax.devices()) == {
      **compile_options.CPU_FAST_COMPILE, **compile_options.CPU_XLA_REDUCTIONS}
  assert compile_options.fast_compile_options(jax.devices()) == compile_options.CPU_FAST_COMPILE


def test_fast_compile_options_only_when_on_and_for_cpu_devices(fast_compile):
  del fast_compile
  assert compile_options.fast_compile_options(jax.devices()) == compile_options.CPU_FAST_COMPILE
  gpu = types.SimpleNamespace(platform="gpu")
  assert compile_options.fast_compile_options([jax.devices()[0], gpu]) == {}
  compile_options.use_fast_cpu_compile(False)
  assert compile_options.fast_compile_options(jax.devices()) == {}


def test_options_named_in_xla_flags_are_left_to_them(monkeypatch):
  """The user's ``XLA_FLAGS`` win: an option they name is not in the program's options."""
  monkeypatch.setenv("XLA_FLAGS", os.environ["XLA_FLAGS"] + " --xla_backend_optimization_level=0")
  compile_options.use_fast_cpu_compile(True)
  compile_options.use_cpu_xla_reductions(True)
  options = compile_options.training_options(jax.devices())
  assert "xla_backend_optimization_level" not in options
  assert options == {k: v for k, v in {**compile_options.CPU_FAST_COMPILE,
                                       **compile_options.CPU_XLA_REDUCTIONS}.items()
                     if k != "xla_backend_optimization_level"}


@functools.cache
def _one_step(fast: bool, reductions: bool = False):
  """Params and record after one RL step of a fresh tiny run, ``train.cpu_fast_compile`` set
  to ``fast`` and ``train.cpu_xla_reductions`` to ``reductions``; and the compiler options of
  a program ``jit_on_mesh`` makes for it. Computed once per setting: the two tests below
  compare the same default step (both options off) with each option's."""
  s = train.build_setup(config_utils.load_config(
      QUICKSTART, TINY + [f"train.cpu_fast_compile={fast}",
                          f"train.cpu_xla_reductions={reductions}"]))
  t = train.make_trainer(s)
  state = train.begin_rl(s, train.init_state(s))
  probe = layout_lib.jit_on_mesh(lambda x: x + 1, t.layout).lower(jnp.zeros(2))
  state, record, _ = train.rl_step(t, state)
  return jax.device_get(state.params), record, dict(probe._lowering._compiler_options_kvs or ())


def test_training_programs_compile_with_the_cpu_options_to_the_same_values():
  fast, fast_record, fast_options = _one_step(True)
  slow, slow_record, slow_options = _one_step(False)
  assert fast_options == compile_options.CPU_FAST_COMPILE and slow_options == {}
  np.testing.assert_allclose(fast_record["loss"], slow_record["loss"], rtol=1e-6)
  # The same computation from another code generator at -O1: equal to float rounding (the
  # last bits may differ, and a longer run drifts).
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-8), fast, slow)


def test_sampler_prefill_compiles_with_the_cpu_options_to_the_same_samples(fast_compile):
  del fast_compile
  cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=88, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=64)
  params = models.init_params(cfg, jax.random.key(0), std=0.1)
  prompts = [[1, 5, 9, 3], [1, 7, 2]]
  engine = lambda: rollout.RolloutEngine(cfg, n=3, max_slots=2, max_new_tokens=6,
                                         max_prompt_len=8)
  assert engine().admit_fn is sampler.admit_with(FAST, 2048) is not sampler.admit
  run = lambda: rollout.generate(cfg, params, prompts, n=3, max_new_tokens=6, temperature=1.0,
                                 seed=3)
  fast = run()
  compile_options.use_fast_cpu_compile(False)
  assert engine().admit_fn is sampler.admit_with((), 2048) is not sampler.admit_with(FAST, 2048)
  slow = run()
  np.testing.assert_array_equal(fast.tokens, slow.tokens)
  np.testing.assert_allclose(fast.logprobs, slow.logprobs, rtol=1e-6, atol=1e-7)


def test_xla_reductions_options_only_when_on_and_for_cpu_devices():
  compile_options.use_fast_cpu_compile(False)
  compile_options.use_cpu_xla_reductions(True)
  assert compile_options.training_options(jax.devices()) == compile_options.CPU_XLA_REDUCTIONS
  assert compile_options.fast_compile_options(jax.devices()) == {}  # not the prefill's
  compile_options.use_fast_cpu_compile(True)
  assert compile_options.training_options(jax.devices()) == {
      **compile_options.CPU_FAST_COMPILE, **compile_options.CPU_XLA_REDUCTIONS}
  gpu = types.SimpleNamespace(platform="gpu")
  assert compile_options.training_options([jax.devices()[0], gpu]) == {}
  compile_options.use_cpu_xla_reductions(False)
  compile_options.use_fast_cpu_compile(False)
  assert compile_options.training_options(jax.devices()) == {}


def _library_fusions(compiled_text: str) -> list[str]:
  """The HLO bodies of the YNNPACK fusions in an optimized module's text."""
  called = re.findall(r"calls=%([\w.\-]+),.*__ynn_fusion", compiled_text)
  bodies = dict(re.findall(r"^%([\w.\-]+) .*?\{\n(.*?)\n\}", compiled_text, re.M | re.S))
  return [bodies[c] for c in called]


def test_xla_reductions_leave_matmuls_to_the_library_and_sum_in_xla():
  """With the option, the library fuses the matmul and no reduction; without it (XLA's
  default here) the row sum of a product is a library fusion too."""
  x, w = jnp.ones((1034, 256)), jnp.ones((256, 512))  # a backward pass's sizes (smaller
  # sums stay XLA's by default)
  program = jax.jit(lambda x, w: ((x * x).sum(0), x @ w)).lower(x, w)
  default = _library_fusions(program.compile().as_text())
  only_dots = _library_fusions(program.compile(compile_options.CPU_XLA_REDUCTIONS).as_text())
  assert any(" reduce(" in body for body in default)
  assert only_dots and all(" dot(" in body and " reduce(" not in body for body in only_dots)


def test_training_programs_sum_in_xla_to_the_same_values():
  """One RL step with ``train.cpu_xla_reductions`` equals the default's to float rounding
  (sums added in another order), and its programs carry the option."""
  xla, xla_record, xla_options = _one_step(False, reductions=True)
  lib, lib_record, lib_options = _one_step(False)
  assert xla_options == compile_options.CPU_XLA_REDUCTIONS and lib_options == {}
  np.testing.assert_allclose(xla_record["loss"], lib_record["loss"], rtol=1e-5, atol=1e-7)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7), xla, lib)


def test_temp_block_option_only_when_set_and_for_cpu_devices():
  """Off by default; a run's ``train.cpu_temp_block_mib`` reaches its training programs (not
  the prefill's), on CPU devices only; a wrong value fails in one line."""
  compile_options.use_cpu_temp_blocks(16)
  train.build_setup(config_utils.load_config(QUICKSTART, TINY))
  assert compile_options.CPU_TEMP_BLOCK not in compile_options.training_options(jax.devices())
  train.build_setup(config_utils.load_config(
      QUICKSTART, TINY + ["train.cpu_fast_compile=False", "train.cpu_xla_reductions=False",
                          "train.cpu_temp_block_mib=16"]))
  assert compile_options.training_options(jax.devices()) == {
      compile_options.CPU_TEMP_BLOCK: 16 << 20}
  assert compile_options.fast_compile_options(jax.devices()) == {}  # not the prefill's
  gpu = types.SimpleNamespace(platform="gpu")
  assert compile_options.training_options([jax.devices()[0], gpu]) == {}
  for bad in (-1, 1.5, True, "16"):
    with pytest.raises(ValueError, match="whole number of MiB"):
      compile_options.use_cpu_temp_blocks(bad)
  with pytest.raises(ValueError, match="cpu_temp_block_mib"):
    train.build_setup(config_utils.load_config(QUICKSTART, TINY + ["train.cpu_temp_block_mib=-1"]))


def _temp_blocks(dump_dir: str) -> list[int]:
  """The sizes of the temporaries' blocks in the one buffer assignment XLA dumped there."""
  [path] = glob.glob(os.path.join(dump_dir, "*jit_loss_and_grads*buffer-assignment.txt"))
  return [int(size) for size in
          re.findall(r"^allocation \d+: size (\d+), preallocated-temp", open(path).read(), re.M)]


# the suite's compilation cache (conftest) cannot store these programs; the next test covers it
@pytest.mark.filterwarnings("ignore:Error writing persistent compilation cache entry")
def test_temp_blocks_split_the_temporaries_to_bit_identical_values(tmp_path):
  """A policy's loss and gradients (the update's computation, 16 x 64 packed tokens) compiled
  with 2 MiB blocks of temporaries (its largest buffer's size): several blocks, none over
  2 MiB, where the default has one larger block, and bit-identical values (only where
  buffers live changes)."""
  cfg = models.ModelConfig(vocab_size=64, hidden_size=32, intermediate_size=88, num_layers=2,
                           num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=96,
                           qk_norm=True, fused_mlp=True,
                           # the two-region attention: its largest buffer is 2 MiB at this shape
                           # (the concatenated one's score buffer is larger)
                           prefix_attention="kernel")
  params = models.init_params(cfg, jax.random.key(0), std=0.1)
  rng = np.random.default_rng(0)
  prompt, prompt_len = jnp.asarray(rng.integers(0, 64, (1, 9)), jnp.int32), jnp.array([9])
  tokens = jnp.asarray(rng.integers(0, 64, (1, 16, 64)), jnp.int32)
  mask = jnp.asarray(rng.random((1, 16, 64)) < 0.9)
  adv = jnp.asarray(rng.normal(size=(1, 16, 1)), jnp.float32)

  def loss_and_grads(p):
    loss = lambda p: -(adv * mask * models.response_logprobs(
        cfg, p, prompt, prompt_len, tokens, mask, shared_prefix=True)).sum() / mask.sum()
    return jax.value_and_grad(loss)(p)

  values, blocks = {}, {}
  for mib in (0, 2):
    dump = str(tmp_path / f"mib{mib}")
    options = {**compile_options.temp_block_options(mib), "xla_dump_to": dump}
    values[mib] = jax.jit(loss_and_grads).lower(params).compile(options)(params)
    blocks[mib] = _temp_blocks(dump)
  assert len(blocks[0]) == 1 and blocks[0][0] > 2 << 20
  assert len(blocks[2]) > 1 and max(blocks[2]) <= 2 << 20
  jax.tree.map(np.testing.assert_array_equal, values[2], values[0])


def test_programs_in_several_blocks_stay_out_of_the_cache_with_one_note(tmp_path):
  """JAX's persistent cache cannot store a CPU program with several blocks of temporaries:
  JAX warns for each such program, and with the option set that warning is silenced (the
  trainer prints ``uncached_note`` once instead, only where the option meets the cache on
  CPU); the program runs either way."""
  assert compile_options.uncached_note(str(tmp_path), jax.devices()) is None  # option off
  with warnings.catch_warnings():  # the option's warning filter ends with this block
    compile_options.use_cpu_temp_blocks(1)
    assert compile_options.uncached_note(str(tmp_path), jax.devices()) == \
        compile_options.UNCACHED_NOTE
    assert compile_options.uncached_note(None, jax.devices()) is None  # no cache
    assert compile_options.uncached_note(
        str(tmp_path), [types.SimpleNamespace(platform="gpu")]) is None
    compile_options.use_cpu_temp_blocks(0)
  previous = jax.config.jax_compilation_cache_dir
  startup.use_compile_cache(str(tmp_path / "cache"), str(tmp_path))
  x = jnp.ones((512, 512))

  def run(scale):  # a new program each time (no cache hit), in 1 MiB blocks
    f = lambda x: ((jnp.sin(x * scale) @ x) @ (jnp.cos(x) @ x)).sum()
    return jax.jit(f).lower(x).compile(compile_options.temp_block_options(1))(x)

  try:
    for option_on in (False, True):
      with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if option_on:
          compile_options.use_cpu_temp_blocks(1)
        assert np.isfinite(run(1.0 + option_on))
      uncached = [w for w in caught if "Multiple temp buffer allocations" in str(w.message)]
      assert len(uncached) == (0 if option_on else 1)
  finally:
    startup.use_compile_cache(previous or "", str(tmp_path))
