"""The ``serve`` fixture of the server tests: real server processes, each stopped afterwards."""

import pytest


@pytest.fixture
def serve():
    """start(folder, *options, api_key=None) -> a running Server; every one is stopped afterwards."""
    from served import Server  # (imported here: it starts servers that need fastapi and uvicorn)

    started = []

    def start(folder, *extra, api_key=None):
        server = Server(folder, *extra, api_key=api_key)
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()
