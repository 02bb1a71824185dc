"""The agentic stage: multi-turn episodes of an environment task (``env.name``).

What the producer, the learner, the supervised warm start and the evaluation need from an
environment task, as small functions of the setup's config and host arrays:

* ``task_chat_format``: the compact built-in format for the character tokenizer, else the
  checkpoint's own chat template (``ChatFormat.from_pretrained``: its end of turn, e.g.
  ``<|im_end|>``, ends the engine's turns); ``tool_format``: the tool-call format of
  ``math_tools`` (``env.tool_format``, or the one the template writes).
* ``env_task`` / ``env_examples``: the task (``rl_jax.envs.tasks``; ``math_tools`` reads its
  questions from ``data.path``, ``file_examples``) and its splits as
  ``EnvExample``s whose ``prompt`` is the rendered first prompt (opening messages and the
  assistant's generation header), so the packed training layout's prompt part is exactly the
  engine's first prompt (prompt-once groups share it).
* ``make_engines``: the training ``AgentEngine`` (M samples per group at the rollout
  temperature) and the greedy evaluation engine (same slots and samples: the same compiled
  programs). ``roll`` runs groups to their end, each group ``uid = step · G + group`` so every
  environment seed and every token draw is a function of (seed, step, group, sample).
* ``roll_partial`` (``rollout.partial``, APRIL across turns): the engine returns the first G
  groups to complete and holds the rest (mid-turn, waiting on a tool, or with an observation
  to append) in ``ProducerState.held``; group uids come from the engine's
  counter, which travels with the held groups. The engine's schedule is deterministic
  (lockstep environment steps), so which groups complete and everything held is a function of
  the seeds, and a resumed run continues exactly; held environments are rebuilt by replaying
  their actions.
* ``turn_fields``: the per-turn objective inputs (``losses.TURN_FIELDS``) of a rollout.
* ``rollout_metrics``: turns, tool calls and errors (by kind), latency, environment time
  (and the part hidden behind decoding), truncations, KV hit rate.
* ``expert_batch``: supervised rows of the task's expert trajectories, the loss on the
  assistant's tokens only (their end-of-turn id included), observations masked.
* ``evaluate``: held-out success rate and mean turns of greedy episodes.

Without ``rollout.partial`` every group finishes within its step (nothing is held), so the
producer's position is the prompt sampler's alone and a resumed run continues exactly.

Shapes (the package legend, ``rl_jax/__init__.py``): G groups, M samples per group,
B = G·M rows, R trajectory tokens after the first prompt, U turns, P prompt bucket, T = P + R.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, NamedTuple, Sequence

import jax
import numpy as np

from rl_jax import rollout
from rl_jax.data import files
from rl_jax.data.tokenizers import CharTokenizer
from rl_jax.envs import chat as chat_lib
from rl_jax.envs import tasks as env_tasks
from rl_jax.envs import tool_calls
from rl_jax.errors import ConfigError
from rl_jax.rollout.agent_records import AgentRollout, EpisodeSpec
from rl_jax.train.streams import Stream, seed_for

__all__ = ["EnvExample", "METRICS", "env_task", "env_examples", "chat_format",
           "task_chat_format", "tool_format", "file_examples", "make_engines", "make_engine",
           "engine_params", "episodes", "roll", "roll_partial", "turn_fields",
           "rollout_metrics", "expert_rows", "expert_batch",
           "evaluate"]

# the step metrics of a multi-turn batch (besides ``tool_errors_<kind>``)
METRICS = ("turns_mean", "tool_calls", "tool_errors", "tool_latency_s", "env_time_s",
           "env_time_hidden_s", "truncated_trajectories", "kv_hit_rate")


class EnvExample(NamedTuple):
  """One episode's example: ``prompt`` the rendered first prompt (text), ``answer`` the
  reference answer if the task has one, ``data`` the task's example dict."""

  prompt: str
  answer: str
  data: dict


def env_task(config, fmt=None):
  """The configured task (``rl_jax.envs.spec.EnvSpec``); ``fmt`` is the run's chat format
  (``task_chat_format``; math_tools calls tools in its format)."""
  e = config.env
  if e.name == "math_tools":
    return math_tools_task(config, fmt)
  if e.name == "calculator":
    return env_tasks.make_task("calculator", seed=config.data.seed, n_train=e.n_train,
                               n_eval=e.n_eval, digits=(e.digits_min, e.digits_max),
                               max_turns=e.max_turns)
  return env_tasks.make_task("guess", seed=config.data.seed, n_train=e.n_train, n=e.guess_n,
                             max_turns=e.max_turns, step_penalty=e.step_penalty)


def chat_format(tokenizer):
  """The chat format of the built-in tasks (the character tokenizer's compact template)."""
  return chat_lib.ChatFormat.builtin(tokenizer)


def task_chat_format(config, tokenizer):
  """The run's chat format: the compact built-in one for the character tokenizer, else the
  chat template of the tokenizer's checkpoint directory (``data.tokenizer`` or
  ``model.hf_path``; of named templates the "tool_use" one) with ``env.enable_thinking``
  when set; one ``ConfigError`` line when the directory has none, or when math_tools would
  get the built-in format."""
  if isinstance(tokenizer, CharTokenizer):
    if config.env.name == "math_tools":
      raise ConfigError("env.name='math_tools' renders prompts with a checkpoint's chat "
                        "template; set model.hf_path (or data.tokenizer) to a directory with "
                        "tokenizer.json and a chat template")
    return chat_format(tokenizer)
  path = config.data.tokenizer or config.model.hf_path
  thinking = config.env.enable_thinking
  try:
    return chat_lib.ChatFormat.from_pretrained(
        path, tokenizer, with_tools=True,
        template_vars=None if thinking is None else {"enable_thinking": bool(thinking)})
  except ValueError as e:
    raise ConfigError(f"env.name={config.env.name!r}: {' '.join(str(e).split())}") from None


def tool_format(config, fmt) -> str:
  """The tool-call format math_tools parses: ``env.tool_format``, or with "auto" the one
  the chat template writes (``tool_calls.template_format``); one ``ConfigError`` line when
  it names none."""
  if config.env.tool_format != "auto":
    return config.env.tool_format
  found = tool_calls.template_format(fmt.source)
  if found is None:
    raise ConfigError(f"env.tool_format=auto: the chat template of {fmt.name!r} shows no "
                      "tool-call format (no <tool_call> or <|python_tag|>); set "
                      "env.tool_format=hermes or llama3")
  return found


def file_examples(config) -> tuple[list[dict], list[dict]]:
  """(train, eval) examples ``{"prompt": question, "answer": reference}`` of the
  question/answer file ``data.path`` (``data.format``; eval from ``data.eval_path``, else a
  stable hash split: ``rl_jax.data.files.FileTask``), eval cut to ``data.eval_size``."""
  d = config.data
  task = files.FileTask(path=d.path or "", format=d.format, eval_path=d.eval_path,
                        backend="memory")
  as_dicts = lambda view: [{"prompt": x.prompt, "answer": x.answer} for x in view]
  return as_dicts(task.split("train")), as_dicts(task.split("eval", d.eval_size))


def math_tools_task(config, fmt):
  """The math_tools task (``rl_jax.envs.tasks``) on ``data.path``, tools called in
  ``fmt``'s format; no expert, so ``sft.steps`` must be 0."""
  e = config.env
  if config.sft.steps:
    raise ConfigError(f"sft.steps={config.sft.steps}: env.name='math_tools' has no expert "
                      "trajectories to warm-start on; set sft.steps=0")
  train, evals = file_examples(config)
  system = env_tasks.MATH_TOOLS_SYSTEM if e.system_prompt is None else e.system_prompt
  return env_tasks.make_task("math_tools", train=train, eval=evals,
                             parser=tool_format(config, fmt), max_turns=e.max_turns,
                             system_prompt=system, python_timeout_s=e.python_timeout_s,
                             max_tool_calls_per_turn=e.max_tool_calls)


def env_examples(spec, split: Sequence[dict], fmt) -> list[EnvExample]:
  """``split``'s examples with their rendered first prompts."""
  out = []
  for ex in split:
    env, messages = spec.start(ex)
    text = fmt.render(messages, tuple(env.tools), add_generation_prompt=True)
    out.append(EnvExample(text, str(ex.get("answer", "")), dict(ex)))
  return out


def make_engines(s) -> tuple[Any, Any]:
  """(training engine, greedy evaluation engine) of the setup ``s``; the evaluation engine
  differs only in its temperature."""
  return make_engine(s, s.config.rollout.temperature), make_engine(s, 0.0)


def make_engine(s, temperature: float):
  """An ``AgentEngine`` of the setup ``s``: G slots of M samples, R = ``env.max_total_tokens``,
  APRIL's over-sampling and staleness bound, deterministic with ``rollout.partial``."""
  c, e, geo = s.config, s.config.env, s.geometry
  r = c.rollout
  return rollout.AgentEngine(
      s.model_cfg, s.chat, s.tokenizer.decode, n=geo.samples, max_slots=geo.groups,
      max_prompt_len=s.prompt_len, max_total_tokens=geo.new_tokens,
      max_turn_tokens=e.max_turn_tokens, max_turns=e.max_turns,
      max_obs_tokens=e.max_obs_tokens, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
      seed=seed_for(c.train.seed, 0, Stream.AGENT),
      ttl=None if e.kv_ttl_s < 0 else e.kv_ttl_s, step_timeout=e.step_timeout_s,
      workers=e.workers, context=s.model_cfg.max_position_embeddings,
      over_sampling=r.over_sampling,
      max_staleness=None if r.max_staleness < 0 else r.max_staleness,
      deterministic=bool(r.partial))


def episodes(s, examples: Sequence[EnvExample], meta: Sequence[Any]) -> list[EpisodeSpec]:
  """One EpisodeSpec per example (a fresh environment per sample)."""
  make = s.task.make_env
  return [EpisodeSpec(lambda ex=ex.data: make(ex), ex.data, m) for ex, m in zip(examples, meta)]


def engine_params(s, params):
  """The weights on the sampler's first device (the engine's programs are single-device)."""
  return jax.device_put(params, s.sampler_mesh.devices.flat[0])


def roll(s, engine, params, idx: np.ndarray, *, step: int, version: int) -> AgentRollout:
  """Groups of the train examples ``idx`` [G], run to their end from ``params``; group g
  has uid ``step · G + g``."""
  G = s.geometry.groups
  params = engine_params(s, params)
  specs = episodes(s, [s.train_examples[i] for i in idx], [int(i) for i in idx])
  return engine.rollout(params, specs, policy_version=version, first_uid=step * G)


def _spec_of(s, i: int) -> EpisodeSpec:
  """The EpisodeSpec of train example ``i`` (its meta is ``i``)."""
  return episodes(s, [s.train_examples[i]], [i])[0]


def roll_partial(s, engine, params, held: dict, next_index: Callable[[], int], *,
                 version: int, capacity: int) -> tuple[AgentRollout, dict]:
  """The first G groups to complete, from the groups ``held`` (an ``export_held`` dict)
  and new episodes of the train examples ``next_index()`` draws; (the rollout, the held
  groups after it as ``export_held(capacity)``). The held groups are imported every step,
  not only after a resume, so a resumed run takes exactly the path of an uninterrupted one
  (the replay costs one environment step per recorded action of each held sample)."""
  engine.import_held(held, spec_of=lambda i: _spec_of(s, i))

  def specs():
    while True:
      yield _spec_of(s, next_index())

  out = engine.rollout_groups(engine_params(s, params), specs(), s.geometry.groups,
                              policy_version=version)
  return out, engine.export_held(capacity)


def _turn_starts(out: AgentRollout, U: int) -> np.ndarray:
  """int32 [B,U]: index of each turn's first model token (-1 past the last turn)."""
  B = out.tokens.shape[0]
  starts = np.full((B, U), -1, np.int32)
  for b in range(B):
    for u in range(int(out.num_turns[b])):
      hit = np.flatnonzero(out.model_mask[b] & (out.turn[b] == u))
      starts[b, u] = hit[0] if hit.size else -1
  return starts


def turn_fields(out: AgentRollout, U: int, R: int) -> dict[str, np.ndarray]:
  """The per-turn inputs of ``out``: turn_rewards float32 [B,U] (NaN past the last turn),
  turn_ids int32 [B,R] (the turn of each model token, -1 on observation tokens and padding)
  and turn_states int32 [B,U] (a hash of the token history each turn starts from: equal
  histories, equal states; -1 past the last turn)."""
  B = out.tokens.shape[0]
  present = np.arange(U)[None, :] < out.num_turns[:, None]
  rewards = np.where(present, out.turn_rewards[:, :U], np.nan).astype(np.float32)
  ids = np.where(out.model_mask, out.turn, -1)[:, :R].astype(np.int32)
  starts = _turn_starts(out, U)
  prompts = [out.prompts[i] for i in out.prompt_index]
  states = np.full((B, U), -1, np.int32)
  for b in range(B):
    for u in range(U):
      if starts[b, u] >= 0:
        hist = np.asarray(list(prompts[b]) + list(out.tokens[b, :starts[b, u]]), np.int32)
        states[b, u] = zlib.crc32(hist.tobytes()) & 0x7FFFFFFF
  return {"turn_rewards": rewards, "turn_ids": ids, "turn_states": states}


def rollout_metrics(out: AgentRollout) -> dict[str, float]:
  """The step metrics of a multi-turn batch (``METRICS`` and ``tool_errors_<kind>``)."""
  env_s = float(out.env_time.sum())
  kinds: dict[str, int] = {}
  for row in out.error_kinds or ():
    for k, n in row.items():
      kinds[k] = kinds.get(k, 0) + int(n)
  latency = out.tool_latency if out.tool_latency is not None else np.zeros(1)
  return {
      "turns_mean": float(out.num_turns.mean()),
      "tool_calls": float(out.tool_calls.sum()),
      "tool_errors": float(out.tool_errors.sum()),
      "tool_latency_s": float(latency.sum()),
      "env_time_s": env_s,
      "env_time_hidden_s": max(env_s - float(out.stats.get("env_wait_s", 0.0)), 0.0),
      "truncated_trajectories": float(np.sum(out.finish_reason != "done")),
      "kv_hit_rate": float(out.stats.get("kv_hit_rate", 0.0)),
      **{f"tool_errors_{k}": float(n) for k, n in sorted(kinds.items())},
  }


def expert_rows(s, example: EnvExample) -> tuple[list[int], list[int], int]:
  """(ids, loss flags, prompt length) of the task expert's trajectory on ``example``: the
  first prompt, then each assistant turn as the engine would sample it (its text's ids and
  the end-of-turn id: loss 1) and the environment's answer as the engine appends it
  (``delta_ids``: loss 0)."""
  fmt, tok = s.chat, s.tokenizer
  env, opening = s.task.start(example.data)
  messages = s.task.expert(example.data, 0)
  prompt = fmt.prompt_ids(opening, tuple(env.tools))
  ids, flags = list(prompt), [0] * len(prompt)
  i = len(opening)
  eot = list(fmt.end_of_turn_ids[:1])
  while i < len(messages):
    m = messages[i]
    if m.role == "assistant":
      turn = list(tok.encode(m.content)) + eot
      ids += turn
      flags += [1] * len(turn)
      i += 1
      continue
    j = i
    while j < len(messages) and messages[j].role != "assistant":
      j += 1
    obs = fmt.delta_ids(messages[:i], messages[i:j])
    ids += obs
    flags += [0] * len(obs)
    i = j
  return ids, flags, len(prompt)


def expert_batch(s, examples: Sequence[EnvExample]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
  """Supervised rows of the expert trajectories, right-padded to T = P + R: tokens int32
  [B,T], attention mask bool [B,T], loss mask float32 [B,T] (1 where the target is an
  assistant token)."""
  T = s.prompt_len + s.geometry.new_tokens
  tokens = np.full((len(examples), T), s.tokenizer.pad_id, np.int32)
  attn = np.zeros((len(examples), T), bool)
  loss = np.zeros((len(examples), T), np.float32)
  for b, ex in enumerate(examples):
    ids, flags, _ = expert_rows(s, ex)
    ids, flags = ids[:T], flags[:T]
    tokens[b, :len(ids)], attn[b, :len(ids)] = ids, True
    loss[b, :len(ids)] = flags
  return tokens, attn, loss


def evaluate(s, engine, params) -> dict[str, float]:
  """``eval_accuracy``: the held-out success rate (return >= 1) of greedy episodes, and
  ``eval_turns_mean``; the eval split goes through in chunks of G groups (the last one
  padded with copies of its last example), the first of each group's M identical samples
  read."""
  G, M = s.geometry.groups, s.geometry.samples
  params = engine_params(s, params)
  examples = list(s.eval_examples)
  success, turns = [], []
  for lo in range(0, len(examples), G):
    chunk = examples[lo:lo + G]
    real = len(chunk)
    chunk = chunk + [chunk[-1]] * (G - real)
    out = engine.rollout(params, episodes(s, chunk, range(len(chunk))), first_uid=lo)
    success += list(out.reward.reshape(G, M)[:real, 0] >= 1.0)
    turns += list(out.num_turns.reshape(G, M)[:real, 0])
  return {"eval_accuracy": float(np.mean(success)), "eval_turns_mean": float(np.mean(turns))}
