#!/usr/bin/env python3
"""A small HTTP/1.1 server of one file, with range requests, for diskit's
http tests and benchmark, that can also misbehave on purpose.

    range_server.py FILE [--mode MODE] [--tls CERT KEY] [--port N]

It prints the port it listens on (loopback) and serves until killed.
Modes:
  normal   HEAD and GET with one byte range (206), keep-alive
  norange  ignores Range: answers 200 with the whole file, no Accept-Ranges
  flaky    the first GET of each range is a 503, the second sends half its
           body then drops the connection; the third is answered
  shrink   after 2 GETs, says the file is 4096 bytes shorter
  etag     after 2 GETs, sends another entity tag
"""
import argparse
import os
import re
import ssl
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = None
data = None
lock = threading.Lock()
gets = 0
tries = {}


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *a):
        pass

    def common(self, size, etag):
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("ETag", etag)
        if args.mode != "norange":
            self.send_header("Accept-Ranges", "bytes")

    def do_HEAD(self):
        self.send_response(200)
        self.common(len(data), '"v1"')
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()

    def do_GET(self):
        global gets
        with lock:
            gets += 1
            n = gets
        size, etag = len(data), '"v1"'
        if args.mode == "shrink" and n > 2:
            size -= 4096
        if args.mode == "etag" and n > 2:
            etag = '"v2"'
        rng = self.headers.get("Range", "")
        with lock:
            tries[rng] = tries.get(rng, 0) + 1
            attempt = tries[rng]
        if args.mode == "flaky" and attempt == 1:
            body = b"try again"
            self.send_response(503)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
            return
        m = re.fullmatch(r"bytes=(\d+)-(\d*)", self.headers.get("Range", ""))
        if args.mode == "norange" or not m:
            self.send_response(200)
            self.common(size, etag)
            self.send_header("Content-Length", str(size))
            self.end_headers()
            self.wfile.write(data[:size])
            return
        a = int(m.group(1))
        b = int(m.group(2)) if m.group(2) else size - 1
        if a >= size:
            self.send_response(416)
            self.send_header("Content-Range", "bytes */%d" % size)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        b = min(b, size - 1)
        body = data[a:b + 1]
        self.send_response(206)
        self.common(size, etag)
        self.send_header("Content-Range", "bytes %d-%d/%d" % (a, b, size))
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if args.mode == "flaky" and attempt == 2:
            self.wfile.write(body[: len(body) // 2])
            self.wfile.flush()
            self.close_connection = True
            self.connection.shutdown(2)
            return
        self.wfile.write(body)


def main():
    global args, data
    p = argparse.ArgumentParser()
    p.add_argument("file")
    p.add_argument("--mode", default="normal")
    p.add_argument("--tls", nargs=2, metavar=("CERT", "KEY"))
    p.add_argument("--port", type=int, default=0)
    args = p.parse_args()
    with open(args.file, "rb") as f:
        data = f.read()
    server = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    server.daemon_threads = True
    if args.tls:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.load_cert_chain(args.tls[0], args.tls[1])
        server.socket = ctx.wrap_socket(server.socket, server_side=True)
    print(server.server_address[1], flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
