"""The formatter and the linter configured in pyproject.toml pass on the whole source tree."""

import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SOURCES = ("lm", "eval", "launch", "data_pipelines", "configs", "tests", "benchmarks")


@pytest.mark.slow
def test_yapf_leaves_every_file_as_it_is():
  result = subprocess.run([sys.executable, "-m", "yapf", "--diff", "--recursive", "--parallel", *SOURCES],
                          cwd=ROOT, capture_output=True, text=True, timeout=600)
  assert result.returncode == 0 and not result.stdout, ("files not formatted; run `yapf -i -r -p " +
                                                        " ".join(SOURCES) + "`:\n" + result.stdout[-3000:] +
                                                        result.stderr[-1000:])


def test_ruff_finds_nothing():
  result = subprocess.run([sys.executable, "-m", "ruff", "check", "--no-cache", "."], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
  assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]
