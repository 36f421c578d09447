"""Token-weighted statistics, the progress line, and the metrics log (JSON lines in the workdir)."""

import json
import time
from typing import Any

from etils import epath


def format_duration(seconds: float) -> str:
  seconds = int(max(seconds, 0))
  h, rem = divmod(seconds, 3600)
  m, s = divmod(rem, 60)
  return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s"


def format_count(x: float) -> str:
  for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
    if abs(x) >= scale:
      return f"{x / scale:.1f}{unit}"
  return f"{x:.0f}"


class Writer:
  """Appends one JSON object per event to workdir/metrics.jsonl; only process 0 writes."""

  def __init__(self, workdir: str, enabled: bool = True):
    self.path = epath.Path(workdir) / "metrics.jsonl"
    self.enabled = enabled

  def write(self, step: int, kind: str, values: dict[str, Any]) -> None:
    if not self.enabled:
      return
    record = {"step": step, "kind": kind, "time": time.time(), **values}
    with self.path.open("a") as f:
      f.write(json.dumps(record) + "\n")


class Progress:
  """step, loss, tokens/s and ETA, measured between successive reports."""

  def __init__(self, total_steps: int, tokens_per_step: int, start_step: int):
    self.total_steps, self.tokens_per_step = total_steps, tokens_per_step
    self.last_step, self.last_time = start_step, None

  def mark(self, step: int) -> None:
    """Starts timing here, e.g. after the first (compiling) step."""
    self.last_step, self.last_time = step, time.perf_counter()

  def report(self, step: int, loss: float, extra: str = "") -> dict[str, float]:
    now = time.perf_counter()
    stats = {}
    rate = ""
    if self.last_time is not None and step > self.last_step:
      step_time = (now - self.last_time) / (step - self.last_step)
      stats = {"tokens_per_sec": self.tokens_per_step / step_time, "step_time": step_time}
      eta = format_duration(step_time * (self.total_steps - step))
      rate = f" | {format_count(stats['tokens_per_sec'])} tok/s | ETA {eta}"
    width = len(str(self.total_steps))
    print(f"step {step:>{width}}/{self.total_steps} | loss {loss:.4f}{rate}{extra}", flush=True)
    self.last_step, self.last_time = step, now
    return stats
