"""Who a gRPC caller is: its token, checked, and its identity as the owner of hints.

With ``grpc_token_file`` every EngramStore call must carry ``authorization: Bearer <token>``
metadata (:class:`TokenCheck`, compared in constant time); with ``grpc_tls_client_ca`` the TLS
handshake already required a client certificate that CA signed, which then names the client
(:func:`hint_owner`).
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import grpc


class TokenCheck:
    """``authorization: Bearer <token>`` call metadata against the daemon's token, in constant time."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    def refusal(self, metadata: Any) -> str:
        """"" when the metadata carries the token, else why not (for the client's error)."""
        for key, value in metadata or ():
            if key == "authorization":
                given = value if isinstance(value, bytes) else str(value).encode("utf-8", "replace")
                if hmac.compare_digest(given, self._expected):
                    return ""
                return "wrong token in the 'authorization' metadata"
        return ("no 'authorization' metadata; send 'authorization: Bearer <token>' with the token of the daemon's "
                "grpc_token_file (EngramClient.connect(..., token_file=PATH) or ENGRAM_STORE_GRPC_TOKEN_FILE)")


def hint_owner(context: grpc.aio.ServicerContext) -> str:
    """Who a Hint or Withdraw call comes from, as the owner of its hints: the client certificate the TLS
    handshake verified (``grpc_tls_client_ca``: the same client over all its connections), else the
    call's connection. A shared ``grpc_token_file`` token is every gRPC client's, so it tells none
    apart: each connection is then a client of its own (never its host, which clients share)."""
    pem = (context.auth_context() or {}).get("x509_pem_cert")
    if pem:
        return "grpc:cert:" + hashlib.sha256(pem[0]).hexdigest()[:32]
    return "grpc:conn:" + context.peer()
