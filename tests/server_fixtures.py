"""Shared by the serving tests: the demo checkpoint, `python -m qwen3_model serve` as a subprocess
on a free local port, raw HTTP / SSE helpers (stdlib), and a Prometheus text parser.

Also a pytest plugin (``pytest_plugins = ["tests.server_fixtures"]`` in a test module): a failing
test's report gets the log tail of every server subprocess alive at that moment.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BS = 16  # KV block size of every test engine


def write_demo_checkpoint(path) -> str:
    """The demo checkpoint (4 layers, hidden 128, vocab 512, char tokenizer, chat template)."""
    from qwen3_model.random_checkpoint import write_random_checkpoint

    write_random_checkpoint(path, "demo")
    return str(path)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """One `serve` subprocess; stdout + stderr go to a log file (no pipe to fill up)."""

    live: list["ServerProcess"] = []  # started and not yet stopped: their logs go to failures

    def __init__(self, model: str, *flags: str, log_dir: Path, name: str = "server"):
        self.name = name
        self.port = free_port()
        self.host = "127.0.0.1"
        self.url = f"http://{self.host}:{self.port}"
        self.log_path = Path(log_dir) / f"{name}.log"
        cmd = [sys.executable, "-m", "qwen3_model", "serve", "--model", model, "--host", self.host,
               "--port", str(self.port), "--device", "cpu", *flags]
        # one intra-op thread: tiny matrices gain nothing from more, and OpenMP's spin-waits
        # make a busy 2-core runner far slower
        env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="",
                   OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        ServerProcess.live.append(self)

    def tail(self, n: int = 6000) -> str:
        try:
            return self.log_path.read_bytes()[-n:].decode(errors="replace")
        except OSError as e:
            return f"(no log: {e})"

    def wait_ready(self, timeout: float = 90.0) -> None:
        """Until GET /health answers 200; raises with the log if the process exits or the
        deadline passes."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode} before it was "
                                   f"ready; its log:\n{self.tail()}")
            try:
                status, _, _ = request(self, "GET", "/health", timeout=2)
                if status == 200:
                    return
            except OSError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"{self.name} not ready after {timeout} s; its log:\n{self.tail()}")

    def signal(self, sig=signal.SIGTERM) -> None:
        self.proc.send_signal(sig)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._log.close()
        if self in ServerProcess.live:
            ServerProcess.live.remove(self)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.failed:
        for srv in ServerProcess.live:
            report.sections.append((f"{srv.name} log (tail)", srv.tail()))
    return report


# ---- raw HTTP ---------------------------------------------------------------------------------

def request(srv, method: str, path: str, body=None, timeout: float = 30.0):
    """-> (status, headers dict (lower-case names), body bytes). ``body``: bytes (sent as is) or
    a JSON-able object."""
    conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
    try:
        headers = {}
        if body is not None:
            if not isinstance(body, (bytes, bytearray)):
                body = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        conn.request(method, path, body=body, headers=headers)
        resp = conn.getresponse()
        data = resp.read()
        return resp.status, {k.lower(): v for k, v in resp.getheaders()}, data
    finally:
        conn.close()


def post_json(srv, path: str, body, timeout: float = 30.0):
    """-> (status, parsed JSON body)."""
    status, _, data = request(srv, "POST", path, body, timeout=timeout)
    try:
        return status, json.loads(data)
    except ValueError:
        raise AssertionError(f"{path} answered {status} with a body that is not JSON: "
                             f"{data[:500]!r}") from None


class SSEStream:
    """A streaming POST read event by event. The request is sent at once; ``status`` /
    ``events()`` wait for the response (a queued request may get it late); ``close()`` drops the
    connection (the client going away)."""

    def __init__(self, srv, path: str, body: dict, timeout: float = 30.0):
        self.conn = http.client.HTTPConnection(srv.host, srv.port, timeout=timeout)
        self.conn.request("POST", path, body=json.dumps(body).encode(),
                          headers={"Content-Type": "application/json"})
        self._resp = None
        self.truncated = False

    @property
    def resp(self) -> http.client.HTTPResponse:
        if self._resp is None:
            self._resp = self.conn.getresponse()
        return self._resp

    @property
    def status(self) -> int:
        return self.resp.status

    def events(self):
        """Each ``data:`` payload (str), until the connection closes."""
        while True:
            try:
                line = self.resp.readline()
            except (http.client.IncompleteRead, ConnectionError):
                self.truncated = True  # the server dropped the connection mid-chunk
                return
            if not line:
                return
            line = line.decode().rstrip("\r\n")
            if line.startswith("data:"):
                yield line[len("data:"):].strip()

    def close(self) -> None:
        sock = self.conn.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        if self._resp is not None:
            self._resp.close()
        self.conn.close()


def read_sse(srv, path: str, body: dict, timeout: float = 30.0) -> list[str]:
    """The whole stream's ``data:`` payloads, in order ("[DONE]" included)."""
    s = SSEStream(srv, path, body, timeout)
    try:
        assert s.status == 200, f"{path} stream answered {s.status}: {s.resp.read()[:500]!r}"
        assert s.resp.getheader("content-type", "").startswith("text/event-stream")
        return list(s.events())
    finally:
        s.close()


# ---- /metrics ---------------------------------------------------------------------------------

_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)(\s+\d+)?$')
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> dict:
    """Prometheus text format -> {(name, frozenset(labels.items())): value}; raises on a line
    that is neither a comment nor a sample."""
    out = {}
    for line in text.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        m = _SAMPLE.match(line.strip())
        if m is None:
            raise AssertionError(f"not a Prometheus sample line: {line!r}")
        name, _, labels, value = m.group(1), m.group(2), m.group(3), m.group(4)
        lab = frozenset(_LABEL.findall(labels or ""))
        out[(name, lab)] = float(value)
    return out


def metrics(srv) -> dict:
    status, headers, data = request(srv, "GET", "/metrics", timeout=10)
    assert status == 200, data[:500]
    return parse_prometheus(data.decode())


def metric(samples: dict, name: str, **labels) -> float:
    key = (name, frozenset(labels.items()))
    if key not in samples:
        names = sorted({n for n, _ in samples})
        raise AssertionError(f"metric {name}{labels or ''} missing; the metrics are {names}")
    return samples[key]


def wait_for(predicate, timeout: float, what: str, interval: float = 0.05):
    """Poll ``predicate()`` until it returns a truthy value (returned); AssertionError naming
    ``what`` (and the last value) after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        last = predicate()
        if last:
            return last
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s (last: {last!r})")
        time.sleep(interval)
