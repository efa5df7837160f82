"""Admission webhooks: pod mutation (`mutate`), network validation (`validate`), their
HTTPS server (`server`), the caches it serves from (`cache`), certificates (`certs`).

Entry points for the operator:
- `serve_main(argv)`: standalone process, `python -m metaroce_operator.webhooks --help`;
- `WebhookApp(AppOptions(...), creds)`: `.start()` in every replica,
  `await .rotate_certificates(kube)` from the leader, `.stop()` on shutdown.
"""

from metaroce_operator.webhooks.mutate import Allowed, Denied, mutate_pod
from metaroce_operator.webhooks.server import AppOptions, WebhookApp, serve_main
from metaroce_operator.webhooks.validate import validate_network_change

__all__ = [
    "Allowed",
    "AppOptions",
    "Denied",
    "WebhookApp",
    "mutate_pod",
    "serve_main",
    "validate_network_change",
]
