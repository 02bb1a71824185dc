"""The quickstart config and a tiny model for trainer tests (one layer, width 32), and a
random RL update on a setup's mesh."""

import os

import numpy as np

from rl_jax import config as config_lib
from rl_jax import config_utils, losses, settings, train
from rl_jax.train import selection_stage

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(ROOT, "configs", "quickstart.py")
TINY_MODEL = [
    "model.hidden_size=32", "model.intermediate_size=64", "model.num_layers=1",
    "model.num_heads=2", "model.num_kv_heads=1", "model.head_dim=16",
]


def assert_prompts_as_sampled(s, scored) -> None:
  """``scored.prompts`` / ``prompt_lens`` (int32) are the prompts of its examples, encoded
  and right-padded to ``s.prompt_len`` independently here (what the learner packs; it never
  tokenizes them again)."""
  from rl_jax.train import rollouts  # pylint: disable=import-outside-toplevel
  want = rollouts.pad_prompts(
      rollouts.encode_prompts(s, [s.train_examples[i] for i in scored.indices]),
      s.prompt_len, s.tokenizer.pad_id)
  for got, ref in zip((scored.prompts, scored.prompt_lens), want):
    assert got.dtype == np.int32
    np.testing.assert_array_equal(got, ref)


def selection_of(config):
  """(the run's ``selection_stage.Selection``, its geometry) as the setup derives them from
  ``config``."""
  data = settings.from_section(settings.DataSettings, "data", config.data)
  rollout = settings.from_section(settings.RolloutSettings, "rollout", config.rollout)
  how = selection_stage.make_selection(data, config.loss.preset, rollout, config.train.seed)
  return how, config_lib.geometry(config)


def env_with_devices(devices: int) -> dict:
  """This process's environment for a subprocess with ``devices`` host CPU devices: the
  session's other ``XLA_FLAGS`` (see ``conftest``) are kept."""
  flags = " ".join(f for f in os.environ.get("XLA_FLAGS", "").split()
                   if not f.startswith("--xla_force_host_platform_device_count"))
  return dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices}")


class ParityTask:
  """A task wrapper whose reward an untrained policy earns about half the time (the parity of
  the first generated character), so every group has reward variance and every objective
  makes a non-zero update."""

  def __init__(self, task):
    self._task = task

  def split(self, which, size=None):
    return self._task.split(which, size)

  def verify(self, completion, answer):
    del answer
    return float(ord(completion[0]) % 2) if completion else 0.0


def compiled_rl_update(config_path, overrides, G, M, R):
  """The RL update of ``config_path`` + ``overrides`` (with sft off, G groups of M samples
  of R tokens) compiled for a random batch on the setup's mesh: (compiled update, its
  arguments, setup)."""
  config = config_utils.load_config(config_path, list(overrides) + [
      "sft.steps=0", f"train.batch_groups={G}", f"rollout.n={M}", f"rollout.max_new_tokens={R}",
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
  args = (state.params, state.opt_state, state.value_params, state.value_opt_state, batch)
  return train.make_rl_update(setup, layout).lower(*args).compile(), args, setup


def stopped_at(ref_dir, resumed_dir, step: int) -> None:
  """``resumed_dir`` as the run in ``ref_dir`` left it had it stopped after ``step``: its
  checkpoints up to ``step`` (the later ones left out) and its metrics file, for a rerun of
  the same command to resume from."""
  import shutil  # pylint: disable=import-outside-toplevel
  from rl_jax import checkpoint  # pylint: disable=import-outside-toplevel
  shutil.copytree(ref_dir / "checkpoints", resumed_dir / "checkpoints")
  for k in checkpoint.all_steps(str(resumed_dir / "checkpoints")):
    if k > step:
      shutil.rmtree(resumed_dir / "checkpoints" / str(k))
  shutil.copy(ref_dir / "metrics.jsonl", resumed_dir / "metrics.jsonl")


def assert_same_update(got, want, params) -> None:
  """Two ``rl_update`` outputs (params, optimizer state, value params and state, metrics) of
  the same step from ``params``, computed two ways, agree: the update moved the policy (or the
  comparison would be empty), and every array and metric is equal to float rounding."""
  import jax  # pylint: disable=import-outside-toplevel
  moved = max(float(np.max(np.abs(np.asarray(a) - np.asarray(b))))
              for a, b in zip(jax.tree.leaves(want[0]), jax.tree.leaves(params)))
  assert moved > 1e-5, "the update did not move the policy; the comparison would be empty"
  # Adam's first step moves a weight by about lr·sign(g): where g is tiny, the two programs'
  # last-bit differences reach the weight, so a few elements may differ by up to 1e-5
  for a, b in zip(jax.tree.leaves(got[:4]), jax.tree.leaves(want[:4])):
    a, b = np.asarray(a), np.asarray(b)
    off = ~np.isclose(a, b, rtol=1e-5, atol=1e-7)
    assert off.mean() <= 1e-3, (off.sum(), off.size)
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=max(1e-5, 1e-4 * float(np.abs(b).max())))
  m_got, m_want = jax.device_get(got[4]), jax.device_get(want[4])
  assert m_got.keys() == m_want.keys()
  for k in m_want:
    np.testing.assert_allclose(m_got[k], m_want[k], rtol=1e-4, atol=1e-6, err_msg=k)
  assert np.isfinite(m_got["loss"]) and m_got["update_skipped"] == 0
