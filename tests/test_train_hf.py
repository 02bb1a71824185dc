"""The real-model path of the trainer: an HF checkpoint directory + tokenizer.json + a GSM8K
file, through configs/gsm8k_hf.py (tiny sizes, unchanged but for sizes) for a dense Qwen3, a
Qwen3-MoE (router replay and the load-balancing loss on) and a Gemma 3 (text) checkpoint
whose tokenizer prepends a bos; the HF export loads in transformers."""

import json
import os

import jax
import numpy as np
import pytest
import tokenizers
import transformers
from tokenizers import models as tok_models, pre_tokenizers, trainers

from rl_jax import config_utils, metrics, train
from rl_jax.errors import ConfigError
from rl_jax.train import state as train_state
from rl_jax.train.rollouts import encode_prompts
from tests.hf_utils import tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QUESTIONS = [("Tom has 3 apples and buys 4 more. How many apples?", "3 + 4 = 7\n#### 7"),
             ("A box holds 6 pens. How many pens in 2 boxes?", "6 * 2 = 12\n#### 12"),
             ("Sara had 10 coins and spent 3. How many are left?", "10 - 3 = 7\n#### 7"),
             ("There are 5 cats with 4 legs each. How many legs?", "5 * 4 = 20\n#### 20")] * 3


def _write_tokenizer(path, texts, bos=False):
  """A byte-level BPE tokenizer.json; ``bos``: Gemma-style specials (pad 0, eos 1, bos 2, as
  Gemma3TextConfig's ids) with ``add_bos_token`` and a post-processor that prepends it."""
  tok = tokenizers.Tokenizer(tok_models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  specials = ["<pad>", "</s>", "<bos>", "<unk>"] if bos else ["<pad>", "<unk>", "</s>"]
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=specials,
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  special = {"eos_token": "</s>", "pad_token": "<pad>"}
  if bos:
    tok.post_processor = tokenizers.processors.TemplateProcessing(
        single="<bos> $A", special_tokens=[("<bos>", 2)])
    special.update(bos_token="<bos>", add_bos_token=True)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump(special, f)
  return tok.get_vocab_size()


# extra overrides per checkpoint family (MoE: router replay and the load-balancing loss on)
# qwen3 and qwen3_moe sample with their prompts on pool pages (``rollout.prompt_pages``):
# router replay's expert records of the response tokens cut from the prompt's ids
_FAMILY_OVERRIDES = {"qwen3": ["rollout.prompt_pages=True"], "gemma3_text": [],
                     "qwen3_moe": ["model.router_replay=True", "model.router_aux_loss_coef=0.01",
                                   "rollout.prompt_pages=True"]}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe", "gemma3_text"])
def test_gsm8k_config_with_hf_checkpoint(tmp_path, arch):
  model_dir, data = tmp_path / "model", tmp_path / "train.jsonl"
  model_dir.mkdir()
  for name, rows in (("train.jsonl", QUESTIONS), ("eval.jsonl", QUESTIONS[:4])):
    with open(tmp_path / name, "w") as f:
      for i, (q, a) in enumerate(rows):
        f.write(json.dumps({"question": f"{q} (#{i})", "answer": a}) + "\n")
  gemma = arch == "gemma3_text"
  vocab = _write_tokenizer(str(model_dir), [q + " " + a for q, a in QUESTIONS], bos=gemma)
  tiny_hf_model(arch, model_dir, vocab=vocab, hidden=32, inter=64,
                layers=2 if gemma else 1, heads=2, kv_heads=1, head_dim=16, max_pos=512)
  overrides = [
      f"model.hf_path={model_dir}", f"data.path={data}", f"data.eval_path={tmp_path / 'eval.jsonl'}", "data.eval_size=4",
      "rollout.max_new_tokens=8", "rollout.n=2", "train.steps=2", "train.batch_groups=2",
      "train.minibatches=1", "train.eval_every=2", "train.checkpoint_every=0",
      "log.tensorboard=False", "data.max_prompt_len=128", "model.remat=dots"]
  config = config_utils.load_config(os.path.join(ROOT, "configs", "gsm8k_hf.py"),
                                    overrides + _FAMILY_OVERRIDES[arch])
  if arch == "qwen3":  # a fresh state's loaded params are in buffers a donating update reuses
    params = train_state.init_params(train.build_setup(config))
    pointers = lambda tree: [shard.data.unsafe_buffer_pointer() for x in jax.tree.leaves(tree)
                             for shard in x.addressable_shards]
    before = pointers(params)
    params = jax.jit(lambda p: jax.tree.map(lambda x: x * 2, p), donate_argnums=0)(params)
    assert pointers(params) == before
  if arch == "qwen3":  # the load-balancing loss on a dense checkpoint: one line at setup
    bad = config_utils.load_config(os.path.join(ROOT, "configs", "gsm8k_hf.py"),
                                   overrides + ["model.router_aux_loss_coef=0.01"])
    with pytest.raises(ConfigError, match=r"model\.router_aux_loss_coef=0\.01 needs") as e:
      train.build_setup(bad)
    assert "\n" not in str(e.value)
  if gemma:  # every prompt starts with the tokenizer's bos, as transformers encodes it
    s = train.build_setup(config)
    assert s.tokenizer.bos_id == 2 and s.tokenizer.add_bos
    prompts = encode_prompts(s, s.train_examples[:3])
    assert all(p[0] == 2 and 2 not in p[1:] for p in prompts)
    assert [p[1:] for p in prompts] == [s.tokenizer.encode(e.prompt)
                                       for e in s.train_examples[:3]]
  train.train(config, str(tmp_path / "run"), progress=False)
  rows = metrics.read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2] and "eval_accuracy" in rows[-1]
  assert all(np.isfinite(r["loss"]) for r in rows)
  if arch == "qwen3_moe":
    assert all(r["routing_mismatch"] == 0.0 for r in rows)
    assert all(np.isfinite(r["moe_aux_loss"]) and r["moe_aux_loss"] > 0 for r in rows)
  else:
    assert not any("moe_aux_loss" in r for r in rows)
  exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "hf"))
  assert exported.config.model_type == arch
  # Resuming restores onto an abstract target: the base weights are not read again.
  for f in model_dir.glob("*.safetensors"):
    f.write_bytes(b"corrupt")
  state = train.train(config, str(tmp_path / "run"), progress=False)
  assert int(state.step) == 2
  assert [r["step"] for r in metrics.read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))] == [1, 2]


def qwen3_checkpoint(tmp_path):
  """(model directory, data file, vocabulary size): a one-layer Qwen3 with a BPE tokenizer
  trained on ``QUESTIONS``, and those questions as a GSM8K file."""
  model_dir, data = tmp_path / "model", tmp_path / "train.jsonl"
  model_dir.mkdir()
  with open(data, "w") as f:
    for i, (q, a) in enumerate(QUESTIONS):
      f.write(json.dumps({"question": f"{q} (#{i})", "answer": a}) + "\n")
  vocab = _write_tokenizer(str(model_dir), [q + " " + a for q, a in QUESTIONS])
  tiny_hf_model("qwen3", model_dir, vocab=vocab, hidden=32, inter=64, layers=1, heads=2,
                kv_heads=1, head_dim=16, max_pos=512)
  return model_dir, data, vocab


def test_an_end_of_sequence_id_outside_the_vocabulary_is_one_line(tmp_path):
  """A checkpoint whose tokenizer takes its eos from config.json's eos_token_id (no
  eos_token in tokenizer_config.json), an id beyond the model's vocabulary: one line at
  setup naming where it comes from, not an error inside the sampler."""
  model_dir, data, vocab = qwen3_checkpoint(tmp_path)
  (model_dir / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<pad>"}))
  cfg = json.loads((model_dir / "config.json").read_text())
  (model_dir / "config.json").write_text(json.dumps({**cfg, "eos_token_id": 151643}))
  (model_dir / "generation_config.json").unlink(missing_ok=True)
  config = config_utils.load_config(os.path.join(ROOT, "configs", "gsm8k_hf.py"), [
      f"model.hf_path={model_dir}", f"data.path={data}", f"data.eval_path={data}",
      "data.max_prompt_len=128", "rollout.max_new_tokens=8", "mesh.num_devices=1"])
  with pytest.raises(ConfigError) as e:
    train.build_setup(config)
  assert str(e.value) == (f"the end-of-sequence id 151643 of the tokenizer of {model_dir} is "
                          f"outside the model's vocabulary [0, {vocab}): fix its eos_token "
                          "(tokenizer_config.json), or set rollout.eos_id")
