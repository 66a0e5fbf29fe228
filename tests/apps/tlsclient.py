"""A TLS test client that decides how its bytes are cut: a self-signed certificate for
127.0.0.1, and a keep-alive connection (``ssl.SSLObject`` over memory BIOs) whose request is
encrypted as one TLS record and sent in two TCP sends with a pause between them.

The request goes out as one record: ``SSLObject.write`` of less than 16 KiB makes one, and
:meth:`SplitClient.request` checks it (the record header's length is what follows it).
"""

from __future__ import annotations

import datetime
import ipaddress
import socket
import ssl
import time
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec, rsa
from cryptography.x509.oid import NameOID


def make_cert(directory: Path, kind: str = "ec") -> tuple[str, str]:
    """A self-signed certificate and its key for 127.0.0.1 in ``directory``: (certfile,
    keyfile). ``kind``: ``"ec"`` (P-256) or ``"rsa"`` (2048 bits, the costlier handshake)."""
    key = (rsa.generate_private_key(public_exponent=65537, key_size=2048) if kind == "rsa"
           else ec.generate_private_key(ec.SECP256R1()))
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(days=1))
            .not_valid_after(now + datetime.timedelta(days=30))
            .add_extension(x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
            .sign(key, hashes.SHA256()))
    certfile, keyfile = directory / "cert.pem", directory / "key.pem"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM,
                                          serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    return str(certfile), str(keyfile)


def client_context() -> ssl.SSLContext:
    """A client context that accepts the test's self-signed certificate."""
    ctx = ssl.create_default_context()
    ctx.check_hostname = False
    ctx.verify_mode = ssl.CERT_NONE
    return ctx


class SplitClient:
    """One TLS connection to 127.0.0.1:``port`` whose bytes this object writes itself."""

    def __init__(self, port: int, timeout: float = 30.0) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=timeout)
        self._in, self._out = ssl.MemoryBIO(), ssl.MemoryBIO()
        self.tls = client_context().wrap_bio(self._in, self._out)
        while True:
            try:
                self.tls.do_handshake()
                break
            except ssl.SSLWantReadError:
                self._flush()
                self._fill()
        self._flush()
        self._plain = b""

    def _flush(self) -> None:
        data = self._out.read()
        if data:
            self.sock.sendall(data)

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise ConnectionError("the server closed the connection")
        self._in.write(data)

    def send(self, data: bytes) -> None:
        """Encrypt and send ``data`` (any size), reading nothing."""
        self.tls.write(data)
        self._flush()

    def request(self, head: bytes, split_after: float | None = None) -> int:
        """Send ``head`` (a whole request without a body) and return the response's status
        (its body is read by Content-Length). ``split_after``: send the request's TLS record
        in two TCP sends, this many seconds apart. Raises ConnectionError when the server
        closes the connection without an answer."""
        self.tls.write(head)
        record = self._out.read()
        assert record[0] == 23 and int.from_bytes(record[3:5], "big") == len(record) - 5, \
            "the request is not one TLS application-data record"
        if split_after is None:
            self.sock.sendall(record)
        else:
            half = len(record) // 2
            self.sock.sendall(record[:half])
            time.sleep(split_after)  # the second part of the record, later: what is tested
            self.sock.sendall(record[half:])
        return self.response()

    def response(self) -> int:
        """The next response's status (its body read by Content-Length)."""
        while b"\r\n\r\n" not in self._plain:
            self._read_more()
        head = self._plain[:self._plain.index(b"\r\n\r\n")]
        length = 0
        for line in head.split(b"\r\n")[1:]:
            name, _, value = line.partition(b":")
            if name.strip().lower() == b"content-length":
                length = int(value)
        end = len(head) + 4 + length
        while len(self._plain) < end:
            self._read_more()
        self._plain = self._plain[end:]
        return int(head.split(b" ", 2)[1])

    def _read_more(self) -> None:
        while True:
            try:
                chunk = self.tls.read(65536)
            except ssl.SSLWantReadError:
                self._fill()
                continue
            except ssl.SSLZeroReturnError:
                chunk = b""
            if not chunk:
                raise ConnectionError("the server closed the connection")
            self._plain += chunk
            return

    def close(self) -> None:
        self.sock.close()


def padded_head(pad: int = 3000) -> bytes:
    """A keep-alive ``GET /work?ms=1`` (level ``work`` of tests/apps/apf.yaml) of about
    ``pad`` + 80 bytes, in header lines of at most 4000 bytes (gunicorn's field limit is
    8190)."""
    lines = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"a" * min(4000, pad - i * 4000))
                     for i in range((pad + 3999) // 4000))
    return b"GET /work?ms=1 HTTP/1.1\r\nHost: 127.0.0.1\r\n" + lines + b"\r\n"
