"""A Redis that speaks TLS, started by the test with a certificate of its own: a client that does
not trust it is refused when the engine starts (a configuration error, never an outage and never
plaintext), and one given its CA deposits and grafts through it."""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import subprocess
import time

import pytest
import redis

from kvrag import KVEngine, StoreError
from kvrag.testing import free_port

from ..conftest import DOC_A, QUESTION, tiny
from .conftest import text_logits

pytestmark = pytest.mark.skipif(not shutil.which("redis-server"), reason="redis-server is not installed")


def _self_signed(folder):
    """A key and a self-signed certificate for 127.0.0.1 (it is its own CA)."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "kvrag test redis")])
    now = datetime.datetime.now(datetime.timezone.utc)
    certificate = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
                   .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
                   .not_valid_after(now + datetime.timedelta(days=1))
                   .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                                  critical=False)
                   .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                   .sign(key, hashes.SHA256()))
    (folder / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                       serialization.NoEncryption()))
    (folder / "cert.pem").write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
    return folder / "cert.pem", folder / "key.pem"


@pytest.fixture(scope="module")
def tls_redis(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(folder)
    port = free_port()
    process = subprocess.Popen(["redis-server", "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                                "--tls-cert-file", str(cert), "--tls-key-file", str(key), "--tls-ca-cert-file", str(cert),
                                "--tls-auth-clients", "no", "--logfile", str(folder / "redis.log"), "--save", "", "--appendonly", "no", "--dir", str(folder)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    client = redis.Redis(host="127.0.0.1", port=port, ssl=True, ssl_ca_certs=str(cert), socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.exceptions.ConnectionError:
            if process.poll() is not None and b"tls" in process.stderr.read().lower():
                pytest.skip("this redis-server was built without TLS")
            if time.monotonic() > deadline or process.poll() is not None:
                process.kill()
                raise
            time.sleep(0.05)
    yield port, cert
    process.kill()
    process.wait(5)
    process.stderr.close()


def test_a_certificate_not_trusted_is_refused_at_start_naming_the_fix(tls_redis):
    port, _ = tls_redis
    for url in (f"rediss://127.0.0.1:{port}/0", f"redis+cluster://127.0.0.1:{port}?ssl=true",
                f"rediss+cluster://127.0.0.1:{port}"):
        with pytest.raises(StoreError, match="is not trusted.*ssl_ca_certs=PATH") as refused:
            KVEngine(tiny("llama"), url)
        assert "redis" not in type(refused.value).__module__


def test_a_trusted_tls_redis_deposits_and_grafts(tls_redis):
    port, cert = tls_redis
    engine = KVEngine(tiny("llama"), f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={cert}")
    ref = engine.deposit(DOC_A)
    answer = engine.generate(QUESTION, states=[ref], max_new_tokens=1)
    assert answer.receipt.mode == "exact-graft" and answer.receipt.states[0].tier.startswith("rediss://")
    assert answer.receipt.first_token_logits_sha256 == text_logits()
