"""Goodput: the share of a run's wall-clock time that went into training steps that count.

Each lm-train process keeps a Clock: every second since it started belongs to one phase (starting,
restoring, training, checkpointing, evaluating), except the time JAX spends tracing and compiling,
which is counted as compiling whatever the phase (JAX reports it through jax.monitoring). The trainer
logs the totals as `goodput` records. `summarize` reads a whole run, over all of its (re)starts: the
steps between a restart's checkpoint and the point where the previous process stopped were trained
twice, so their time moves from training to `repeated`; the time between a process's last record and
the next start (a crash, a hang until the watchdog fired, waiting for a new slice) is `down`.
"""

import threading
import time
from collections.abc import Iterable

from jax import monitoring

PHASES = ("starting", "restoring", "compiling", "training", "checkpointing", "evaluating")
# Tracing, lowering, and compiling or loading from the persistent cache: JAX's own duration events.
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/jaxpr_to_mlir_module_duration",
                   "/jax/core/compile/backend_compile_duration")
RUN_CATEGORIES = (*PHASES, "repeated", "down")


class Clock:
  """Seconds by phase since this process's training began (the phase starts as `starting`)."""

  def __init__(self):
    self.seconds = dict.fromkeys(PHASES, 0.0)
    self._phase, self._since, self._compiled = "starting", time.monotonic(), 0.0
    self._lock = threading.Lock()
    monitoring.register_event_duration_secs_listener(self._on_event)

  def _on_event(self, event: str, duration: float, **_) -> None:
    if event in _COMPILE_EVENTS:
      with self._lock:
        self._compiled += duration

  def enter(self, phase: str) -> None:
    """Time from now on belongs to phase."""
    with self._lock:
      now = time.monotonic()
      # Compiling happened inside the phase that ends: move it out of that phase.
      self.seconds[self._phase] += now - self._since - self._compiled
      self.seconds["compiling"] += self._compiled
      self._phase, self._since, self._compiled = phase, now, 0.0

  def totals(self) -> dict[str, float]:
    """Seconds by phase up to now, their sum (`wall`) and `goodput` = training / wall."""
    self.enter(self._phase)
    wall = sum(self.seconds.values())
    return {**self.seconds, "wall": wall, "goodput": self.seconds["training"] / max(wall, 1e-9)}

  def close(self) -> None:
    monitoring.unregister_event_duration_listener(self._on_event)


def summarize(records: Iterable[dict]) -> dict[str, float]:
  """A run's seconds by category over all of its (re)starts, from its log records in order.

  A process begins with a `run` record (step: where it started) and logs `goodput` records (its
  Clock's totals at that step); the last of them stands for the process.
  """
  processes = []  # [first step, last goodput record]
  for record in records:
    if record["kind"] == "run":
      processes.append([record["step"], None])
    elif record["kind"] == "goodput" and processes:
      processes[-1][1] = record
  processes = [(first, last) for first, last in processes if last is not None]
  out = dict.fromkeys(RUN_CATEGORIES, 0.0)
  for i, (first, last) in enumerate(processes):
    for phase in PHASES:
      out[phase] += last[phase]
    if i + 1 < len(processes):
      restart, next_last = processes[i + 1]
      step_seconds = last["training"] / max(last["step"] - first, 1)
      repeated = min(max(last["step"] - restart, 0) * step_seconds, last["training"])
      out["training"] -= repeated
      out["repeated"] += repeated
      # The next process started its Clock `wall` seconds before its last record.
      out["down"] += max(next_last["time"] - next_last["wall"] - last["time"], 0.0)
  out["wall"] = sum(out[c] for c in RUN_CATEGORIES)
  out["goodput"] = out["training"] / max(out["wall"], 1e-9)
  out["restarts"] = max(len(processes) - 1, 0)
  return out
