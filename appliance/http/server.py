"""Running the app under uvicorn: in the foreground with graceful SIGTERM, or in a thread.

SIGTERM / SIGINT: uvicorn stops accepting connections, lets open requests (streams
included) finish for up to `server.shutdown_grace_s`, cancels what is left (which aborts
those engine requests), then the engine loop is stopped and the process exits 0. uvicorn's
own signal capture is replaced because it re-raises the signal after a graceful shutdown,
which would make the exit status 143 instead of 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import threading
from collections.abc import Callable, Generator

import uvicorn
from starlette.applications import Starlette

from appliance.config import ServerConfig
from appliance.logs import log_event

logger = logging.getLogger("appliance.server")


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # signals are handled by `serve_forever` (or not at all in a thread)


def uvicorn_config(app: Starlette, server: ServerConfig, port: int | None = None) -> uvicorn.Config:
    return uvicorn.Config(
        app,
        host=server.host,
        port=server.http_port if port is None else port,
        log_config=None,  # our structured handler (appliance.logs) is already installed
        access_log=False,  # the app logs each request itself, without bodies
        lifespan="on",
        timeout_graceful_shutdown=server.shutdown_grace_s,
        timeout_keep_alive=5,
        server_header=False,
    )


def bound_port(server: uvicorn.Server) -> int:
    for s in server.servers:
        for sock in s.sockets:
            return sock.getsockname()[1]
    raise RuntimeError("server has no listening socket")


async def serve_forever(
    app: Starlette, server_cfg: ServerConfig, on_shutdown: Callable[[], None] | None = None
) -> None:
    """Serves until SIGTERM/SIGINT, then shuts down gracefully (see module docstring).

    `on_shutdown` runs once when the first signal arrives (e.g. to stop other frontends)."""
    server = _Server(uvicorn_config(app, server_cfg))
    loop = asyncio.get_running_loop()

    def on_signal(sig: signal.Signals) -> None:
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True  # a second Ctrl-C: stop waiting
        if not server.should_exit and on_shutdown is not None:
            on_shutdown()
        server.should_exit = True
        app.state.appliance.shutting_down = True
        log_event(
            logger, "shutdown requested", signal=sig.name, grace_s=server_cfg.shutdown_grace_s
        )

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    task = asyncio.create_task(server.serve())
    while not server.started and not task.done():
        await asyncio.sleep(0.05)
    if server.started:
        log_event(logger, "http listening", host=server_cfg.host, port=bound_port(server))
    await task
    if not server.started:
        raise RuntimeError(
            f"HTTP server failed to start on {server_cfg.host}:{server_cfg.http_port}"
        )


class BackgroundServer:
    """uvicorn on its own event loop in a daemon thread, for tests and benchmarks."""

    def __init__(self, app: Starlette, server_cfg: ServerConfig | None = None, port: int = 0):
        cfg = server_cfg or ServerConfig(host="127.0.0.1")
        self.server = _Server(uvicorn_config(app, cfg, port))
        self.thread = threading.Thread(target=self._run, name="http-server", daemon=True)
        self.host = cfg.host
        self.port = 0
        self._error: BaseException | None = None

    def _run(self) -> None:
        try:
            asyncio.run(self.server.serve())
        except BaseException as e:  # surfaced by start()
            self._error = e

    def start(self, timeout: float = 30.0) -> BackgroundServer:
        self.thread.start()
        self.thread.join(0)
        waited = 0.0
        while not self.server.started:
            if self._error or not self.thread.is_alive() or waited > timeout:
                raise RuntimeError(f"server did not start: {self._error!r}")
            threading.Event().wait(0.02)
            waited += 0.02
        self.port = bound_port(self.server)
        return self

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def stop(self, timeout: float = 30.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)

    def __enter__(self) -> BackgroundServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
