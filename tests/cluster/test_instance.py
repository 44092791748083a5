"""mmreuse.cluster.instance.wait_http: the one "start a process, poll its URL until it
answers" loop of the harness (the proxy, HAProxy, vLLM's reference proxy): it returns once
the URL answers, and names the process and its log when the process exits or the deadline
passes first."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from mmreuse.cluster.instance import StartupError, free_ports, wait_http

# an HTTP server answering 200 at /health and 404 elsewhere, on the port given
SERVER = """
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer
class H(BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404)
        self.end_headers()
    def log_message(self, *args):
        pass
HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def server():
    (port,) = free_ports(1)
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(port)])
    yield proc, f"http://127.0.0.1:{port}"
    proc.kill()
    proc.wait(10)


def test_it_returns_once_the_url_answers_200(server):
    proc, url = server
    wait_http(url + "/health", proc, time.monotonic() + 60, name="server")
    assert proc.poll() is None


def test_any_answer_will_do_where_asked(server):
    proc, url = server
    wait_http(url + "/health", proc, time.monotonic() + 60, name="server")  # up
    wait_http(url + "/nothing", proc, time.monotonic() + 60, name="server", any_status=True)
    with pytest.raises(StartupError, match=r"^server did not answer .*/nothing in time$"):
        wait_http(url + "/nothing", proc, time.monotonic(), name="server")  # a 404


def test_a_process_that_exits_first_is_named_with_its_log(tmp_path):
    log = tmp_path / "p.log"
    log.write_text("boom: no such flag\n")
    proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    proc.wait(30)
    with pytest.raises(StartupError) as exc:
        wait_http("http://127.0.0.1:1/health", proc, time.monotonic() + 60, name="the X", log=log)
    message = str(exc.value)
    assert message.startswith("the X exited (code 3) before http://127.0.0.1:1/health answered")
    assert f"log {log}:\nboom: no such flag" in message


def test_a_url_that_never_answers_is_a_startup_error_at_the_deadline():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        with pytest.raises(StartupError, match=r"^the X did not answer http://127\.0\.0\.1:1/h"):
            wait_http("http://127.0.0.1:1/h", proc, time.monotonic(), name="the X")
        assert proc.poll() is None  # left running: the caller stops it
    finally:
        proc.kill()
        proc.wait(10)
