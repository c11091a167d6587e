"""A stand-in container for the node agent's tests: `python fake_container.py --host H --port P --data FILE`.

GET /ready answers 503 until --ready-after seconds have passed, then 200; GET / answers JSON with its argv,
its pid, the env value FAKE_COLOUR and the text of the --data file (a ConfigMap key mounted by the agent).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--ready-after", type=float, default=0.5)
    args = parser.parse_args()
    started = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 - http.server's name
            if self.path == "/ready":
                code, body = (200, b"ok") if time.monotonic() - started >= args.ready_after else (503, b"warming")
            elif self.path == "/health":
                code, body = 200, b"ok"
            else:
                code = 200
                body = json.dumps({"argv": sys.argv[1:], "pid": os.getpid(), "colour": os.environ.get("FAKE_COLOUR"),
                                   "data": Path(args.data).read_text()}).encode()
            self.send_response(code)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    HTTPServer((args.host, args.port), Handler).serve_forever()


if __name__ == "__main__":
    main()
