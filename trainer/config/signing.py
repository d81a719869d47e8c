"""Checkpoints this user wrote on this machine: their saved config, signed.

A checkpoint's saved config is data (trainer/config/trust.py): its targets and paths are
refused unless the user restates or trusts them. That is right for a checkpoint received from
elsewhere and friction for one's own. So, as Jupyter signs the notebooks a user ran, training
signs what evaluation and export read back of a checkpoint's config (the resolved config and
its derived keys) with HMAC-SHA256 under a secret that only this user can read: 32 random bytes
in `checkpoint-secret` of the user's config directory (`$CUMULUS_CONFIG_DIR`, else
`$XDG_CONFIG_HOME/cumulus`, else `~/.config/cumulus`), created with mode 0600 by the first
training run (rank 0, which writes a checkpoint's config). A signature that verifies means the
config is this user's own, unedited.

A checkpoint copied from another machine or user (another secret), one whose config was edited
(the signature no longer matches) and one written before signing existed (no signature) stay
data. A secret that is missing or unreadable means "not own", never an error. Deleting the
secret revokes every signature made with it; the next run that saves makes a new one.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import sys
import tempfile
from pathlib import Path
from typing import Any

ENV = "CUMULUS_CONFIG_DIR"
SECRET = "checkpoint-secret"
SECRET_BYTES = 32
SCHEME = "hmac-sha256:"  # what a signature starts with: the scheme, then the hex digest


def config_dir() -> Path:
    """The user's cumulus config directory: `$CUMULUS_CONFIG_DIR`, `$XDG_CONFIG_HOME/cumulus`
    or `~/.config/cumulus`."""
    if os.environ.get(ENV):
        return Path(os.environ[ENV]).expanduser()
    base = os.environ.get("XDG_CONFIG_HOME") or str(Path.home() / ".config")
    return Path(base).expanduser() / "cumulus"


def secret_path() -> Path:
    return config_dir() / SECRET


def _read_secret(path: Path) -> bytes | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    return data if len(data) == SECRET_BYTES else None


def _create_secret(path: Path) -> bytes | None:
    """A new secret at `path`, or the one a racing process wrote first: written to a private
    temporary file, then hard-linked into place (a link never replaces a file, so two ranks or
    runs starting together end with one secret, both signing with it)."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{SECRET}.", dir=path.parent)  # mode 0600
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(secrets.token_bytes(SECRET_BYTES))
            f.flush()
            os.fsync(f.fileno())
        with contextlib.suppress(FileExistsError):  # another process made it first: theirs
            os.link(tmp, path)
    finally:
        os.unlink(tmp)
    return _read_secret(path)


def _canonical(node: Any) -> Any:
    """`node` as JSON can hold it without loss, or ValueError: string keys only, and plain
    values (a key `1` and a key `"1"` must not sign alike)."""
    if isinstance(node, dict):
        if not all(isinstance(k, str) for k in node):
            raise ValueError("a mapping with a key that is not a string")
        return {k: _canonical(v) for k, v in node.items()}
    if isinstance(node, list | tuple):
        return [_canonical(v) for v in node]
    if node is None or isinstance(node, bool | int | float | str):
        return node
    raise ValueError(f"a value of type {type(node).__name__}")


def digest(record: dict[str, Any], key: bytes) -> str:
    """HMAC-SHA256 of `record`'s canonical JSON (sorted keys, no spaces, floats as `repr`)."""
    text = json.dumps(_canonical(record), sort_keys=True, separators=(",", ":"))
    return SCHEME + hmac.new(key, text.encode(), hashlib.sha256).hexdigest()


def sign(record: dict[str, Any]) -> str | None:
    """The signature of `record` (what a checkpoint's config is read back from), creating the
    user's secret on first use; None, with a warning, where no secret can be kept (the
    checkpoint is then treated as received)."""
    path = secret_path()
    try:
        key = _read_secret(path) or _create_secret(path)
        if key is None:
            raise OSError(f"{path} does not hold a {SECRET_BYTES}-byte secret")
        return digest(record, key)
    except (OSError, ValueError) as exc:
        print(
            f"warning: this run's checkpoints are not signed as yours ({exc}); evaluating or "
            "exporting them will need their paths named again or saved_paths=true, as for a "
            f"received checkpoint. Set {ENV} to a directory you can write.",
            file=sys.stderr,
        )
        return None


def is_own(record: dict[str, Any], signature: Any) -> bool:
    """Whether `signature` is this user's signature of `record`. Never creates the secret;
    a missing or unreadable one, or a record that cannot be signed, means not own."""
    if not isinstance(signature, str) or not signature.isascii():
        return False
    key = _read_secret(secret_path())
    if key is None:
        return False
    try:
        expected = digest(record, key)
    except ValueError:
        return False
    return hmac.compare_digest(expected, signature)
