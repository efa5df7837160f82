"""A webhook server in its own process, with a file-descriptor limit a flood can reach
(what a container's limit is to the real one): `python flood_server.py CERT_DIR SPARE`
sets RLIMIT_NOFILE to the server's connection cap + SPARE, serves on a free loopback
port, prints it and runs until killed."""

from __future__ import annotations

import resource
import sys
import threading
import time
from pathlib import Path

from metaroce_operator.webhooks.server import AdmissionHandler, ServerOptions, WebhookServer


def main() -> None:
    cert_dir, spare = Path(sys.argv[1]), int(sys.argv[2])
    options = ServerOptions(cert_dir=cert_dir, address="127.0.0.1", port=0)
    cap = int(getattr(options, "max_connections", 256))
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (cap + spare, hard))
    synced = threading.Event()
    synced.set()
    handler = AdmissionHandler(lambda: {}, synced, lambda ns: {}, lambda: {})
    server = WebhookServer(options, handler)
    server.start()
    print(f"{server.port} {cap}", flush=True)
    while True:
        time.sleep(60)


if __name__ == "__main__":
    main()
