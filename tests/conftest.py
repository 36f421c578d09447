"""Shared fixtures: a small generated corpus in C4's record format with its own tokenizer; a GCS
API emulator and fresh gs:// directories on it."""

import os
import socket
import sys
import uuid

import numpy as np
import pytest
from gcs_emulator import Emulator
from small import FAST_CPU_COMPILE

from data_pipelines import records, tokenizer

# Read when JAX starts its backends, which no import above does; processes the tests start inherit it
# (tests/small.py).
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {FAST_CPU_COMPILE}".strip()

WORDS = ("the quick brown fox jumps over a lazy dog while seven wise kings sing of "
         "green hills and silver rivers under an old moon").split()


def make_documents(n: int, seed: int) -> list[dict]:
  rng = np.random.default_rng(seed)
  docs = []
  for i in range(n):
    lines = [" ".join(rng.choice(WORDS, size=rng.integers(3, 12))) for _ in range(rng.integers(1, 30))]
    docs.append({"text": "\n".join(lines), "url": f"test://{seed}/{i}", "timestamp": ""})
  return docs


@pytest.fixture(scope="session")
def small_corpus(tmp_path_factory):
  """A data dir with 3 train shards, 2 validation shards and a 320-piece tokenizer."""
  root = tmp_path_factory.mktemp("corpus")
  for split, n_docs, n_shards, seed in (("train", 120, 3, 0), ("validation", 30, 2, 1)):
    docs = make_documents(n_docs, seed)
    for i in range(n_shards):
      records.write_shard(root / records.shard_name(split, i, n_shards), docs[i::n_shards])
  tokenizer.train(records.shard_paths(root, "train"), tokenizer.model_path(root, 320), 320)
  return root


BUCKET = "test-bucket"


@pytest.fixture(scope="session")
def gcs(tmp_path_factory):
  """A GCS API emulator for the session with one bucket; gs:// paths of this process and of the
  processes it starts go to it."""
  if "gcsfs" in sys.modules:
    pytest.fail("gcsfs was imported before the GCS emulator fixture set its environment")
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
  emulator = Emulator(port, str(tmp_path_factory.mktemp("gcs") / "emulator.log"))
  with pytest.MonkeyPatch.context() as patch:
    for name, value in emulator.environment().items():
      patch.setenv(name, value)
    emulator.create_bucket(BUCKET)
    yield emulator
  emulator.stop()


@pytest.fixture
def gs_dir(gcs, request):
  """A fresh gs:// directory on the emulator, like tmp_path."""
  return f"gs://{BUCKET}/{request.node.originalname}-{uuid.uuid4().hex[:8]}"


@pytest.fixture
def v5e_2x2():
  """A 4-chip TPU v5e topology to compile for on this CPU host (libtpu's compile-only client)."""
  os.environ.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
  from jax.experimental import topologies
  try:
    return topologies.get_topology_desc("v5e:2x2", "tpu")
  except (RuntimeError, NotImplementedError) as e:
    pytest.skip(f"no libtpu to compile for TPU (pip install -e '.[tpu]'): {e}")
