"""The local broker's SASL_SSL listener, so that authentication and TLS are tried for real.

Production Kafka asks for both; a pipeline that only ever met a PLAINTEXT broker has never
shown that its settings reach every client (source, sink, lag probe), nor what its errors
look like. The listener uses a CA and a server certificate made with `openssl`, and one
SCRAM-SHA-512 user created through the admin API on the PLAINTEXT listener (SCRAM users live
in the cluster's metadata, so this works on a storage formatted without them).

Everything lives in one directory, readable by its owner only: the CA, the server's PKCS#12
key store and `client.properties`, librdkafka settings any client can load (`kcat -F`).
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

USERNAME = "onceflow"
MECHANISM = "SCRAM-SHA-512"
SCRAM_ITERATIONS = 8192
USER_READY_TIMEOUT_S = 30.0
CERT_DAYS = 825


class SecureListenerError(RuntimeError):
    """The SASL_SSL listener could not be set up; the message says what to do."""


@dataclass(frozen=True)
class SecureListener:
    """Where the SASL_SSL listener keeps its files, and the port it listens on."""

    directory: Path
    port: int

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def ca_file(self) -> Path:
        return self.directory / "ca.pem"

    @property
    def keystore(self) -> Path:
        return self.directory / "server.p12"

    @property
    def client_properties(self) -> Path:
        return self.directory / "client.properties"

    @property
    def _keystore_password_file(self) -> Path:
        return self.directory / "keystore.password"

    def client_settings(self) -> dict[str, str]:
        """librdkafka settings for a client of this listener, the password included."""
        conf = {}
        for line in self.client_properties.read_text().splitlines():
            if line and not line.startswith("#"):
                key, _, value = line.partition("=")
                conf[key] = value
        return conf

    def prepare(self) -> list[str]:
        """Make the certificates and credentials (once); the broker settings that use them."""
        self.directory.mkdir(parents=True, exist_ok=True)
        self.directory.chmod(0o700)
        if not self.keystore.exists():
            self._make_certificates()
        if not self.client_properties.exists():
            _write_private(
                self.client_properties,
                "# onceflow's local broker, SASL_SSL listener (kcat -F this file)\n"
                + "".join(
                    f"{key}={value}\n"
                    for key, value in {
                        "bootstrap.servers": self.bootstrap,
                        "security.protocol": "SASL_SSL",
                        "sasl.mechanism": MECHANISM,
                        "sasl.username": USERNAME,
                        "sasl.password": secrets.token_urlsafe(18),
                        "ssl.ca.location": str(self.ca_file),
                    }.items()
                ),
            )
        return [
            "ssl.keystore.type=PKCS12",
            f"ssl.keystore.location={self.keystore}",
            f"ssl.keystore.password={self._keystore_password_file.read_text().strip()}",
            f"sasl.enabled.mechanisms={MECHANISM}",
            # The broker's side of SCRAM needs a login module, though users live in metadata.
            f"listener.name.sasl_ssl.{MECHANISM.lower()}.sasl.jaas.config="
            "org.apache.kafka.common.security.scram.ScramLoginModule required;",
        ]

    def create_user(self, plaintext_bootstrap: str, progress: Callable[[str], None]) -> None:
        """Create (or reset) the SCRAM user, then wait until the listener accepts it."""
        from confluent_kafka.admin import (
            AdminClient,
            ScramCredentialInfo,
            ScramMechanism,
            UserScramCredentialUpsertion,
        )

        conf = self.client_settings()
        admin = AdminClient({"bootstrap.servers": plaintext_bootstrap, "log_level": 0})
        upsert = UserScramCredentialUpsertion(
            USERNAME,
            ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, SCRAM_ITERATIONS),
            conf["sasl.password"].encode(),
        )
        for future in admin.alter_user_scram_credentials([upsert]).values():
            future.result(timeout=USER_READY_TIMEOUT_S)
        secured = AdminClient({**conf, "log_level": 0})
        deadline = time.monotonic() + USER_READY_TIMEOUT_S
        while True:
            try:
                if secured.list_topics(timeout=2).brokers:
                    break
                why = "no brokers in the metadata"
            except Exception as exc:
                why = str(exc)
            if time.monotonic() > deadline:
                raise SecureListenerError(
                    f"the SASL_SSL listener on {self.bootstrap} did not accept user "
                    f"{USERNAME!r} within {USER_READY_TIMEOUT_S:.0f}s ({why}); see the "
                    "broker's log, then `onceflow kafka stop` and start again"
                )
            time.sleep(0.2)
        self.describe(progress)

    def describe(self, progress: Callable[[str], None]) -> None:
        progress(
            f"SASL_SSL listener at {self.bootstrap} (user {USERNAME!r}, {MECHANISM}, CA "
            f"{self.ca_file}); client settings with the password: {self.client_properties}"
        )

    def _make_certificates(self) -> None:
        """A CA, and a server certificate it signs for 127.0.0.1 and localhost (clients
        verify the broker's name: librdkafka's ssl.endpoint.identification.algorithm)."""
        openssl = shutil.which("openssl")
        if openssl is None:
            raise SecureListenerError(
                "`openssl` is not on PATH: install it (Debian: apt-get install openssl), "
                "then start the broker again"
            )
        d = self.directory
        (d / "server.ext").write_text(
            "basicConstraints=CA:FALSE\n"
            "keyUsage=digitalSignature,keyEncipherment\n"
            "extendedKeyUsage=serverAuth\n"
            "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        )
        keystore_password = secrets.token_urlsafe(18)
        _write_private(self._keystore_password_file, keystore_password + "\n")
        steps = [
            ["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", str(CERT_DAYS),
             "-subj", "/CN=onceflow local CA", "-keyout", "ca.key", "-out", "ca.pem",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
            ["req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=localhost",
             "-keyout", "server.key", "-out", "server.csr"],
            ["x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
             "-CAcreateserial", "-days", str(CERT_DAYS), "-extfile", "server.ext",
             "-out", "server.pem"],
            ["pkcs12", "-export", "-in", "server.pem", "-inkey", "server.key",
             "-certfile", "ca.pem", "-name", "broker", "-out", "server.p12.tmp",
             "-passout", "env:ONCEFLOW_KEYSTORE_PASSWORD"],
        ]  # fmt: skip
        env = {**os.environ, "ONCEFLOW_KEYSTORE_PASSWORD": keystore_password}
        for args in steps:
            result = subprocess.run(
                [openssl, *args], cwd=d, env=env, capture_output=True, text=True
            )
            if result.returncode != 0:
                raise SecureListenerError(
                    f"`openssl {args[0]}` failed making the local broker's certificates in "
                    f"{d}; delete that directory and start again.\n{result.stderr[-2000:]}"
                )
        for leftover in ("server.csr", "server.ext", "ca.srl"):
            (d / leftover).unlink(missing_ok=True)
        (d / "server.p12.tmp").rename(self.keystore)


def _write_private(path: Path, text: str) -> None:
    """Write a file only its owner can read: it holds a password."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
