"""The real-model path of the trainer: an HF checkpoint directory + tokenizer.json + a GSM8K
file, through configs/gsm8k_hf.py (tiny sizes), and the HF export loads in transformers."""

import json
import os

import numpy as np
import tokenizers
import transformers
from tokenizers import models as tok_models, pre_tokenizers, trainers

from rl_jax import config_utils, metrics, train
from tests.hf_utils import tiny_hf_model

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

QUESTIONS = [("Tom has 3 apples and buys 4 more. How many apples?", "3 + 4 = 7\n#### 7"),
             ("A box holds 6 pens. How many pens in 2 boxes?", "6 * 2 = 12\n#### 12"),
             ("Sara had 10 coins and spent 3. How many are left?", "10 - 3 = 7\n#### 7"),
             ("There are 5 cats with 4 legs each. How many legs?", "5 * 4 = 20\n#### 20")] * 3


def _write_tokenizer(path, texts):
  tok = tokenizers.Tokenizer(tok_models.BPE(unk_token="<unk>"))
  tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
  trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<pad>", "<unk>", "</s>"],
                                initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
  tok.train_from_iterator(texts, trainer)
  tok.save(os.path.join(path, "tokenizer.json"))
  with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
    json.dump({"eos_token": "</s>", "pad_token": "<pad>"}, f)
  return tok.get_vocab_size()


def test_gsm8k_config_with_hf_checkpoint(tmp_path):
  model_dir, data = tmp_path / "model", tmp_path / "train.jsonl"
  model_dir.mkdir()
  for name, rows in (("train.jsonl", QUESTIONS), ("eval.jsonl", QUESTIONS[:4])):
    with open(tmp_path / name, "w") as f:
      for i, (q, a) in enumerate(rows):
        f.write(json.dumps({"question": f"{q} (#{i})", "answer": a}) + "\n")
  vocab = _write_tokenizer(str(model_dir), [q + " " + a for q, a in QUESTIONS])
  tiny_hf_model("qwen3", model_dir, vocab=vocab, hidden=32, inter=64, layers=1, heads=2,
                kv_heads=1, head_dim=16, max_pos=512)
  config = config_utils.load_config(os.path.join(ROOT, "configs", "gsm8k_hf.py"), [
      f"model.hf_path={model_dir}", f"data.path={data}", f"data.eval_path={tmp_path / 'eval.jsonl'}", "data.eval_size=4",
      "rollout.max_new_tokens=8", "rollout.n=2", "train.steps=2", "train.batch_groups=2",
      "train.minibatches=1", "train.eval_every=2", "train.checkpoint_every=0",
      "log.tensorboard=False", "data.max_prompt_len=128", "model.remat=dots"])
  train.train(config, str(tmp_path / "run"), progress=False)
  rows = metrics.read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))
  assert [r["step"] for r in rows] == [1, 2] and "eval_accuracy" in rows[-1]
  assert all(np.isfinite(r["loss"]) for r in rows)
  exported = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "run" / "hf"))
  assert exported.config.model_type == "qwen3"
  # Resuming restores onto an abstract target: the base weights are not read again.
  for f in model_dir.glob("*.safetensors"):
    f.write_bytes(b"corrupt")
  state = train.train(config, str(tmp_path / "run"), progress=False)
  assert int(state.step) == 2
  assert [r["step"] for r in metrics.read_jsonl(str(tmp_path / "run" / "metrics.jsonl"))] == [1, 2]
