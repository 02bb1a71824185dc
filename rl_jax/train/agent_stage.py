"""The agentic stage: multi-turn episodes of an environment task (``env.name``).

What the producer, the learner, the supervised warm start and the evaluation need from an
environment task, as small functions of the setup's config and host arrays:

* ``task_chat_format``: the compact built-in format for the character tokenizer, else the
  checkpoint's own chat template (``ChatFormat.from_pretrained``: its end of turn, e.g.
  ``<|im_end|>``, ends the engine's turns); ``tool_format``: the tool-call format of
  ``math_tools`` (``env.tool_format``, or the one the template writes).
* ``env_task`` / ``env_examples``: the task (``rl_jax.envs.tasks``; ``math_tools`` reads its
  questions from ``data.path``, ``file_examples``; ``env.name=module:factory``, a gymnasium id
  or a verifiers taskset: ``external_task``, ``gymnasium_task``, ``verifiers_task``, each
  checked at setup, before anything compiles) and its splits as
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
  (a tool's result joins ``env.result_delay_steps`` decode steps after its call), so which
  groups complete and everything held is a function of the seeds, and a resumed run
  continues exactly; held environments are rebuilt by replaying their actions.
* ``turn_fields``: the per-turn objective inputs (``losses.TURN_FIELDS``) of a rollout; a
  turn's state id is the state key its environment reported (``StateKeys``: the training
  episodes' environments are wrapped to record them), else a hash of its token history.
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

import dataclasses
import hashlib
import inspect
import zlib
from typing import Any, Callable, Hashable, NamedTuple, Sequence

import numpy as np

from rl_jax import imports
from rl_jax import rollout
from rl_jax import settings
from rl_jax.data import files
from rl_jax.data.tokenizers import CharTokenizer
from rl_jax.envs import adapters
from rl_jax.envs import chat as chat_lib
from rl_jax.envs import tasks as env_tasks
from rl_jax.envs import tool_calls
from rl_jax.envs.spec import EnvSpec
from rl_jax.errors import ConfigError, DataError, RLJaxError
from rl_jax.rollout.agent_records import AgentRollout, EpisodeSpec, env_seed
from rl_jax.train.streams import Stream, seed_for

__all__ = ["EnvExample", "KeyedRollout", "METRICS", "StateKeys", "env_task", "env_examples",
           "external_task", "gymnasium_task", "verifiers_task", "chat_format",
           "task_chat_format", "tool_format", "file_examples", "make_engines", "make_engine",
           "episodes", "roll", "roll_partial", "state_id", "turn_fields",
           "rollout_metrics", "expert_rows", "expert_batch",
           "evaluate"]

# the step metrics of a multi-turn batch (besides ``tool_errors_<kind>``); the last three of
# runs whose episodes are an agent's sessions (``env.agent``)
METRICS = ("turns_mean", "tool_calls", "tool_errors", "tool_latency_s", "env_time_s",
           "env_time_hidden_s", "truncated_trajectories", "kv_hit_rate", "sessions",
           "agent_errors", "session_rewrites")


class EnvExample(NamedTuple):
  """One episode's example: ``prompt`` the rendered first prompt (text), ``answer`` the
  reference answer if the task has one, ``data`` the task's example dict."""

  prompt: str
  answer: str
  data: dict


def env_task(e: settings.EnvSettings, data: settings.DataSettings, sft_steps: int,
             fmt=None):
  """The task ``e`` names (``rl_jax.envs.spec.EnvSpec``); ``data``: the prompt stream's seed
  and math_tools' question file; ``sft_steps``: the supervised warm start (a task needs
  expert trajectories for it); ``fmt`` is the run's chat format (``task_chat_format``;
  math_tools and verifiers tasks call tools in its format)."""
  if e.name == "math_tools":
    return math_tools_task(e, data, sft_steps, fmt)
  if e.name == "calculator":
    return env_tasks.make_task("calculator", seed=data.seed, n_train=e.n_train,
                               n_eval=e.n_eval, digits=(e.digits_min, e.digits_max),
                               max_turns=e.max_turns)
  if e.name == "guess":
    return env_tasks.make_task("guess", seed=data.seed, n_train=e.n_train, n=e.guess_n,
                               max_turns=e.max_turns, step_penalty=e.step_penalty)
  if e.name == "gymnasium":
    spec, key = gymnasium_task(e), f"env.gym_id={e.gym_id!r}"
  elif e.name == "verifiers":
    spec, key = verifiers_task(e, fmt), f"env.verifiers={e.verifiers!r}"
  else:
    spec, key = external_task(e), f"env.name={e.name!r}"
  return _checked(spec, key, fmt, sft_steps)


def _call_with_section(path: str, key: str, e: settings.EnvSettings):
  """``imports.call(path, key, e.section())``; a key the function reads that the section
  lacks (ConfigDict raises AttributeError or KeyError with the key quoted) is named, with
  how to set it."""
  section = e.section()
  try:
    return imports.call(path, key, section)
  except ConfigError as err:
    cause = err.__cause__
    while isinstance(cause, AttributeError) and cause.args and isinstance(cause.args[0],
                                                                          KeyError):
      cause = cause.args[0]  # ConfigDict's attribute access wraps its KeyError
    name = (cause.args[0].strip("'\"") if isinstance(cause, (AttributeError, KeyError))
            and cause.args and isinstance(cause.args[0], str) else "")
    if name.isidentifier() and name not in section and name not in section.kwargs:
      raise ConfigError(f"{err} (no env setting or env.kwargs key {name!r}: the user's own "
                        f"settings go in env.kwargs, e.g. --config.env.kwargs.{name}=VALUE)"
                        ) from None
    raise


def external_task(e: settings.EnvSettings) -> EnvSpec:
  """The task of ``env.name=module.path:factory``: ``factory(env)`` returns an ``EnvSpec``,
  where ``env`` is the run's environment section as a read-only ``ConfigDict``
  (``EnvSettings.section()``; the user's own settings under ``env.kwargs``). The module is
  found as ``rl_jax.imports`` says (sys.path, the config file's directory, the working
  directory); a bad path, a factory that raises or that returns anything else is one
  ``ConfigError`` line."""
  spec = _call_with_section(e.name, "env.name", e)
  if not isinstance(spec, EnvSpec):
    raise ConfigError(f"env.name={e.name!r} returned a {type(spec).__name__}, not an "
                      "rl_jax.envs.EnvSpec")
  return spec


_GYM_CODECS = {"frozen_lake": adapters.FROZEN_LAKE_CODEC, "blackjack": adapters.BLACKJACK_CODEC,
               "default": None}


def gymnasium_task(e: settings.EnvSettings) -> EnvSpec:
  """``env.gym_id``'s environment played in text (``adapters.GymnasiumTextEnv``):
  ``gymnasium.make(gym_id, **env.kwargs)``, the codec ``env.gym_codec`` ("auto": FrozenLake
  and Blackjack by id, else the action's index), its instructions ``env.system_prompt`` when
  set, ``env.invalid_reward``. Examples are episode seeds (train ``0 .. n_train - 1``, eval
  the next ``n_eval``); every sample of an example plays the episode of its seed (the same
  first observation and random stream), so its group compares actions. The engine cuts
  episodes at ``env.max_turns``; state keys are the observations' text."""
  key = f"env.gym_id={e.gym_id!r}"
  try:
    import gymnasium  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ConfigError(f"{key} needs gymnasium (pip install 'rl_jax[agent]')") from None
  kwargs = dict(e.kwargs)

  def make():
    return gymnasium.make(e.gym_id, **kwargs)

  try:
    probe = make()
  except Exception as ex:  # an unknown id, bad kwargs: gymnasium's own message
    raise ConfigError(f"{key}: gymnasium.make failed: {_one_line(ex)}") from None
  name = e.gym_codec
  if name == "auto":
    base = e.gym_id.split("/")[-1].split("-")[0]
    name = {"FrozenLake": "frozen_lake", "Blackjack": "blackjack"}.get(base, "default")
  codec = _GYM_CODECS[name]
  if e.system_prompt is not None:
    codec = dataclasses.replace(codec or adapters.TextCodec(text_to_action=None),
                                instructions=e.system_prompt)
  try:
    adapters.GymnasiumTextEnv(probe, codec)
  except ValueError as ex:
    raise ConfigError(f"{key}: {_one_line(ex)} (env.gym_codec={e.gym_codec!r})") from None
  finally:
    probe.close()

  def make_env(example):
    del example
    return adapters.GymnasiumTextEnv(make, codec, invalid_reward=float(e.invalid_reward),
                                     sample_seeds=False)

  train = [{"seed": i} for i in range(e.n_train)]
  evals = [{"seed": e.n_train + i} for i in range(e.n_eval)]
  return EnvSpec(f"gymnasium:{e.gym_id}", make_env, train, evals)


def verifiers_task(e: settings.EnvSettings, fmt) -> EnvSpec:
  """The task of ``env.verifiers=module:fn``: ``fn(env)`` (the section as ``external_task``
  passes it) returns a verifiers (v1)
  ``Taskset``, or a pair (train, eval) of them (eval may be None); the episodes are
  ``adapters.VerifiersEnvironment``s scored by the taskset's own rewards, with no tools, tool
  calls parsed in ``env.tool_format`` (with "auto" the template's, else hermes),
  ``env.max_turns`` and ``env.max_tool_calls``. For tools, write an ``env.name`` factory
  that returns ``adapters.verifiers_spec(taskset, tools=[...])``."""
  key = f"env.verifiers={e.verifiers!r}"
  try:
    import verifiers.v1 as vf  # pylint: disable=import-outside-toplevel
  except ImportError:
    raise ConfigError(f"{key} needs verifiers (pip install 'rl_jax[agent]')") from None
  out = _call_with_section(e.verifiers, "env.verifiers", e)
  train, evals = out if isinstance(out, tuple) and len(out) == 2 else (out, None)
  for what, ts in (("the train taskset", train), ("the eval taskset", evals)):
    if not (isinstance(ts, vf.Taskset) or (ts is None and what == "the eval taskset")):
      raise ConfigError(f"{key} returned a {type(ts).__name__} as {what}, not a "
                        "verifiers.v1.Taskset")
  parser = e.tool_format
  if parser == "auto":
    parser = (tool_calls.template_format(fmt.source) if fmt is not None else None) or "hermes"
  try:
    return adapters.verifiers_spec(train, evals, name=f"verifiers:{e.verifiers}",
                                   parser=parser, max_turns=e.max_turns,
                                   max_tool_calls_per_turn=e.max_tool_calls)
  except RLJaxError:
    raise
  except Exception as ex:  # loading the tasks
    raise ConfigError(f"{key}: loading its tasks failed: {_one_line(ex)}") from None


def _checked(spec: EnvSpec, key: str, fmt, sft_steps: int) -> EnvSpec:
  """A task from outside rl_jax, checked where the trainer would otherwise fail later: a
  train split, an expert for ``sft.steps``, the chat format it is meant for, and its first
  train example starting (``make_env``, ``reset``, a state key ``state_id`` can read)."""
  if not spec.train:
    raise ConfigError(f"{key}: the task {spec.name!r} has no train examples")
  if sft_steps and spec.expert is None:
    raise ConfigError(f"sft.steps={sft_steps}: the task of {key} has no expert "
                      "trajectories to warm-start on; set sft.steps=0")
  if spec.chat == "model" and getattr(fmt, "name", None) == "builtin":
    raise ConfigError(f"{key}: the task {spec.name!r} renders prompts with a checkpoint's "
                      "chat template (EnvSpec.chat='model'); set model.hf_path (or "
                      "data.tokenizer) to a directory with tokenizer.json and a chat template")
  try:
    env, _ = spec.start(spec.train[0])
    key_now = _current_key(env)
  except RLJaxError:
    raise
  except Exception as ex:
    raise ConfigError(f"{key}: starting its first train example raised {_one_line(ex)}"
                      ) from None
  try:
    state_id(key_now)
  except TypeError as ex:
    raise ConfigError(f"{key}: {ex}") from None
  return spec


def _check_agent_signature(path: str, agent) -> None:
  """One line unless ``agent`` can be called as fn(base_url, api_key, example) (a function
  whose signature Python cannot read is let through)."""
  try:
    signature = inspect.signature(agent)
  except (TypeError, ValueError):
    return
  try:
    signature.bind("base_url", "api_key", {})
  except TypeError:
    raise ConfigError(f"env.agent={path!r} must take (base_url, api_key, example); its "
                      f"signature is {signature}") from None


def agent_task(e: settings.EnvSettings, spec: EnvSpec, fmt, tokenizer) -> EnvSpec:
  """``spec`` with every episode a session of the agent function ``env.agent``
  (``rl_jax.serve.sessions``): its examples, expert and evaluation stay the task's. The
  session server starts on first use; one ``ConfigError`` line when the function cannot be
  imported or the serve extra is missing."""
  agent = imports.resolve(e.agent, "env.agent")
  _check_agent_signature(e.agent, agent)
  try:
    from rl_jax.serve import app as app_lib  # pylint: disable=import-outside-toplevel
    from rl_jax.serve import sessions  # pylint: disable=import-outside-toplevel
    from rl_jax.serve.checkpoint import ServedModel  # pylint: disable=import-outside-toplevel
  except ImportError as ex:
    raise ConfigError(f"env.agent={e.agent!r} needs the serve extra ({ex.name} is missing): "
                      "pip install -e '.[serve]'") from None
  parser = "compact" if fmt.name == "builtin" else tool_calls.template_format(fmt.source)
  served = ServedModel("policy", None, None, tokenizer, fmt, parser,
                       tuple(fmt.end_of_turn_ids))

  def start(hub):
    app = app_lib.create_app(model=served, sessions=hub, api_key=hub.api_key)
    return sessions.start_uvicorn(app, sessions.free_port())

  hub = sessions.SessionHub(agent, start, parser=parser,
                            first_request_timeout=max(e.step_timeout_s, 60.0))
  return dataclasses.replace(spec, play=hub.make_env, stats=hub.take_stats)


def _one_line(e: BaseException) -> str:
  text = " ".join(str(e).split())
  return f"{type(e).__name__}: {text}" if text else type(e).__name__


def chat_format(tokenizer):
  """The chat format of the built-in tasks (the character tokenizer's compact template)."""
  return chat_lib.ChatFormat.builtin(tokenizer)


def task_chat_format(e: settings.EnvSettings, tokenizer, path: str | None):
  """The run's chat format: the compact built-in one for the character tokenizer, else the
  chat template of the tokenizer's checkpoint directory ``path`` (``data.tokenizer`` or
  ``model.hf_path``; of named templates the "tool_use" one) with ``env.enable_thinking``
  when set; one ``ConfigError`` line when the directory has none, or when math_tools would
  get the built-in format."""
  if isinstance(tokenizer, CharTokenizer):
    if e.name == "math_tools":
      raise ConfigError("env.name='math_tools' renders prompts with a checkpoint's chat "
                        "template; set model.hf_path (or data.tokenizer) to a directory with "
                        "tokenizer.json and a chat template")
    return chat_format(tokenizer)
  thinking = e.enable_thinking
  try:
    return chat_lib.ChatFormat.from_pretrained(
        path, tokenizer, with_tools=True,
        template_vars=None if thinking is None else {"enable_thinking": bool(thinking)})
  except ValueError as ex:
    raise ConfigError(f"env.name={e.name!r}: {' '.join(str(ex).split())}") from None


def tool_format(e: settings.EnvSettings, fmt) -> str:
  """The tool-call format math_tools parses: ``env.tool_format``, or with "auto" the one
  the chat template writes (``tool_calls.template_format``); one ``ConfigError`` line when
  it names none."""
  if e.tool_format != "auto":
    return e.tool_format
  found = tool_calls.template_format(fmt.source)
  if found is None:
    raise ConfigError(f"env.tool_format=auto: the chat template of {fmt.name!r} shows no "
                      "tool-call format (no <tool_call> or <|python_tag|>); set "
                      "env.tool_format=hermes or llama3")
  return found


def file_examples(d: settings.DataSettings) -> tuple[list[dict], list[dict]]:
  """(train, eval) examples ``{"prompt": question, "answer": reference}`` of the
  question/answer file ``data.path`` (``data.format``; eval from ``data.eval_path``, else a
  stable hash split: ``rl_jax.data.files.FileTask``), eval cut to ``data.eval_size``."""
  task = files.FileTask(path=d.path or "", format=d.format, eval_path=d.eval_path,
                        backend="memory")
  as_dicts = lambda view: [{"prompt": x.prompt, "answer": x.answer} for x in view]
  return as_dicts(task.split("train")), as_dicts(task.split("eval", d.eval_size))


def math_tools_task(e: settings.EnvSettings, data: settings.DataSettings, sft_steps: int,
                    fmt):
  """The math_tools task (``rl_jax.envs.tasks``) on ``data.path``, tools called in
  ``fmt``'s format; no expert, so ``sft.steps`` must be 0."""
  if sft_steps:
    raise ConfigError(f"sft.steps={sft_steps}: env.name='math_tools' has no expert "
                      "trajectories to warm-start on; set sft.steps=0")
  train, evals = file_examples(data)
  system = env_tasks.MATH_TOOLS_SYSTEM if e.system_prompt is None else e.system_prompt
  return env_tasks.make_task("math_tools", train=train, eval=evals,
                             parser=tool_format(e, fmt), max_turns=e.max_turns,
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
  return make_engine(s, s.rollout.temperature), make_engine(s, 0.0)


def make_engine(s, temperature: float, kv_pages: int | None = None):
  """An ``AgentEngine`` of the setup ``s``: G slots of M samples, R = ``env.max_total_tokens``,
  APRIL's over-sampling and staleness bound, and the deterministic schedule: a tool's result
  joins the batch ``env.result_delay_steps`` decode steps after its call, the time-to-live
  is ``env.kv_ttl_steps`` decode steps, so a resumed run decodes exactly the batches of an
  uninterrupted one (``scripts/bench_agent.py`` times it against the wall-clock schedule).
  ``kv_pages``: a fixed pool of that many pages instead of ``rollout.kv_pages`` (the memory
  plan's and the dry run's)."""
  e, geo = s.env, s.geometry
  r = s.rollout
  return rollout.AgentEngine(
      s.model_cfg, s.chat, s.tokenizer.decode, n=geo.samples, max_slots=geo.groups,
      max_prompt_len=s.prompt_len, max_total_tokens=geo.new_tokens,
      max_turn_tokens=e.max_turn_tokens, max_turns=e.max_turns,
      max_obs_tokens=e.max_obs_tokens, temperature=temperature, top_p=r.top_p, top_k=r.top_k,
      seed=seed_for(s.train.seed, 0, Stream.AGENT),
      step_timeout=e.step_timeout_s,
      # an agent session's step waits for the agent's next request: a thread per session
      workers=max(e.workers, 2 * geo.groups * geo.samples) if e.agent else e.workers,
      context=s.model_cfg.max_position_embeddings,
      over_sampling=r.over_sampling,
      max_staleness=None if r.max_staleness < 0 else r.max_staleness,
      deterministic=True, result_delay=e.result_delay_steps,
      ttl_steps=None if e.kv_ttl_steps < 0 else e.kv_ttl_steps, mesh=s.sampler_mesh,
      rules=s.sampler_rules, page_size=r.page_size, kv_pages=kv_pages or r.kv_pages,
      kv_memory_fraction=r.kv_memory_fraction,
      prefill_chunk=r.prefill_chunk, prompt_pages=r.prompt_pages)


# -- state keys (GiGPO's anchor states; rl_jax.envs.base) --

def _key_bytes(key: Any, out: list[bytes]) -> None:
  """A typed, process-independent encoding of a state key (equal keys, equal bytes: bools
  and integral floats as the ints they equal, NumPy scalars as Python ones)."""
  if isinstance(key, np.generic):
    key = key.item()
  if isinstance(key, float) and key.is_integer():
    key = int(key)
  if key is None:
    out.append(b"N")
  elif isinstance(key, int):  # bool too (True == 1)
    out.append(b"i%d;" % int(key))
  elif isinstance(key, float):
    out.append(b"f" + repr(key).encode() + b";")
  elif isinstance(key, str):
    raw = key.encode("utf-8", "surrogatepass")
    out.append(b"s%d:" % len(raw) + raw)
  elif isinstance(key, bytes):
    out.append(b"b%d:" % len(key) + key)
  elif isinstance(key, tuple):
    out.append(b"(%d:" % len(key))
    for k in key:
      _key_bytes(k, out)
  elif isinstance(key, frozenset):
    parts = []
    for k in key:
      one: list[bytes] = []
      _key_bytes(k, one)
      parts.append(b"".join(one))
    out.append(b"{%d:" % len(parts) + b"".join(sorted(parts)))
  else:
    raise TypeError(f"state key {key!r} is a {type(key).__name__}; build keys of str, bytes, "
                    "int, float, bool, None, tuples and frozensets")


def state_id(key: Hashable) -> int:
  """The step-group id of a state key: a 31-bit hash of its typed encoding, the same in
  every process and run (Python's ``hash`` of a str is not); TypeError for a key of another
  type (``rl_jax.envs.base``)."""
  out: list[bytes] = []
  _key_bytes(key, out)
  digest = hashlib.blake2b(b"".join(out), digest_size=8, person=b"rl_jax.state").digest()
  return int.from_bytes(digest, "little") & 0x7FFFFFFF


def _current_key(env) -> Hashable | None:
  """``env.state_key()`` if the environment defines it, else None."""
  fn = getattr(env, "state_key", None)
  return fn() if callable(fn) else None


class _Keyed:
  """An environment whose state keys go to a ``StateKeys`` record (everything else is the
  wrapped environment's)."""

  def __init__(self, env, record: dict):
    self._env, self._record = env, record
    self._keys: list = []
    self._steps = 0

  @property
  def tools(self):
    return self._env.tools

  def __getattr__(self, name: str):
    if name.startswith("_"):
      raise AttributeError(name)
    return getattr(self._env, name)

  def reset(self, example, seed: int):
    messages = self._env.reset(example, seed)
    self._keys, self._steps = [_current_key(self._env)], 0  # a new list: a restart is new
    self._record[int(seed)] = self._keys
    return messages

  def step(self, action: str):
    n, keys = self._steps, self._keys
    self._steps += 1
    keys.extend([None] * (n + 2 - len(keys)))  # slot n + 1 stays None if the step raises
    res = self._env.step(action)
    key = getattr(res, "state_key", None)
    keys[n + 1] = key if key is not None else _current_key(self._env)
    return res


class StateKeys:
  """The state keys the training episodes' environments report, by episode seed.

  ``wrap(env)`` records: index 0 the key after ``reset``, index n + 1 the key after step n
  (``StepResult.state_key``, else the environment's ``state_key()``); a reset starts the
  list over (a restarted sample, a held one replayed). The reset seed is
  ``env_seed(engine seed, group uid, sample)``, which names a row of the rollout
  (``ids``). One record per ``roll`` / ``roll_partial`` call: every environment a call steps
  was built in it (``import_held`` rebuilds the held groups)."""

  def __init__(self):
    self._by_seed: dict[int, list] = {}

  def wrap(self, env) -> _Keyed:
    return _Keyed(env, self._by_seed)

  def ids(self, out: AgentRollout, seed: int, U: int) -> np.ndarray:
    """int32 [B,U]: ``state_id`` of the key each turn of ``out`` starts from, -1 where its
    environment reported none (or past its last turn); ``seed`` is the engine's. A key of
    another type is one DataError line."""
    B = out.tokens.shape[0]
    ids = np.full((B, U), -1, np.int32)
    sample: dict[int, int] = {}
    for b in range(B):
      g = int(out.prompt_index[b])
      m = sample[g] = sample.get(g, -1) + 1
      keys = self._by_seed.get(env_seed(seed, int(out.group_ids[g]), m)) or []
      for u in range(min(U, int(out.num_turns[b]), len(keys))):
        if keys[u] is not None:
          try:
            ids[b, u] = state_id(keys[u])
          except TypeError as e:
            raise DataError(f"env task: {e}") from None
    return ids

  def attach(self, out: AgentRollout, seed: int, U: int) -> "KeyedRollout":
    """``out`` with its ``state_ids`` (``ids``)."""
    fields = {f.name: getattr(out, f.name) for f in dataclasses.fields(out)}
    return KeyedRollout(**fields, state_ids=self.ids(out, seed, U))


@dataclasses.dataclass
class KeyedRollout(AgentRollout):
  """An ``AgentRollout`` of training episodes with ``state_ids`` int32 [B,U], the reported
  state of each turn (``StateKeys.ids``; -1: none, ``turn_fields`` hashes the history)."""

  state_ids: np.ndarray | None = None


def episodes(s, examples: Sequence[EnvExample], meta: Sequence[Any],
             keys: StateKeys | None = None) -> list[EpisodeSpec]:
  """One EpisodeSpec per example (a fresh environment per sample; with ``keys``, wrapped to
  record its state keys)."""
  make = s.task.play or s.task.make_env
  if keys is not None:
    make = lambda ex, make=make: keys.wrap(make(ex))
  return [EpisodeSpec(lambda ex=ex.data: make(ex), ex.data, m) for ex, m in zip(examples, meta)]


def roll(s, engine, params, idx: np.ndarray, *, step: int, version: int) -> KeyedRollout:
  """Groups of the train examples ``idx`` [G], run to their end from ``params``; group g
  has uid ``step · G + g``."""
  G = s.geometry.groups
  keys = StateKeys()
  specs = episodes(s, [s.train_examples[i] for i in idx], [int(i) for i in idx], keys)
  out = engine.rollout(params, specs, policy_version=version, first_uid=step * G)
  return keys.attach(out, engine.seed, s.geometry.turns)


def _spec_of(s, i: int, keys: StateKeys | None = None) -> EpisodeSpec:
  """The EpisodeSpec of train example ``i`` (its meta is ``i``)."""
  return episodes(s, [s.train_examples[i]], [i], keys)[0]


def roll_partial(s, engine, params, held: dict, next_index: Callable[[], int], *,
                 version: int, capacity: int) -> tuple[KeyedRollout, dict]:
  """The first G groups to complete, from the groups ``held`` (an ``export_held`` dict)
  and new episodes of the train examples ``next_index()`` draws; (the rollout, the held
  groups after it as ``export_held(capacity)``). The held groups are imported every step,
  not only after a resume, so a resumed run takes exactly the path of an uninterrupted one
  (the replay costs one environment step per recorded action of each held sample)."""
  keys = StateKeys()
  engine.import_held(held, spec_of=lambda i: _spec_of(s, i, keys))

  def specs():
    while True:
      yield _spec_of(s, next_index(), keys)

  out = engine.rollout_groups(params, specs(), s.geometry.groups,
                              policy_version=version)
  return keys.attach(out, engine.seed, s.geometry.turns), engine.export_held(capacity)


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
  and turn_states int32 [B,U] (the id of the state each turn starts from: the state key its
  environment reported, ``state_id``, where ``out`` is a ``KeyedRollout`` that has one, else
  a hash of the token history, equal histories giving equal states; -1 past the last
  turn)."""
  B = out.tokens.shape[0]
  present = np.arange(U)[None, :] < out.num_turns[:, None]
  rewards = np.where(present, out.turn_rewards[:, :U], np.nan).astype(np.float32)
  ids = np.where(out.model_mask, out.turn, -1)[:, :R].astype(np.int32)
  starts = _turn_starts(out, U)
  prompts = [out.prompts[i] for i in out.prompt_index]
  states = np.full((B, U), -1, np.int32)
  keyed = getattr(out, "state_ids", None)
  for b in range(B):
    for u in range(U):
      if starts[b, u] >= 0 and keyed is not None and u < keyed.shape[1] and keyed[b, u] >= 0:
        states[b, u] = keyed[b, u]
      elif starts[b, u] >= 0:
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
