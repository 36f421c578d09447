"""Entry of every console script (lm-train, lm-evaluate, ...): what all of them set up the same way.

A command defines its flags in its `run()`, never on import, so that any modules (and tests and
scripts with flags of their own) import side by side; `run()` then calls `cli.run(main, __name__)`,
which sets up the rest:
- `--help` lists the command's flags. absl lists the flags of the module named by sys.argv[0]; for an
  installed console script that is the generated wrapper, which defines none, so the defining
  module's flags are registered under the wrapper's name.
- Libraries (orbax, jax) log every save and compile at INFO; the progress lines say enough, so the
  default verbosity is WARNING (`--verbosity=0` brings INFO back).
- JAX's platform: libtpu is installed (the `tpu` extra) so that lm-compile can compile for TPU
  topologies, and JAX then tries it first on every host. On a host without TPU chips that attempt
  fails and libtpu prints an error-looking trace about worker hostnames, so there JAX is told to use
  the CPU; lm-compile loads libtpu's compiler itself (`jax.experimental.topologies`), which this does
  not touch. A JAX_PLATFORMS the user set is left as it is.
- The CPU backend's device count: a --config's `cpu_devices`, set before anything starts JAX.
- TensorStore's tracebacks of operations a failed orbax save or restore abandoned are not shown
  (`_ignore_late_completions`): the command reports that failure in its own line.
- A --config file that is missing or fails to run, a misspelt --config.* field or a value of the
  wrong type is one line, not a traceback.
"""

import os
import re
import sys
import traceback
import warnings
from collections.abc import Callable

import jax
from absl import app, flags, logging
from jax._src import hardware_utils  # the PCI scan JAX itself uses to decide whether TPUs are present


def choose_platform() -> None:
  """CPU on a host without TPU chips, unless JAX_PLATFORMS (jax_platforms) says otherwise."""
  if not jax.config.jax_platforms and not hardware_utils.num_available_tpu_chips_and_device_id()[0]:
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


def run(main: Callable[[list[str]], None], module: str) -> None:
  """app.run(main) with `module`'s flags shown by --help, quiet libraries and the host's platform."""
  for flag in flags.FLAGS.get_key_flags_for_module(module):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  choose_platform()

  def configured_main(argv: list[str]) -> None:
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    if "config" in flags.FLAGS and flags.FLAGS["config"].value is not None:
      use_cpu_devices(flags.FLAGS.config.get("cpu_devices", 0))
    main(argv)

  sys.unraisablehook = _ignore_late_completions
  # A save that failed on one item (GCS refusing a write) leaves the other items' coroutines never
  # run; Python warns of each at exit, below the line that reports the failure.
  warnings.filterwarnings("ignore", r"coroutine '\w+\.async_save' was never awaited", RuntimeWarning)
  app.run(configured_main, flags_parser=_parse_flags)


def _ignore_late_completions(unraisable) -> None:
  """sys.unraisablehook: drops what TensorStore operations abandoned by a failed orbax save or
  restore (a full disk, a damaged checkpoint) print when they end.

  orbax runs its coroutines in an event loop of their own and closes it as soon as one operation
  fails, while the others are still in flight; each of those, when it ends, hands its result to the
  closed loop (`call_soon_threadsafe` from TensorStore's thread), which raises "Event loop is
  closed", and TensorStore prints that as an unraisable traceback: dozens of them on a loaded host,
  above the command's one line. Nothing awaits those results; the failure they belong to is
  reported already. Everything else goes to Python's own hook."""
  frames = traceback.extract_tb(unraisable.exc_traceback)
  if not (unraisable.object is None and isinstance(unraisable.exc_value, RuntimeError) and
          str(unraisable.exc_value) == "Event loop is closed" and
          any(f.name == "call_soon_threadsafe" for f in frames)):
    sys.__unraisablehook__(unraisable)
