"""Real file systems for fault tests: a small one that fills up, a read-only one.

As root (CI runs as root in a VM, like the development machines) these are tmpfs mounts; root
ignores permission bits, so only a mount makes a directory read-only for it. Where mounting is not
permitted, `small` returns None (the caller injects the write error instead) and `read_only` takes
away the write permission, which binds a user who is not root.
"""

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator


def _mount(path, *options: str) -> bool:
  os.makedirs(path, exist_ok=True)
  return subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join(options), "tmpfs",
                         str(path)], capture_output=True).returncode == 0


@contextlib.contextmanager
def small(path, size: str) -> Iterator[bool]:
  """A tmpfs of `size` (e.g. "700k") at path; yields whether it could be mounted."""
  mounted = _mount(path, f"size={size}")
  try:
    yield mounted
  finally:
    if mounted:
      subprocess.run(["umount", str(path)], check=True)


@contextlib.contextmanager
def read_only(path, source) -> Iterator[str]:
  """A read-only copy of directory `source` at path/<its name>; yields the copy's path."""
  mounted = _mount(path, "size=64m")
  copy = os.path.join(path, os.path.basename(source))
  shutil.copytree(source, copy)
  if mounted:
    subprocess.run(["mount", "-o", "remount,ro", str(path)], check=True)
  else:
    for root, _, files in os.walk(path):
      for name in files:
        os.chmod(os.path.join(root, name), 0o444)
      os.chmod(root, 0o555)
  try:
    yield copy
  finally:
    if mounted:
      subprocess.run(["umount", str(path)], check=True)
    else:
      for root, _, _ in os.walk(path):
        os.chmod(root, 0o755)
