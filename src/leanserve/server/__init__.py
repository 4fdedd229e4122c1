"""`leanserve serve`: the OpenAI-compatible server (FastAPI on uvicorn) over one engine loop."""

from __future__ import annotations

import socket
import sys

from leanserve.errors import EngineDied


def serve(
    llm, host: str = "127.0.0.1", port: int = 8000, served_model_name: str | None = None, api_key=None,
    chat_template: str | None = None,
) -> None:  # fmt: skip
    """Serves until SIGINT/SIGTERM: then stops taking requests (503), lets in-flight ones finish for a few
    seconds, aborts the rest, stops the engine (and its pipeline stages) and releases the port. If the engine
    dies (a pipeline stage died), in-flight requests get a 503 error, the server shuts down the same way and
    EngineDied is raised."""
    import uvicorn

    from leanserve.server.app import build_app

    name = served_model_name or llm.engine.config.model
    app = build_app(llm, name, api_key, chat_template)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # The connections it accepts inherit TCP_NODELAY: a response's body goes out without waiting for the client to
    # acknowledge its headers (with Nagle's algorithm on, a client's delayed ACK held it back 40 ms).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.bind((host, port))  # port 0: a free one, printed below
    bound = sock.getsockname()[1]

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame) -> None:
            app.state.leanserve["shutting_down"] = True  # new requests get 503 from now on
            super().handle_exit(sig, frame)
            # uvicorn re-raises the signal after its shutdown; a clean stop exits 0 instead.
            self._captured_signals.clear()

        async def startup(self, sockets=None) -> None:
            await super().startup(sockets)
            if self.started:
                shown = f"[{host}]" if family == socket.AF_INET6 else host
                print(f"leanserve: serving '{name}' on http://{shown}:{bound}/v1", file=sys.stderr, flush=True)

    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5, access_log=False)
    server = Server(config)
    died: list[str] = []

    def on_dead(reason: str) -> None:  # the engine cannot go on: stop serving, so a supervisor can restart us
        died.append(reason)
        app.state.leanserve["shutting_down"] = True
        server.should_exit = True

    app.state.leanserve["on_dead"] = on_dead
    try:
        server.run(sockets=[sock])
    finally:
        sock.close()
    if died:
        raise EngineDied(died[0])
