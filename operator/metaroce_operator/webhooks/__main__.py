"""`python -m metaroce_operator.webhooks`: serve the admission webhooks standalone."""

from metaroce_operator.webhooks.server import serve_main

raise SystemExit(serve_main())
