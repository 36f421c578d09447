"""Entry of every console script (lm-train, lm-eval, ...): what all of them set up the same way.

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
- A --config file that is missing, or a misspelt --config.* field, is one line, not a traceback.
"""

import os
import sys
from collections.abc import Callable

import jax
from absl import app, flags, logging
from jax._src import hardware_utils  # the PCI scan JAX itself uses to decide whether TPUs are present


def choose_platform() -> None:
  """CPU on a host without TPU chips, unless JAX_PLATFORMS (jax_platforms) says otherwise."""
  if not jax.config.jax_platforms and not hardware_utils.num_available_tpu_chips_and_device_id()[0]:
    jax.config.update("jax_platforms", "cpu")


def _parse_flags(argv: list[str]) -> list[str]:
  """absl's own parsing, and the --config file loaded now: a missing file or a misspelt
  --config.* field stops the command with one line that names it, not a traceback."""
  command = os.path.basename(argv[0])
  try:
    args = app.parse_flags_with_usage(argv)
    if "config" in flags.FLAGS and flags.FLAGS["config"].present:
      flags.FLAGS.config.keys()  # a file that failed to load raises here, on first use
    return args
  except (AttributeError, KeyError) as e:  # a misspelt field: ml_collections says which it meant
    while e.args and isinstance(e.args[0], BaseException):  # ml_collections wraps its KeyError
      e = e.args[0]
    lines = str(e.args[0] if e.args else e).splitlines()
    raise SystemExit(f"{command}: no config field {lines[0]} (from a --config.* override)" +
                     "".join(f"; {line.strip()}" for line in lines[1:])) from None
  except OSError as e:  # the config file: config_flags lists every path it tried, the cause last
    raise SystemExit(f"{command}: cannot load --config: {str(e).strip().splitlines()[-1].strip()}") from None


def run(main: Callable[[list[str]], None], module: str) -> None:
  """app.run(main) with `module`'s flags shown by --help, quiet libraries and the host's platform."""
  for flag in flags.FLAGS.get_key_flags_for_module(module):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  choose_platform()

  def configured_main(argv: list[str]) -> None:
    if not flags.FLAGS["verbosity"].present:
      logging.set_verbosity(logging.WARNING)
    main(argv)

  app.run(configured_main, flags_parser=_parse_flags)
