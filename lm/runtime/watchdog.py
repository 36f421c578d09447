"""Hang watchdog: when no training step completes in time, the stack of every thread goes to the log
and the process exits with HUNG_EXIT_STATUS, so that whatever restarts the job (`lm-launch processes
--max-restarts`, a SkyPilot managed job) starts it again from the latest checkpoint.

A hung collective (a peer lost mid-step, a stuck host) otherwise waits forever, paying for the slice.
"""

import faulthandler
import os
import sys
import threading
import time

import ml_collections

HUNG_EXIT_STATUS = 75  # EX_TEMPFAIL of sysexits.h: a temporary failure, worth trying again.


class Watchdog:
  """Deadlines from the config's `watchdog` section: `first_step_secs` until the first step (which
  compiles) and for each evaluation (which may compile too), `step_secs` after each step."""

  def __init__(self, cfg: ml_collections.ConfigDict, poll_secs: float = 1.0):
    self.step_secs, self.first_step_secs = cfg.step_secs, cfg.first_step_secs
    self._lock = threading.Lock()
    self.beat(self.first_step_secs, "the first step")
    threading.Thread(target=self._watch, args=(poll_secs,), daemon=True, name="watchdog").start()

  def beat(self, seconds: float | None = None, waiting_for: str = "the next step") -> None:
    """Progress: the next deadline is `seconds` (default step_secs) from now."""
    with self._lock:
      self._allowed = self.step_secs if seconds is None else seconds
      self._deadline = time.monotonic() + self._allowed
      self._waiting_for = waiting_for

  def _watch(self, poll_secs: float) -> None:
    while True:
      time.sleep(poll_secs)
      with self._lock:
        if time.monotonic() < self._deadline:
          continue
        print(
            f"watchdog: {self._waiting_for} did not complete within {self._allowed:g} s; the stack "
            f"of every thread follows, then exit status {HUNG_EXIT_STATUS} so that the job is "
            "restarted from its latest checkpoint", file=sys.stderr, flush=True)
      faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
      # Not sys.exit: the main thread is the one that is stuck, and exit handlers might block too.
      os._exit(HUNG_EXIT_STATUS)


# The process's watchdog: lm-train's command starts it; the training loop, also run as a library
# (tests, sweeps in one process), only reports progress, which is a no-op when none was started.
_current: Watchdog | None = None


def start(cfg: ml_collections.ConfigDict) -> None:
  """Watches this process until it exits; step_secs 0 turns the watchdog off."""
  global _current
  if cfg.step_secs > 0:
    _current = Watchdog(cfg)


def step_done() -> None:
  if _current:
    _current.beat()


def compiling(what: str) -> None:
  """What comes next may compile: it gets first_step_secs."""
  if _current:
    _current.beat(_current.first_step_secs, what)
