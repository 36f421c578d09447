"""The progress line and the metrics log: JSON lines and TensorBoard events in the workdir."""

import atexit
import time
from typing import Any

from etils import epath

from lm.runtime import run_log


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
  """Logs one JSON object per event to workdir/metrics/ (lm/runtime/run_log.py; read with run_log.read)
  and the numbers to TensorBoard (workdir/tensorboard, tag `kind/name`); only process 0 writes.
  Records reach storage within a few seconds, at each checkpoint and at close(). After a resume,
  steps between the checkpoint and the interruption may appear twice, the later one current."""

  def __init__(self, workdir: str | epath.Path, enabled: bool = True):
    self.enabled = enabled
    if enabled:
      self.log = run_log.JsonLog(workdir)
      self.events = run_log.EventLog(epath.Path(workdir) / "tensorboard")
      atexit.register(self.close)  # so that an exit by exception writes what is pending too

  def write(self, step: int, kind: str, values: dict[str, Any]) -> None:
    if self.enabled:
      self.log.write({"step": step, "kind": kind, "time": time.time(), **values})
      self.events.write(step, kind, values)
      if kind == "checkpoint":
        # Written at once, so a run resumed from this checkpoint (or a later one) has no gap in
        # its log: what a crash loses, the resumed run logs again.
        self.log.flush()
        self.events.flush()

  def close(self) -> None:
    """Writes what is pending; call it where the run ends (again: a no-op). A write that fails
    raises here once, not again at exit."""
    if self.enabled:
      self.enabled = False
      atexit.unregister(self.close)
      try:
        self.log.close()
      finally:
        self.events.close()


class Progress:
  """step, loss, tokens/s, MFU and ETA, measured between successive reports."""

  def __init__(self, total_steps: int, tokens_per_step: int, start_step: int, flops_per_token: float,
               peak_flops: float | None, peak_label: str = "MFU"):
    """peak_label: what the fraction of peak_flops is called ("MFU" for a device's datasheet peak)."""
    self.total_steps, self.tokens_per_step, self.peak_label = total_steps, tokens_per_step, peak_label
    self.flops_per_token, self.peak_flops = flops_per_token, peak_flops
    self.last_step, self.last_time = start_step, None

  def mark(self, step: int) -> None:
    """Starts timing here, e.g. after the first (compiling) step."""
    self.last_step, self.last_time = step, time.perf_counter()

  def report(self, step: int, loss: float) -> dict[str, float]:
    now = time.perf_counter()
    stats = {}
    rate = ""
    if self.last_time is not None and step > self.last_step:
      step_time = (now - self.last_time) / (step - self.last_step)
      stats = {"tokens_per_sec": self.tokens_per_step / step_time, "step_time": step_time}
      mfu = "n/a"
      if self.peak_flops:
        stats["mfu"] = stats["tokens_per_sec"] * self.flops_per_token / self.peak_flops
        mfu = f"{100 * stats['mfu']:.1f}%"
      eta = format_duration(step_time * (self.total_steps - step))
      rate = f" | {format_count(stats['tokens_per_sec'])} tok/s | {self.peak_label} {mfu} | ETA {eta}"
    width = len(str(self.total_steps))
    print(f"step {step:>{width}}/{self.total_steps} | loss {loss:.4f}{rate}", flush=True)
    self.last_step, self.last_time = step, now
    return stats
