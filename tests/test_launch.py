"""lm-launch: the gcloud commands for a v5e-16 slice, and real local processes."""

import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import pytest

from launch import cli, tpu

ROOT = Path(__file__).resolve().parents[1]
WHERE = "--zone=us-west4-a --project=my-proj"
SLICE = tpu.Slice(zone="us-west4-a", project="my-proj")


@pytest.fixture(autouse=True)
def no_real_gcloud(monkeypatch, tmp_path_factory):
  """A gcloud first on PATH that fails: no test may reach a real project."""
  fake = tmp_path_factory.mktemp("bin") / "gcloud"
  fake.write_text("#!/bin/sh\necho 'a test ran gcloud' >&2\nexit 99\n")
  fake.chmod(0o755)
  monkeypatch.setenv("PATH", f"{fake.parent}{os.pathsep}{os.environ['PATH']}")


def dry_run(capsys, action: str, *argv: str) -> list[str]:
  assert cli.main(["tpu", action, "--zone=us-west4-a", "--project=my-proj", "--dry-run", *argv]) == 0
  return capsys.readouterr().out.splitlines()


def launch(*argv: str) -> subprocess.CompletedProcess:
  return subprocess.run([sys.executable, "-m", "launch.cli", *argv], cwd=ROOT, text=True, capture_output=True,
                        timeout=180)


def test_create_dry_run(capsys):
  assert dry_run(capsys, "create") == [
      f"gcloud compute tpus tpu-vm describe lm-tpu '--format=value(state)' {WHERE}",
      f"gcloud compute tpus tpu-vm create lm-tpu --accelerator-type=v5litepod-16 "
      f"--version=v2-alpha-tpuv5-lite {WHERE}",
  ]
  assert dry_run(
      capsys, "create", "--spot",
      "--name=big")[1] == (f"gcloud compute tpus tpu-vm create big --accelerator-type=v5litepod-16 "
                           f"--version=v2-alpha-tpuv5-lite --spot {WHERE}")


def test_queued_create_and_delete_dry_run(capsys):
  describe = f"gcloud compute tpus queued-resources describe lm-tpu '--format=value(state.state)' {WHERE}"
  assert dry_run(capsys, "create", "--queued", "--spot") == [
      describe,
      f"gcloud compute tpus queued-resources create lm-tpu --node-id=lm-tpu "
      f"--accelerator-type=v5litepod-16 --runtime-version=v2-alpha-tpuv5-lite --spot {WHERE}",
      describe,  # Waits until the queued resource is granted.
  ]
  assert dry_run(capsys, "delete",
                 "--queued") == [f"gcloud compute tpus queued-resources delete lm-tpu --force {WHERE}"]
  assert dry_run(capsys, "delete") == [f"gcloud compute tpus tpu-vm delete lm-tpu {WHERE}"]


def test_install_dry_run(capsys):
  archive = Path(tempfile.gettempdir()) / "lm-launch-lm-tpu.tar.gz"
  script = ("mkdir -p ~/hyla-lm && tar -xzf ~/hyla-lm.tar.gz -C ~/hyla-lm && cd ~/hyla-lm"
            " && python3 -m pip install --user -q uv==0.13.8"
            " && ~/.local/bin/uv venv -q --allow-existing --python 3.11 ~/.venv-hyla-lm"
            " && ~/.local/bin/uv pip install -q --python ~/.venv-hyla-lm/bin/python -e '.[tpu]'")
  assert [shlex.split(line) for line in dry_run(capsys, "install")] == [
      ["git", "-C", str(ROOT), "archive", "--format=tar.gz", f"--output={archive}", "HEAD"],
      [
          "gcloud", "compute", "tpus", "tpu-vm", "scp",
          str(archive), "lm-tpu:hyla-lm.tar.gz", "--worker=all", *WHERE.split()
      ],
      [
          "gcloud", "compute", "tpus", "tpu-vm", "ssh", "lm-tpu", "--worker=all", f"--command={script}",
          *WHERE.split()
      ],
  ]


def test_run_logs_stop_dry_run(capsys):
  train = ["lm-train", "--config=configs/c4_50m.py", "--workdir=gs://b/run", "--config.name=it's mine"]
  [line] = dry_run(capsys, "run", "--", *train)
  *ssh, command, zone, project = shlex.split(line)
  command = command.removeprefix("--command=")
  assert ssh == ["gcloud", "compute", "tpus", "tpu-vm", "ssh", "lm-tpu", "--worker=all"]
  assert [zone, project] == WHERE.split()
  assert command == (
      'if pid=$(cat ~/lm-train.pid 2>/dev/null) && '
      'tr "\\0" " " < /proc/"$pid"/cmdline 2>/dev/null | grep -q -- --jax_distributed; '
      'then echo "training already runs '
      'here; stop it first: lm-launch tpu stop" >&2; exit 1; fi; cd ~/hyla-lm || { echo "not installed '
      'here; run: lm-launch tpu install" >&2; exit 1; }; PATH="$HOME/.venv-hyla-lm/bin:$PATH" setsid '
      "nohup lm-train --config=configs/c4_50m.py --workdir=gs://b/run '--config.name=it'\"'\"'s mine' "
      "--jax_distributed >> ~/lm-train.log 2>&1 < /dev/null & echo $! > ~/lm-train.pid")
  # The user's quoting survives both shells: the local one (gcloud's argv) and the worker's.
  start = command[command.index(" nohup ") + 7:command.index(" >> ")]
  assert shlex.split(start) == [*train, "--jax_distributed"]

  assert dry_run(capsys, "logs", "--worker=2") == [
      f"gcloud compute tpus tpu-vm ssh lm-tpu --worker=2 '--command=tail -n 100 -F ~/lm-train.log' {WHERE}"
  ]
  [stop] = dry_run(capsys, "stop")
  assert shlex.split(stop)[5:7] == ["lm-tpu", "--worker=all"]


def test_up_dry_run_for_a_queued_spot_v5e_16_slice(capsys):
  """Every command of a run's life on a 16-chip slice (4 workers): the ones `up` runs, then as
  comments the ones that follow it."""
  train = ["lm-train", "--config=configs/c4_50m.py", "--workdir=gs://b/run"]
  lines = dry_run(capsys, "up", "--queued", "--spot", "--accelerator-type=v5litepod-16", "--", *train)
  describe = f"gcloud compute tpus queued-resources describe lm-tpu '--format=value(state.state)' {WHERE}"
  assert lines[:3] == [
      describe, f"gcloud compute tpus queued-resources create lm-tpu --node-id=lm-tpu "
      f"--accelerator-type=v5litepod-16 --runtime-version=v2-alpha-tpuv5-lite --spot {WHERE}", describe
  ]
  archive, scp, install, start = map(shlex.split, lines[3:7])
  assert archive[:4] == ["git", "-C", str(ROOT), "archive"]
  assert scp[4:6] == ["scp", archive[-2].removeprefix("--output=")] and "--worker=all" in scp
  assert install[4:7] == ["ssh", "lm-tpu", "--worker=all"] and "pip install" in install[7]
  assert start[4:7] == ["ssh", "lm-tpu", "--worker=all"]
  assert f"nohup {shlex.join(train)} --jax_distributed >> ~/lm-train.log" in start[7]
  assert lines[7:] == [
      f"# then, to follow the log: gcloud compute tpus tpu-vm ssh lm-tpu --worker=0 "
      f"'--command=tail -n 100 -F ~/lm-train.log' {WHERE}",
      f"# then, to stop training: {shlex.join(tpu.ssh_command(SLICE, tpu.STOP_SCRIPT))}",
      f"# then, to delete the slice: gcloud compute tpus queued-resources delete lm-tpu --force {WHERE}"
  ]


def test_remote_run_and_stop_scripts(tmp_path):
  """The scripts that run and stop work on a worker, run here by bash in a fake home directory."""
  (tmp_path / "hyla-lm").mkdir()
  venv_bin = tmp_path / ".venv-hyla-lm" / "bin"
  venv_bin.mkdir(parents=True)
  (venv_bin / "lm-train").write_text('#!/bin/sh\nfor a in "$@"; do echo "arg=$a"; done\nsleep 60\n')
  (venv_bin / "lm-train").chmod(0o755)
  env = dict(os.environ, HOME=str(tmp_path))
  bash = lambda script: subprocess.run(["bash", "-c", script], env=env, capture_output=True, text=True)

  # A pid file that outlived a reboot names some other process: neither blocks nor gets killed.
  other = subprocess.Popen(["sleep", "60"], start_new_session=True)
  (tmp_path / "lm-train.pid").write_text(str(other.pid))
  assert bash(tpu.STOP_SCRIPT).returncode == 0
  assert other.poll() is None
  other.kill()
  other.wait()

  assert bash(tpu.run_script(["lm-train", "--config.name=my run"])).returncode == 0
  pid = int((tmp_path / "lm-train.pid").read_text())
  deadline = time.monotonic() + 10
  while "jax_distributed" not in (log := (tmp_path / "lm-train.log").read_text()):
    assert time.monotonic() < deadline, log
    time.sleep(0.05)
  assert log == "arg=--config.name=my run\narg=--jax_distributed\n"
  # Once the trainer runs (checked after it has started: before its exec it is still a shell).
  again = bash(tpu.run_script(["lm-train"]))
  assert again.returncode == 1 and "stop it first" in again.stderr

  assert bash(tpu.STOP_SCRIPT).returncode == 0
  with pytest.raises(ProcessLookupError):
    os.killpg(pid, 0)  # The whole group (the trainer and its sleep) is gone.
  assert not (tmp_path / "lm-train.pid").exists()
  assert bash(tpu.STOP_SCRIPT).returncode == 0  # Nothing to stop is fine.


class FakeGcloud:
  """Records commands; answers `describe` from a script of states (None: no such resource)."""

  def __init__(self, states, fail=()):
    self.states, self.fail, self.calls = list(states), fail, []

  def __call__(self, argv, capture):
    self.calls.append(list(argv))
    if "describe" in argv:
      state = self.states.pop(0)
      return subprocess.CompletedProcess(argv, 1 if state is None else 0, stdout=f"{state}\n")
    return subprocess.CompletedProcess(argv, 255 if argv[4] in self.fail else 0, stdout="")


def test_queued_create_waits_until_active():
  fake = FakeGcloud([None, "WAITING_FOR_RESOURCES", "PROVISIONING", "ACTIVE"])
  s = tpu.Slice(queued=True, zone="us-west4-a", project="my-proj")
  tpu.create(s, tpu.Shell(runner=fake), poll_seconds=0)
  assert [call[4] for call in fake.calls] == ["describe", "create", "describe", "describe", "describe"]

  with pytest.raises(tpu.LaunchError, match="is FAILED; .*lm-launch tpu delete --name=lm-tpu --queued"):
    tpu.create(s, tpu.Shell(runner=FakeGcloud(["FAILED"])), poll_seconds=0)


def test_up_reuses_ready_slice_and_reports_failures(capsys):
  fake = FakeGcloud(["READY"])
  assert cli.main(["tpu", "up", "--", "lm-train", "--config=configs/tiny.py"], runner=fake) == 0
  assert [c[:2] if c[0] == "git" else c[4] for c in fake.calls
         ] == ["describe", ["git", "-C"], "scp", "ssh", "ssh"]
  assert "reusing lm-tpu (READY)" in capsys.readouterr().out

  with pytest.raises(tpu.LaunchError, match="is PREEMPTED; delete it first"):
    tpu.create(SLICE, tpu.Shell(runner=FakeGcloud(["PREEMPTED"])))
  assert cli.main(["tpu", "stop"], runner=FakeGcloud([], fail=("ssh",))) == 1
  assert "exit status 255 from: gcloud compute tpus tpu-vm ssh" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["processes", "-n", "2", "python3", "x.py"], "unexpected 'python3'; the command to run goes after --"),
    (["processes", "-n", "2"], "no command to run; put it after --"),
    (["processes", "-n", "0", "--", "python3"], "-n must be at least 1"),
    (["processes", "-n", "2", "--max-restarts=-1", "--", "python3"], "--max-restarts must be at least 0"),
    (["sky", "--max-restarts-on-errors=-1", "--", "lm-train"], "--max-restarts-on-errors must be at least 0"),
    (["remote", "--", "python3"], "invalid choice: 'remote'"),
    (["tpu", "create", "--", "lm-train"], "lm-launch tpu create takes no command after --"),
    (["local", "--", "no-such-command-xyz"], "command not found: no-such-command-xyz"),
])
def test_usage_errors(capsys, argv, message):
  with pytest.raises(SystemExit) as exit_info:
    cli.main(argv)
  assert exit_info.value.code == 2
  assert message in capsys.readouterr().err


def test_tpu_without_gcloud(capsys, monkeypatch, tmp_path):
  monkeypatch.setenv("PATH", str(tmp_path))
  with pytest.raises(SystemExit):
    cli.main(["tpu", "delete"])
  assert "gcloud not found on PATH; install the Google Cloud CLI" in capsys.readouterr().err


def test_local_passes_exit_status():
  result = launch("local", "--", sys.executable, "-c", "print('hi'); raise SystemExit(7)")
  assert (result.returncode, result.stdout) == (7, "hi\n")


DISTRIBUTED = """
import sys
import jax
import numpy as np
from jax.experimental import multihost_utils

jax.config.update("jax_platforms", "cpu")
flags = dict(arg[2:].split("=", 1) for arg in sys.argv[1:])
jax.distributed.initialize(flags["coordinator_address"], int(flags["num_processes"]),
                           int(flags["process_id"]))
ids = multihost_utils.process_allgather(np.int32(jax.process_index() + 1))
print(f"processes={jax.process_count()} devices={jax.device_count()} sum={ids.sum()}")
"""


@pytest.mark.slow
def test_processes_form_one_distributed_jax_run(tmp_path):
  script = tmp_path / "distributed.py"
  script.write_text(DISTRIBUTED)
  result = launch("processes", "-n", "2", "--xla_devices", "2", "--", sys.executable, str(script))
  assert result.returncode == 0, result.stderr
  # Only a real two-process run sees 2 processes, 2 x 2 devices, and the other process's id.
  # The runtime's own logging (jax 0.12's Gloo transport, XLA's C++ log) may share a line with ours,
  # before or after it.
  assert sorted(re.findall(r"^\[(\d)\] .*?(processes=\d+ devices=\d+ sum=\d+)", result.stdout,
                           re.M)) == [("0", "processes=2 devices=4 sum=3"),
                                      ("1", "processes=2 devices=4 sum=3")], result.stdout


CHILD = """
import os, signal, sys, time
i = int(sys.argv[-1].split("=")[1])
with open(os.path.join({tmp!r}, f"pid{{i}}"), "w") as f:
  f.write(str(os.getpid()))
if i == {fails}:
  while not os.path.exists(os.path.join({tmp!r}, "pid0")):  # Fail once process 0 is up.
    time.sleep(0.01)
  sys.exit(3)
signal.signal(signal.SIGTERM, lambda *_: (open(os.path.join({tmp!r}, f"term{{i}}"), "w"), sys.exit(0)))
print("ready", flush=True)
time.sleep(60)
"""


def test_processes_failure_stops_the_others(tmp_path):
  script = tmp_path / "child.py"
  script.write_text(textwrap.dedent(CHILD.format(tmp=str(tmp_path), fails=1)))
  start = time.monotonic()
  result = launch("processes", "-n", "2", "--", sys.executable, str(script))
  assert time.monotonic() - start < 30
  assert result.returncode == 3
  assert "lm-launch: process 1 of 2 exited with status 3; stopping the others" in result.stderr
  with pytest.raises(ProcessLookupError):
    os.kill(int((tmp_path / "pid0").read_text()), 0)
  assert not (tmp_path / "term0").exists()  # SIGKILL: without its peer it could not save anyway.


FLAKY = """
import os, sys
i = int(sys.argv[-1].split("=")[1])
runs = os.path.join({tmp!r}, f"runs{{i}}")
with open(runs, "a") as f:
  f.write("x")
if i == 1 and os.path.getsize(runs) <= {failures}:
  os.kill(os.getpid(), 9)  # Dies by a signal, as an OOM-killed process does.
"""


@pytest.mark.parametrize("failures, status", [(2, 0), (3, 137)])
def test_processes_restart_after_a_failure_up_to_max_restarts(tmp_path, failures, status):
  script = tmp_path / "flaky.py"
  script.write_text(textwrap.dedent(FLAKY.format(tmp=str(tmp_path), failures=failures)))
  result = launch("processes", "-n", "2", "--max-restarts=2", "--", sys.executable, str(script))
  assert result.returncode == status, result.stderr
  restarts = re.findall(r"lm-launch: restarting all 2 processes \((\d) of 2 restarts\)", result.stderr)
  assert restarts == ["1", "2"]
  assert (tmp_path / "runs1").read_text() == "xxx"  # Three runs: the first and two restarts.


def test_processes_forward_sigterm(tmp_path):
  script = tmp_path / "child.py"
  script.write_text(textwrap.dedent(CHILD.format(tmp=str(tmp_path), fails=-1)))
  proc = subprocess.Popen(
      [sys.executable, "-m", "launch.cli", "processes", "-n", "2", "--", sys.executable,
       str(script)], cwd=ROOT, stdout=subprocess.PIPE, text=True)
  assert sorted(proc.stdout.readline() for _ in range(2)) == ["[0] ready\n", "[1] ready\n"]
  proc.send_signal(signal.SIGTERM)
  assert proc.wait(timeout=30) == 0  # both children handled SIGTERM and exited 0
  assert (tmp_path / "term0").exists() and (tmp_path / "term1").exists()


@pytest.mark.slow
@pytest.mark.parametrize("script,expected", [("lm-train", ("--config", "--workdir")),
                                             ("lm-evaluate", ("--workdir", "--step"))])
def test_console_script_help_lists_its_flags(script, expected):
  # An installed console script's main module is a generated wrapper that defines no flags, so
  # absl's --help listed none before lm.runtime.cli registered them under the wrapper's name.
  out = subprocess.run([str(Path(sys.executable).parent / script), "--help"], capture_output=True, text=True,
                       timeout=120)
  for flag in expected:
    assert f"  {flag}:" in out.stdout, out.stdout


@pytest.mark.parametrize("flag", [
    "--name=--zone=x", "--name=Big_TPU", "--name=lm-tpu-", "--zone=--x", "--project=p; rm -rf ~",
    "--accelerator-type=v5e", "--runtime-version=-x"
])
def test_tpu_values_are_checked_as_gcp_does(capsys, flag):
  """A value gcloud would refuse, or read as a flag of its own, stops before any command runs."""
  with pytest.raises(SystemExit) as e:
    cli.main(["tpu", "create", "--dry-run", flag])
  assert e.value.code == 2
  err = capsys.readouterr()
  assert not err.out  # nothing was printed to run
  assert f"argument {flag.split('=')[0]}: {flag.split('=', 1)[1]!r} is not a" in err.err
