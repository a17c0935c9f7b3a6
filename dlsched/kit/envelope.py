"""Envelope encryption of secrets at rest (AES-256-GCM); no grpc, no etcd.

Every record gets a fresh random 256-bit data key that encrypts it with
AES-256-GCM; the data key itself is encrypted ("wrapped") with the keyring's
active key-encryption key (KEK), also AES-256-GCM. Rotating the KEK only
rewraps, and a stolen etcd dump is useless without the key file.

Key file (JSON, mode 0600; group read is tolerated for Kubernetes Secret
volumes with an fsGroup, nothing more)::

    {"version": 1, "active": "k2-…", "keys": {"k1-…": "<base64 of 32 bytes>", "k2-…": "…"}}

``generate_key_file`` makes a new one (one key, refuses to overwrite);
``add_key`` adds a fresh key and makes it active, keeping the old ones so
existing blobs still decrypt.

Blob: the magic ``dlsenc1`` followed by compact UTF-8 JSON::

    {"kid": key id, "wn": nonce of the wrap, "wk": wrapped data key (+ tag),
     "n": nonce of the data, "ct": ciphertext (+ tag)}        (bytes as base64)

``aad`` (the caller passes what the blob belongs to, e.g. the cluster id)
is authenticated by both layers, as is the key id, so a blob copied under
another name, or edited in any byte, fails to decrypt. Failures are
``DecryptError`` / ``KeyFileError``; cryptography's exceptions never leave
this module, and no key material is ever put in a message or a repr.
"""

from __future__ import annotations

import base64
import binascii
import contextlib
import json
import os
import re
import secrets
import stat
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from dlsched.errors import Internal

MAGIC = b"dlsenc1"
FILE_VERSION = 1
KEY_BYTES = 32
NONCE_BYTES = 12
_KEY_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}\Z")
_LOOSE_MODE = 0o037  # group write, or any access by others


class EnvelopeError(Internal):
    """Base of the envelope errors; messages never carry key material."""

    reason = "ENCRYPTION_ERROR"


class KeyFileError(EnvelopeError):
    """The key file is missing, unreadable, too open, malformed, or would be overwritten."""

    reason = "ENCRYPTION_KEY_FILE_INVALID"


class DecryptError(EnvelopeError):
    """A blob that is not ours, names a key the keyring lacks, was altered, or
    belongs to another ``aad``."""

    reason = "DECRYPT_FAILED"


def _b64(b: bytes) -> str:
    return base64.b64encode(b).decode("ascii")


def _unb64(s: object) -> bytes:
    if not isinstance(s, str):
        raise ValueError("not a base64 string")
    return base64.b64decode(s.encode("ascii"), validate=True)


def _wrap_aad(kid: str, aad: bytes) -> bytes:
    return MAGIC + b"/wrap\x00" + kid.encode() + b"\x00" + aad


def _data_aad(aad: bytes) -> bytes:
    return MAGIC + b"/data\x00" + aad


def _as_bytes(aad: bytes | str) -> bytes:
    return aad.encode() if isinstance(aad, str) else aad


class Keyring:
    """Key-encryption keys by id, one of them active. Built by ``Keyring.load``.

    A keyring loaded from a file re-reads it once when a blob names a key it
    does not hold, so a process keeps working after ``add_key`` ran on its file.
    """

    def __init__(self, keys: Mapping[str, bytes], active: str, *, path: Path | None = None) -> None:
        if active not in keys:
            raise KeyFileError("the active key id is not among the keys")
        for kid, k in keys.items():
            if not _KEY_ID_RE.match(kid):
                raise KeyFileError(f"bad key id {kid[:64]!r}")
            if len(k) != KEY_BYTES:
                raise KeyFileError(f"key {kid!r} is not {KEY_BYTES} bytes")
        self._keys = dict(keys)
        self._active = active
        self._path = path

    def __repr__(self) -> str:
        return f"Keyring(active={self._active!r}, key_ids={sorted(self._keys)!r})"

    @property
    def active_key_id(self) -> str:
        return self._active

    @property
    def key_ids(self) -> tuple[str, ...]:
        return tuple(sorted(self._keys))

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Keyring:
        """The keyring in ``path``; KeyFileError saying what is wrong otherwise."""
        p = Path(path)
        doc = _read_key_file(p)
        return cls(doc[0], doc[1], path=p)

    def encrypt(self, plaintext: bytes, aad: bytes | str) -> bytes:
        """A blob of ``plaintext`` under the active key, bound to ``aad``."""
        a = _as_bytes(aad)
        kid = self._active
        data_key = AESGCM.generate_key(bit_length=256)
        n, wn = os.urandom(NONCE_BYTES), os.urandom(NONCE_BYTES)
        ct = AESGCM(data_key).encrypt(n, plaintext, _data_aad(a))
        wk = AESGCM(self._keys[kid]).encrypt(wn, data_key, _wrap_aad(kid, a))
        body = {"kid": kid, "wn": _b64(wn), "wk": _b64(wk), "n": _b64(n), "ct": _b64(ct)}
        return MAGIC + json.dumps(body, separators=(",", ":")).encode()

    def decrypt(self, blob: bytes, aad: bytes | str) -> bytes:
        """The plaintext of ``blob``; DecryptError when it cannot be trusted."""
        a = _as_bytes(aad)
        kid, wn, wk, n, ct = _parse(blob)
        kek = self._keys.get(kid)
        if kek is None and self._reload():
            kek = self._keys.get(kid)
        if kek is None:
            raise DecryptError(f"no key {kid!r} in the keyring (it holds {', '.join(self.key_ids)})",
                               metadata={"key_id": kid})
        try:
            data_key = AESGCM(kek).decrypt(wn, wk, _wrap_aad(kid, a))
            return AESGCM(data_key).decrypt(n, ct, _data_aad(a))
        except (InvalidTag, ValueError):
            raise DecryptError("the blob was altered, or belongs to another record",
                               metadata={"key_id": kid}) from None

    @staticmethod
    def key_id_of(blob: bytes) -> str | None:
        """The key id a blob names; None when ``blob`` is not an envelope at all
        (e.g. plain proto bytes stored before encryption)."""
        if not blob.startswith(MAGIC):
            return None
        return _parse(blob)[0]

    def _reload(self) -> bool:
        if self._path is None:
            return False
        try:
            keys, active = _read_key_file(self._path)
        except KeyFileError:
            return False
        self._keys, self._active = keys, active
        return True


def _parse(blob: bytes) -> tuple[str, bytes, bytes, bytes, bytes]:
    if not blob.startswith(MAGIC):
        raise DecryptError("not an encrypted blob (no dlsenc1 prefix)")
    try:
        body = json.loads(blob[len(MAGIC):])
        kid = body["kid"]
        if not isinstance(kid, str) or not _KEY_ID_RE.match(kid):
            raise ValueError("bad key id")
        return kid, _unb64(body["wn"]), _unb64(body["wk"]), _unb64(body["n"]), _unb64(body["ct"])
    except (ValueError, KeyError, TypeError, binascii.Error):
        raise DecryptError("malformed encrypted blob") from None


def _read_key_file(p: Path) -> tuple[dict[str, bytes], str]:
    try:
        fd = os.open(p, os.O_RDONLY)
    except FileNotFoundError:
        raise KeyFileError(f"encryption key file {p} does not exist; create one with "
                           "`python -m cluster_manager generate-key --encryption-key-file PATH`"
                           ) from None
    except OSError as e:
        raise KeyFileError(f"cannot open encryption key file {p}: {e.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise KeyFileError(f"encryption key file {p} is not a regular file")
        if st.st_mode & _LOOSE_MODE:
            raise KeyFileError(f"encryption key file {p} is mode "
                               f"{stat.S_IMODE(st.st_mode):04o}; make it 0600 (chmod 600)")
        with os.fdopen(fd, "rb") as f:
            fd = -1
            raw = f.read(1 << 20)
    except OSError as e:
        raise KeyFileError(f"cannot read encryption key file {p}: {e.strerror}") from None
    finally:
        if fd >= 0:
            os.close(fd)
    return _parse_key_file(raw, p)


def _parse_key_file(raw: bytes, p: Path) -> tuple[dict[str, bytes], str]:
    bad = f"encryption key file {p} is malformed"
    try:
        doc: Any = json.loads(raw)
    except ValueError:
        raise KeyFileError(f"{bad}: not JSON") from None
    if not isinstance(doc, dict) or doc.get("version", FILE_VERSION) != FILE_VERSION:
        raise KeyFileError(f"{bad}: want {{\"version\": 1, \"active\": ID, \"keys\": {{ID: BASE64}}}}")
    keys_doc, active = doc.get("keys"), doc.get("active")
    if not isinstance(keys_doc, dict) or not keys_doc or not isinstance(active, str):
        raise KeyFileError(f"{bad}: want \"active\" and a non-empty \"keys\" object")
    keys: dict[str, bytes] = {}
    for kid, v in keys_doc.items():
        try:
            keys[str(kid)] = _unb64(v)
        except (ValueError, binascii.Error):
            raise KeyFileError(f"{bad}: key {str(kid)[:64]!r} is not base64") from None
    if active not in keys:
        raise KeyFileError(f"{bad}: active key {active[:64]!r} is not among the keys")
    try:
        Keyring(keys, active)
    except KeyFileError as e:
        raise KeyFileError(f"{bad}: {e.message}") from None
    return keys, active


def _new_key_id(existing: Mapping[str, bytes]) -> str:
    """``k<n>-<random hex>``: ordered for people, unique across files."""
    nums = [int(m.group(1)) for k in existing if (m := re.match(r"^k(\d+)-", k))]
    return f"k{max(nums, default=len(existing)) + 1}-{secrets.token_hex(4)}"


def _dump(keys: Mapping[str, bytes], active: str) -> bytes:
    doc = {"version": FILE_VERSION, "active": active,
           "keys": {kid: _b64(k) for kid, k in keys.items()}}
    return (json.dumps(doc, indent=2) + "\n").encode()


def _write_private(path: Path, data: bytes, *, replace: bool) -> None:
    """Write ``data`` to a 0600 temp file beside ``path``, fsync, then move it
    into place: ``os.replace`` when ``replace``, else a link that fails if
    ``path`` exists (so a concurrent creator never loses its key)."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        raise KeyFileError(f"cannot write beside {path}: {e.strerror}") from None
    try:
        try:
            os.fchmod(fd, 0o600)
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        if replace:
            os.replace(tmp, path)
        else:
            try:
                os.link(tmp, path)
            except FileExistsError:
                raise KeyFileError(f"encryption key file {path} already exists; "
                                   "not overwriting it") from None
    except OSError as e:
        raise KeyFileError(f"cannot write encryption key file {path}: {e.strerror}") from None
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
    with contextlib.suppress(OSError):
        dfd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def generate_key_file(path: str | os.PathLike[str]) -> Keyring:
    """Create ``path`` (0600) holding one fresh active key; KeyFileError if it exists."""
    p = Path(path)
    keys = {_new_key_id({}): AESGCM.generate_key(bit_length=256)}
    (active,) = keys
    _write_private(p, _dump(keys, active), replace=False)
    return Keyring(keys, active, path=p)


def add_key(path: str | os.PathLike[str]) -> Keyring:
    """Add a fresh key to ``path`` and make it active; the old keys stay so
    existing blobs still decrypt. Returns the new keyring. Run one at a time."""
    p = Path(path)
    keys, _ = _read_key_file(p)
    kid = _new_key_id(keys)
    keys[kid] = AESGCM.generate_key(bit_length=256)
    _write_private(p, _dump(keys, kid), replace=True)
    return Keyring(keys, kid, path=p)
