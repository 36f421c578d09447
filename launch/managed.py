"""The training command as a SkyPilot managed job: a TPU VM slice that recovers by itself.

`sky jobs launch` provisions the slice (spot if asked), runs the task's `setup` and `run` on every
host of it, and when the slice is preempted or the command fails, provisions a new one (in another
zone or region when the task allows) and runs them again. lm-train then resumes from the latest
checkpoint in its workdir, which therefore lives on gs://: a replaced slice keeps no local disk.
SkyPilot is an optional extra (`pip install -e ".[sky]"`), imported only here.
"""

import copy
import dataclasses
import re
import shlex
import tempfile
from collections.abc import Sequence
from pathlib import Path

import yaml

from launch import tpu
from lm.runtime import watchdog

# SkyPilot's default: after a preemption, try the next region at once rather than wait in this one.
_STRATEGY = "EAGER_NEXT_REGION"


@dataclasses.dataclass(frozen=True)
class Job:
  name: str = "lm-train"
  accelerator_type: str = "v5litepod-16"
  runtime_version: str = "v2-alpha-tpuv5-lite"
  infra: str = "gcp"  # SkyPilot's `cloud[/region[/zone]]`: where the slice, and its recoveries, may go.
  spot: bool = False
  max_restarts_on_errors: int = 3  # Restarts after the command itself fails (not preemptions).


def workdir_of(cmd: Sequence[str]) -> str | None:
  """The value of --workdir in cmd, in either absl spelling."""
  for i, arg in enumerate(cmd):
    if arg.startswith("--workdir="):
      return arg.removeprefix("--workdir=")
    if arg == "--workdir" and i + 1 < len(cmd):
      return cmd[i + 1]
  return None


def task(job: Job, cmd: Sequence[str]) -> dict:
  """The SkyPilot task (the dict form of its YAML) that runs cmd on every host of the slice."""
  workdir = workdir_of(cmd)
  if not (workdir or "").startswith("gs://"):
    raise tpu.LaunchError(
        f"the command's --workdir is {workdir or 'missing'}; a managed job gets a new slice after a "
        "preemption, so its checkpoints must be on gs://, e.g. --workdir=gs://BUCKET/runs/NAME")
  return {
      "name": job.name,
      "resources": {
          "infra": job.infra,
          "accelerators": f"tpu-{job.accelerator_type}",
          "accelerator_args": {
              "runtime_version": job.runtime_version
          },
          "use_spot": job.spot,
          "job_recovery": {
              "strategy": _STRATEGY,
              "max_restarts_on_errors": job.max_restarts_on_errors,
              # A hang the watchdog ended is always worth a restart.
              "recover_on_exit_codes": [watchdog.HUNG_EXIT_STATUS]
          },
      },
      # Synced to ~/sky_workdir on every host (less what .gitignore excludes); setup and run start there.
      "workdir": str(tpu.ROOT),
      "setup": "\n".join(["set -e", *tpu.install_steps()]) + "\n",
      # exec: the trainer itself gets SkyPilot's signals and gives the job its exit status.
      "run": f"{tpu.VENV_PATH} exec {shlex.join([*cmd, '--jax_distributed'])}\n",
  }


class _Dumper(yaml.SafeDumper):
  """Multi-line strings (setup, run) as YAML block literals, as people write them."""


_Dumper.add_representer(
    str, lambda dumper, s: dumper.represent_scalar("tag:yaml.org,2002:str", s, style="|"
                                                   if "\n" in s else None))


def to_yaml(config: dict) -> str:
  return yaml.dump(config, Dumper=_Dumper, sort_keys=False)


# TPU generations SkyPilot provisions on GCP (its catalog's tpu-GEN-N accelerators).
TPU_GENERATIONS = ("v2", "v3", "v4", "v5litepod", "v5p", "v6e")
_INFRA_FORM = "give gcp, gcp/REGION or gcp/REGION/ZONE (e.g. gcp/us-central2/us-central2-b)"


def check_place(job: Job) -> None:
  """What SkyPilot can check of --infra and --accelerator-type without the network: a cloud it
  knows, which for a TPU slice is GCP; GCP's forms of region and zone names; a TPU generation. That
  the region, zone and accelerator exist it checks against its catalog, online, at launch."""
  try:
    import sky  # pylint: disable=import-outside-toplevel
    from sky.utils import infra_utils  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise tpu.LaunchError('SkyPilot is not installed; install the extra: pip install -e ".[sky]"') from e
  try:
    place = infra_utils.InfraInfo.from_str(job.infra)
  except ValueError as e:
    raise tpu.LaunchError(f"--infra={job.infra}: {e}; {_INFRA_FORM}") from None
  cloud = (place.cloud or "").lower()
  if cloud != "gcp":
    known = cloud in {str(c).lower() for c in sky.CLOUD_REGISTRY.values()} if cloud else False
    why = "TPU slices run on GCP only;" if known else f"SkyPilot knows no cloud {cloud!r}; TPU slices run on GCP:"
    raise tpu.LaunchError(f"--infra={job.infra}: {why} {_INFRA_FORM}")
  if place.region and not re.fullmatch(r"[a-z]+-[a-z]+[0-9]+", place.region):
    raise tpu.LaunchError(f"--infra={job.infra}: {place.region!r} is not a GCP region name; {_INFRA_FORM}")
  if place.zone and not re.fullmatch(rf"{re.escape(place.region or '')}-[a-z]", place.zone):
    raise tpu.LaunchError(f"--infra={job.infra}: {place.zone!r} is not a zone of region {place.region}; "
                          f"{_INFRA_FORM}")
  generation = job.accelerator_type.rsplit("-", 1)[0]
  if generation not in TPU_GENERATIONS:
    raise tpu.LaunchError(f"--accelerator-type={job.accelerator_type}: no TPU generation {generation!r}; "
                          f"SkyPilot's TPUs on GCP are {', '.join(TPU_GENERATIONS)} (e.g. v5litepod-16)")


def validate(config: dict) -> None:
  """Parses the task with SkyPilot's own parser (offline; no cloud credentials needed)."""
  try:
    import sky  # pylint: disable=import-outside-toplevel
  except ImportError as e:
    raise tpu.LaunchError('SkyPilot is not installed; install the extra: pip install -e ".[sky]"') from e
  try:
    sky.Task.from_yaml_config(copy.deepcopy(config))  # It consumes the dict it reads.
  except ValueError as e:
    raise tpu.LaunchError(f"SkyPilot rejects the task: {e}") from e


def launch_command(job: Job, task_file: Path) -> list[str]:
  # --detach-run: submitting returns; the job runs on for days without this terminal.
  return ["sky", "jobs", "launch", f"--name={job.name}", "--detach-run", str(task_file)]


def launch(job: Job, sh: tpu.Shell, cmd: Sequence[str]) -> None:
  """Writes the task file and submits it; on a dry run prints both and writes nothing."""
  config = task(job, cmd)
  check_place(job)
  validate(config)
  text = to_yaml(config)
  task_file = Path(tempfile.gettempdir()) / f"lm-launch-{job.name}.yaml"
  if sh.dry_run:
    print(f"# {task_file}:\n{text}", end="", flush=True)
  else:
    task_file.write_text(text)
  sh.run(launch_command(job, task_file))
  later = (("follow the log", ["sky", "jobs", "logs", f"--name={job.name}"]), ("see its state and recoveries",
                                                                               ["sky", "jobs", "queue"]),
           ("stop it", ["sky", "jobs", "cancel", f"--name={job.name}"]))
  for when, argv in later:
    print(f"# then, to {when}: {shlex.join(argv)}", flush=True)
