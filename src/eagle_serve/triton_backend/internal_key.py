"""The key that lets only spec_decode call eagle_target and eagle_drafter.

Triton has no internal models: any client can send requests to any loaded model. Our two
workers take block tables, slot mappings and KV moves as given, so a client calling them could
read or overwrite other requests' KV pages. spec_decode therefore sends a secret with every BLS
call (the `internal_key` input) and the workers refuse any request without it, before touching
a tensor.

The secret is made once per tritonserver start, by whichever of the server's model processes
asks first, and kept in a file only this user can read, named after the server process (its
pid and start time): every model process of one server reads the same key, the next start
makes a new one. It is never in the repository, a config or a response. `EAGLE_INTERNAL_KEY`
overrides it (e.g. a Kubernetes secret).
"""
from __future__ import annotations

import hmac
import os
import secrets
import tempfile
from pathlib import Path

import psutil

INPUT_NAME = "internal_key"


def _key_file() -> Path:
    folder = Path(tempfile.gettempdir()) / f"eagle-serve-{os.getuid()}"
    folder.mkdir(mode=0o700, exist_ok=True)
    info = folder.stat()
    if info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{folder} must belong to this user and be private (mode 700)")
    server = psutil.Process(os.getppid())  # the model processes are children of tritonserver
    return folder / f"internal-key-{server.pid}-{int(server.create_time() * 1000)}"


def server_key() -> str:
    """This server's key: read it, or make it if no model process of the server has yet."""
    if os.environ.get("EAGLE_INTERNAL_KEY"):
        return os.environ["EAGLE_INTERNAL_KEY"]
    path = _key_file()
    if not path.exists():
        draft = path.with_name(f"{path.name}.{os.getpid()}")
        fd = os.open(draft, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        try:
            os.link(draft, path)  # atomic: the first process to get here wins
        except FileExistsError:
            pass
        finally:
            os.unlink(draft)
    return path.read_text().strip()


def forget_server_key() -> None:
    """Remove the key file (at shutdown)."""
    if not os.environ.get("EAGLE_INTERNAL_KEY"):
        _key_file().unlink(missing_ok=True)


def is_valid(sent: bytes | str | None, key: str) -> bool:
    if sent is None:
        return False
    sent = sent.decode("utf-8", "replace") if isinstance(sent, bytes) else sent
    return hmac.compare_digest(sent, key)
