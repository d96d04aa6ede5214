"""`strata-jax serve`: the app under uvicorn, with safe binding defaults and a clean shutdown."""

from __future__ import annotations

import errno
import ipaddress
import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from strata_jax.core.errors import StrataError

if TYPE_CHECKING:
    from strata_jax.engine.config import EngineConfig

log = logging.getLogger("strata_jax")

API_KEY_ENV = "STRATA_JAX_API_KEY"
SHUTDOWN_MARGIN_S = 5.0  # uvicorn waits this much past the grace period for streams to send their last events
DRAIN_POLL_S = 0.05


def is_loopback(host: str) -> bool:
    if host.lower() in ("localhost", "localhost.localdomain"):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve anywhere


def check_options(args: Any) -> str | None:
    """Refuse unsafe or invalid settings before loading anything; returns the API key."""
    from strata_jax.engine.config import check_option

    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    check_option("parallel", args.parallel, flag=True)
    if not is_loopback(args.host) and not api_key:
        raise StrataError(f"refusing to listen on {args.host} without an API key: anyone who can reach that address "
                          f"could use the model. Pass --api-key KEY (or set {API_KEY_ENV}), or keep the default "
                          "--host 127.0.0.1 (this machine only).")
    if not 0 < args.port < 65536:
        raise StrataError(f"--port {args.port} is not a TCP port; give 1-65535.")
    if not args.shutdown_timeout >= 0:
        raise StrataError(f"--shutdown-grace {args.shutdown_timeout} must be a number of seconds >= 0.")
    from strata_jax.core.units import parse_size

    if parse_size(args.max_body, "--max-body") < 1024:
        raise StrataError(f"--max-body {args.max_body} is too small for any request; give e.g. 4MiB.")
    if args.model is not None:
        from strata_jax.gguf.reader import GGUFFile

        GGUFFile(args.model)  # a missing or non-GGUF file fails now, not after the server is up
    return api_key


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, bound before the model loads: a port in use fails in a second, not after
    the weights are read. uvicorn serves on it."""
    try:
        info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except socket.gaierror as e:
        raise StrataError(f"--host {host}: cannot resolve it ({e.strerror}); give an IP address or a known host "
                          "name.") from None
    family, _, _, _, addr = info[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart reuses a TIME_WAIT port
    try:
        sock.bind(addr)
    except OSError as e:
        sock.close()
        if e.errno == errno.EADDRINUSE:
            raise StrataError(f"port {port} on {host} is already in use (another server?): stop it, or pick a free "
                              "port with --port N.") from None
        raise StrataError(f"cannot listen on {host}:{port}: {e.strerror}; pick another --host/--port.") from None
    sock.set_inheritable(True)
    return sock


def model_id(args: Any) -> str:
    if args.alias:
        return args.alias
    if args.model:
        return Path(args.model).stem
    from strata_jax.dev.default_model import DEFAULT_MODEL_NAME

    return DEFAULT_MODEL_NAME


def serve(args: Any, config: "EngineConfig") -> int:
    """Serve the model of args.model loaded with `config` (an EngineConfig, already validated): the
    engine decodes config.parallel rows, the ones the expert cache was sized to leave KV room for."""
    import uvicorn

    import strata_jax
    from strata_jax.core.units import parse_size
    from strata_jax.serving.app import create_app
    from strata_jax.serving.engine import Engine

    api_key = check_options(args)
    sock = bind(args.host, args.port)
    failure: list[BaseException] = []
    grace = float(args.shutdown_timeout)

    class Server(uvicorn.Server):
        """On the first SIGTERM/SIGINT it keeps listening, answering new requests 503 with Retry-After
        while the running ones get `grace` seconds; uvicorn's own shutdown (which closes the socket) starts
        only after that. A second signal stops at once."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            if engine.draining:  # a second signal: end the running requests now; a third SIGINT forces the exit
                engine.end_running()
                super().handle_exit(sig, frame)
                return
            engine.begin_drain(grace)
            log.info("shutting down: running requests have %g s to finish; new ones get 503", grace)
            threading.Thread(target=self._drain, args=(sig, frame), name="strata-drain", daemon=True).start()

        def _drain(self, sig: int, frame: Any) -> None:
            t_end = time.monotonic() + grace
            # monitor streams end by themselves once draining, with an event saying why: wait for that too,
            # or uvicorn's shutdown can cut them before their last event
            while ((app.state.open_requests.n or engine.watchers) and time.monotonic() < t_end
                   and not self.should_exit):
                time.sleep(DRAIN_POLL_S)
            if app.state.open_requests.n:
                engine.end_running()  # each open stream gets its error event within SHUTDOWN_MARGIN_S
            if not self.should_exit:
                super().handle_exit(sig, frame)

    def on_load_error(e: BaseException) -> None:
        failure.append(e)
        server.should_exit = True

    engine = Engine(lambda: strata_jax.load(args.model, config), queue_size=args.queue_size,
                    warmup=args.warmup, parallel=config.parallel, on_load_error=on_load_error)
    app = create_app(engine, model_id=model_id(args), api_key=api_key,
                     max_body=parse_size(args.max_body, "--max-body"))
    uv_config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning" if args.quiet else "info",
                               access_log=not args.quiet, timeout_graceful_shutdown=SHUTDOWN_MARGIN_S,
                               lifespan="on")
    server = Server(uv_config)
    log.info("serving %s on http://%s:%d (OpenAI and Anthropic APIs under /v1%s); the model loads in the background",
             model_id(args), args.host, args.port, ", API key required" if api_key else "")
    # uvicorn re-raises the signal that stopped it once it has shut down; with these no-op handlers in
    # place that re-raise is harmless and a graceful stop exits 0
    previous = {s: signal.signal(s, lambda *_: None) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
        for s, h in previous.items():
            signal.signal(s, h)
    if failure:
        e = failure[0]
        raise e if isinstance(e, StrataError) else StrataError(f"the model failed to load: {type(e).__name__}: {e}")
    return 0
