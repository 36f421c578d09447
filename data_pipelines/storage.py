"""Writing files that appear whole, on a local disk and on an object store (gs://) alike.

An object store has no append and no rename (a rename is a copy and a delete), but an upload is
atomic: an object appears whole when its upload finishes, or not at all. A local disk is the
reverse: a file is visible while it is being written, and a rename of a finished file is atomic.
`written_whole` and `write_bytes` do whichever the path needs, so no reader ever sees a partial file.
"""

import contextlib
import errno
import os
import pathlib
import re
import shutil
import socket
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Iterator

from etils import epath


def is_remote(path: str | os.PathLike) -> bool:
  """gs:// and the other object stores that etils reaches through a URI scheme."""
  return "://" in os.fspath(path)


@contextlib.contextmanager
def written_whole(path: str | os.PathLike) -> Iterator[str]:
  """Yields a local file name to write; when the block finishes, `path` holds that file whole.

  Locally the file is renamed into place (its directory is created if missing); for an object store
  it is written in a local temporary directory and uploaded in one piece. If the block raises,
  nothing appears at `path`.
  """
  path = epath.Path(path)
  if not is_remote(path):
    try:
      path.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError as e:  # a file stands where one of the path's directories must be
      raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), os.fspath(path)) from e
    tmp = _partial(path)
    try:
      yield os.fspath(tmp)
    except BaseException as e:
      tmp.unlink(missing_ok=True)
      # A failed write() names no file, ArrayRecord's writer says it in words only: name both here.
      code = e.errno if isinstance(e, OSError) and e.filename is None else _refused_errno(e)
      if code:
        raise OSError(code, os.strerror(code), os.fspath(path)) from e
      raise
    os.replace(tmp, path)
    return
  with tempfile.TemporaryDirectory(prefix="upload-") as tmp_dir:
    local = os.path.join(tmp_dir, path.name)
    yield local
    # A streamed upload (gcsfs: resumable) becomes visible only when the file is closed.
    with naming(path), open(local, "rb") as src, path.open("wb") as dst:
      shutil.copyfileobj(src, dst, 16 << 20)


def _partial(path: epath.Path) -> epath.Path:
  return path.parent / f".{path.name}.tmp"


def discard_partial(path: str | os.PathLike) -> None:
  """Deletes what a `written_whole(path)` of a process that was killed mid-write left."""
  if not is_remote(path):
    _partial(epath.Path(path)).unlink(missing_ok=True)


def write_bytes(path: str | os.PathLike, data: bytes) -> None:
  """Replaces `path` with `data` in one step: readers see the old content or the new, never a mix."""
  if is_remote(path):
    with naming(path):
      epath.Path(path).write_bytes(data)  # one upload: atomic
    return
  with written_whole(path) as local:
    pathlib.Path(local).write_bytes(data)


def write_text(path: str | os.PathLike, text: str) -> None:
  """write_bytes for UTF-8 text: result files (JSON, markdown) appear whole or not at all."""
  write_bytes(path, text.encode("utf-8"))


# What the OS says when storage refuses a write, and what to do about it. orbax and TensorStore
# report these inside a ValueError's text, so the text is matched as well as the errno.
_REFUSALS = {
    errno.ENOSPC: ("No space left on device", "free space on it"),
    errno.EDQUOT: ("Disk quota exceeded", "free space or raise the quota"),
    errno.EROFS: ("Read-only file system", "remount it read-write"),
    errno.EACCES: ("Permission denied", "make it writable by this user"),
    errno.ENOTDIR: ("Not a directory", "a file stands where its path needs a directory: move the file "
                    "or choose another path"),
}

# What GCS answers when it refuses a request, and what to do about it.
_GCS_REFUSALS = {
    403: ("permission denied by GCS (HTTP 403)", "give the account this job runs as write access to "
          "the bucket (e.g. roles/storage.objectUser, and on a VM a read-write storage scope), or use "
          "a bucket it can write"),
    429: ("too many requests to GCS (HTTP 429: a rate limit or quota was exceeded)",
          "wait a few minutes and run the command again, or raise the project's quota; GCS takes about "
          "one write per second to one object"),
}


class RefusedError(OSError):
  """GCS refused a request for `filename` with HTTP `status` (for the clients that do not say which
  object it was)."""

  def __init__(self, status: int, message: str, filename: str):
    super().__init__(f"HTTP {status}: {message}")
    self.status, self.filename = status, filename


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
  """A GCS refusal raised in the block names `path` (gcsfs's HTTP 429 and google-cloud-storage's
  errors do not name the object)."""
  try:
    yield
  except Exception as e:
    if isinstance(e, RefusedError) or not (status := _gcs_status(e)):
      raise
    raise RefusedError(status, str(e).splitlines()[0], os.fspath(path)) from e


def _gcs_status(e: BaseException) -> int | None:
  """403 or 429 if e is GCS refusing a request, as each client says it: google-cloud-storage and
  gcsfs carry the HTTP code (gcsfs's 403 is an OSError 'Forbidden: URL'); TensorStore gives a status
  name, or, after retrying a 429, GCS's own words."""
  if getattr(e, "code", None) in _GCS_REFUSALS:
    return e.code
  if isinstance(e, RefusedError):
    return e.status
  text = str(e)
  if text.startswith("Forbidden: ") or text.startswith("PERMISSION_DENIED: "):
    return 403
  if "gs://" in text and re.search(r"RESOURCE_EXHAUSTED|rate limit|quota exceeded", text, re.IGNORECASE):
    return 429
  return None


def _gcs_object(text: str) -> str | None:
  """The gs:// object an error names: TensorStore writes the path, gcsfs the request's URL."""
  if path := re.search(r"gs://[^\s:'\"]+", text):
    return path[0]
  url = re.search(r"/b/([^/?\s]+)/o(?:/([^?\s]+))?(?:\?\S*?\bname=([^&\s]+))?", text)
  if url and (url[2] or url[3]):
    return f"gs://{url[1]}/{urllib.parse.unquote(url[2] or url[3])}"
  return None


def _refused_errno(e: BaseException) -> int | None:
  """The errno of _REFUSALS that e is, or names in its text."""
  if isinstance(e, OSError) and e.errno in _REFUSALS:
    return e.errno
  return next((code for code, (words, _) in _REFUSALS.items() if words in str(e)), None)


def write_refused(e: BaseException) -> str | None:
  """When e, or an exception it came from, is storage refusing a write (full disk, quota,
  read-only file system, permission; on GCS permission, rate and quota): one line naming the cause,
  the file, the file system it is on (with its free space) and the fix; else None."""
  seen = set()
  while e is not None and id(e) not in seen:
    seen.add(id(e))
    if status := _gcs_status(e):
      words, fix = _GCS_REFUSALS[status]
      path = e.filename if isinstance(e, RefusedError) else _gcs_object(str(e))
      return f"{words}{f': cannot write {path}' if path else ''}; {fix}"
    quoted = re.findall(r'"(/[^"]+)"', str(e))  # TensorStore quotes the file it failed to write
    for code, (words, fix) in _REFUSALS.items():
      if (isinstance(e, OSError) and e.errno == code) or (words in str(e) and quoted):
        path = e.filename if isinstance(e, OSError) else quoted[0]
        where = f": cannot write {path}{_file_system(path)}" if path else ""
        return f"{words.lower()}{where}; {fix}"
    e = e.__cause__ or e.__context__
  return None


def _file_system(path: str | None) -> str:
  """' (on the file system mounted at M, N MB free)' for a local path."""
  if not path or is_remote(path):
    return ""
  mount = os.path.abspath(path)
  while not os.path.exists(mount) or not os.path.ismount(mount):
    mount = os.path.dirname(mount)
  return f" (on the file system mounted at {mount}, {shutil.disk_usage(mount).free / 1e6:.1f} MB free)"


# Where each client sends gs:// requests: gcsfs and google-cloud-storage (etils paths, the lease),
# TensorStore (orbax's arrays) and ArrayRecord's reader, each pointed elsewhere by its own variable.
_GCS_ENDPOINTS = ("STORAGE_EMULATOR_HOST", "TENSORSTORE_GCS_HTTP_URL", "CLOUD_STORAGE_EMULATOR_ENDPOINT")
_GCS = "https://storage.googleapis.com"
_reached: set[str] = set()


class UnreachableError(ConnectionError):
  """The storage endpoint a remote path is reached through refuses connections or does not resolve."""


def check_reachable(path: str | os.PathLike, timeout: float = 5.0) -> None:
  """Raises UnreachableError, at once, if a gs:// `path`'s endpoints cannot be connected to.

  The clients retry a refused connection or an unknown host for 38-101 s before they give up, in
  dozens of lines of tracebacks; at the first access neither is worth retrying. Each endpoint (and
  the proxy in front of it, if one is set) is tried once per process with one TCP connection."""
  path = os.fspath(path)
  if not path.startswith("gs://"):
    return
  for url in dict.fromkeys(os.environ.get(name) or _GCS for name in _GCS_ENDPOINTS):
    if url in _reached:
      continue
    url_parts = urllib.parse.urlsplit(url if "://" in url else f"http://{url}")
    host, port = url_parts.hostname, url_parts.port or (443 if url_parts.scheme == "https" else 80)
    proxy = urllib.request.getproxies().get(url_parts.scheme)
    if proxy and not urllib.request.proxy_bypass(host):
      proxy_parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
      host, port = proxy_parts.hostname, proxy_parts.port or 80
    try:
      socket.create_connection((host, port), timeout=timeout).close()
    except OSError as e:
      reason = "unknown host" if isinstance(e, socket.gaierror) else (
          f"no answer in {timeout:g} s" if isinstance(e, TimeoutError) else e.strerror or str(e))
      via = f" through the proxy {host}:{port}" if proxy and host != url_parts.hostname else ""
      raise UnreachableError(f"cannot reach GCS at {url}{via} for {path} ({reason}); "
                             f"{_what_to_check(url)}") from None
    _reached.add(url)


def _what_to_check(url: str) -> str:
  if set_by := [name for name in _GCS_ENDPOINTS if os.environ.get(name) == url]:
    return (f"check that {set_by[0]}={url} names a running emulator (or unset it to use GCS)")
  return ("check this host's network, DNS and proxy settings (HTTPS_PROXY), and that it has "
          "credentials for GCS (gcloud auth application-default login, or a VM's service account)")
