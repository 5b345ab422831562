#!/usr/bin/env python3
"""A test upstream on Python's http.server: HTTP/1.1 keep-alive, and every connection idle for longer than
the handler's `timeout` (argv[1], seconds) is closed by the server, as real upstreams close idle connections.

POST: counts one execution under the request's Idempotency-Key, answers 201. GET: the counts as JSON.
Prints its port on the first line of standard output.
"""
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

counts = {}
lock = threading.Lock()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    # StreamRequestHandler sets this as the socket timeout: an idle keep-alive connection is closed after it.
    timeout = float(sys.argv[1])

    def do_POST(self):
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        key = self.headers.get("Idempotency-Key", "")
        with lock:
            counts[key] = counts.get(key, 0) + 1
        self.answer(201, b'{"ok":true}')

    def do_GET(self):
        with lock:
            body = json.dumps(counts).encode()
        self.answer(200, body)

    def answer(self, status, body):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
server.daemon_threads = True
print(server.server_address[1], flush=True)
server.serve_forever()
