"""A stand-in for the Kubernetes API's pod endpoints, for the router's service discovery.

The router (vllm-router) finds replicas by listing and watching the pods of one namespace
through the Kubernetes API (kube-rs: a kubeconfig first, in-cluster settings otherwise),
then keeps the Running and Ready pods whose labels match its --selector. This server
answers exactly that: `GET /api/v1/namespaces/<ns>/pods` (a PodList) and the same path
with `watch=true` (a chunked stream of watch events the test pushes with `modify`). Every
request is recorded, so a test can see what the router asked for and with whose token.
No tests here.
"""

from __future__ import annotations

import copy
import json
import queue
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import yaml

TOKEN = "fake-service-account-token"


def pod(name: str, namespace: str, ip: str, labels: dict[str, str], ready: bool = True) -> dict:
    """A Running pod with `ip` and a Ready condition."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": f"uid-{name}",
            "resourceVersion": "1",
            "labels": dict(labels),
        },
        "spec": {"containers": [{"name": "main", "image": "stand-in"}]},
        "status": {
            "phase": "Running",
            "podIP": ip,
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class FakeKubeAPI:
    """Pods of one namespace behind a list and a watch endpoint on 127.0.0.1."""

    def __init__(self, namespace: str, pods: list[dict[str, Any]]):
        self.namespace = namespace
        self.pods = {p["metadata"]["name"]: p for p in pods}
        self.requests: list[tuple[str, dict[str, list[str]], str | None]] = []
        self._watchers: list[queue.Queue[dict[str, Any] | None]] = []
        self._version = 1
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    def kubeconfig(self, path: Path) -> Path:
        """A kubeconfig that points a client at this server with a bearer token."""
        path.write_text(
            yaml.safe_dump(
                {
                    "apiVersion": "v1",
                    "kind": "Config",
                    "clusters": [{"name": "fake", "cluster": {"server": self.url}}],
                    "users": [{"name": "router", "user": {"token": TOKEN}}],
                    "contexts": [
                        {
                            "name": "fake",
                            "context": {
                                "cluster": "fake",
                                "user": "router",
                                "namespace": self.namespace,
                            },
                        }
                    ],
                    "current-context": "fake",
                }
            )
        )
        return path

    def modify(self, name: str, *, ready: bool = True, terminating: bool = False) -> None:
        """Sets a pod's Ready condition, and marks it terminating (a deletionTimestamp, as
        the API server does the moment a pod is deleted, before its containers get
        SIGTERM); tells every open watch (MODIFIED)."""
        with self._lock:
            self._version += 1
            p = self.pods[name]
            p["metadata"]["resourceVersion"] = str(self._version)
            p["status"]["conditions"] = [{"type": "Ready", "status": "True" if ready else "False"}]
            if terminating:
                p["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
                p["metadata"]["deletionGracePeriodSeconds"] = 45
            event = {"type": "MODIFIED", "object": copy.deepcopy(p)}
            for w in self._watchers:
                w.put(event)

    def _pod_list(self) -> bytes:
        with self._lock:
            return json.dumps(
                {
                    "apiVersion": "v1",
                    "kind": "PodList",
                    "metadata": {"resourceVersion": str(self._version)},
                    "items": list(self.pods.values()),
                }
            ).encode()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        api = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                url = urlsplit(self.path)
                q = parse_qs(url.query)
                api.requests.append((url.path, q, self.headers.get("Authorization")))
                if url.path != f"/api/v1/namespaces/{api.namespace}/pods":
                    self._send(404, b'{"kind":"Status","status":"Failure","code":404}')
                elif q.get("watch", [""])[0] in ("true", "1"):
                    self._watch()
                else:
                    self._send(200, api._pod_list())

            def _send(self, status: int, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _watch(self) -> None:
                events: queue.Queue[dict[str, Any] | None] = queue.Queue()
                with api._lock:
                    api._watchers.append(events)
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                try:
                    while (event := events.get()) is not None:
                        data = json.dumps(event).encode() + b"\n"
                        self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                        self.wfile.flush()
                except OSError:  # the client went away
                    pass
                finally:
                    with api._lock:
                        api._watchers.remove(events)

        return Handler

    def start(self) -> FakeKubeAPI:
        self._thread.start()
        return self

    def stop(self) -> None:
        with self._lock:
            for w in self._watchers:
                w.put(None)
        self._server.shutdown()
        self._server.server_close()


@contextmanager
def fake_kube_api(namespace: str, pods: list[dict[str, Any]]) -> Iterator[FakeKubeAPI]:
    api = FakeKubeAPI(namespace, pods).start()
    try:
        yield api
    finally:
        api.stop()
