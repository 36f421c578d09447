"""Entry of every console script (lm-train, lm-eval, ...).

absl's `--help` lists the flags of the module named by sys.argv[0]; for an installed console script
that is the generated wrapper, which defines none, so `--help` showed no flags at all. Registering the
defining module's flags under the wrapper's name makes `--help` list them.
"""

import sys
from typing import Callable

from absl import app, flags


def run(main: Callable[[list[str]], None], module: str) -> None:
  """app.run(main) with `module`'s flags shown by --help."""
  for flag in flags.FLAGS.get_key_flags_for_module(module):
    flags.FLAGS.register_key_flag_for_module(sys.argv[0], flag)
  app.run(main)
