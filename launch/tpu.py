"""gcloud commands for a TPU VM slice: create, install the project, run on every worker, stop, delete.

Defaults to a v5e slice of 16 chips (`v5litepod-16`: 4 workers of 4 chips) with the runtime that
Cloud TPU's "TPU software versions" page documents for JAX on v5e, `v2-alpha-tpuv5-lite`.
Every worker runs the same command; the trainer gets `--jax_distributed`, so
`jax.distributed.initialize()` learns the slice from the TPU VM itself.
"""

import argparse
import dataclasses
import re
import shlex
import subprocess
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]  # The checkout that `install` ships.

# On every worker, under the home directory.
_SRC = "hyla-lm"
_VENV = ".venv-hyla-lm"
_ARCHIVE = "hyla-lm.tar.gz"
_LOG = "lm-train.log"
_PID = "lm-train.pid"
# The v5e runtime's own Python is older than our 3.11, so uv fetches a 3.11 (the CI-tested pins).
_UV = "uv==0.13.8"

_QUEUED_WAITING = ("CREATING", "ACCEPTED", "WAITING_FOR_RESOURCES", "PROVISIONING")

Runner = Callable[[Sequence[str], bool], subprocess.CompletedProcess]


class LaunchError(Exception):
  """A failure the user can fix; the message names the fix."""


# What GCP accepts for each value that goes into a gcloud command line. Anything else could act as
# a flag of its own (`--name=--zone=x`) or be refused by gcloud after the slice was paid for.
GCP_VALUES = {
    "name": (r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?", "a TPU name: 1-63 lowercase letters, digits or "
             "hyphens, starting with a letter and not ending with a hyphen, e.g. lm-tpu"),
    "project": (r"([a-z][-a-z0-9.]*:)?[a-z][-a-z0-9]{4,28}[a-z0-9]", "a project ID: 6-30 "
                "lowercase letters, digits or hyphens, starting with a letter, e.g. my-project"),
    "zone": (r"[a-z]+-[a-z]+[0-9]+-[a-z]", "a zone, e.g. us-west4-a"),
    "accelerator-type": (r"[a-z0-9]+-[0-9]+", "an accelerator type, e.g. v5litepod-16"),
    "runtime-version": (r"[a-z0-9][-a-z0-9.]*", "a TPU software version, e.g. v2-alpha-tpuv5-lite"),
    "worker": (r"all|[0-9]+", "a worker index or all"),
}


def gcp_value(kind: str) -> Callable[[str], str]:
  """An argparse type that accepts only what GCP_VALUES[kind] allows."""
  pattern, what = GCP_VALUES[kind]

  def check(value: str) -> str:
    if not re.fullmatch(pattern, value):
      raise argparse.ArgumentTypeError(f"{value!r} is not {what}")
    return value

  return check


@dataclasses.dataclass(frozen=True)
class Slice:
  name: str = "lm-tpu"
  accelerator_type: str = "v5litepod-16"
  runtime_version: str = "v2-alpha-tpuv5-lite"
  project: str | None = None  # None: gcloud's configured core/project.
  zone: str | None = None  # None: gcloud's configured compute/zone.
  spot: bool = False
  queued: bool = False  # Ask through a queued resource (waits for capacity) of the same name.


def run_subprocess(argv: Sequence[str], capture: bool) -> subprocess.CompletedProcess:
  return subprocess.run(argv, text=True, stdout=subprocess.PIPE if capture else None, check=False)


@dataclasses.dataclass(frozen=True)
class Shell:
  """Runs commands, or on a dry run only prints them, one per line, shell-quoted."""
  dry_run: bool = False
  runner: Runner = run_subprocess

  def run(self, argv: Sequence[str]) -> None:
    if self.dry_run:
      print(shlex.join(argv), flush=True)
    elif (code := self.runner(argv, False).returncode) != 0:
      raise LaunchError(f"exit status {code} from: {shlex.join(argv)}")

  def query(self, argv: Sequence[str]) -> str | None:
    """Stdout of a read-only command; None when it fails, and on a dry run."""
    if self.dry_run:
      print(shlex.join(argv), flush=True)
      return None
    result = self.runner(argv, True)
    return result.stdout.strip() if result.returncode == 0 else None


def _gcloud(s: Slice, *args: str) -> list[str]:
  where = [f"--zone={s.zone}"] * bool(s.zone) + [f"--project={s.project}"] * bool(s.project)
  return ["gcloud", "compute", "tpus", *args, *where]


def create_command(s: Slice) -> list[str]:
  spot = ["--spot"] * s.spot
  if s.queued:
    return _gcloud(s, "queued-resources", "create", s.name, f"--node-id={s.name}",
                   f"--accelerator-type={s.accelerator_type}", f"--runtime-version={s.runtime_version}",
                   *spot)
  return _gcloud(s, "tpu-vm", "create", s.name, f"--accelerator-type={s.accelerator_type}",
                 f"--version={s.runtime_version}", *spot)


def describe_command(s: Slice) -> list[str]:
  if s.queued:
    return _gcloud(s, "queued-resources", "describe", s.name, "--format=value(state.state)")
  return _gcloud(s, "tpu-vm", "describe", s.name, "--format=value(state)")


def delete_command(s: Slice) -> list[str]:
  if s.queued:  # --force deletes the slice together with its queued resource.
    return _gcloud(s, "queued-resources", "delete", s.name, "--force")
  return _gcloud(s, "tpu-vm", "delete", s.name)


def ssh_command(s: Slice, script: str, worker: str = "all") -> list[str]:
  return _gcloud(s, "tpu-vm", "ssh", s.name, f"--worker={worker}", f"--command={script}")


# Prefix of a command that runs the installed lm-train.
VENV_PATH = f'PATH="$HOME/{_VENV}/bin:$PATH"'


def install_steps() -> list[str]:
  """Shell steps, run in the unpacked source, that pip-install it into a venv under ~."""
  return [
      f"python3 -m pip install --user -q {_UV}",
      f"~/.local/bin/uv venv -q --allow-existing --python 3.11 ~/{_VENV}",
      f"~/.local/bin/uv pip install -q --python ~/{_VENV}/bin/python -e '.[tpu]'",
  ]


def install_commands(s: Slice, archive: Path) -> list[list[str]]:
  """Ships HEAD of this checkout (committed files only) and installs it in a venv on every worker."""
  script = " && ".join([
      # Unpacked over the old copy, never wiped: a relative --workdir lives in this directory.
      f"mkdir -p ~/{_SRC}",
      f"tar -xzf ~/{_ARCHIVE} -C ~/{_SRC}",
      f"cd ~/{_SRC}",
      *install_steps(),
  ])
  return [
      ["git", "-C", str(ROOT), "archive", "--format=tar.gz", f"--output={archive}", "HEAD"],
      _gcloud(s, "tpu-vm", "scp", str(archive), f"{s.name}:{_ARCHIVE}", "--worker=all"),
      ssh_command(s, script),
  ]


# True, with $pid set, while our trainer runs; a pid file that outlived a reboot names another process.
# /proc rather than ps: minimal images ship without procps.
_RUNNING = (f'pid=$(cat ~/{_PID} 2>/dev/null) && '
            'tr "\\0" " " < /proc/"$pid"/cmdline 2>/dev/null | grep -q -- --jax_distributed')


def run_script(cmd: Sequence[str]) -> str:
  """Starts cmd with --jax_distributed in the background; the log survives the ssh session."""
  train = shlex.join([*cmd, "--jax_distributed"])
  return "; ".join([
      f'if {_RUNNING}; then '
      'echo "training already runs here; stop it first: lm-launch tpu stop" >&2; exit 1; fi',
      f'cd ~/{_SRC} || {{ echo "not installed here; run: lm-launch tpu install" >&2; exit 1; }}',
      # setsid: its own process group, so `stop` reaches the data workers it forks too.
      f"{VENV_PATH} setsid nohup {train} >> ~/{_LOG} 2>&1 < /dev/null "
      f"& echo $! > ~/{_PID}",
  ])


# SIGTERM lets the trainer finish a checkpoint; SIGKILL after a minute frees the chips regardless.
STOP_SCRIPT = "; ".join([
    f"{_RUNNING} || {{ rm -f ~/{_PID}; exit 0; }}",
    "kill -TERM -- -$pid 2>/dev/null",
    "for _ in $(seq 60); do kill -0 -- -$pid 2>/dev/null || break; sleep 1; done",
    "kill -KILL -- -$pid 2>/dev/null",
    f"rm -f ~/{_PID}",
])


def create(s: Slice, sh: Shell, poll_seconds: float = 30.0) -> None:
  """Creates the slice, or reuses a healthy one of that name; returns once it can run work."""
  state = sh.query(describe_command(s))
  if state is None:
    sh.run(create_command(s))
  elif state in (("ACTIVE", *_QUEUED_WAITING) if s.queued else ("READY",)):
    print(f"lm-launch: reusing {s.name} ({state})", flush=True)
  else:
    raise LaunchError(f"{s.name} exists but is {state}; delete it first: lm-launch tpu delete "
                      f"--name={s.name}{' --queued' * s.queued}")
  if s.queued:  # A queued resource is granted later; wait so that install can follow.
    _wait_active(s, sh, poll_seconds)


def _wait_active(s: Slice, sh: Shell, poll_seconds: float) -> None:
  while (state := sh.query(describe_command(s))) != "ACTIVE":
    if sh.dry_run:
      return
    if state not in _QUEUED_WAITING:
      raise LaunchError(f"queued resource {s.name} is {state or 'unreadable'}; see `gcloud "
                        f"compute tpus queued-resources describe {s.name}`, then delete it: "
                        f"lm-launch tpu delete --name={s.name} --queued")
    print(f"lm-launch: {s.name} is {state}; asking again in {poll_seconds:g} s", flush=True)
    time.sleep(poll_seconds)


def install(s: Slice, sh: Shell) -> None:
  for argv in install_commands(s, Path(tempfile.gettempdir()) / f"lm-launch-{s.name}.tar.gz"):
    sh.run(argv)


def run(s: Slice, sh: Shell, cmd: Sequence[str]) -> None:
  sh.run(ssh_command(s, run_script(cmd)))
  if not sh.dry_run:
    print(
        f"lm-launch: started on every worker of {s.name}; follow it with: "
        f"lm-launch tpu logs --name={s.name}", flush=True)


def logs_command(s: Slice, worker: str = "0") -> list[str]:
  return ssh_command(s, f"tail -n 100 -F ~/{_LOG}", worker)


def logs(s: Slice, sh: Shell, worker: str) -> None:
  sh.run(logs_command(s, worker))


def stop(s: Slice, sh: Shell) -> None:
  sh.run(ssh_command(s, STOP_SCRIPT))


def delete(s: Slice, sh: Shell) -> None:
  sh.run(delete_command(s))


def up(s: Slice, sh: Shell, cmd: Sequence[str]) -> None:
  create(s, sh)
  install(s, sh)
  run(s, sh, cmd)
  if sh.dry_run:
    # The rest of the slice's life, as shell comments: a pasted listing runs only the lines above.
    later = (("follow the log", logs_command(s)), ("stop training", ssh_command(s, STOP_SCRIPT)),
             ("delete the slice", delete_command(s)))
    for when, argv in later:
      print(f"# then, to {when}: {shlex.join(argv)}", flush=True)
