"""Where a traced step's time goes: each kind of XLA operation's share in a jax.profiler trace.

Standard library only, so that benchmark workers running other projects' code (in their own venvs)
can use it too.
"""

import collections
import glob
import gzip
import json
import os
import re


def shares(directory: str) -> tuple[collections.Counter, collections.Counter]:
  """Microseconds per kind of operation (numbered instances summed) and per operation, from the
  newest perfetto trace under directory."""
  path = sorted(glob.glob(f"{directory}/**/*.trace.json.gz", recursive=True), key=os.path.getmtime)[-1]
  ops = [
      e for e in json.load(gzip.open(path))["traceEvents"] if e.get("ph") == "X" and
      not e["name"].startswith("$") and not re.match(r"(ThunkExecutor|Slinky)", e["name"])
  ]
  kinds, each = collections.Counter(), collections.Counter()
  for e in ops:
    kinds[re.sub(r"\.\d+$", "", e["name"])] += e.get("dur", 0)
    each[e["name"]] += e.get("dur", 0)
  return kinds, each


def print_shares(directory: str, top: int = 10) -> None:
  kinds, each = shares(directory)
  total = sum(kinds.values())
  print(f"operation time in the trace: {total / 1e6:.3f} s")
  for name, us in kinds.most_common(top):
    print(f"{us / total:6.1%}  {name}")
  for name, us in each.most_common(8):
    print(f"{us / total:6.1%}  {name} (one operation)")
