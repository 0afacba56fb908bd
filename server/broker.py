"""Brokers for demos and tests: amqtt embedded in a background thread, and a mosquitto launcher."""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import logging
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
import weakref
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

from nestling.cli_numbers import non_negative_int
from nestling.errors import ConfigError, DependencyError

log = logging.getLogger(__name__)


def find_free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind((host, 0))
        return probe.getsockname()[1]


def wait_for_port(host: str, port: int, timeout_s: float) -> bool:
    """True once `host:port` accepts TCP connections, False if it did not within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((host, port), timeout=0.5):
                return True
        except OSError:
            time.sleep(0.02)
    return False


class _SnapshotIteration(dict[str, Any]):
    """A dict whose plain iteration walks a snapshot of its keys.

    amqtt 0.12's broker walks its subscription table with an `await` inside the loop (retained messages for a
    connecting client): a subscription made meanwhile by another client raised "dictionary changed size during
    iteration", the connecting client's session handler died, and that client's next publish failed with "not
    currently connected" (the suite's occasional fleet and transport test failures). Iterating a snapshot is what
    that loop needs; lookups, inserts and deletes are the dict's own."""

    def __iter__(self) -> Iterator[str]:
        return iter(list(self.keys()))


def _iterate_subscriptions_over_a_snapshot(broker: object) -> None:
    """Give an amqtt broker's subscription table snapshot iteration (see `_SnapshotIteration`)."""
    table = getattr(broker, "_subscriptions", None)
    if isinstance(table, dict) and not isinstance(table, _SnapshotIteration):
        broker._subscriptions = _SnapshotIteration(table)  # type: ignore[attr-defined]


class EmbeddedBroker:
    """amqtt on its own asyncio loop in a daemon thread: anonymous, plain TCP, meant for one host.

    Use as a context manager; `port=0` picks a free port, read back from `.port` / `.url`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0, *, start_timeout_s: float = 10.0) -> None:
        self.host = host
        self.port = port
        self.start_timeout_s = start_timeout_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._broker: Any = None

    @property
    def url(self) -> str:
        return f"mqtt://{self.host}:{self.port}"

    def _config(self, port: int) -> dict:
        return {
            "listeners": {"default": {"type": "tcp", "bind": f"{self.host}:{port}"}},
            # Only the auth plugin: amqtt's packet/event loggers cost time on every multi-MB publish.
            "plugins": {"amqtt.plugins.authentication.AnonymousAuthPlugin": {"allow_anonymous": True}},
        }

    def start(self) -> EmbeddedBroker:
        try:
            from amqtt.broker import Broker
            from amqtt.errors import BrokerError
        except ImportError as error:
            raise DependencyError("the embedded broker needs amqtt: pip install amqtt") from error
        if self._thread is not None:
            raise ConfigError("embedded broker already started")
        # amqtt's per-session state machine (the `transitions` package) logs every state change at INFO: noise
        # for an operator at --log-level INFO. Left alone when someone set that logger's level on purpose.
        # amqtt's broker logs each connection's listener accounting at INFO ("Listener 'default': 0/∞
        # connections acquired"): quieted the same way.
        for name in ("transitions", "amqtt.broker"):
            chatter = logging.getLogger(name)
            if chatter.level == logging.NOTSET:
                chatter.setLevel(logging.WARNING)
        attempts = 5 if self.port == 0 else 1  # a picked port can be taken before we bind it
        last_error: BaseException | None = None
        for _ in range(attempts):
            port = self.port or find_free_port(self.host)
            loop = asyncio.new_event_loop()

            async def create_and_start(
                bind_port: int = port, own_loop: asyncio.AbstractEventLoop = loop
            ) -> object:
                broker = Broker(self._config(bind_port), loop=own_loop)
                _iterate_subscriptions_over_a_snapshot(broker)
                await broker.start()
                return broker

            thread = threading.Thread(target=loop.run_forever, name=f"amqtt-{port}", daemon=True)
            thread.start()
            try:
                self._broker = asyncio.run_coroutine_threadsafe(create_and_start(), loop).result(
                    self.start_timeout_s
                )
            except (BrokerError, OSError, concurrent.futures.TimeoutError) as error:  # bind failures
                last_error = error
                loop.call_soon_threadsafe(loop.stop)
                thread.join()
                loop.close()
                continue
            self._loop, self._thread, self.port = loop, thread, port
            log.info("embedded MQTT broker listening on %s", self.url)
            return self
        raise ConfigError(f"embedded broker could not listen on {self.host}:{self.port}: {last_error}")

    def stop(self) -> None:
        """Disconnect clients, close the listener and end the thread; safe to call twice."""
        loop, thread, broker = self._loop, self._thread, self._broker
        if loop is None or thread is None:
            return
        self._loop = self._thread = self._broker = None

        async def shut_down() -> None:
            try:
                await broker.shutdown()
            finally:
                others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
                for task in others:
                    task.cancel()
                await asyncio.gather(*others, return_exceptions=True)

        # A failed shutdown is logged, never raised: it must not keep the thread (or the test) alive.
        try:
            asyncio.run_coroutine_threadsafe(shut_down(), loop).result(10.0)
        except (RuntimeError, OSError, concurrent.futures.TimeoutError) as error:
            log.warning("embedded broker shutdown: %s", error)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10.0)
        if not thread.is_alive():
            loop.close()

    def __enter__(self) -> EmbeddedBroker:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def mosquitto_binary() -> str | None:
    """Path of the mosquitto executable (Debian puts it in /usr/sbin, often off a user's PATH)."""
    return shutil.which("mosquitto") or next(
        (p for p in ("/usr/sbin/mosquitto", "/usr/local/sbin/mosquitto") if os.access(p, os.X_OK)), None
    )


def start_mosquitto(config_path: Path | None, port: int, *, timeout_s: float = 10.0) -> subprocess.Popen:
    """Run mosquitto (a generated fleet config, or a plain loopback one) until `port` accepts connections.

    The config is used as written: started as root, mosquitto drops to its own account exactly as Debian's
    service does, which is what `nestling broker-config` prepares the fleet's files for.
    """
    binary = mosquitto_binary()
    if binary is None:
        raise DependencyError("mosquitto not found: install mosquitto: apt-get install mosquitto")
    workdir = Path(tempfile.mkdtemp(prefix="nestling-mosquitto-"))
    if config_path is None:
        text = f"listener {port} 127.0.0.1\nallow_anonymous true\nset_tcp_nodelay true\npersistence false\n"
    else:
        text = Path(config_path).read_text()
    config = workdir / "mosquitto.conf"
    config.write_text(text)
    log_file = (workdir / "mosquitto.log").open("wb")
    process = subprocess.Popen([binary, "-c", str(config)], stdout=log_file, stderr=subprocess.STDOUT)
    log_file.close()
    weakref.finalize(process, shutil.rmtree, workdir, True)
    if not wait_for_port("127.0.0.1", port, timeout_s):
        process.kill()
        process.wait()
        output = (workdir / "mosquitto.log").read_text(errors="replace")[-2000:]
        raise DependencyError(
            f"mosquitto did not accept connections on port {port} within {timeout_s}s:\n{output}"
        )
    return process


def broker_main(argv: list[str]) -> int:
    """`nestling broker [--host H] [--port P]`: serve the embedded broker until Ctrl-C."""
    parser = argparse.ArgumentParser(prog="nestling broker", description="Run the embedded MQTT broker.")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default: loopback only)")
    parser.add_argument(
        "--port", type=non_negative_int, default=1883, help="TCP port (0 picks a free one; default 1883)"
    )
    args = parser.parse_args(argv)
    stop = threading.Event()
    # Both signals only set the event: a KeyboardInterrupt raised wherever the main thread happens to be
    # (still printing the banner on a busy host, say) would skip the clean shutdown and exit with a traceback.
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with EmbeddedBroker(args.host, args.port) as broker:
            print(
                f"embedded MQTT broker listening on {broker.url} (anonymous, no TLS); Ctrl-C stops it",
                flush=True,
            )
            while not stop.wait(0.5):
                pass
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    print("broker stopped", flush=True)
    return 0
