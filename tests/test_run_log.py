"""The run log in parts written whole (lm/runtime/run_log.py) and files written whole (data_pipelines/storage.py)."""

import os
import re
import signal
import subprocess
import sys
import time

import pytest

from data_pipelines import storage
from lm.runtime import run_log


def test_parts_roll_over_and_read_back_in_order(tmp_path):
  records = [{"step": i, "kind": "train", "loss": i / 7} for i in range(40)]
  log = run_log.JsonLog(tmp_path, part_bytes=300, flush_seconds=3600)
  for r in records[:20]:
    log.write(r)
    log.flush()
  log.close()
  resumed = run_log.JsonLog(tmp_path, part_bytes=300, flush_seconds=3600)  # a later job's writer
  for r in records[20:]:
    resumed.write(r)
  resumed.close()
  files = run_log.log_files(tmp_path)
  # The first writer's flushes started a new part past 300 bytes; the second wrote one part at close.
  assert len(files) >= 5 and all(len(f.read_bytes()) < 300 + 100 for f in files[:-1])
  assert run_log.read(tmp_path) == records


def test_a_cut_line_is_skipped_and_an_old_single_file_log_is_not_read(tmp_path, caplog):
  (tmp_path / "metrics").mkdir()
  cut = tmp_path / "metrics" / "00000000T000000-00000.jsonl"  # sorts before the writer's part
  cut.write_text('{"step": 1, "kind": "train"}\n{"step": 2, "ki')
  (tmp_path / "metrics.jsonl").write_text('{"step": 0, "kind": "train"}\n')  # the removed format
  log = run_log.JsonLog(tmp_path)
  log.write({"step": 3, "kind": "train"})
  log.close()
  assert [r["step"] for r in run_log.read(tmp_path)] == [1, 3]
  assert f"{cut}, line 2: not a JSON record" in caplog.text


def test_no_log_names_the_fix(tmp_path):
  with pytest.raises(
      ValueError, match=re.escape(f"{tmp_path} has no training log (metrics/*.jsonl): "
                                  f"it is not a training workdir (lm-train --workdir=")):
    run_log.read(tmp_path)


@pytest.mark.slow
def test_a_crash_loses_at_most_the_last_seconds(tmp_path):
  script = f"""
import os, signal, time
from lm.runtime import metrics
writer = metrics.Writer({str(tmp_path)!r})
writer.write(1, "train", {{"loss": 1.0}})
time.sleep(3 * {run_log.FLUSH_SECONDS})
writer.write(2, "train", {{"loss": 2.0}})
os.kill(os.getpid(), signal.SIGKILL)
"""
  result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
  assert result.returncode == -signal.SIGKILL, result.stderr[-2000:]
  assert [r["step"] for r in run_log.read(tmp_path)] == [1]


def test_written_whole_leaves_nothing_when_the_writer_fails(tmp_path):
  target = tmp_path / "shard"
  with pytest.raises(RuntimeError):
    with storage.written_whole(target) as local:
      with open(local, "w") as f:
        f.write("half a shard")
      raise RuntimeError("the writer failed")
  assert os.listdir(tmp_path) == []
  storage.write_bytes(target, b"whole")
  assert target.read_bytes() == b"whole" and os.listdir(tmp_path) == ["shard"]


def test_a_log_that_cannot_be_written_warns_once_per_outage(tmp_path, caplog):
  """A full disk fails every flush; one warning says so, and one more when writing works again."""
  (tmp_path / "metrics").write_text("a file where the log's directory should be")
  log = run_log.RollingFile(lambda i: tmp_path / "metrics" / f"{i}.jsonl", flush_seconds=0.01)
  log.add(b"{}\n")
  time.sleep(0.3)
  (tmp_path / "metrics").unlink()
  deadline = time.time() + 30
  while not (tmp_path / "metrics" / "0.jsonl").exists() and time.time() < deadline:
    time.sleep(0.01)
  log.close()
  warnings = [
      r.getMessage() for r in caplog.records if "run log" in r.getMessage() or "again" in r.getMessage()
  ]
  assert len(warnings) == 2 and "failed" in warnings[0] and warnings[1].endswith("works again"), warnings
  assert (tmp_path / "metrics" / "0.jsonl").read_text() == "{}\n"
