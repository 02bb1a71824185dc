"""Multi-process (multi-host) start-up through JAX's own multi-controller runtime.

Every process of a job runs the same command; ``initialize(config.distributed)`` joins them
before anything touches a device:

* explicit: ``distributed.coordinator_address="host:port"``, ``distributed.num_processes=N``,
  ``distributed.process_id=i`` (any cluster; two processes on localhost with CPU devices use
  gloo collectives);
* automatic: on a Cloud TPU VM slice with several hosts and under SLURM with several tasks,
  JAX finds the coordinator itself (``jax.distributed.initialize()`` without arguments);
* otherwise nothing happens: one process.

A process that dies takes the job down: the coordination service stops every other process
once the dead one has missed heartbeats for ``distributed.heartbeat_timeout_s`` seconds.

A process other than 0 first waits (up to ``distributed.initialization_timeout_s`` seconds)
until something listens at the coordinator address: JAX's own client aborts the process with
a C++ stack trace when nobody answers, so an address nobody listens on is reported here, in
one ``ConfigError`` line, instead.
"""

from __future__ import annotations

import os
import socket
import time
from typing import Any

import jax

from rl_jax.errors import ConfigError

__all__ = ["initialize", "is_lead", "auto_detected", "wait_for_coordinator"]


def auto_detected() -> bool:
  """Whether the environment is a multi-host TPU slice or a multi-task SLURM job."""
  hosts = [h for h in os.environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h]
  return len(hosts) > 1 or int(os.environ.get("SLURM_NTASKS", "1") or 1) > 1


def initialize(d: Any) -> bool:
  """Join the job described by the ``distributed`` config section; True if multi-process.

  Must run before the first device query of the process.

  Raises:
    ConfigError: only some of the explicit fields are set, or they are out of range, or
      (on a process other than 0) nobody listens at the coordinator address within
      ``initialization_timeout_s``.
  """
  fields = (d.coordinator_address, d.num_processes, d.process_id)
  explicit = [f is not None for f in fields]
  if any(explicit) and not all(explicit):
    raise ConfigError("distributed: set coordinator_address, num_processes and process_id "
                      "together (or none of them for automatic detection)")
  timeouts = dict(initialization_timeout=int(d.initialization_timeout_s),
                  heartbeat_timeout_seconds=int(d.heartbeat_timeout_s))
  if all(explicit):
    if d.num_processes < 1 or not 0 <= d.process_id < d.num_processes:
      raise ConfigError(f"distributed: process_id={d.process_id} must be in "
                        f"[0, num_processes={d.num_processes})")
    if d.num_processes == 1:
      return False
    if d.process_id != 0:
      wait_for_coordinator(d.coordinator_address, d.initialization_timeout_s)
    else:
      coordinator_port_free(d.coordinator_address)
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=d.coordinator_address,
                               num_processes=d.num_processes, process_id=d.process_id,
                               **timeouts)
    return True
  if auto_detected():
    jax.distributed.initialize(**timeouts)
    return True
  return False


_ADDRESS_KEY = "distributed.coordinator_address"


def _host_port(address: str) -> tuple[str, int]:
  """(host, port) of "host:port" (a bracketed IPv6 host too); one ConfigError line when the
  address is not one, before JAX reads it (it fails there with an IndexError)."""
  host, sep, port = address.rpartition(":")
  host = host.strip("[]")
  if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
    raise ConfigError(f"{_ADDRESS_KEY}={address!r} is not host:port (a port in 1..65535)")
  return host, int(port)


def coordinator_port_free(address: str) -> None:
  """Process 0 serves the coordinator at ``address``: one line when it is malformed or the
  port is taken (JAX's coordinator would abort the process with a native stack trace)."""
  host, port = _host_port(address)
  try:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
      s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      s.bind(("", port))
  except OSError as e:
    raise ConfigError(f"{_ADDRESS_KEY}={address}: process 0 serves the coordinator on port "
                      f"{port}, which it cannot take ({e.strerror or e}); choose a free "
                      "port") from None


def wait_for_coordinator(address: str, timeout_s: float) -> None:
  """Waits until a TCP connection to ``address`` ("host:port") succeeds, for at most
  ``timeout_s`` seconds.

  Raises:
    ConfigError: the address is malformed, or nothing listens there within the time-out.
  """
  key = _ADDRESS_KEY
  host, port = _host_port(address)
  deadline = time.monotonic() + timeout_s
  while True:
    left = deadline - time.monotonic()
    try:
      socket.create_connection((host, port), timeout=max(min(left, 2.0), 0.1)).close()
      return
    except OSError as e:
      reason = e.strerror or str(e) or type(e).__name__
    if left <= 0:
      raise ConfigError(
          f"{key}={address}: nobody listens there (tried for distributed."
          f"initialization_timeout_s={timeout_s:g} s; last: {reason}); check that process 0 "
          "of the job runs with this address and that this host can reach its host and port")
    time.sleep(min(0.25, max(left, 0.0)))


def is_lead() -> bool:
  """Whether this process writes the run's files (metrics, plots, the HF export)."""
  return jax.process_index() == 0
