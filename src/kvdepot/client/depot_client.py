"""What the scheduler-side and worker-side clients share: connection, chunk size, health."""

from __future__ import annotations

import logging
import threading
from typing import Any

import zmq

from kvdepot.client.engine_types import ParallelStrategy
from kvdepot.client.heartbeat import HeartbeatThread
from kvdepot.errors import ServerUnavailable
from kvdepot.options import DEFAULTS
from kvdepot.protocol import Message, RequestType
from kvdepot.rpc.connection import DepotConnection

log = logging.getLogger(__name__)


class DepotClient:
    def __init__(self, server_url: str, context: zmq.Context | None, model_name: str,
                 world_size: int = 1, kv_rank: int = 0, vllm_block_size: int = 16,
                 tp_size: int = 1, parallel_strategy: ParallelStrategy | None = None,
                 mq_timeout: float = DEFAULTS.mq_timeout,
                 heartbeat_interval: float = DEFAULTS.heartbeat_interval,
                 credentials: str | None = DEFAULTS.credentials) -> None:
        """`credentials`: a credential file; default `$KVDEPOT_CREDENTIALS`, else the owner
        credential a server of this user wrote for `server_url` (docs/security.md)."""
        self.parallel_strategy = parallel_strategy or ParallelStrategy.simple(
            world_size, kv_rank, tp_size)
        self.model_name = model_name
        self._mq_timeout = mq_timeout
        self.mq_client = DepotConnection(server_url, context,
                                         connect_timeout=min(mq_timeout,
                                                             DEFAULTS.connect_timeout),
                                         credentials=credentials)
        try:
            self.chunk_size: int = self.mq_client.call(RequestType.GET_CHUNK_SIZE,
                                                       timeout=mq_timeout)
            self._boot_id = self.mq_client.call(RequestType.PING, timeout=mq_timeout).boot_id
        except (TimeoutError, ServerUnavailable) as exc:
            self.mq_client.close()
            raise ConnectionError(f"kvdepot server at {server_url} did not answer: {exc}. "
                                  "Is `kvdepot serve` running?") from None
        if self.chunk_size % vllm_block_size:
            self.mq_client.close()
            raise ValueError(f"the server's chunk size {self.chunk_size} is not a multiple of "
                             f"the engine block size {vllm_block_size}; start `kvdepot serve` "
                             "with a matching --chunk-size")
        self.block_size = vllm_block_size
        self._health_event = threading.Event()
        self._health_event.set()
        self._heartbeat_interval = heartbeat_interval
        self._heartbeat: HeartbeatThread | None = None
        self._heartbeat_lock = threading.Lock()
        self._closed = False
        self.mq_client.on_disconnect.append(
            lambda: self._mark_unhealthy("the connection to the server dropped"))

    # ---- health ---------------------------------------------------------------------
    @property
    def is_healthy(self) -> bool:
        return self._health_event.is_set()

    @property
    def world_size(self) -> int:
        return self.parallel_strategy.kv_world_size

    @property
    def tp_size(self) -> int:
        return self.parallel_strategy.tp_size

    def _on_server_back(self, boot_id: str) -> bool:
        """Hook for subclasses: the server answers again (possibly a new process)."""
        return True

    def _ensure_heartbeat_started(self) -> None:
        """Started lazily, on first use, when the engine is fully up (as the seed does)."""
        if self._heartbeat is not None:
            return
        with self._heartbeat_lock:
            if self._heartbeat is None and not self._closed:
                self._heartbeat = HeartbeatThread(
                    self.mq_client, self._health_event, self._heartbeat_interval,
                    on_server_back=self._on_server_back, boot_id=self._boot_id)
                self._heartbeat.start()

    def _mark_unhealthy(self, reason: str) -> None:
        if self._health_event.is_set():
            log.warning("kvdepot: %s; degraded mode until the server answers again", reason)
        self._health_event.clear()
        if self._closed:
            return
        # Only the heartbeat ends degraded mode, so it starts now if no call has started it.
        self._ensure_heartbeat_started()
        if self._heartbeat is not None:
            self._heartbeat.poke()

    # ---- requests -------------------------------------------------------------------
    def _request(self, request_type: RequestType, payload: Message | None = None,
                 timeout: float | None = None) -> Any:
        """A blocking request; raises the server's error, or ServerUnavailable/TimeoutError
        after marking the client unhealthy."""
        try:
            return self.mq_client.call(request_type, payload,
                                       timeout=self._mq_timeout if timeout is None else timeout)
        except (TimeoutError, ServerUnavailable) as exc:
            self._mark_unhealthy(f"{request_type.name} failed ({exc})")
            raise

    def _notify(self, request_type: RequestType, payload: Message) -> None:
        """Fire-and-forget: errors are logged when their reply arrives."""
        try:
            self.mq_client.notify(request_type, payload)
        except ServerUnavailable as exc:
            self._mark_unhealthy(f"{request_type.name} failed ({exc})")

    def close(self) -> None:
        with self._heartbeat_lock:
            self._closed = True
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self.mq_client.close()
