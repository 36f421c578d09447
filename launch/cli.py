"""lm-launch: run a command here, as N local processes, or on every worker of a TPU VM slice.

  lm-launch local -- CMD ...
  lm-launch processes -n N [--port P] [--xla_devices K] [--max-restarts R] -- CMD ...
  lm-launch tpu {create,install,run,logs,stop,delete,up} [--name ...] [--dry-run] [-- CMD ...]
  lm-launch sky [--name ...] [--spot] [--dry-run] -- lm-train ... --workdir=gs://...
"""

import argparse
import os
import shutil
import sys
from collections.abc import Sequence

from launch import managed, processes, tpu

_EXAMPLE = "lm-train --config=configs/tiny.py --workdir=/tmp/run"
_TPU_ACTIONS = {
    "create": "create the slice, or reuse a healthy one of that name",
    "install": "ship HEAD of this checkout to every worker and pip-install it there",
    "run": "start the command after -- on every worker, with --jax_distributed appended",
    "logs": "follow the training log of one worker",
    "stop": "stop the training processes on every worker",
    "delete": "delete the slice (and its queued resource)",
    "up": "create + install + run",
}
_TAKES_COMMAND = {"local", "processes", "run", "up", "sky"}


def _parser() -> argparse.ArgumentParser:
  parser = argparse.ArgumentParser(
      prog="lm-launch", description=__doc__.splitlines()[0],
      epilog=f"The command goes after --, e.g.: lm-launch processes -n 2 -- {_EXAMPLE}")
  modes = parser.add_subparsers(dest="mode", required=True)
  modes.add_parser("local", help="run the command here; its exit status is ours")
  procs = modes.add_parser(
      "processes", help="N local processes as one distributed JAX run on 127.0.0.1",
      description="Starts N copies of the command, each with --coordinator_address=127.0.0.1:PORT "
      "--num_processes=N --process_id=I appended; stops all when one fails.")
  procs.add_argument("-n", "--num_processes", type=int, required=True, help="how many processes")
  procs.add_argument("--port", type=int, help="coordinator port (default: a free one)")
  procs.add_argument("--xla_devices", type=int,
                     help="simulated CPU devices per process (XLA's host platform device count)")
  procs.add_argument(
      "--max-restarts", type=int, default=0,
      help="when a process dies (non-zero exit or a signal), stop the others and "
      "start all again, up to this many times; a trainer resumes from its "
      "latest checkpoint (default: %(default)s)")

  # The slice's type and software: the same flags for a gcloud slice and a managed job.
  tpu_type = argparse.ArgumentParser(add_help=False)
  defaults = tpu.Slice()
  tpu_type.add_argument("--accelerator-type", default=defaults.accelerator_type,
                        type=tpu.gcp_value("accelerator-type"),
                        help="TPU type (default: %(default)s, 4 workers x 4 chips)")
  tpu_type.add_argument("--runtime-version", default=defaults.runtime_version,
                        type=tpu.gcp_value("runtime-version"),
                        help="TPU software version (default: %(default)s, the documented v5e one)")
  slice_flags = argparse.ArgumentParser(add_help=False, parents=[tpu_type])
  slice_flags.add_argument("--name", default=defaults.name, type=tpu.gcp_value("name"),
                           help="TPU VM (and queued resource) name")
  slice_flags.add_argument("--project", type=tpu.gcp_value("project"),
                           help="GCP project (default: gcloud's core/project)")
  slice_flags.add_argument("--zone", type=tpu.gcp_value("zone"), help="zone (default: gcloud's compute/zone)")
  slice_flags.add_argument("--spot", action="store_true", help="Spot VMs: cheaper, preemptible")
  slice_flags.add_argument("--queued", action="store_true",
                           help="request through a queued resource that waits for capacity")
  slice_flags.add_argument("--dry-run", action="store_true",
                           help="print every command, one per line, and run nothing")
  slice_parser = modes.add_parser("tpu", help="a TPU VM slice through gcloud")
  actions = slice_parser.add_subparsers(dest="action", required=True)
  for action, help_text in _TPU_ACTIONS.items():
    example = f"e.g. lm-launch tpu {action} --zone=ZONE -- {_EXAMPLE}"
    actions.add_parser(action, parents=[slice_flags], help=help_text, description=help_text,
                       epilog=example if action in _TAKES_COMMAND else None)
  actions.choices["logs"].add_argument("--worker", default="0", type=tpu.gcp_value("worker"),
                                       help="worker index (default 0)")

  job = managed.Job()
  sky_parser = modes.add_parser(
      "sky", parents=[tpu_type], help="a SkyPilot managed job: the slice recovers by itself from preemptions",
      description=managed.__doc__.splitlines()[0] + " Needs the extra: pip install -e \".[sky]\".",
      epilog="e.g. lm-launch sky --spot -- lm-train --config=configs/c4_50m.py "
      "--workdir=gs://BUCKET/runs/c4_50m")
  sky_parser.add_argument("--name", default=job.name, type=tpu.gcp_value("name"),
                          help="managed job name (default: %(default)s)")
  sky_parser.add_argument(
      "--infra", default=job.infra, help="where the slice may run: gcp, gcp/REGION or gcp/REGION/ZONE "
      "(default: %(default)s, any region: the widest recovery)")
  sky_parser.add_argument("--spot", action="store_true", help="Spot VMs: cheaper, preemptible")
  sky_parser.add_argument(
      "--max-restarts-on-errors", type=int, default=job.max_restarts_on_errors,
      help="restarts after the command fails, beside those after preemptions "
      "(default: %(default)s)")
  sky_parser.add_argument("--dry-run", action="store_true",
                          help="print the task file and the sky command, and run nothing")
  return parser


def _split(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """Our flags, and the command after the first --."""
  argv = list(argv)
  if "--" not in argv:
    return argv, []
  cut = argv.index("--")
  return argv[:cut], argv[cut + 1:]


def main(argv: Sequence[str] | None = None, runner: tpu.Runner | None = None) -> int:
  """Entry point of lm-launch; runner stands in for subprocess in tests of the tpu and sky modes."""
  own, cmd = _split(sys.argv[1:] if argv is None else argv)
  parser = _parser()
  args, unknown = parser.parse_known_args(own)
  label = f"tpu {args.action}" if args.mode == "tpu" else args.mode
  name = label.split()[-1]
  if unknown:
    parser.error(f"unexpected {unknown[0]!r}; the command to run goes after --, "
                 f"e.g. lm-launch {label} -- {_EXAMPLE}")
  if name in _TAKES_COMMAND and not cmd:
    parser.error(f"no command to run; put it after --, e.g. lm-launch {label} -- {_EXAMPLE}")
  if name not in _TAKES_COMMAND and cmd:
    parser.error(f"lm-launch {label} takes no command after --")
  if args.mode in ("local", "processes") and shutil.which(cmd[0]) is None:
    parser.error(f"command not found: {cmd[0]}")

  if args.mode == "local":
    os.execvp(cmd[0], cmd)  # Replaces us: signals, terminal and exit status are the command's own.
  if args.mode == "processes":
    if args.num_processes < 1:
      parser.error("-n must be at least 1")
    if args.xla_devices is not None and args.xla_devices < 1:
      parser.error("--xla_devices must be at least 1")
    if args.max_restarts < 0:
      parser.error("--max-restarts must be at least 0")
    return processes.run(cmd, args.num_processes, args.port, args.xla_devices, args.max_restarts)
  if args.mode == "sky":
    return _sky(parser, args, cmd, runner)

  if not args.dry_run and runner is None and shutil.which("gcloud") is None:
    parser.error("gcloud not found on PATH; install the Google Cloud CLI "
                 "(cloud.google.com/sdk/docs/install), or add --dry-run to print the commands")
  s = tpu.Slice(name=args.name, accelerator_type=args.accelerator_type, runtime_version=args.runtime_version,
                project=args.project, zone=args.zone, spot=args.spot, queued=args.queued)
  sh = tpu.Shell(dry_run=args.dry_run, runner=runner or tpu.run_subprocess)
  try:
    match args.action:
      case "create":
        tpu.create(s, sh)
      case "install":
        tpu.install(s, sh)
      case "run":
        tpu.run(s, sh, cmd)
      case "logs":
        tpu.logs(s, sh, args.worker)
      case "stop":
        tpu.stop(s, sh)
      case "delete":
        tpu.delete(s, sh)
      case "up":
        tpu.up(s, sh, cmd)
  except tpu.LaunchError as e:
    print(f"lm-launch: {e}", file=sys.stderr)
    return 1
  return 0


def _sky(parser: argparse.ArgumentParser, args: argparse.Namespace, cmd: list[str],
         runner: tpu.Runner | None) -> int:
  if args.max_restarts_on_errors < 0:
    parser.error("--max-restarts-on-errors must be at least 0")
  if not args.dry_run and runner is None and shutil.which("sky") is None:
    parser.error('sky not found on PATH; install the extra: pip install -e ".[sky]", then set up '
                 "Google Cloud for it: sky check gcp")
  job = managed.Job(name=args.name, accelerator_type=args.accelerator_type,
                    runtime_version=args.runtime_version, infra=args.infra, spot=args.spot,
                    max_restarts_on_errors=args.max_restarts_on_errors)
  try:
    managed.launch(job, tpu.Shell(dry_run=args.dry_run, runner=runner or tpu.run_subprocess), cmd)
  except tpu.LaunchError as e:
    print(f"lm-launch: {e}", file=sys.stderr)
    return 1
  return 0


if __name__ == "__main__":
  sys.exit(main())
