"""Writing files that appear whole, on a local disk and on an object store (gs://) alike.

An object store has no append and no rename (a rename is a copy and a delete), but an upload is
atomic: an object appears whole when its upload finishes, or not at all. A local disk is the
reverse: a file is visible while it is being written, and a rename of a finished file is atomic.
`written_whole` and `write_bytes` do whichever the path needs, so no reader ever sees a partial file.
"""

import contextlib
import os
import pathlib
import shutil
import tempfile
from collections.abc import Iterator

from etils import epath


def is_remote(path: str | os.PathLike) -> bool:
  """gs:// and the other object stores that etils reaches through a URI scheme."""
  return "://" in os.fspath(path)


@contextlib.contextmanager
def written_whole(path: str | os.PathLike) -> Iterator[str]:
  """Yields a local file name to write; when the block finishes, `path` holds that file whole.

  Locally the file is renamed into place; for an object store it is written in a local temporary
  directory and uploaded in one piece. If the block raises, nothing appears at `path`.
  """
  path = epath.Path(path)
  if not is_remote(path):
    tmp = path.parent / f".{path.name}.tmp"
    try:
      yield os.fspath(tmp)
    except BaseException:
      tmp.unlink(missing_ok=True)
      raise
    os.replace(tmp, path)
    return
  with tempfile.TemporaryDirectory(prefix="upload-") as tmp_dir:
    local = os.path.join(tmp_dir, path.name)
    yield local
    # A streamed upload (gcsfs: resumable) becomes visible only when the file is closed.
    with open(local, "rb") as src, path.open("wb") as dst:
      shutil.copyfileobj(src, dst, 16 << 20)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
  """Replaces `path` with `data` in one step: readers see the old content or the new, never a mix."""
  if is_remote(path):
    epath.Path(path).write_bytes(data)  # one upload: atomic
    return
  with written_whole(path) as local:
    pathlib.Path(local).write_bytes(data)
