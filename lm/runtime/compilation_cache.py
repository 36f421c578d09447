"""JAX's persistent compilation cache: a restarted run loads its compiled programs from the cache
instead of compiling them again. Entries are keyed by the program, the devices and the JAX version,
so a cache is safe to share between runs; only compilations over a second are stored (JAX's default).
"""

import contextlib
from collections.abc import Iterator

import jax
from etils import epath
from jax.experimental.compilation_cache import compilation_cache

OFF = "none"


def enable(setting: str, workdir: epath.Path) -> str | None:
  """Points JAX at this run's cache and returns its path (None when off).

  setting: "" for WORKDIR/compilation_cache, "none" for no cache, otherwise the directory (local or
  gs://). The cache runs code it reads: only point it at storage that only you can write.
  """
  # JAX opens its cache once per process; a second run in this process (tests, sweeps) must reopen.
  compilation_cache.reset_cache()
  path = None if setting == OFF else setting or str(workdir / "compilation_cache")
  compilation_cache.set_cache_dir(path)
  return path


@contextlib.contextmanager
def enabled(setting: str, workdir: epath.Path) -> Iterator[str | None]:
  """`enable` for the duration of a run, then the process's cache as it was: JAX's cache is global to
  the process, and later compilations here (a test, a notebook) must not write into a finished run's
  workdir."""
  before = jax.config.jax_compilation_cache_dir
  try:
    yield enable(setting, workdir)
  finally:
    enable(before or OFF, workdir)
