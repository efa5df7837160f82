"""A minimal mutating admission webhook for harness tests.

It answers every AdmissionReview by adding the annotation
``harness.metaroce.io/<tag>: called`` with a JSONPatch, so a test can tell which
webhook (loopback URL or Service in the pod network) the apiserver really called.

    python webhook_echo.py --cert C --key K --host H --port P --tag T
"""

from __future__ import annotations

import argparse
import base64
import json
import ssl
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def make_handler(tag: str) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length", "0")))
            review = json.loads(body)
            request = review["request"]
            has_annotations = bool(request["object"]["metadata"].get("annotations"))
            patch = []
            if not has_annotations:
                patch.append({"op": "add", "path": "/metadata/annotations", "value": {}})
            patch.append(
                {
                    "op": "add",
                    "path": f"/metadata/annotations/harness.metaroce.io~1{tag}",
                    "value": "called",
                }
            )
            response = {
                "apiVersion": "admission.k8s.io/v1",
                "kind": "AdmissionReview",
                "response": {
                    "uid": request["uid"],
                    "allowed": True,
                    "patchType": "JSONPatch",
                    "patch": base64.b64encode(json.dumps(patch).encode()).decode(),
                },
            }
            data = json.dumps(response).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:  # readiness probe for the test
            self.send_response(200)
            self.end_headers()

        def log_message(self, fmt: str, *args: object) -> None:
            print(f"[{tag}] " + fmt % args, flush=True)

    return Handler


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cert", required=True)
    parser.add_argument("--key", required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--tag", required=True)
    args = parser.parse_args()
    server = ThreadingHTTPServer((args.host, args.port), make_handler(args.tag))
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(args.cert, args.key)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print(f"serving {args.tag} on {args.host}:{args.port}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
