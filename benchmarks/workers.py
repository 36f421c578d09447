"""Side-by-side drivers run every measurement in a fresh worker process; this is how.

Standard library only, like profiles.py: the drivers start workers in other projects' venvs.
"""

import json
import os
import re
import subprocess


def run_json(cmd: list[str], xla_flags: str = "") -> dict:
  """Runs a worker on the CPU and returns the JSON object its last line prints."""
  # CPU only: libtpu (installed with the tpu extra) would otherwise be probed.
  env = {**os.environ, "JAX_PLATFORMS": "cpu"}
  if xla_flags:
    env["XLA_FLAGS"] = f"{env.get('XLA_FLAGS', '')} {xla_flags}".strip()
  out = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
  if out.returncode:
    raise SystemExit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
  return json.loads(out.stdout.strip().splitlines()[-1])


def uptime() -> str:
  """The load averages, printed before and after a measurement to say what else ran."""
  return subprocess.run(["uptime"], capture_output=True, text=True, check=False).stdout.strip()


def machine() -> str:
  """The CPU's model and how many cores this process may use: ratios differ between machines."""
  try:
    with open("/proc/cpuinfo") as f:
      model = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.M)
  except OSError:
    model = None
  return f"{model.group(1) if model else 'unknown CPU'}, {len(os.sched_getaffinity(0))} cores"
