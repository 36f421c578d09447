"""lm-launch sky: the SkyPilot task for a managed TPU job, checked by SkyPilot's own parser, offline."""

import copy
import os
import shlex
import subprocess
import sys
import tempfile

import pytest
import yaml

from launch import cli, managed, tpu

TRAIN = ["lm-train", "--config=configs/c4_50m.py", "--workdir=gs://b/runs/c4", "--config.name=it's mine"]


@pytest.fixture(autouse=True)
def sky_home(monkeypatch, tmp_path_factory):
  """SkyPilot keeps its state under ~/.sky: a fresh home per test, and no cloud credentials;
  task files go to a fresh temporary directory."""
  monkeypatch.setenv("HOME", str(tmp_path_factory.mktemp("home")))
  monkeypatch.setattr(tempfile, "tempdir", str(tmp_path_factory.mktemp("tmp")))


def dry_run(capsys, *argv: str) -> tuple[str, dict, list[str]]:
  """The first line of a dry run, the task it prints, and the lines after that."""
  assert cli.main(["sky", "--dry-run", *argv, "--", *TRAIN]) == 0
  header, *lines = capsys.readouterr().out.splitlines()
  cut = next(i for i, line in enumerate(lines) if line.startswith("sky "))
  return header, yaml.safe_load("\n".join(lines[:cut])), lines[cut:]


@pytest.mark.slow
def test_dry_run_prints_a_task_that_skypilot_parses(capsys):
  import sky  # pylint: disable=import-outside-toplevel
  header, config, commands = dry_run(capsys, "--spot", "--max-restarts-on-errors=5", "--name=c4-hyla")
  task = sky.Task.from_yaml_config(copy.deepcopy(config))
  [resources] = task.resources
  assert (task.name, task.num_nodes) == ("c4-hyla", 1)  # A TPU slice is one node of 4 hosts.
  assert resources.accelerators == {"tpu-v5litepod-16": 1}
  assert resources.accelerator_args["runtime_version"] == "v2-alpha-tpuv5-lite"
  assert resources.use_spot and str(resources.cloud) == "GCP"
  assert resources.job_recovery == {
      "strategy": "EAGER_NEXT_REGION",
      "max_restarts_on_errors": 5,
      "recover_on_exit_codes": [75]
  }  # The watchdog's status.
  assert task.workdir == str(tpu.ROOT)
  assert task.setup.splitlines() == ["set -e", *tpu.install_steps()]
  assert task.run.startswith(f"{tpu.VENV_PATH} exec ")
  # The user's quoting survives: SkyPilot runs `run` with bash on every host.
  assert shlex.split(task.run.removeprefix(f"{tpu.VENV_PATH} exec ")) == [*TRAIN, "--jax_distributed"]
  task_file = os.path.join(tempfile.gettempdir(), "lm-launch-c4-hyla.yaml")
  assert header == f"# {task_file}:"
  assert commands == [
      f"sky jobs launch --name=c4-hyla --detach-run {task_file}",
      "# then, to follow the log: sky jobs logs --name=c4-hyla",
      "# then, to see its state and recoveries: sky jobs queue",
      "# then, to stop it: sky jobs cancel --name=c4-hyla"
  ]
  assert os.listdir(tempfile.gettempdir()) == []  # A dry run writes nothing.


def test_run_script_starts_the_trainer_with_the_users_arguments(tmp_path):
  """The task's run script, run here by bash in a fake home with a fake installed lm-train."""
  venv_bin = tmp_path / ".venv-hyla-lm" / "bin"
  venv_bin.mkdir(parents=True)
  (venv_bin / "lm-train").write_text('#!/bin/sh\nfor a in "$@"; do echo "arg=$a"; done\nexit 7\n')
  (venv_bin / "lm-train").chmod(0o755)
  script = managed.task(managed.Job(), TRAIN)["run"]
  result = subprocess.run(["bash", "-c", script], env=dict(os.environ, HOME=str(tmp_path)),
                          capture_output=True, text=True)
  assert result.returncode == 7  # The trainer's status is the job's: SkyPilot restarts on it.
  assert result.stdout.splitlines() == [f"arg={a}" for a in [*TRAIN[1:], "--jax_distributed"]]


def test_submits_the_task_file_with_sky(capsys):
  calls = []

  def fake_sky(argv, capture):
    calls.append((list(argv), open(argv[-1]).read()))
    return subprocess.CompletedProcess(argv, 0, stdout="")

  assert cli.main(["sky", "--infra=gcp/us-west4", "--", *TRAIN], runner=fake_sky) == 0
  [(argv, text)] = calls
  assert argv[:4] == ["sky", "jobs", "launch", "--name=lm-train"]
  config = yaml.safe_load(text)
  assert config["resources"]["infra"] == "gcp/us-west4" and not config["resources"]["use_spot"]
  assert managed.to_yaml(config) == text
  assert "sky jobs logs --name=lm-train" in capsys.readouterr().out

  assert cli.main(["sky", "--", *TRAIN],
                  runner=lambda argv, capture: subprocess.CompletedProcess(argv, 2, stdout="")) == 1
  assert "exit status 2 from: sky jobs launch" in capsys.readouterr().err


@pytest.mark.parametrize("workdir, shown", [(["--workdir=/tmp/run"], "/tmp/run"),
                                            (["--workdir", "runs/x"], "runs/x"), ([], "missing")])
def test_workdir_must_be_on_gcs(capsys, workdir, shown):
  assert cli.main(["sky", "--dry-run", "--", "lm-train", "--config=configs/c4_50m.py", *workdir]) == 1
  err = capsys.readouterr().err
  assert f"--workdir is {shown};" in err
  assert "must be on gs://, e.g. --workdir=gs://BUCKET/runs/NAME" in err


def test_skypilot_rejects_a_bad_task_and_a_missing_extra_is_named(monkeypatch):
  config = managed.task(managed.Job(), TRAIN)
  config["resources"]["no_such_field"] = 1
  with pytest.raises(tpu.LaunchError, match="SkyPilot rejects the task: .*no_such_field"):
    managed.validate(config)
  monkeypatch.setitem(sys.modules, "sky", None)  # What `import sky` meets without the extra.
  with pytest.raises(tpu.LaunchError, match=r'install the extra: pip install -e "\.\[sky\]"'):
    managed.validate(managed.task(managed.Job(), TRAIN))


@pytest.mark.parametrize("flag, message", [
    ("--infra=foo", "--infra=foo: SkyPilot knows no cloud 'foo'; TPU slices run on GCP: give gcp, "
     "gcp/REGION or gcp/REGION/ZONE (e.g. gcp/us-central2/us-central2-b)"),
    ("--infra=aws", "--infra=aws: TPU slices run on GCP only; give gcp, gcp/REGION or gcp/REGION/ZONE "
     "(e.g. gcp/us-central2/us-central2-b)"),
    ("--infra=gcp/us-central1;rm -rf ~", "--infra=gcp/us-central1;rm -rf ~: 'us-central1;rm -rf ~' is not "
     "a GCP region name; give gcp, gcp/REGION or gcp/REGION/ZONE (e.g. gcp/us-central2/us-central2-b)"),
    ("--infra=gcp/us-central2/europe-west4-a", "--infra=gcp/us-central2/europe-west4-a: 'europe-west4-a' "
     "is not a zone of region us-central2; give gcp, gcp/REGION or gcp/REGION/ZONE (e.g. "
     "gcp/us-central2/us-central2-b)"),
    ("--accelerator-type=v9-999", "--accelerator-type=v9-999: no TPU generation 'v9'; SkyPilot's TPUs on "
     "GCP are v2, v3, v4, v5litepod, v5p, v6e (e.g. v5litepod-16)"),
])
def test_dry_run_refuses_what_skypilot_would_refuse_later(capsys, flag, message):
  """Shell text in --infra and an accelerator that does not exist printed a task that fails later."""
  assert cli.main(["sky", "--dry-run", flag, "--", *TRAIN]) == 1
  captured = capsys.readouterr()
  assert captured.err == f"lm-launch: {message}\n" and captured.out == ""
