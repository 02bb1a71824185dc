"""On-policy distillation: the reverse-KL advantages against NumPy, the teacher's log-probs
against `transformers` running the same checkpoint, offload, training, and the one-line
errors of a teacher the policy cannot use."""

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from rl_jax import config as config_lib
from rl_jax import config_utils, losses, train
from rl_jax.data import tokenizers
from rl_jax.errors import ConfigError
from tests.hf_utils import tiny_hf_model
from tests.tiny import QUICKSTART, TINY_MODEL

VOCAB = tokenizers.CharTokenizer().vocab_size
TINY = TINY_MODEL + [
    "sft.steps=0", "train.steps=2", "train.batch_groups=2", "rollout.n=4",
    "rollout.temperature=0.7", "train.eval_every=0", "log.tensorboard=False",
    "train.checkpoint_every=0",
]


# ------------------------------------------------------------------ the formulas (NumPy)
def _inputs(rng, G=3, M=4, R=5):
  mask = rng.random((G, M, R)) < 0.7
  return losses.ObjectiveInputs(
      rewards=jnp.asarray(rng.integers(0, 2, (G, M)).astype(np.float32)),
      mask=jnp.asarray(mask),
      old_logp=jnp.asarray(-rng.random((G, M, R)).astype(np.float32)),
      behaviour_logp=jnp.asarray(-rng.random((G, M, R)).astype(np.float32)),
      teacher_logp=jnp.asarray(-2 * rng.random((G, M, R)).astype(np.float32)))


def _grpo_numpy(r, eps=1e-6):
  mean = r.mean(axis=1, keepdims=True)
  std = r.std(axis=1, ddof=1, keepdims=True)
  return (r - mean) / (std + eps)


def test_reverse_kl_advantages_match_numpy():
  x = _inputs(np.random.default_rng(0))
  t, b, m = (np.asarray(a, np.float64) for a in (x.teacher_logp, x.behaviour_logp, x.mask))
  alone = losses.get_objective("on_policy_distill", distill_coef=0.5).advantages_from(x)
  np.testing.assert_allclose(alone.advantages, np.where(m > 0, 0.5 * (t - b), 0.0), rtol=1e-6)
  both = losses.get_objective("dapo", distill_coef=2.0).advantages_from(x)
  task = _grpo_numpy(np.asarray(x.rewards, np.float64))[..., None]
  np.testing.assert_allclose(both.advantages, np.where(m > 0, task + 2.0 * (t - b), 0.0),
                             rtol=1e-5, atol=1e-6)
  kl = losses.sampled_reverse_kl(x.teacher_logp, x.behaviour_logp, x.mask)
  np.testing.assert_allclose(kl, ((b - t) * m).sum() / m.sum(), rtol=1e-6)


def test_objectives_declare_what_they_read():
  assert losses.get_objective("on_policy_distill").needs >= {"teacher_logp", "behaviour_logp"}
  assert "teacher_logp" not in losses.get_objective("grpo").needs
  with pytest.raises(ValueError, match="distill_coef must be > 0"):
    losses.get_objective("grpo", distill_coef=0.0)


# --------------------------------------------------------------------- the trainer side
@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory):
  """A tiny random Qwen3 of the character vocabulary, of another shape than the policy."""
  path = tmp_path_factory.mktemp("teacher")
  model = tiny_hf_model("qwen3", path, vocab=VOCAB, hidden=48, inter=96, layers=2, heads=4,
                        kv_heads=2, head_dim=12, max_pos=64)
  with torch.no_grad():  # a peaked teacher, far from the near-uniform random policy
    model.lm_head.weight.mul_(8.0)
  model.save_pretrained(str(path), safe_serialization=True)
  return str(path), model


def _config(teacher, extra=()):
  return config_utils.load_config(QUICKSTART, TINY + [
      f"distill.teacher_path={teacher}", "loss.preset=on_policy_distill", *extra])


def _hf_logprobs(model, prompt, response, temperature):
  ids = torch.as_tensor([list(prompt) + list(response)], dtype=torch.long)
  with torch.no_grad():
    logits = model(ids).logits[0].double() / temperature
  logp = torch.log_softmax(logits, dim=-1)
  P = len(prompt)
  return np.array([logp[P - 1 + i, tok].item() for i, tok in enumerate(response)])


@pytest.mark.parametrize("offload", ["", "teacher"])
def test_teacher_logprobs_match_transformers(teacher_dir, offload):
  """The learner batch's ``teacher_logp`` is what transformers gives for the teacher
  checkpoint on the same prompt and sampled tokens (at the sampling temperature), with the
  teacher on the device or in host memory, and the advantages are coef · (teacher - sampler)."""
  path, model = teacher_dir
  s = train.build_setup(_config(path, [f"train.offload={offload}"]))
  assert s.teacher_cfg.hidden_size == 48 and s.model_cfg.hidden_size == 32
  t = train.make_trainer(s)
  if offload:
    assert all(x.sharding.memory_kind == "pinned_host" for x in jax.tree.leaves(t.teacher))
  state = train.begin_rl(s, train.init_state(s))
  batch, info, _ = train.collect(t, state)
  x = batch.inputs
  pt, pl, rt, mask = (np.asarray(a) for a in (batch.prompt_tokens, batch.prompt_lengths,
                                              batch.tokens, x.mask))
  got = np.asarray(x.teacher_logp)
  G, M, R = rt.shape
  checked = 0
  for g in range(G):
    for m in range(M):
      n = int(mask[g, m].sum())
      want = _hf_logprobs(model, pt[g, :pl[g]], rt[g, m, :n], 0.7)
      np.testing.assert_allclose(got[g, m, :n], want, rtol=2e-4, atol=2e-4)
      checked += n
  assert checked > G * M  # responses of more than one token were compared
  want_adv = np.where(mask, got - np.asarray(x.behaviour_logp), 0.0)
  np.testing.assert_allclose(np.asarray(batch.advantages.advantages), want_adv, rtol=1e-6)
  np.testing.assert_allclose(info["distill_reverse_kl"],
                             -(want_adv * mask).sum() / mask.sum(), rtol=1e-5)


def _run(config, workdir) -> list[dict]:
  train.train(config, str(workdir), progress=False)
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return [json.loads(line) for line in f]


def test_distillation_trains_toward_the_teacher(teacher_dir, tmp_path):
  """Alone, the policy's sampled reverse KL to the teacher falls over a short run; beside a
  task reward (GRPO + the teacher's term) the run trains too."""
  path, _ = teacher_dir
  cfg = _config(path, ["train.steps=24", "train.batch_groups=4", "rollout.n=8", "optim.lr=3e-3",
                        "rollout.max_new_tokens=4"])
  metrics = _run(cfg, tmp_path / "alone")
  kl = [m["distill_reverse_kl"] for m in metrics if "distill_reverse_kl" in m]
  assert len(kl) == 24 and np.mean(kl[-4:]) < 0.85 * np.mean(kl[:4]), kl  # 5.7 -> 4.1 here
  cfg = config_utils.load_config(QUICKSTART, TINY + [
      f"distill.teacher_path={path}", "distill.coef=0.1", "loss.preset=dapo"])
  metrics = _run(cfg, tmp_path / "beside")
  assert all(np.isfinite(m["loss"]) and "distill_reverse_kl" in m
             for m in metrics if "loss" in m)


# ------------------------------------------------------------------------ the errors
def _error(config) -> str:
  with pytest.raises(ConfigError) as e:
    train.build_setup(config)
  assert "\n" not in str(e.value)
  return str(e.value)


def test_preset_without_teacher_is_one_line():
  config = config_utils.load_config(QUICKSTART, TINY + ["loss.preset=on_policy_distill"])
  with pytest.raises(ConfigError, match="needs distill.teacher_path"):
    config_lib.validate(config)
  config = config_utils.load_config(QUICKSTART, TINY + ["loss.advantage=distill"])
  assert "set distill.teacher_path" in _error(config)
  config = config_utils.load_config(QUICKSTART, TINY + ["train.offload=teacher"])
  assert "no teacher to offload" in _error(config)


def test_missing_teacher_directory_is_one_line(tmp_path):
  assert "does not exist" in _error(_config(str(tmp_path / "nowhere")))


def test_teacher_with_another_vocabulary_size_is_one_line(tmp_path):
  tiny_hf_model("qwen3", tmp_path, vocab=VOCAB + 5, hidden=32, inter=64, layers=1)
  msg = _error(_config(str(tmp_path)))
  assert f"vocabulary of {VOCAB + 5} tokens, the policy {VOCAB}" in msg


def test_teacher_tokenizer_must_map_ids_as_the_policy_does(tmp_path):
  """Same size, other strings: a word-level tokenizer.json over the characters reversed is
  refused; the character tokenizer's own export (what rl_jax writes beside hf/) is accepted."""
  import tokenizers as hf_tokenizers  # the HF library
  tiny_hf_model("qwen3", tmp_path, vocab=VOCAB, hidden=32, inter=64, layers=1)
  ours = tokenizers.CharTokenizer().vocab()
  shuffled = dict(zip(ours, reversed(list(ours.values()))))
  tok = hf_tokenizers.Tokenizer(hf_tokenizers.models.WordLevel(shuffled, unk_token="<pad>"))
  tok.save(os.path.join(tmp_path, "tokenizer.json"))
  with open(os.path.join(tmp_path, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "<eos>"}, f)
  assert "tokenizer differs from the policy's" in _error(_config(str(tmp_path)))
  for name in ("tokenizer.json", "tokenizer_config.json"):
    os.remove(os.path.join(tmp_path, name))
  tokenizers.save_tokenizer("char", str(tmp_path))
  assert train.build_setup(_config(str(tmp_path))).teacher_cfg.vocab_size == VOCAB
