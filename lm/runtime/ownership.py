"""One job per workdir: the first job to take `workdir/owner.json` owns the workdir until it ends.

A second job stops at once with a message naming the owner (host, pid, start time). The lock survives
crashes on both kinds of storage:
- local disks: an exclusive `flock` on `workdir/.owner.lock`, which the kernel releases when the
  owning process ends, however it ends; owner.json only says who holds it;
- object stores (gs://): owner.json is a lease, created only if absent (if-generation-match=0) and
  renewed by the owner every `lease_seconds / 3`, each renewal conditional on the generation it wrote
  last. A job that finds a lease not renewed for the owner's `lease_seconds` (it died) takes it over with
  the same condition, so of two jobs doing so at once exactly one wins. An owner whose lease was taken
  (it could not renew for that long) stops at once rather than write beside the new owner.
Only process 0 of a multi-process job takes the lock; the others follow its outcome.
"""

import contextlib
import datetime
import fcntl
import json
import os
import socket
import sys
import threading
import time
from collections.abc import Iterator

import jax
import numpy as np
from etils import epath
from jax.experimental import multihost_utils

from data_pipelines import storage

OWNER = "owner.json"
LOCK = ".owner.lock"
RENEWALS_PER_LEASE = 3
# How long a job refused a local workdir waits for the lock's holder to write its details: the holder
# writes them just after locking, so a job started at the same moment may look before they exist.
OWNER_WAIT_SECONDS = 5.0


class WorkdirError(Exception):
  """This job may not use the workdir: another job owns it (the message names it) or it is unusable."""


def _me(lease_seconds: float | None = None) -> dict:
  now = time.time()
  return {
      "host": socket.gethostname(),
      "pid": os.getpid(),
      "started": now,
      "renewed": now,
      "lease_seconds": lease_seconds,
      "processes": jax.process_count()
  }


def _stamp(t: float) -> str:
  return datetime.datetime.fromtimestamp(t, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


def _in_use(workdir, owner: dict | None, release: str) -> WorkdirError:
  who = ("another job (it has not written its details yet)" if owner is None else
         f"another job: host {owner['host']}, pid {owner['pid']}, started {_stamp(owner['started'])}")
  return WorkdirError(f"{workdir} is in use by {who}. Wait for that job to end or stop it, or choose "
                      f"another --workdir; {release}")


class LocalLock:
  """flock on a local disk: released by the kernel when the process ends."""

  def __init__(self, workdir: epath.Path):
    self.workdir, self.existed = workdir, workdir.exists()
    self.found = set(os.listdir(workdir)) if self.existed and workdir.is_dir() else set()
    try:
      workdir.mkdir(parents=True, exist_ok=True)
      while True:
        self.file = open(workdir / LOCK, "a+")
        try:
          fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
          self.file.close()
          raise _in_use(workdir, _holder(workdir), "a job that dies releases the workdir at once.") from None
        # A job that wrote nothing removes the lock file as it leaves (`release`): one that opened the
        # file before that holds a lock nobody else sees, so it takes the new one.
        if os.path.exists(workdir / LOCK) and os.path.samestat(os.fstat(self.file.fileno()),
                                                               os.stat(workdir / LOCK)):
          break
        self.file.close()
    except OSError as e:
      raise WorkdirError(f"cannot use {workdir} as a workdir ({e.strerror}); --workdir must name a "
                         f"directory this user can write, or one that can be created") from e
    storage.write_bytes(workdir / OWNER, json.dumps(_me()).encode())

  def release(self) -> None:
    """Drops the lock; a job that wrote nothing else (a refused config) leaves the workdir as it found
    it: the lock files it added removed, and the directory too if it created it."""
    with contextlib.suppress(OSError):
      added = set(os.listdir(self.workdir)) - self.found
      if added <= {LOCK, OWNER}:
        for name in added:
          os.remove(self.workdir / name)  # still holding the lock: see __init__
        if not self.existed:
          os.rmdir(self.workdir)
    self.file.close()  # closing drops the flock


def _holder(workdir: epath.Path) -> dict | None:
  """The details the lock's holder wrote, waiting up to OWNER_WAIT_SECONDS for them; details left by a
  process of this host that has ended (an owner before the holder) are not the holder's."""
  deadline = time.monotonic() + OWNER_WAIT_SECONDS
  while True:
    owner = _read(workdir / OWNER)
    if owner is not None and _may_be_running(owner):
      return owner
    if time.monotonic() > deadline:
      return None
    time.sleep(0.05)


def _may_be_running(owner: dict) -> bool:
  if owner.get("host") != socket.gethostname():
    return True  # a workdir shared between hosts: no way to tell from here
  try:
    os.kill(owner["pid"], 0)
  except ProcessLookupError:
    return False
  except PermissionError:  # another user's process
    pass
  return True


class Lease:
  """A renewed lease object on gs:// (google-cloud-storage: preconditions on generations)."""

  def __init__(self, workdir: epath.Path, lease_seconds: float):
    from google.api_core import exceptions  # cloud-only dependencies, loaded for gs:// only
    from google.cloud import storage as gcs
    self.taken = exceptions.PreconditionFailed
    self.failed = (exceptions.PreconditionFailed, exceptions.NotFound)
    bucket, _, key = os.fspath(workdir).removeprefix("gs://").partition("/")
    self.blob = gcs.Client().bucket(bucket).blob(f"{key.rstrip('/')}/{OWNER}")
    self.workdir, self.lease_seconds = workdir, lease_seconds
    self.record = _me(lease_seconds)
    try:
      self._take()
    except exceptions.NotFound as e:
      raise WorkdirError(f"cannot use {workdir} as a workdir: bucket {bucket!r} does not exist or "
                         f"this account cannot see it ({e.message})") from e
    self.stop = threading.Event()
    self.thread = threading.Thread(target=self._renew_every, daemon=True)
    self.thread.start()

  def _write(self, generation: int) -> None:
    with storage.naming(self.workdir / OWNER):
      self.blob.upload_from_string(json.dumps(self.record), content_type="application/json",
                                   if_generation_match=generation)

  def _take(self) -> None:
    for _ in range(3):  # the lease may change hands while we look at it
      try:
        return self._write(0)  # 0: only if there is none
      except self.taken:
        pass
      current = self.blob.bucket.get_blob(self.blob.name)
      if current is None:
        continue
      owner = json.loads(current.download_as_bytes())
      # The owner's lease, not ours: a job started with a shorter one must not cut it short.
      silent, lease = time.time() - owner["renewed"], owner["lease_seconds"]
      if silent < lease:
        raise _in_use(
            self.workdir, owner, f"its lease was renewed {silent:.0f}s ago; a job that dies "
            f"releases the workdir {lease:.0f}s after its last renewal.")
      try:
        self._write(current.generation)
      except self.taken:
        continue
      print(
          f"took over {self.workdir} from host {owner['host']}, pid {owner['pid']}: its lease was "
          f"last renewed {silent:.0f}s ago", file=sys.stderr, flush=True)
      return
    raise _in_use(self.workdir, None, "several jobs are contending for it.")

  def _renew_every(self) -> None:
    while not self.stop.wait(self.lease_seconds / RENEWALS_PER_LEASE):
      self.record["renewed"] = time.time()
      try:
        self._write(self.blob.generation)
      except self.failed:
        # Another job took the lease after we failed to renew it for lease_seconds: it owns the
        # workdir now, and anything more this job wrote would mix with its files.
        print(f"lm-train: lost the lease on {self.workdir} to another job; stopping at once", file=sys.stderr,
              flush=True)
        os._exit(75)
      except Exception as e:  # a network hiccup: the next renewal retries, well within the lease
        print(f"warning: renewing the lease on {self.workdir} failed: {e}", file=sys.stderr, flush=True)

  def release(self) -> None:
    self.stop.set()
    self.thread.join()
    with contextlib.suppress(*self.failed):
      self.blob.delete(if_generation_match=self.blob.generation)


def _read(path: epath.Path) -> dict | None:
  try:
    return json.loads(path.read_text())
  except (FileNotFoundError, ValueError):
    return None


@contextlib.contextmanager
def hold(workdir: str, lease_seconds: float = 60.0) -> Iterator[None]:
  """Owns workdir for the block, or raises WorkdirError (on every process of the job)."""
  path = epath.Path(workdir)
  lock, problem = None, ""
  if jax.process_index() == 0:
    try:
      lock = Lease(path, lease_seconds) if storage.is_remote(path) else LocalLock(path)
    except WorkdirError as e:
      problem = str(e)
  if jax.process_count() > 1:
    ok = multihost_utils.broadcast_one_to_all(np.int32(not problem))
    if not ok and not problem:
      problem = f"{workdir} is in use by another job (process 0 of this job says who)"
  if problem:
    raise WorkdirError(problem)
  try:
    yield
  finally:
    if lock is not None:
      lock.release()
