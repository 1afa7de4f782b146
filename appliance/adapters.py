"""The served LoRA adapters: names the `model` field may take, and loading them at runtime.

One `AdapterRegistry` per server, shared by HTTP and gRPC, so that every frontend resolves
a request's `model` against the same set and a load or unload is seen by all at once. It
decides what the appliance owns (the engine owns the weights):

- ids: the appliance numbers adapters 1, 2, ... in load order (the YAML's `lora.modules`
  first, in their order) and never hands an id out twice, so an id always means one
  adapter for as long as the process lives, in logs as in the engine (which refuses an id
  that another adapter holds). A name unloaded and loaded again gets a new id.
- the path policy of runtime loads: an absolute path whose real location (symlinks and
  `..` resolved) lies under one of `lora.allowed_dirs`, else a 403; without it any API-key
  holder could make the server read any file it can. The engine is given the resolved
  path, so a symlink swapped after the check cannot point it elsewhere.
- the order of a load or an unload with requests: a name is routable only once the
  engine holds the adapter, and stops being routable the moment its unload starts. A
  frontend hands a request to the engine inside `admitting(lora)`, which refuses it if the
  adapter was unloaded since the request resolved its name; the unload waits for those
  brackets to close before it asks the engine to remove the adapter, so no request can
  reach the engine for an adapter it no longer holds (the engine would read it from disk
  again, behind the registry's back). The engine's removal then returns once the requests
  running with the adapter have finished.

Refusals are `AdapterError`s carrying the HTTP status vLLM answers them with (the
vocabulary of `/v1/load_lora_adapter`); a frontend without those routes maps it to its own.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import re
import threading
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from typing import Protocol

from appliance.config import ConfigError
from appliance.config.schema import LoRASection
from engine.errors import InvalidRequestError, LoRANotFoundError, LoRAPathError
from engine.lora_request import LoRARequest

logger = logging.getLogger(__name__)


class AdapterEngine(Protocol):
    """What the registry needs of the engine (`AsyncEngine`)."""

    def add_lora(self, lora: LoRARequest) -> Awaitable[None]: ...

    def remove_lora(self, lora_name: str) -> Awaitable[None]: ...


class AdapterError(Exception):
    """A refused adapter operation: an HTTP status, an OpenAI error code, the field at fault."""

    def __init__(self, status: int, code: str, message: str, param: str | None):
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.param = param


# Adapter names are identifiers (they reach URLs, logs, /v1/models and metric labels):
# at most this many characters, each a letter, digit or one of `._:/-`.
MAX_NAME_CHARS = 128
_NAME = re.compile(rf"[A-Za-z0-9._:/-]{{1,{MAX_NAME_CHARS}}}")
_NAME_RULE = f"1 to {MAX_NAME_CHARS} characters, each a letter, a digit or one of . _ : / -"


def shown_name(name: str) -> str:
    """A name as error messages echo it: cut short, so a huge one is not sent back whole."""
    return name if len(name) <= 64 else name[:61] + "..."


def _under(path: str, root: str) -> bool:
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


class AdapterRegistry:
    """The adapters a server routes to; see the module docstring."""

    def __init__(self, engine: AdapterEngine, lora: LoRASection, base_name: str):
        self._engine = engine
        self.base_name = base_name
        self.enabled = lora.enabled
        self.max_loras = lora.max_loras
        self.runtime_updates = lora.allow_runtime_updates
        self._modules = dict(lora.modules)
        # Resolved once, so that an allowed directory reached through a symlink still matches.
        self._allowed = tuple(os.path.realpath(d) for d in lora.allowed_dirs)
        # HTTP and gRPC may run on different event loops: a thread lock, and a condition
        # an unload waits on (in a worker thread) for admissions to end.
        self._lock = threading.Lock()
        self._admissions_done = threading.Condition(self._lock)
        self._admitting: dict[str, int] = {}  # requests being handed to the engine
        self._ids = itertools.count(1)
        self._loaded: dict[str, LoRARequest] = {}  # routable, in load order
        self._busy: set[str] = set()  # being loaded or unloaded
        self._requests: dict[str, int] = {}  # engine requests admitted, per adapter

    # ---- routing --------------------------------------------------------------------------
    def get(self, name: str) -> LoRARequest | None:
        """The loaded adapter called `name`, or None."""
        return self._loaded.get(name)

    def adapters(self) -> list[LoRARequest]:
        """The loaded adapters, in load order."""
        with self._lock:
            return list(self._loaded.values())

    @contextmanager
    def admitting(self, lora: LoRARequest) -> Iterator[None]:
        """Brackets handing requests for `lora` to the engine (see the module docstring);
        a 404 model_not_found when the adapter was unloaded since `get` returned it."""
        name = lora.lora_name
        with self._lock:
            if self._loaded.get(name) is not lora:
                raise AdapterError(
                    404, "model_not_found",
                    f"The model `{name}` does not exist (its adapter was unloaded)", "model",
                )  # fmt: skip
            self._admitting[name] = self._admitting.get(name, 0) + 1
        try:
            yield
        finally:
            with self._lock:
                self._admitting[name] -= 1
                if not self._admitting[name]:
                    del self._admitting[name]
                    self._admissions_done.notify_all()

    def _wait_admissions(self, name: str) -> None:
        """Blocks (a worker thread) until no request for `name` is being admitted."""
        with self._lock:
            self._admissions_done.wait_for(lambda: name not in self._admitting)

    def count_request(self, lora: LoRARequest) -> None:
        """One engine request admitted with `lora` (the per-adapter request counter)."""
        with self._lock:
            self._requests[lora.lora_name] = self._requests.get(lora.lora_name, 0) + 1

    def request_counts(self) -> dict[str, int]:
        """Engine requests admitted per adapter name, since start (unloaded ones included)."""
        with self._lock:
            return dict(self._requests)

    # ---- start-up -------------------------------------------------------------------------
    async def load_modules(self) -> None:
        """Loads `lora.modules`; a bad one is a ConfigError naming `lora.modules.<name>`."""
        for name, path in self._modules.items():
            key = f"lora.modules.{name}"
            try:
                self._check_name(name)
            except AdapterError as e:
                raise ConfigError(key, e.message) from None
            lora = LoRARequest(name, next(self._ids), path)
            try:
                await self._engine.add_lora(lora)
            except InvalidRequestError as e:
                raise ConfigError(key, str(e)) from None
            self._loaded[name] = lora
            logger.info("adapter loaded", extra={"fields": {"name": name, "path": path}})

    # ---- runtime updates ------------------------------------------------------------------
    def require_runtime_updates(self) -> None:
        """404, as vLLM answers these routes when runtime updating is off."""
        if not self.runtime_updates:
            raise AdapterError(
                404,
                "not_found",
                "loading and unloading adapters at runtime is off "
                "(lora.allow_runtime_updates: false)",
                None,
            )

    async def load(self, name: str, path: str) -> LoRARequest:
        """Loads the adapter at `path` as `name`. Refusals: 404 runtime updates off, 400 bad
        name or path or an adapter the engine refuses (its message says why), 400 `name`
        already loaded (or being loaded or unloaded), 403 `path` outside lora.allowed_dirs,
        404 no directory there. A caller that goes away does not stop a load half-way."""
        self.require_runtime_updates()
        self._check_name(name)
        if not path:
            raise AdapterError(400, "invalid_value", "lora_path must not be empty", "lora_path")
        with self._lock:
            if name in self._loaded or name in self._busy:
                what = "has already been loaded" if name in self._loaded else "is being updated"
                raise AdapterError(
                    400, "invalid_value", f"The lora adapter '{name}' {what}.", "lora_name"
                )
            self._busy.add(name)
        return await asyncio.shield(self._load_reserved(name, path))

    async def _load_reserved(self, name: str, path: str) -> LoRARequest:
        try:
            real = await asyncio.to_thread(self._allowed_path, path)
            with self._lock:
                lora = LoRARequest(name, next(self._ids), real, allowed_dirs=self._allowed)
            try:
                await self._engine.add_lora(lora)
            except LoRAPathError as e:
                raise AdapterError(403, "path_not_allowed", str(e), "lora_path") from None
            except InvalidRequestError as e:
                raise AdapterError(400, "invalid_value", str(e), "lora_path") from None
            with self._lock:
                self._loaded[name] = lora
            logger.info("adapter loaded", extra={"fields": {"name": name, "path": real}})
            return lora
        finally:
            with self._lock:
                self._busy.discard(name)

    async def unload(self, name: str) -> None:
        """Unloads `name`: no new request may use it from now on; returns once the requests
        running with it have finished. 404 when no adapter of that name is loaded."""
        self.require_runtime_updates()
        if _NAME.fullmatch(name) is None:
            raise AdapterError(400, "invalid_value", f"lora_name must be {_NAME_RULE}", "lora_name")
        with self._lock:
            lora = self._loaded.pop(name, None)
            if lora is None:
                raise AdapterError(
                    404, "model_not_found", f"The lora adapter '{name}' cannot be found.",
                    "lora_name",
                )  # fmt: skip
            self._busy.add(name)
        await asyncio.shield(self._unload_reserved(lora))

    async def _unload_reserved(self, lora: LoRARequest) -> None:
        try:
            await asyncio.to_thread(self._wait_admissions, lora.lora_name)
            try:
                await self._engine.remove_lora(lora.lora_name)
            except LoRANotFoundError:  # the engine never held it: it is gone either way
                logger.warning(
                    "adapter unknown to the engine", extra={"fields": {"name": lora.lora_name}}
                )
            logger.info("adapter unloaded", extra={"fields": {"name": lora.lora_name}})
        finally:
            with self._lock:
                self._busy.discard(lora.lora_name)

    # ---- checks ---------------------------------------------------------------------------
    def _check_name(self, name: str) -> None:
        if not name:
            raise AdapterError(400, "invalid_value", "lora_name must not be empty", "lora_name")
        if _NAME.fullmatch(name) is None:  # (no ',': the lora_requests_info gauge's separator)
            raise AdapterError(400, "invalid_value", f"lora_name must be {_NAME_RULE}", "lora_name")
        if name == self.base_name:
            raise AdapterError(
                400, "invalid_value", f"'{name}' is the base model's name", "lora_name"
            )

    def _allowed_path(self, path: str) -> str:
        """The real path of `path` if it is allowed and a directory (runs off the loop).
        The engine then reads each file of it confined to the same directories
        (`LoRARequest.allowed_dirs`: the file's own real path is checked, symlinks and all)."""
        if "\0" in path:
            raise AdapterError(400, "invalid_value", "lora_path must not contain NUL", "lora_path")
        if not os.path.isabs(path):
            raise AdapterError(400, "invalid_value", "lora_path must be absolute", "lora_path")
        real = os.path.realpath(path)
        if not any(_under(real, root) for root in self._allowed):
            raise AdapterError(
                403, "path_not_allowed",
                f"lora_path '{path}' is outside the directories adapters may be loaded from "
                "(lora.allowed_dirs)",
                "lora_path",
            )  # fmt: skip
        if not os.path.isdir(real):
            raise AdapterError(
                404, "adapter_not_found", f"No adapter found at '{path}': not a directory",
                "lora_path",
            )  # fmt: skip
        return real
