"""N local processes of one command, joined into one distributed JAX run on 127.0.0.1.

The same code path as a multi-host TPU slice: every process runs the same command and learns its
place from `--coordinator_address --num_processes --process_id` (the trainer's flags).
"""

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import BinaryIO

_POLL_SECONDS = 0.1
# Time a stopped process gets to exit before SIGKILL: a preempted trainer saves a checkpoint first.
_GRACE_SECONDS = 120.0


def free_port() -> int:
  """A TCP port on 127.0.0.1 that nothing listens on right now."""
  with socket.socket() as sock:
    sock.bind(("127.0.0.1", 0))
    return sock.getsockname()[1]


def distributed_flags(port: int, num_processes: int, process_id: int) -> list[str]:
  return [
      f"--coordinator_address=127.0.0.1:{port}",
      f"--num_processes={num_processes}",
      f"--process_id={process_id}",
  ]


def _child_env(xla_devices: int | None) -> dict[str, str]:
  env = dict(os.environ)
  # Children write into pipes, where Python would buffer their output until exit.
  env["PYTHONUNBUFFERED"] = "1"
  if xla_devices is not None:
    flag = f"--xla_force_host_platform_device_count={xla_devices}"
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {flag}".strip()
  return env


def _pump(src: BinaryIO, dst: BinaryIO, prefix: bytes, lock: threading.Lock) -> None:
  """Copies src to dst line by line, each line prefixed; the lock keeps lines whole."""
  for line in iter(src.readline, b""):
    with lock:
      dst.write(prefix + line)
      dst.flush()
  src.close()


def _signal(children: Sequence[subprocess.Popen], signum: int) -> None:
  # Each child leads its own process group, so this reaches what it started too (data workers).
  for child in children:
    try:
      os.killpg(child.pid, signum)
    except ProcessLookupError:
      pass


def _stop(children: Sequence[subprocess.Popen], signum: int) -> None:
  _signal([c for c in children if c.poll() is None], signum)
  deadline = time.monotonic() + _GRACE_SECONDS
  while any(c.poll() is None for c in children) and time.monotonic() < deadline:
    time.sleep(_POLL_SECONDS)
  _signal([c for c in children if c.poll() is None], signal.SIGKILL)
  for child in children:
    child.wait()


def _status(returncode: int) -> int:
  """The shell's convention: 128 + N for a process killed by signal N."""
  return returncode if returncode >= 0 else 128 - returncode


def run(cmd: Sequence[str], num_processes: int, port: int | None = None, xla_devices: int | None = None,
        max_restarts: int = 0) -> int:
  """Runs num_processes copies of cmd until all succeed, one fails, or we get SIGINT/SIGTERM
  (forwarded to every process). After a failure, starts the whole job again, up to max_restarts
  times: a trainer resumes from its latest checkpoint.

  Returns the launcher's exit status: 0 when every process exited 0, else non-zero.
  """
  env = _child_env(xla_devices)
  lock = threading.Lock()
  # Installed first, so that a signal that comes while the children start still reaches them all.
  received: list[int] = []
  handlers = {
      s: signal.signal(s, lambda signum, _: received.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)
  }
  try:
    for attempt in range(max_restarts + 1):
      # A fresh port each time: the dead coordinator's may not be free yet.
      status = _run_once(cmd, num_processes, port or free_port(), env, received, lock)
      if status == 0 or received or attempt == max_restarts:
        return status
      with lock:
        print(
            f"lm-launch: restarting all {num_processes} processes ({attempt + 1} of "
            f"{max_restarts} restarts)", file=sys.stderr, flush=True)
  finally:
    for signum, handler in handlers.items():
      signal.signal(signum, handler)


def _run_once(cmd: Sequence[str], num_processes: int, port: int, env: dict[str, str], received: list[int],
              lock: threading.Lock) -> int:
  children, pumps = [], []
  for i in range(num_processes):
    child = subprocess.Popen(
        [*cmd, *distributed_flags(port, num_processes, i)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        # Out of our process group: a terminal's Ctrl-C reaches the children once, through us.
        start_new_session=True)
    children.append(child)
    for src, dst in ((child.stdout, sys.stdout.buffer), (child.stderr, sys.stderr.buffer)):
      pump = threading.Thread(target=_pump, args=(src, dst, f"[{i}] ".encode(), lock), daemon=True)
      pump.start()
      pumps.append(pump)
  status = _wait(children, received, lock)
  for pump in pumps:
    pump.join(timeout=_GRACE_SECONDS)
  return status


def _wait(children: Sequence[subprocess.Popen], received: list[int], lock: threading.Lock) -> int:
  while True:
    if received:
      _stop(children, received[0])
      # A trainer stopped by SIGTERM saves and exits 0: then so do we, as one trainer would.
      return max(_status(child.returncode) for child in children)
    codes = [child.poll() for child in children]
    if all(code == 0 for code in codes):
      return 0
    failed = next((i for i, code in enumerate(codes) if code not in (None, 0)), None)
    if failed is not None:
      with lock:
        print(
            f"lm-launch: process {failed} of {len(children)} exited with status "
            f"{_status(codes[failed])}; stopping the others", file=sys.stderr, flush=True)
      # SIGKILL, not SIGTERM: without their peer the others cannot save (a checkpoint needs every
      # process), and one blocked in a collective would wait out the coordination service's
      # heartbeat timeout (minutes) before it failed by itself.
      _stop(children, signal.SIGKILL)
      return _status(codes[failed])
    time.sleep(_POLL_SECONDS)
