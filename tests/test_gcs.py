"""gs:// data and workdirs against the GCS API emulator (tests/gcs_emulator.py): lm-prepare reads
json.gz from a bucket and writes shards and a tokenizer to it; the grid runner (lm-sweep) trains on
them into the bucket and summarises there (lm-compare's curves); lm-evaluate evaluates the run there. SIGKILL and exact resume on gs:// are in
test_checkpoint.py, two jobs on one gs:// workdir in test_ownership.py."""

import gzip
import json
import os
import re
import subprocess
import sys

import pytest
from conftest import BUCKET
from etils import epath
from gcs_emulator import Refusals
from small import tensorboard_events

from data_pipelines import records
from lm.runtime import run_log

HERE = os.path.dirname(__file__)
GRID_CONFIG = """
from small import small_config

def get_config():
  c = small_config({data!r})
  c.data.tokenizer = {tokenizer!r}
  c.train.update(steps=8, log_every_steps=2)
  c.eval.every_steps = 4
  c.checkpoint.every_steps = 4
  return c
"""


@pytest.mark.slow
def test_prepare_from_a_bucket_then_train_evaluate_and_compare_there(gs_dir, tmp_path):
  from conftest import make_documents
  raw, data = epath.Path(gs_dir) / "raw", epath.Path(gs_dir) / "data"
  for name, seed, n in (("train-0", 0, 60), ("train-1", 1, 60), ("validation-0", 2, 30)):
    lines = "".join(json.dumps(d) + "\n" for d in make_documents(n, seed))
    (raw / f"{name}.json.gz").write_bytes(gzip.compress(lines.encode()))
  prepare = [
      sys.executable, "-m", "launch.prepare", f"--train={raw}/train-*.json.gz",
      f"--validation={raw}/validation-*.json.gz", f"--output={data}", "--train_tokenizer=320", "--workers=1"
  ]
  result = subprocess.run(prepare, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  assert [epath.Path(p).name for p in records.shard_paths(data, "train")
         ] == ["train.array_record-00000-of-00002", "train.array_record-00001-of-00002"]
  assert json.loads(records.stats_path(data /
                                       "train.array_record-00001-of-00002").read_text())["documents"] == 60
  tokenizer = data / "spm_bpe_320.model"
  assert tokenizer.exists()

  config = tmp_path / "grid_config.py"
  config.write_text(GRID_CONFIG.format(data=str(data), tokenizer=str(tokenizer)))
  root = epath.Path(gs_dir) / "grid"
  grid = [sys.executable, "-m", "eval.grid", f"--config={config}", "--presets=softmax", f"--root={root}"]
  result = subprocess.run(grid, capture_output=True, text=True, timeout=600, env={
      **os.environ, "PYTHONPATH": HERE
  })
  assert result.returncode == 0, result.stderr[-3000:]
  workdir = root / "softmax_seed0"
  evaluate = [sys.executable, "-m", "eval.evaluate", f"--workdir={workdir}", "--step=8"]
  result = subprocess.run(evaluate, capture_output=True, text=True, timeout=300)
  assert result.returncode == 0, result.stderr[-3000:]
  log = run_log.read(workdir)
  assert [r["step"] for r in log if r["kind"] == "train"] == [2, 4, 6, 8], "every record of the run"
  assert [r["step"] for r in log if r["kind"] == "eval/validation"] == [4, 8]
  assert [r["step"] for r in log if r["kind"] == "checkpoint"] == [4, 8]
  evaluated = json.loads((workdir / "eval" / "step_8.json").read_text())
  final = [r for r in log if r["kind"] == "eval/validation"][-1]
  assert evaluated["loss"] == pytest.approx(final["loss"], rel=1e-5)
  assert "softmax" in (root / "summary.md").read_text()
  assert (root / "curves.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
  losses = {
      e.step: v.simple_value
      for e in tensorboard_events(workdir) for v in e.summary.value if v.tag == "train/loss"
  }
  assert losses == {r["step"]: pytest.approx(r["loss"]) for r in log if r["kind"] == "train"}
  # Nothing written through a temporary name: object stores have no cheap rename.
  import gcsfs  # only now: gcsfs reads the emulator fixture's environment when imported
  leftovers = [p for p in gcsfs.GCSFileSystem().find(gs_dir) if ".tmp" in p]
  assert not leftovers, leftovers


TRAIN_CONFIG = """
from small import small_config

def get_config():
  c = small_config({corpus!r})
  c.train.update(steps=6, log_every_steps=1)
  c.checkpoint.every_steps = 5
  return c
"""


@pytest.mark.slow
@pytest.mark.parametrize("refused", ["owner.json", "config.json", "checkpoints"])
def test_a_bucket_that_refuses_writes_is_one_line(small_corpus, gcs, gs_dir, tmp_path, refused):
  """GCS refusing the job's writes (HTTP 403: its account may not write there) is one line naming
  the object and the fix, whichever client wrote: google-cloud-storage (the workdir's lease), gcsfs
  (config.json), TensorStore and gcsfs (a checkpoint)."""
  prefix = f"{gs_dir.removeprefix('gs://')}/{refused}"
  proxy = Refusals(gcs, prefix.split("/", 1)[1], 403)
  config = tmp_path / "run_config.py"
  config.write_text(TRAIN_CONFIG.format(corpus=str(small_corpus)))
  try:
    result = subprocess.run([sys.executable, "-m", "lm.train", f"--config={config}", f"--workdir={gs_dir}"],
                            capture_output=True, text=True, timeout=300, env={
                                **os.environ,
                                **proxy.environment(), "PYTHONPATH": HERE
                            })
  finally:
    proxy.close()
  # TensorStore notes once that the emulator's clients run without credentials; a user has them.
  lines = [line for line in result.stderr.splitlines() if "google_auth_provider" not in line]
  assert result.returncode == 1 and len(lines) == 1, result.stderr[-3000:]
  assert re.fullmatch(
      rf"lm-train: permission denied by GCS \(HTTP 403\): cannot write gs://{re.escape(prefix)}\S*; give "
      r"the account this job runs as write access to the bucket \(e\.g\. roles/storage\.objectUser, and on "
      r"a VM a read-write storage scope\), or use a bucket it can write; (?:.*; )?no checkpoint was saved",
      lines[0]), result.stderr[-3000:]
  assert lines[0].count("HTTP 403") == 1, "the cause and its fix are said once"


def test_rate_and_quota_refusals_name_the_object_and_the_fix(gcs, gs_dir):
  """HTTP 429 (a rate limit or a quota exceeded) as each client reports it once its retries are
  spent: google-cloud-storage and gcsfs without the object (storage.naming adds it), TensorStore in
  its own words. Real answers through the refusing proxy; gcsfs's (six retries, half a minute) is
  its exception as raised."""
  import gcsfs.retry  # only now: gcsfs reads the emulator fixture's environment when imported
  import tensorstore as ts
  from google.cloud import storage as gcs_client

  from data_pipelines import storage
  key = gs_dir.removeprefix(f"gs://{BUCKET}/")
  proxy = Refusals(gcs, key, 429)
  refusals = {}
  try:
    with pytest.MonkeyPatch.context() as patch:
      for name, value in proxy.environment().items():
        patch.setenv(name, value)
      blob = gcs_client.Client().bucket(BUCKET).blob(f"{key}/owner.json")
      with pytest.raises(Exception) as e, storage.naming(f"{gs_dir}/owner.json"):
        blob.upload_from_string("{}", retry=None)
      refusals["owner.json"] = e.value
      with pytest.raises(Exception) as e, storage.naming(f"{gs_dir}/config.json"):
        raise gcsfs.retry.HttpError({"code": 429, "message": Refusals.MESSAGES[429]})
      refusals["config.json"] = e.value
      retries = {"gcs_request_retries": {"max_retries": 1, "initial_delay": "0.1s", "max_delay": "0.1s"}}
      with pytest.raises(ValueError) as e:
        ts.open({
            "driver": "zarr",
            "kvstore": f"{gs_dir}/state/",
            "context": retries
        }, create=True, dtype=ts.float32, shape=[4]).result()
      refusals["state/.zarray"] = e.value
  finally:
    proxy.close()
  for name, error in refusals.items():
    assert storage.write_refused(error) == (
        f"too many requests to GCS (HTTP 429: a rate limit or quota was exceeded): cannot write "
        f"{gs_dir}/{name}; wait a few minutes and run the command again, or raise the project's quota; "
        f"GCS takes about one write per second to one object"), error


def _closed_port() -> int:
  import socket
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


UNREACHABLE = {
    "lm-train": ["lm.train", "--config=configs/tiny.py", "--workdir={gs}/run"],
    "lm-evaluate": ["eval.evaluate", "--workdir={gs}/run"],
    "lm-prepare": [
        "launch.prepare", "--train={gs}/raw/train-*.json.gz", "--validation={gs}/raw/v-*.json.gz",
        "--output={tmp}/data", "--workers=1"
    ],
    "lm-grid": ["eval.grid", "--config=configs/tiny.py", "--presets=softmax", "--root={gs}/grid"],
    "lm-train --config.data.dir": [
        "lm.train", "--config=configs/tiny.py", "--config.data.source=array_record",
        "--config.data.dir={gs}/data", "--workdir={tmp}/run"
    ],
}


@pytest.mark.parametrize("command,endpoint",
                         [(c, "closed port") for c in UNREACHABLE] + [("lm-train", "unknown host")])
def test_storage_that_cannot_be_reached_is_one_line_within_seconds(tmp_path, command, endpoint):
  """A gs:// path whose endpoint refuses connections or does not resolve stops the command at once
  (it retried for 38-101 s, then printed 51-199 lines of tracebacks), naming the path, the endpoint
  and what to check."""
  import time
  url = f"http://127.0.0.1:{_closed_port()}" if endpoint == "closed port" else "http://gcs.invalid:4443"
  env = {
      **os.environ, "STORAGE_EMULATOR_HOST": url,
      "TENSORSTORE_GCS_HTTP_URL": url,
      "CLOUD_STORAGE_EMULATOR_ENDPOINT": url,
      "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"
  }
  gs = f"gs://{BUCKET}/unreachable"
  argv = [a.format(gs=gs, tmp=tmp_path) for a in UNREACHABLE[command]]
  start = time.monotonic()
  result = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, timeout=60, env=env,
                          cwd=os.path.dirname(HERE))
  took = time.monotonic() - start
  name = command.split()[0]
  assert result.returncode == 1 and len(result.stderr.splitlines()) == 1, result.stderr[-3000:]
  assert re.fullmatch(
      rf"{name}: cannot reach GCS at {re.escape(url)} for {re.escape(gs)}/\S+ \(.+\); check that "
      rf"STORAGE_EMULATOR_HOST={re.escape(url)} names a running emulator \(or unset it to use GCS\)",
      result.stderr.strip()), result.stderr
  # Most of it is starting Python and JAX (on a loaded test host); the clients retried for 38-101 s.
  assert took < 30, f"{took:.0f} s: a refused connection or an unknown host is not worth retrying"
