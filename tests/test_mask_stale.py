"""``rollout.mask_stale``: tokens sampled by an older policy than the producer held leave the
loss mask, and stay in the generated mask (so a terminal reward still sits on the last
generated token)."""

import numpy as np
import pytest

from rl_jax import config_utils, train
from rl_jax.train import learner, producer
from tests.tiny import QUICKSTART, TINY_MODEL

TINY = TINY_MODEL + [
    "sft.steps=0", "train.steps=1", "train.batch_groups=2", "rollout.n=4",
    "rollout.temperature=1.0", "train.eval_every=0", "log.tensorboard=False",
    "train.checkpoint_every=0", "rollout.max_new_tokens=6",
]


@pytest.mark.parametrize("mask_stale", [False, True])
def test_stale_tokens_leave_the_loss_mask_only(mask_stale):
  s = train.build_setup(config_utils.load_config(QUICKSTART, TINY + [
      f"rollout.mask_stale={mask_stale}"]))
  t = train.make_trainer(s)
  state = train.begin_rl(s, train.init_state(s))
  G = s.geometry.rows
  scored, _ = producer.produce(t, t.layout.sampler_params(state.params), state.producer,
                               step=3, version=3, lo=0, hi=G)
  # the first half of every sample's tokens as if a held group had sampled them two
  # versions earlier (an APRIL engine's partial response)
  versions = np.array(scored.versions)
  versions[:, :3] = 1
  scored = scored._replace(versions=versions)
  batch, _ = learner.learner_batch(t, state, scored)
  gen = scored.mask.reshape(batch.inputs.mask.shape)
  want = gen & (versions.reshape(gen.shape) >= 3) if mask_stale else gen
  assert gen[..., :3].any() and (want != gen).any() == mask_stale
  np.testing.assert_array_equal(np.asarray(batch.inputs.mask), want)
  np.testing.assert_array_equal(np.asarray(batch.inputs.generated_mask), gen)
