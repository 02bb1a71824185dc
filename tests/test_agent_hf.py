"""The real-model path of agentic RL: configs/gsm8k_tools_hf.py (env.name="math_tools") on a
tiny random Qwen3 checkpoint whose directory holds a byte-level tokenizer and a Qwen3-style
chat template with tools (tests/envs_fixtures.py), a GSM8K-format file, and the sandboxed
Python tool called in the hermes format the template advertises."""

import dataclasses
import json
import os

import numpy as np
import pytest
import transformers

from rl_jax import config_utils, metrics, train
from rl_jax.data.tokenizers import HFTokenizer
from rl_jax.envs import Message, run_episode
from rl_jax.envs import tasks as env_tasks
from rl_jax.envs.chat import ChatFormat
from rl_jax.envs.tool_calls import ParsedTurn, ToolCall, template_format
from rl_jax.errors import ConfigError
from rl_jax.train.context import build_setup
from tests import envs_fixtures
from tests.hf_utils import tiny_hf_model
from tests.test_agent_train import first_batch
from tests.tiny import ROOT

CONFIG = os.path.join(ROOT, "configs", "gsm8k_tools_hf.py")
QUESTIONS = [("Tom has 3 apples and buys 4 more. How many apples?", "3 + 4 = 7\n#### 7"),
             ("A box holds 6 pens. How many pens in 2 boxes?", "6 * 2 = 12\n#### 12"),
             ("Sara had 10 coins and spent 3. How many are left?", "10 - 3 = 7\n#### 7"),
             ("There are 5 cats with 4 legs each. How many legs?", "5 * 4 = 20\n#### 20"),
             ("A pack has 8 cards. How many cards in 3 packs?", "8 * 3 = 24\n#### 24"),
             ("Ann reads 9 pages and then 6 more. How many pages?", "9 + 6 = 15\n#### 15")]
CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(3 + 4)"}}\n</tool_call>'


@pytest.fixture(scope="module")
def files(tmp_path_factory):
  """(checkpoint directory, train file, eval file)."""
  root = tmp_path_factory.mktemp("agent_hf")
  model_dir = envs_fixtures.write_checkpoint(root / "model", "qwen3_tools")
  vocab = HFTokenizer(str(model_dir)).vocab_size
  tiny_hf_model("qwen3", model_dir, vocab=vocab, hidden=32, inter=64, layers=1, heads=2,
                kv_heads=1, head_dim=16, max_pos=1024)
  paths = []
  for name, rows in (("train.jsonl", QUESTIONS), ("eval.jsonl", QUESTIONS[:2])):
    with open(root / name, "w") as f:
      for q, a in rows:
        f.write(json.dumps({"question": q, "answer": a}) + "\n")
    paths.append(str(root / name))
  return str(model_dir), paths[0], paths[1]


def _config(files, overrides=()):
  model_dir, train_path, eval_path = files
  return config_utils.load_config(CONFIG, [
      f"model.hf_path={model_dir}", f"data.path={train_path}", f"data.eval_path={eval_path}",
      "model.dtype=float32", "data.eval_size=2", "data.max_prompt_len=1024",
      "env.max_turns=2", "env.max_total_tokens=128", "env.max_turn_tokens=16",
      "env.max_obs_tokens=96", "env.workers=2", "rollout.n=2", "train.steps=2",
      "train.batch_groups=2", "train.minibatches=1", "train.eval_every=2",
      "train.checkpoint_every=0", "log.tensorboard=False"] + list(overrides))


def test_scripted_python_episode_through_the_template(files):
  """A hermes call running Python, its result, then a boxed answer: reward 1 (0 for a wrong
  answer); the observation's ids are the template's tool turn and the next generation
  prompt (with the empty think block of enable_thinking=False)."""
  model_dir = files[0]
  fmt = ChatFormat.from_pretrained(model_dir, HFTokenizer(model_dir), with_tools=True,
                                   template_vars={"enable_thinking": False})
  assert fmt.end_of_turn == "<|im_end|>" and template_format(fmt.source) == "hermes"
  spec = env_tasks.make_task("math_tools", train=[{"prompt": QUESTIONS[0][0], "answer": "7"}])
  example = spec.train[0]
  for answer, reward in (("So there are \\boxed{7} apples.", 1.0), ("\\boxed{8}", 0.0)):
    policy = lambda msgs, a=answer: a if msgs[-1].role == "tool" else CALL
    episode = run_episode(spec.make_env(example), example, policy, max_turns=4)
    assert [m.role for m in episode.messages] == ["system", "user", "assistant", "tool",
                                                  "assistant"]
    assert episode.messages[3] == Message("tool", "7\n", name="python")
    assert episode.total_reward == reward and episode.done
  env, opening = spec.start(example)
  prompt = fmt.render(opening, env.tools, add_generation_prompt=True)
  assert '"name": "python"' in prompt and prompt.endswith("assistant\n<think>\n\n</think>\n\n")
  delta = fmt.delta_ids(episode.messages[:3], episode.messages[3:4], env.tools)
  assert fmt.tokenizer._tok.decode(delta, skip_special_tokens=False) == (
      "\n<|im_start|>user\n<tool_response>\n7\n\n</tool_response><|im_end|>\n"
      "<|im_start|>assistant\n<think>\n\n</think>\n\n")


@pytest.fixture(scope="module")
def run(files, tmp_path_factory):
  workdir = str(tmp_path_factory.mktemp("agent_hf_run"))
  train.train(_config(files), workdir, progress=False)
  return workdir


def test_math_tools_trains_end_to_end(run):
  rows = metrics.read_jsonl(os.path.join(run, "metrics.jsonl"))
  rl = [r for r in rows if r["phase"] == "rl"]
  assert [r["step"] for r in rl] == [1, 2]
  for key in ("turns_mean", "tool_calls", "tool_errors", "reward_mean", "loss"):
    assert all(np.isfinite(r[key]) for r in rl), key
  assert all(1.0 <= r["turns_mean"] <= 2.0 for r in rl)
  assert 0.0 <= rows[-1]["eval_accuracy"] <= 1.0 and "eval_turns_mean" in rows[-1]
  exported = transformers.AutoConfig.from_pretrained(os.path.join(run, "hf"))
  assert exported.model_type == "qwen3"
  # the export carries the tokenizer and chat template: it serves as it was trained
  from rl_jax.serve.checkpoint import load_served  # pylint: disable=import-outside-toplevel
  served = load_served(os.path.join(run, "hf"))
  assert served.chat is not None and served.parser == template_format(served.chat.source)
  assert served.stop_ids == served.chat.end_of_turn_ids


def _always_calls(text):
  """A parser that reads every turn as a Python call: the random policy's episodes then
  take two turns with a real sandbox observation between them."""
  del text
  return ParsedTurn(calls=(ToolCall("python", {"code": "print(6 * 7)"}),))


def test_trained_ids_are_the_sampled_ids(files):
  """The learner's packed rows hold exactly the engine's ids (first prompt rendered by the
  checkpoint's template, sampled ids, the sandbox's observation ids appended through the
  template) and score them with the engine's log-probs; observations are not trained."""
  s = build_setup(_config(files, ["train.old_logp_pass=separate"]))
  assert s.chat.end_of_turn_ids[0] == s.tokenizer.eos_id  # <|im_end|> ends a turn
  make_env = lambda ex: env_tasks.make_math_tools_env(_always_calls, max_turns=2)
  s = dataclasses.replace(s, task=dataclasses.replace(s.task, make_env=make_env))
  _, _, scored, batch = first_batch(s)
  G, M, R = s.geometry.groups, s.geometry.samples, s.geometry.new_tokens
  mask = scored.mask.reshape(G, M, R)
  assert mask.any()
  assert np.array_equal(np.asarray(batch.tokens), scored.tokens.reshape(G, M, R))
  assert np.array_equal(np.asarray(batch.inputs.mask), mask)
  old = np.asarray(batch.inputs.old_logp)
  np.testing.assert_allclose(old[mask], scored.logprobs.reshape(G, M, R)[mask], atol=1e-5)
  prompt = s.tokenizer.encode(s.train_examples[int(scored.indices[0])].prompt)
  assert np.array_equal(np.asarray(batch.prompt_tokens)[0, :len(prompt)], prompt)
  # every row: turn 1, the tool's answer "42" in a tool turn (ids not in the loss), turn 2
  assert scored.stats["turns_mean"] == 2.0 and scored.stats["tool_calls"] == 2 * G * M
  for row, m in zip(scored.tokens, scored.mask):
    first, last = np.flatnonzero(m)[[0, -1]]
    obs = row[first:last][~m[first:last]]
    assert "<tool_response>\n42\n\n</tool_response>" in s.tokenizer._tok.decode(
        obs.tolist(), skip_special_tokens=False)


def test_checkpoint_without_template_or_tool_format_fails_in_one_line(files, tmp_path):
  bare = tmp_path / "bare"
  bare.mkdir()
  model_dir = files[0]
  for name in ("tokenizer.json", "config.json"):
    (bare / name).write_bytes(open(os.path.join(model_dir, name), "rb").read())
  (bare / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
  plain = envs_fixtures.write_checkpoint(tmp_path / "plain", "qwen3")  # no tool markers
  assert template_format(envs_fixtures.LLAMA3_STYLE) == "llama3"
  assert template_format(envs_fixtures.QWEN3_STYLE) is None
  for overrides, needle in (([f"model.hf_path={bare}"], "no chat template"),
                            ([f"data.tokenizer={plain}"], "env.tool_format=hermes or llama3"),
                            (["sft.steps=3"], "sft.steps=3"),
                            (["env.tool_format=json"], "config.env.tool_format")):
    with pytest.raises(ConfigError) as e:
      build_setup(_config(files, overrides))
    assert needle in str(e.value) and "\n" not in str(e.value)
