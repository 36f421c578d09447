"""One job per workdir (lm/runtime/ownership.py), with real lm-train processes: a second job stops at once
naming the owner; a crashed owner's workdir is taken over (locally at once, on gs:// once its lease
lapses)."""

import fcntl
import json
import os
import re
import socket
import subprocess
import sys
import threading
import time

import pytest
from etils import epath
from test_checkpoint import run_until, trainer

from lm.runtime import ownership

LONG = 100_000  # steps: the owner is killed long before it would finish


def refusal(proc) -> str:
  output = proc.communicate(timeout=120)[0]
  assert proc.returncode == 1, output[-3000:]
  return output


def names_owner(output: str, owner) -> bool:
  return re.search(
      rf"is in use by another job: host {re.escape(socket.gethostname())}, pid "
      rf"{owner.pid}, started \d{{4}}-\d\d-\d\d \d\d:\d\d:\d\d UTC", output) is not None


@pytest.mark.slow
@pytest.mark.parametrize("where", ["local", "gs"])
def test_one_job_per_workdir_and_a_dead_owner_is_replaced(small_corpus, tmp_path, where, request):
  workdir = tmp_path / "run" if where == "local" else request.getfixturevalue("gs_dir")
  lease = "--lease_seconds=6"
  start = lambda: trainer(tmp_path, small_corpus, workdir, LONG, 1000, lease)
  # Started together: exactly one owns the workdir, the other stops naming it.
  a, b = start(), start()
  outputs = {}
  for proc in (a, b):
    outputs[proc] = next(line for line in proc.stdout if line.startswith(("model:", "lm-train:")))
  owner, other = (a, b) if outputs[a].startswith("model:") else (b, a)
  assert names_owner(outputs[other] + refusal(other), owner)
  # Started while the owner trains: stops at once, naming it.
  run_until(owner, "step ")
  late = start()
  assert names_owner(refusal(late), owner)
  assert owner.poll() is None, "the owner trains on"
  # The owner dies without cleaning up; its workdir is free locally at once, on gs:// when the lease
  # has not been renewed for lease_seconds.
  owner.kill()
  owner.wait()
  if where == "gs":
    with pytest.raises(
        ownership.WorkdirError, match="its lease was renewed .* ago; a job that dies "
        "releases the workdir 6s after its last renewal"):
      with ownership.hold(workdir, lease_seconds=1):
        pass
    time.sleep(6)
  successor = start()
  output = run_until(successor, "model:")
  successor.kill()
  successor.wait()
  if where == "gs":
    assert f"took over {workdir} from host {socket.gethostname()}, pid {owner.pid}" in output
  assert epath.Path(workdir, ownership.OWNER).exists()


def test_an_unusable_workdir_is_named(tmp_path, gcs):
  (tmp_path / "file").write_text("not a directory")
  with pytest.raises(ownership.WorkdirError, match="--workdir must name a directory this user can write"):
    with ownership.hold(str(tmp_path / "file")):
      pass
  with pytest.raises(ownership.WorkdirError, match="bucket 'no-such-bucket' does not exist"):
    with ownership.hold("gs://no-such-bucket/run"):
      pass


def test_a_refused_job_names_the_holder_not_an_owner_that_ended(tmp_path, monkeypatch):
  """Locally the holder writes its details just after taking the lock. A job refused in between waits for
  them, and details left by an earlier owner whose process has ended are not taken for the holder's."""
  workdir = tmp_path / "run"
  workdir.mkdir()
  ended = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                         text=True, check=True)
  details = lambda pid: json.dumps({"host": socket.gethostname(), "pid": pid, "started": time.time()})
  (workdir / ownership.OWNER).write_text(details(int(ended.stdout)))
  holder = open(workdir / ".owner.lock", "a+")  # pylint: disable=consider-using-with
  fcntl.flock(holder, fcntl.LOCK_EX | fcntl.LOCK_NB)  # the holder, before it writes its details
  monkeypatch.setattr(ownership, "OWNER_WAIT_SECONDS", 0.5)
  with pytest.raises(ownership.WorkdirError, match=r"in use by another job \(it has not written its details"):
    ownership.LocalLock(epath.Path(workdir))
  # The holder writes them while the refused job waits: it is named.
  monkeypatch.setattr(ownership, "OWNER_WAIT_SECONDS", 10.0)
  threading.Timer(0.3, lambda: (workdir / ownership.OWNER).write_text(details(os.getpid()))).start()
  with pytest.raises(ownership.WorkdirError,
                     match=rf"host {re.escape(socket.gethostname())}, pid {os.getpid()},"):
    ownership.LocalLock(epath.Path(workdir))
  holder.close()
