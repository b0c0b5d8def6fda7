"""A TCP forwarder from a chosen source address (issue 42's flood tests).

gRPC clients cannot bind their source address, so a test that needs calls
from several client hosts (127.0.0.0/8 addresses, each a peer of its own for
the server's per-host bounds) sends them through one Forwarder per address.
Standard library only; used by tests/integration/flood_test.py and
bench/flood/big_messages.py.
"""

import socket
import threading


class Forwarder:
    """Accepts on 127.0.0.1:<port>, connects to `target` from `source`."""

    def __init__(self, source, target):
        self.source, self.target = source, target
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.sockets = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self):
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.socket()
            upstream.bind((self.source, 0))
            upstream.connect(self.target)
            for s in (client, upstream):
                s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b),
                                 daemon=True).start()

    @staticmethod
    def _pump(a, b):
        try:
            while True:
                data = a.recv(1 << 20)
                if not data:
                    break
                b.sendall(data)
        except OSError:
            pass
        for x in (a, b):
            try:
                x.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def close(self):
        self.listener.close()
        for x in self.sockets:
            try:
                x.close()
            except OSError:
                pass
