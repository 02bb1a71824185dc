"""``python -m rl_jax.serve --model=DIR``: serve a checkpoint over OpenAI's HTTP API.

Flags: ``--model`` (a run's ``hf/``, a Hugging Face checkpoint, or a PEFT adapter
directory), ``--tokenizer`` (default: the checkpoint's), ``--served-model-name`` (default:
the directory's name), ``--host`` (default 127.0.0.1), ``--port`` (8000), ``--api-key``
(required when the host is not a loopback address; also read from ``RL_JAX_API_KEY``),
``--max-slots``, ``--max-prompt-tokens``, ``--max-tokens``, ``--max-n``, ``--page-size``,
``--prompt-pages``, ``--prefix-cache``, ``--seed``, ``--dtype``, ``--tool-parser``. A wrong flag or directory,
or a ``--host``/``--port`` it cannot listen on, prints one ``error:`` line and exits with
status 2.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import socket
import sys

from rl_jax import config_utils
from rl_jax.errors import RLJaxError


def _parser() -> argparse.ArgumentParser:
  p = argparse.ArgumentParser(prog="python -m rl_jax.serve", description=__doc__.split("\n")[0])
  p.add_argument("--model", required=True, help="checkpoint directory (a run's hf/)")
  p.add_argument("--tokenizer", default=None, help="tokenizer directory, or 'char'")
  p.add_argument("--served-model-name", default=None, help="the model id clients send")
  p.add_argument("--host", default="127.0.0.1")
  p.add_argument("--port", type=int, default=8000, help="1..65535")
  p.add_argument("--api-key", default=os.environ.get("RL_JAX_API_KEY"))
  p.add_argument("--max-slots", type=int, default=8, help="choices decoded together")
  p.add_argument("--max-prompt-tokens", type=int, default=None,
                 help="longest prompt (default: min(1024, half the context))")
  p.add_argument("--max-tokens", type=int, default=None,
                 help="most tokens per choice (default: min(512, the rest of the context))")
  p.add_argument("--max-n", type=int, default=8, help="most choices per request")
  p.add_argument("--page-size", type=int, default=64, help="tokens per KV page")
  p.add_argument("--prompt-pages", action="store_true",
                 help="write each prompt onto KV pages: memory follows the prompts' lengths "
                      "instead of --max-prompt-tokens per slot (slower on CPU)")
  p.add_argument("--prefix-cache", type=int, default=64,
                 help="with --prompt-pages: ended choices whose pages stay for later "
                      "requests that begin alike (0: none)")
  p.add_argument("--kv-pages", type=int, default=None,
                 help="a fixed pool of this many KV pages: when it is full the prefix "
                      "cache's pages, then the newest choice (resumed later, same tokens) "
                      "give way (default: the pool grows as the choices need)")
  p.add_argument("--seed", type=int, default=0, help="base seed of every random stream")
  p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
  p.add_argument("--tool-parser", default="auto", help="auto, compact, hermes, llama3 or qwen")
  return p


def _loopback(host: str) -> bool:
  if host == "localhost":
    return True
  try:
    return ipaddress.ip_address(host).is_loopback
  except ValueError:
    return False


def _positive(name: str, v: int) -> None:
  if v < 1:
    raise RLJaxError(f"--{name}={v} must be at least 1")


def _bind(family: int, kind: int, proto: int, addr) -> None:
  """Bind (and close) a socket on ``addr`` the way uvicorn's listener is bound."""
  try:
    s = socket.socket(family, kind, proto)
  except OSError:  # a family this machine lacks: uvicorn (asyncio) skips it too
    return
  with s:
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
      s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    s.bind(addr)


def _check_listen(host: str, port: int) -> None:
  """One line unless the server can listen on ``host:port`` (every address the host resolves
  to), before the model loads."""
  try:
    for family, kind, proto, _, addr in socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE):
      _bind(family, kind, proto, addr)
  except OSError as e:
    raise RLJaxError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None


def _budgets(args: argparse.Namespace, context: int) -> tuple[int, int]:
  """(--max-prompt-tokens, --max-tokens): the flags, or defaults that fit ``context``."""
  if context < 2:
    raise RLJaxError(f"the model's context of {context} positions (max_position_embeddings) "
                     "has no room for a prompt and a new token")
  prompt = min(1024, context // 2) if args.max_prompt_tokens is None else args.max_prompt_tokens
  if prompt >= context:
    raise RLJaxError(f"--max-prompt-tokens={prompt} leaves no room for new tokens in the "
                     f"model's context of {context} positions")
  tokens = min(512, context - prompt) if args.max_tokens is None else args.max_tokens
  if prompt + tokens > context:
    raise RLJaxError(f"--max-prompt-tokens={prompt} + --max-tokens={tokens} exceeds the "
                     f"model's context of {context} positions")
  return prompt, tokens


def main(argv: list[str] | None = None) -> None:
  args = _parser().parse_args(argv)
  if not _loopback(args.host) and not args.api_key:
    raise RLJaxError(f"--host={args.host} is reachable from other machines: set --api-key "
                     "(or RL_JAX_API_KEY)")
  for name in ("max_slots", "max_n", "page_size", "max_prompt_tokens", "max_tokens",
               "kv_pages"):
    if getattr(args, name) is not None:  # None: the default, from the model's context
      _positive(name.replace("_", "-"), getattr(args, name))
  if args.prefix_cache < 0:
    raise RLJaxError(f"--prefix-cache={args.prefix_cache} must be at least 0 (0: no cache)")
  if not 1 <= args.port <= 65535:
    raise RLJaxError(f"--port={args.port} must lie in [1, 65535]")
  if args.page_size & (args.page_size - 1):
    raise RLJaxError(f"--page-size={args.page_size} must be a power of two")
  if not -2**63 <= args.seed < 2**63:
    raise RLJaxError(f"--seed={args.seed} must lie in [-2**63, 2**63)")
  try:
    import uvicorn  # pylint: disable=import-outside-toplevel
    from rl_jax.serve.app import create_app  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise RLJaxError(f"rl_jax.serve needs the serve extra ({e.name} is missing): "
                     "pip install -e '.[serve]'") from None
  _check_listen(args.host, args.port)
  from rl_jax.serve.checkpoint import load_served  # pylint: disable=import-outside-toplevel
  from rl_jax.serve.scheduler import (  # pylint: disable=import-outside-toplevel
      Scheduler, choice_pages)

  model = load_served(args.model, tokenizer=args.tokenizer, name=args.served_model_name,
                      dtype=args.dtype, tool_parser=args.tool_parser)
  prompt, tokens = _budgets(args, int(model.cfg.max_position_embeddings))
  need = choice_pages(prompt, tokens, args.page_size, args.prompt_pages)
  if args.kv_pages is not None and args.kv_pages < need:
    budget = (f"--max-prompt-tokens={prompt} + --max-tokens={tokens}" if args.prompt_pages
              else f"--max-tokens={tokens}")
    raise RLJaxError(f"--kv-pages={args.kv_pages} holds less than one choice's whole budget "
                     f"({budget}): {need} pages of up to {args.page_size} tokens")
  for note in model.notes:
    print(f"note: {note}", file=sys.stderr, flush=True)
  sched = Scheduler(model, max_slots=args.max_slots, max_prompt_tokens=prompt,
                    max_tokens=tokens, page_size=args.page_size, seed=args.seed,
                    prompt_pages=args.prompt_pages, prefix_cache=args.prefix_cache,
                    kv_pages=args.kv_pages)
  app = create_app(sched, api_key=args.api_key, max_n=args.max_n)
  print(f"serving {model.name!r} on http://{args.host}:{args.port}/v1 "
        f"(prompts <= {prompt} tokens, <= {tokens} new tokens, {args.max_slots} slots)",
        file=sys.stderr, flush=True)
  try:
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning", timeout_keep_alive=60)
  finally:
    sched.close()


if __name__ == "__main__":
  config_utils.main_guard(main)()
