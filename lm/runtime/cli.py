"""Entry of every console script (lm-train, lm-evaluate, ...): what all of them set up the same way.

A command defines its flags in its `run()`, never on import, so that any modules (and tests and
scripts with flags of their own) import side by side; `run()` then calls `cli.run(main, __name__)`,
which sets up the rest:
- `--help` lists the command's flags, registered under the console-script wrapper's name (absl lists
  those of the module sys.argv[0] names, the wrapper, which defines none).
- The default verbosity is WARNING: libraries log every save and compile at INFO (`--verbosity=0`).
- On a host without TPU chips JAX is told to use the CPU, so that an installed libtpu (the `tpu`
  extra, for lm-compile) does not print an error-looking trace; where a GPU plugin is installed (the
  `gpu` extra, or an image's own CUDA build) JAX's own order stands (its GPUs, else the CPU); a
  JAX_PLATFORMS the user set stays.
- The CPU backend's device count: a --config's `cpu_devices`, set before anything starts JAX.
- TensorStore's tracebacks of operations a failed orbax save or restore abandoned are not shown
  (`_ignore_late_completions`): the command reports that failure in its own line.
- A missing or failing --config file, a misspelt --config.* field or a mistyped value is one line.
"""

import importlib.metadata
import logging as pylogging
import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable

import jax
from absl import app, flags, logging
from jax._src import hardware_utils  # the PCI scan JAX itself uses to decide whether TPUs are present

from data_pipelines import storage


def gpu_plugin_installed() -> bool:
  """Whether a CUDA or ROCm build of jaxlib's plugin is installed (jax-cuda12-plugin, ...)."""
  return any((d.metadata["Name"] or "").lower().replace("_", "-").startswith(("jax-cuda", "jax-rocm"))
             for d in importlib.metadata.distributions())


def choose_platform() -> None:
  """CPU on a host without TPU chips or a GPU plugin, unless JAX_PLATFORMS (jax_platforms) says
  otherwise."""
  if jax.config.jax_platforms or hardware_utils.num_available_tpu_chips_and_device_id()[0]:
    return
  if not gpu_plugin_installed():
    jax.config.update("jax_platforms", "cpu")


def use_cpu_devices(count: int) -> None:
  """config.cpu_devices: JAX's CPU backend as `count` devices (0: its default). A count forced in
  XLA_FLAGS wins, as the user's explicit choice; so does a JAX whose backends have started (a test, a
  notebook), which keeps the devices it has and says so."""
  if count <= 0 or "xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", ""):
    return
  try:
    jax.config.update("jax_num_cpu_devices", count)
  except RuntimeError:
    logging.warning("cpu_devices=%d not applied: JAX has started already with %d device(s)", count,
                    jax.device_count())


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's own parsing, and the --config file loaded now: a missing file, one that fails to run, a
  misspelt --config.* field or a value of the wrong type stops the command with one line that
  names it, not a traceback."""
  command = os.path.basename(argv[0])
  try:
    args = flags.FLAGS(argv)
    if "config" in flags.FLAGS and flags.FLAGS["config"].present:
      flags.FLAGS.config.keys()  # a file that failed to load raises here, on first use
  except Exception as e:  # pylint: disable=broad-except
    _refuse(command, e)
  for name in _DIRECTORIES:  # `--workdir=` would be the current directory: every file written there
    if name in flags.FLAGS and flags.FLAGS[name].present and not flags.FLAGS[name].value:
      raise SystemExit(f"{command}: --{name} is empty; give a directory")
  return args


# Flags that name the directory a command writes into.
_DIRECTORIES = ("workdir", "root", "output")


def _refuse(command: str, e: Exception) -> None:
  """Stops the command with one line for a flag or config mistake; re-raises anything else."""
  if raised := _raised_by_config_file(e):
    raise SystemExit(f"{command}: --config: {raised}; correct the config file") from None
  if isinstance(e, flags.Error):
    raise SystemExit(f"{command}: {_wrong_value(str(e))}") from None
  if isinstance(e, (AttributeError, KeyError)):  # a misspelt field: ml_collections says which it meant
    field, _, hint = _message(e).partition("; ")
    raise SystemExit(f"{command}: no config field {field} (from a --config.* override)" +
                     (f"; {hint}" if hint else "")) from None
  if isinstance(e, OSError):  # the config file: config_flags lists every path it tried, the cause last
    raise SystemExit(f"{command}: cannot load --config: {str(e).strip().splitlines()[-1].strip()}") from None
  raise e


def _raised_by_config_file(e: Exception) -> str | None:
  """'FILE, line N: Error: message' when the config file's code failed: its syntax, its import, or
  get_config (or a module it imports) raising. config_flags passes these on as they are, except TypeError and
  ValueError, whose traceback it puts into the text of absl's error."""
  if isinstance(e, SyntaxError):
    return f"{e.filename}, line {e.lineno}: SyntaxError: {e.msg}"
  if isinstance(e, flags.Error) and "Error whilst parsing config file" in str(e):
    frames = re.findall(r'File "([^"]+)", line (\d+)', str(e))
    return f"{frames[-1][0]}, line {frames[-1][1]}: {str(e).strip().splitlines()[-1].strip()}"
  frames = traceback.extract_tb(e.__traceback__)
  loader = [i for i, f in enumerate(frames) if f.filename.endswith("config_flags.py")]
  # The config's own line that failed (at import or in get_config): the last frame below the loader
  # that is neither a library's (site-packages) nor the import machinery's.
  ours = [
      f for f in frames[loader[-1] + 1:] if not ("site-packages" in f.filename or "<frozen" in f.filename)
  ] if loader else []
  if not ours:
    return None
  return f"{ours[-1].filename}, line {ours[-1].lineno}: {type(e).__name__}: {_message(e)}"


def _message(e: BaseException) -> str:
  """e's message in one line; ml_collections' AttributeError wraps a KeyError, whose str() quotes."""
  while e.args and isinstance(e.args[0], BaseException):
    e = e.args[0]
  text = str(e.args[0] if len(e.args) == 1 else e)
  return "; ".join(line.strip() for line in text.splitlines())


def _wrong_value(message: str) -> str:
  """absl's message for a flag value it refused, in one line naming what the field takes."""
  line = message.strip().splitlines()[0].removeprefix("flag ")
  for words, kind in (("for int()", "an integer"), ("to float", "a number"), ("Non-boolean",
                                                                              "true or false")):
    if words in line:
      return f"{line.split(': ')[0]}: give {kind}"
  return line


# The flags defined here belong to the command that asks for them (absl attributes them to the caller).
flags.disclaim_key_flags()


def define_distributed_flags() -> None:
  """The flags that join a job of several processes (lm-train, lm-harness), listed by `--help` as the
  calling command's own (this module disclaims the flags it defines); `join_distributed` reads them."""
  flags.DEFINE_bool(
      "jax_distributed", False, "Call jax.distributed.initialize() with no arguments "
      "(TPU VM slices, where the environment describes the job).")
  flags.DEFINE_string("coordinator_address", None, "host:port of process 0.")
  flags.DEFINE_integer("num_processes", None, "Processes in the job.")
  flags.DEFINE_integer("process_id", None, "This process's index.")


def join_distributed() -> None:
  """jax.distributed.initialize as the flags of `define_distributed_flags` say (nothing without them)."""
  f = flags.FLAGS
  if f.jax_distributed:
    jax.distributed.initialize()
  elif f.coordinator_address:
    jax.distributed.initialize(f.coordinator_address, f.num_processes, f.process_id)


def run(main: Callable[[list[str]], None], module: str, *, config_storage: bool = True) -> None:
  """app.run(main) with `module`'s flags shown by --help, quiet libraries and the host's platform.
  config_storage=False: the command touches none of the paths its --config names (lm-compile), so
  their storage is not probed."""
  for flag in flags.FLAGS.get_key_flags_for_module(module):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  choose_platform()

  def configured_main(argv: list[str]) -> None:
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    if "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
      use_cpu_devices(flags.FLAGS.config.get("cpu_devices", 0))
    _check_remote_paths(argv, config_storage)
    main(argv)

  sys.unraisablehook = _ignore_late_completions
  pylogging.getLogger("asyncio").addFilter(_AbandonedOrbaxTasks())
  # A save that failed on one item (GCS refusing a write) leaves the other items' coroutines never
  # run; Python warns of each at exit, below the line that reports the failure.
  warnings.filterwarnings("ignore", r"coroutine '\w+\.async_save' was never awaited", RuntimeWarning)
  app.run(configured_main, flags_parser=_parse_flags)


def _check_remote_paths(argv: list[str], config_storage: bool = True) -> None:
  """Stops the command with one line if storage that a gs:// flag, argument or config field names
  cannot be reached: before anything is written, and in seconds rather than after the clients'
  retries."""
  values = [flags.FLAGS[name].value for name in flags.FLAGS] + argv[1:]
  if config_storage and "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
    values += _leaves(flags.FLAGS.config.to_dict())
  remote = [v for v in values if isinstance(v, str) and v.startswith("gs://")]
  remote += [
      p for v in values if isinstance(v, list) for p in v if isinstance(p, str) and p.startswith("gs://")
  ]
  try:
    for path in dict.fromkeys(remote):
      storage.check_reachable(path)
  except storage.UnreachableError as e:
    raise SystemExit(f"{command_name()}: {e}") from None


def _leaves(tree: dict) -> list:
  return [x for v in tree.values() for x in (_leaves(v) if isinstance(v, dict) else [v])]


def command_name() -> str:
  """The console script running (lm-train for `python -m lm.train` too)."""
  module = sys.modules["__main__"].__spec__.name if getattr(sys.modules["__main__"], "__spec__",
                                                            None) else None
  for entry in importlib.metadata.entry_points(group="console_scripts"):
    if module and entry.value == f"{module}:run":
      return entry.name
  return os.path.basename(sys.argv[0])


def _ignore_late_completions(unraisable) -> None:
  """sys.unraisablehook: drops what operations abandoned by a failed orbax save or restore (a full
  disk, a damaged checkpoint) print when they end.

  orbax runs its coroutines in an event loop of their own and closes it as soon as one operation
  fails, while the others are still in flight; each of those, when it ends, hands its result to the
  closed loop (`call_soon_threadsafe` from TensorStore's thread), which raises "Event loop is
  closed", and TensorStore prints that as an unraisable traceback: dozens of them on a loaded host,
  above the command's one line. orbax's own coroutines left suspended are closed when collected and
  raise their read's or write's error ("Exception ignored in: <coroutine ...>"). Nothing awaits
  those results; the failure they belong to is reported already. Everything else goes to Python's
  own hook."""
  frames = traceback.extract_tb(unraisable.exc_traceback)
  closed_loop = (unraisable.object is None and isinstance(unraisable.exc_value, RuntimeError) and
                 str(unraisable.exc_value) == "Event loop is closed" and
                 any(f.name == "call_soon_threadsafe" for f in frames))
  if not (closed_loop or _is_orbax_coroutine(unraisable.object)):
    sys.__unraisablehook__(unraisable)


def _is_orbax_coroutine(obj) -> bool:
  code = getattr(obj, "cr_code", None)
  return code is not None and _ORBAX in code.co_filename


_ORBAX = f"{os.sep}orbax{os.sep}checkpoint{os.sep}"


class _AbandonedOrbaxTasks(pylogging.Filter):
  """asyncio's "Task exception was never retrieved" for a task of orbax's coroutines that failed
  after the operation it belonged to had failed and been reported: dropped, as above."""

  def filter(self, record: pylogging.LogRecord) -> bool:
    text = record.getMessage()
    return not ("exception was never retrieved" in text and _ORBAX in text)
