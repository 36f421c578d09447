"""The run's logs as parts written whole, so they survive object storage (no append there).

Layout: `workdir/metrics/<writer start, UTC>-<part>.jsonl`, one JSON object per line, and TensorBoard
event files `workdir/tensorboard/events.out.tfevents.<writer start>.<host>.<part>`. A writer keeps its
current part in memory and rewrites it whole every few seconds (a background thread) and at close;
past a size it starts the next part. A crash loses at most the last few seconds, a reader never sees
a partial part, and no part is appended to or renamed.
"""

import datetime
import json
import numbers
import socket
import struct
import threading
import time
from collections.abc import Callable
from typing import Any

from absl import logging
from etils import epath
from tensorboardX.proto import event_pb2, summary_pb2
from tensorboardX.record_writer import masked_crc32c

from data_pipelines import storage

LOG_DIR = "metrics"
FLUSH_SECONDS = 2.0  # at most one write per object every 2 s: GCS allows about one a second
PART_BYTES = 256 << 10  # bounds each rewrite (and the old copies a bucket's soft delete keeps)


def start_stamp() -> str:
  """A name prefix that sorts in time order (the next writer on a resumed run sorts after)."""
  return datetime.datetime.now(datetime.UTC).strftime("%Y%m%dT%H%M%S.%fZ")


class RollingFile:
  """Bytes added in memory and written out whole: `part_name(i)` holds part i. Every
  `flush_seconds` (a daemon thread) and on flush()/close() the current part is rewritten in one
  piece; once it holds `part_bytes` the next part begins (with `header`), so no write exceeds that.
  add() never waits for storage: a write holds only `writing`, and the buffer's lock for a copy."""

  def __init__(self, part_name: Callable[[int], epath.Path], *, header: bytes = b"",
               flush_seconds: float = FLUSH_SECONDS, part_bytes: int = PART_BYTES):
    self.part_name, self.part_bytes, self.header = part_name, part_bytes, header
    self.part, self.buffer, self.dirty = 0, bytearray(header), False
    self.lock, self.writing = threading.Lock(), threading.Lock()
    self.closed = threading.Event()
    self.thread = threading.Thread(target=self._flush_every, args=(flush_seconds,), daemon=True)
    self.thread.start()

  def add(self, data: bytes) -> None:
    with self.lock:
      self.buffer += data
      self.dirty = True

  def flush(self) -> None:
    with self.writing:  # one write at a time, so an older copy of a part never lands last
      with self.lock:
        if not self.dirty:
          return
        part, data, self.dirty = self.part, bytes(self.buffer), False
      try:
        storage.write_bytes(self.part_name(part), data)
      except BaseException:
        with self.lock:
          self.dirty = True  # the next flush writes it again
        raise
      if len(data) >= self.part_bytes:
        with self.lock:  # what was added during the write begins the next part
          self.part, self.buffer = part + 1, bytearray(self.header) + self.buffer[len(data):]
          self.dirty = len(self.buffer) > len(self.header)

  def close(self) -> None:
    self.closed.set()
    self.thread.join()
    self.flush()

  def _flush_every(self, seconds: float) -> None:
    failing = False
    while not self.closed.wait(seconds):
      try:
        self.flush()
        if failing:
          logging.warning("writing %s works again", self.part_name(self.part))
        failing = False
      except Exception as e:  # a storage hiccup must not end training; the next flush retries
        if not failing:  # once per outage: a full disk would otherwise warn every few seconds
          logging.warning("writing the run log failed (retrying every %.0fs): %s", seconds, e)
        failing = True


class JsonLog(RollingFile):
  """Appends records to workdir's log (see the module docstring)."""

  def __init__(self, workdir: str | epath.Path, **kwargs):
    directory, stamp = epath.Path(workdir) / LOG_DIR, start_stamp()
    directory.mkdir(parents=True, exist_ok=True)
    super().__init__(lambda i: directory / f"{stamp}-{i:05d}.jsonl", **kwargs)

  def write(self, record: dict[str, Any]) -> None:
    self.add((json.dumps(record) + "\n").encode())


class EventLog(RollingFile):
  """TensorBoard scalars (tag `kind/name`) in event files under workdir/tensorboard."""

  def __init__(self, directory: str | epath.Path, **kwargs):
    directory, stamp = epath.Path(directory), int(time.time())
    directory.mkdir(parents=True, exist_ok=True)
    host = socket.gethostname()
    # TensorBoard reads a directory's event files in name order: the part number is zero-padded.
    name = lambda i: directory / f"events.out.tfevents.{stamp}.{host}.{i:05d}"
    header = _record(event_pb2.Event(wall_time=time.time(), file_version="brain.Event:2"))
    super().__init__(name, header=header, **kwargs)

  def write(self, step: int, kind: str, values: dict[str, Any]) -> None:
    scalars = [
        summary_pb2.Summary.Value(tag=f"{kind}/{k}", simple_value=v)
        for k, v in values.items()
        if isinstance(v, numbers.Real)
    ]
    if scalars:
      self.add(
          _record(
              event_pb2.Event(wall_time=time.time(), step=step, summary=summary_pb2.Summary(value=scalars))))


def _record(event: event_pb2.Event) -> bytes:
  """One event in TFRecord framing: length, its masked CRC-32C, the data, the data's CRC."""
  data = event.SerializeToString()
  header = struct.pack("<Q", len(data))
  return (header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data)))


def log_files(workdir: str | epath.Path) -> list[epath.Path]:
  """The files holding workdir's log, in the order they were written."""
  return sorted((epath.Path(workdir) / LOG_DIR).glob("*.jsonl"))


def read(workdir: str | epath.Path) -> list[dict[str, Any]]:
  """Every record of workdir's log in the order written (after a resume, the steps between the
  checkpoint and the interruption appear twice, the later one current). A line that does not
  parse (a part cut by a crash mid-write on a local disk) is skipped with a warning naming file and
  line."""
  files = log_files(workdir)
  if not files and epath.Path(workdir).is_file():
    raise ValueError(f"{workdir} is a file, not a training workdir; give the directory that "
                     f"lm-train --workdir wrote")
  if not files:
    raise ValueError(f"{workdir} has no training log ({LOG_DIR}/*.jsonl): it is not a training "
                     f"workdir (lm-train --workdir={workdir} creates one)")
  records = []
  for path in files:
    for n, line in enumerate(path.read_text().splitlines(), 1):
      try:
        records.append(json.loads(line))
      except ValueError:
        logging.warning("%s, line %d: not a JSON record (cut by a crash?); skipped", path, n)
  return records
