"""ToolEnvironment step semantics and the built-in agent tasks (experts solve them; their
trajectories fit the char tokenizer's built-in template and stay short)."""

import pytest

from rl_jax.data.tokenizers import CharTokenizer
from rl_jax.envs import Environment, Message
from rl_jax.envs.chat import ChatFormat
from rl_jax.envs.spec import run_episode
from rl_jax.envs.tasks import (GuessEnvironment, calculator_examples, calculator_task,
                               guess_task, make_task)
from rl_jax.envs.tool_env import ToolEnvironment
from rl_jax.envs.tools import Calculator, PythonSandbox

EXAMPLE = {"prompt": "What is 12*34?", "answer": "408"}


def _verifier(example, answer):
  return 1.0 if example["answer"] in answer else 0.0


def _hermes(name, args):
  import json  # pylint: disable=import-outside-toplevel
  return f'<tool_call>{json.dumps({"name": name, "arguments": args})}</tool_call>'


def test_tool_environment_runs_calls_then_scores_the_answer():
  env = ToolEnvironment([Calculator()], _verifier, system_prompt="Use tools.")
  assert isinstance(env, Environment)
  opening = env.reset(EXAMPLE, seed=0)
  assert opening == [Message("system", "Use tools."), Message("user", "What is 12*34?")]
  res = env.step("Computing. " + _hermes("calc", {"expr": "12*34"}))
  assert res.messages == (Message("tool", "408", name="calc"),)
  assert not res.done and res.reward == 0.0
  assert res.info["tool_calls"] == 1 and res.info["tool_errors"] == {}
  assert res.info["tool_latency_s"] >= 0
  res = env.step("It is 408.")
  assert res.done and res.reward == 1.0 and res.messages == ()


def test_tool_environment_errors_are_observations():
  env = ToolEnvironment([Calculator(), PythonSandbox(timeout_s=1.0)], _verifier,
                        max_tool_calls_per_turn=2)
  env.reset(EXAMPLE, seed=0)
  res = env.step(_hermes("nope", {}) + _hermes("calc", {"x": 1}) + _hermes("calc", {"expr": "1"})
                 + "<tool_call>{broken</tool_call>")
  assert not res.done
  assert res.info["tool_calls"] == 4
  assert res.info["tool_errors"] == {"unknown_tool": 1, "bad_arguments": 1,
                                     "too_many_calls": 1, "bad_json": 1}
  assert all(type(m.content) is str and m.role == "tool" for m in res.messages)
  assert [m.content.split(":")[0] for m in res.messages] == [
      "error[unknown_tool]", "error[bad_arguments]", "error[too_many_calls]", "error[bad_json]"]
  res = env.step(_hermes("python", {"code": "raise KeyError(1)"}))
  assert res.info["tool_errors"] == {"exception": 1} and "KeyError" in res.messages[0].content


def test_tool_environment_truncates_and_survives_a_failing_verifier():
  env = ToolEnvironment([Calculator()], _verifier, max_turns=2)
  env.reset(EXAMPLE, seed=0)
  assert not env.step(_hermes("calc", {"expr": "1"})).done
  res = env.step(_hermes("calc", {"expr": "1"}))
  assert res.done and res.reward == 0.0 and res.info["truncated"]

  def bad_verifier(example, answer):
    raise KeyError("answer")
  env = ToolEnvironment([], bad_verifier)
  env.reset(EXAMPLE, seed=0)
  res = env.step("42")
  assert res.done and res.reward == 0.0 and "KeyError" in res.info["verifier_error"]


def test_calculator_task_splits_are_deterministic_and_disjoint():
  a, b = calculator_task(seed=3, n_train=300, n_eval=50), calculator_task(seed=3, n_train=300,
                                                                          n_eval=50)
  assert a.train == b.train and a.eval == b.eval
  assert not {e["prompt"] for e in a.train} & {e["prompt"] for e in a.eval}
  assert calculator_task(seed=4, n_train=300, n_eval=50).train != a.train
  for e in a.train:
    assert 10 <= e["a"] <= 999 and 10 <= e["b"] <= 999 and int(e["answer"]) == e["a"] * e["b"]
  with pytest.raises(ValueError):
    calculator_examples(100, 0, digits=(1, 1))


def _check_expert(spec, examples, max_tokens):
  fmt = ChatFormat.builtin(CharTokenizer())
  for i, ex in enumerate(examples):
    messages = spec.expert(ex, i)
    # Replaying the expert's assistant turns in a fresh environment solves the example.
    actions = iter([m.content for m in messages if m.role == "assistant"])
    episode = run_episode(spec.make_env(ex), ex, lambda _: next(actions), seed=i)
    assert episode.done and episode.total_reward == 1.0, messages
    assert episode.messages == messages
    text = fmt.render(messages)
    fmt.tokenizer.encode(text.replace("<eos>", ""))  # every char in the vocabulary
    assert len(fmt.encode(text)) <= max_tokens, text


def test_calculator_expert_solves_every_eval_example():
  spec = calculator_task(n_train=10, n_eval=100)
  _check_expert(spec, spec.eval + spec.train, max_tokens=48)
  messages = spec.expert({"prompt": "123*45", "a": 123, "b": 45, "answer": "5535"}, 0)
  assert ChatFormat.builtin().render(messages) == "U:123*45\nA:<c>123*45</c><eos>T:5535\nA:5535<eos>"


def test_calculator_wrong_answer_and_missing_call():
  spec = calculator_task(n_train=1, n_eval=1)
  ex = spec.eval[0]
  env, opening = spec.start(ex)
  assert opening == [Message("user", ex["prompt"])]
  assert env.step("12").reward == 0.0
  env, _ = spec.start(ex)
  res = env.step("<c>1*")
  assert res.info["tool_errors"] == {"bad_call": 1} and not res.done


def test_guess_expert_solves_every_target_within_the_budget():
  spec = guess_task(n_train=20, n=20, max_turns=5)
  assert [e["target"] for e in spec.eval] == list(range(1, 21))
  assert spec.train == guess_task(n_train=20, n=20).train
  _check_expert(spec, spec.eval, max_tokens=80)


def test_guess_environment_feedback_budget_and_shaping():
  env = GuessEnvironment(max_turns=3, step_penalty=0.1)
  assert env.reset({"prompt": "guess 1-20", "target": 7, "n": 20}, seed=0) == [
      Message("user", "guess 1-20")]
  r = env.step("10")
  assert r.messages == (Message("user", "lower"),) and r.reward == pytest.approx(-0.1)
  assert env.step("x").messages == (Message("user", "invalid"),)
  r = env.step("3")
  assert r.done and r.reward == pytest.approx(-0.1) and not r.info["solved"]
  env.reset({"prompt": "guess 1-20", "target": 7, "n": 20}, seed=0)
  r = env.step(" 7 ")
  assert r.done and r.reward == 1.0


def test_make_task():
  assert make_task("guess", n_train=3).name == "guess"
  with pytest.raises(ValueError, match="unknown agent task"):
    make_task("chess")


@pytest.mark.parametrize("task", ["calculator", "guess"])
def test_engine_style_token_sequence_matches_the_render(task):
  """prompt_ids, then per turn the sampled ids (content + eos) and delta_ids, rebuild the
  tokenized render of the whole conversation."""
  fmt = ChatFormat.builtin(CharTokenizer())
  spec = make_task(task, n_train=5) if task == "guess" else make_task(task, n_train=5, n_eval=5)
  for ex in spec.eval[:5]:
    messages = spec.expert(ex, 0)
    n_open = 1
    ids = fmt.prompt_ids(messages[:n_open])
    i = n_open
    while i < len(messages):
      assert messages[i].role == "assistant"
      ids += fmt.tokenizer.encode(messages[i].content) + [fmt.end_of_turn_ids[0]]
      j = i + 1
      while j < len(messages) and messages[j].role != "assistant":
        j += 1
      if j > i + 1:
        ids += fmt.delta_ids(messages[:i + 1], messages[i + 1:j])
      i = j
    assert ids == fmt.encode(fmt.render(messages))
