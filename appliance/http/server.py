"""Running the app under uvicorn: in the foreground with graceful SIGTERM, or in a thread.

SIGTERM / SIGINT: uvicorn stops accepting connections, lets open requests (streams
included) finish for up to `server.shutdown_grace_s`, cancels what is left (which aborts
those engine requests), then the engine loop is stopped and the process exits 0. uvicorn's
own signal capture is replaced because it re-raises the signal after a graceful shutdown,
which would make the exit status 143 instead of 0.

An engine that dies (or hangs past `server.step_timeout_s`) while serving can never answer
again, so `serve_forever` notices it, stops at once and raises `EngineDiedError`; the CLI
exits non-zero and the orchestrator restarts the container instead of routing traffic to
a process whose /health says 503 forever.

The HTTP protocol is pinned to h11 (never httptools, even when installed) because h11 is
what enforces `server.max_header_bytes`: a client cannot make the server buffer an
unbounded request line and headers. Its protocol errors are answered in OpenAI format.
uvicorn closes idle kept-alive connections but never one that has not yet sent a whole
request line and headers, so `_H11Protocol` closes those after `server.header_timeout_s`
(the body's deadline, `server.body_timeout_s`, is kept where the body is read).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import threading
from collections.abc import Callable, Generator

import h11
import uvicorn
from starlette.applications import Starlette
from uvicorn.protocols.http.h11_impl import H11Protocol

from appliance.config import ServerConfig
from appliance.logs import log_event

logger = logging.getLogger("appliance.server")

# How often `serve_forever` checks that the engine is still alive.
ENGINE_POLL_S = 0.25


class EngineDiedError(RuntimeError):
    """The engine died (or hung) while serving; the process should exit non-zero."""


class _H11Protocol(H11Protocol):
    """uvicorn's h11 protocol, answering malformed or oversized requests in OpenAI format.

    uvicorn answers every h11 protocol error with a plain-text 400; h11 knows better (431
    when the request line and headers exceed `max_header_bytes`), and OpenAI clients parse
    `{"error": {...}}` bodies. The status h11 suggests is caught where the error is raised.
    """

    # Seconds to receive a request line and headers; set per server by `uvicorn_config`.
    header_timeout_s: float = 20.0

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._error_status = 400
        self._header_timer: asyncio.TimerHandle | None = None
        next_event = self.conn.next_event

        def next_event_noting_status() -> object:
            try:
                return next_event()
            except h11.RemoteProtocolError as e:
                self._error_status = e.error_status_hint
                raise

        self.conn.next_event = next_event_noting_status  # type: ignore[method-assign]

    # ---- header timeout: armed while the client owes a request line and headers ------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._watch_headers()

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_headers()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        super().connection_lost(exc)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.timeout_keep_alive_task is not None:
            self._stop_header_timer()  # idle again: uvicorn's keep-alive timeout governs

    def _watch_headers(self) -> None:
        """Arms the timer when a request has begun arriving (or the connection just opened)
        without its headers complete; stops it once they are."""
        waiting = self.conn.their_state is h11.IDLE and self.timeout_keep_alive_task is None
        if not waiting:
            self._stop_header_timer()
        elif self._header_timer is None and not self.transport.is_closing():
            self._header_timer = self.loop.call_later(
                self.header_timeout_s, self._headers_timed_out
            )

    def _stop_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _headers_timed_out(self) -> None:
        self._header_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            self.transport.close()

    def send_400_response(self, msg: str) -> None:
        status = self._error_status
        if status == 431:
            message, code = "Request line and headers are too large", "headers_too_large"
        else:
            message, code = "Malformed HTTP request", "invalid_http"
        body = json.dumps(
            {"error": {"message": message, "type": "invalid_request_error", "param": None,
                       "code": code}}
        ).encode()  # fmt: skip
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            (b"connection", b"close"),
        ]
        try:
            for event in (
                h11.Response(status_code=status, headers=headers),
                h11.Data(data=body),
                h11.EndOfMessage(),
            ):
                self.transport.write(self.conn.send(event))
        except h11.LocalProtocolError:  # too broken to answer (e.g. a response already began)
            pass
        self.transport.close()


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        yield  # signals are handled by `serve_forever` (or not at all in a thread)


def uvicorn_config(app: Starlette, server: ServerConfig, port: int | None = None) -> uvicorn.Config:
    # uvicorn builds the protocol itself: the header timeout travels on a subclass.
    protocol = type("H11Protocol", (_H11Protocol,), {"header_timeout_s": server.header_timeout_s})
    return uvicorn.Config(
        app,
        host=server.host,
        port=server.http_port if port is None else port,
        log_config=None,  # our structured handler (appliance.logs) is already installed
        http=protocol,
        h11_max_incomplete_event_size=server.max_header_bytes,
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

    `on_shutdown` runs once when shutdown begins (e.g. to stop other frontends). Raises
    `EngineDiedError` after a prompt shutdown when the engine dies while serving."""
    server = _Server(uvicorn_config(app, server_cfg))
    loop = asyncio.get_running_loop()
    aeng = app.state.appliance.aeng
    died: list[str] = []

    def begin_shutdown() -> None:
        if not server.should_exit and on_shutdown is not None:
            on_shutdown()
        server.should_exit = True
        app.state.appliance.shutting_down = True

    def on_signal(sig: signal.Signals) -> None:
        if server.should_exit and sig == signal.SIGINT:
            server.force_exit = True  # a second Ctrl-C: stop waiting
        begin_shutdown()
        log_event(
            logger, "shutdown requested", signal=sig.name, grace_s=server_cfg.shutdown_grace_s
        )

    async def watch_engine() -> None:
        while aeng.is_healthy:
            await asyncio.sleep(ENGINE_POLL_S)
        died.append(aeng.dead_reason or "engine loop exited")
        logger.critical("engine died; shutting down", extra={"fields": {"reason": died[0]}})
        begin_shutdown()
        server.force_exit = True  # nothing in flight can finish: do not wait for it

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)
    task = asyncio.create_task(server.serve())
    watcher = asyncio.create_task(watch_engine(), name="engine-watch")
    try:
        while not server.started and not task.done():
            await asyncio.sleep(0.05)
        if server.started:
            log_event(logger, "http listening", host=server_cfg.host, port=bound_port(server))
        await task
    finally:
        watcher.cancel()
    if died:
        raise EngineDiedError(died[0])
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
