"""A server process on a free port over a corpus folder, for the serve tests and
benchmarks/serve_bench.py (a helper module: the suite has one conftest, tests/conftest.py)."""

import os
import signal
import socket
import subprocess
import sys
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """``python -m maxsim serve folder`` in a child process; ``url``, ``kill()`` (SIGKILL), ``stop()``."""

    def __init__(self, folder, *extra, api_key=None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        env.pop("MAXSIM_API_KEY", None)
        argv = [sys.executable, "-m", "maxsim", "serve", str(folder), "--port", str(self.port), "--device", "cpu",
                *extra]
        if api_key:
            argv += ["--api-key", api_key]
        self.proc = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        from maxsim.client import Client

        deadline = time.time() + 90
        while True:
            try:
                Client(self.url, timeout=2).health()
                return
            except OSError:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"the server exited: {self.proc.stderr.read().decode()}")
                if time.time() > deadline:
                    self.kill()
                    raise RuntimeError("the server did not start within 90 s")
                time.sleep(0.1)

    def kill(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()



def serving():
    """The body of the tests' ``serve`` fixture (``pytest.fixture(serving, name="serve")`` in each
    test file: a conftest.py here would shadow the suite's own): yields start(folder, *options,
    api_key=None) -> a running Server, and stops every one afterwards."""
    started = []

    def start(folder, *extra, api_key=None):
        server = Server(folder, *extra, api_key=api_key)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
