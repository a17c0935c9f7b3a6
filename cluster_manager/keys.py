"""The encryption key file of ClusterManager and its two maintenance commands.

``python -m cluster_manager generate-key --encryption-key-file F`` creates F
(0600, one key; never overwrites). ``python -m cluster_manager rotate-key
--etcd HOST:PORT [--prefix P] --encryption-key-file F`` adds a new active key
to F, keeping the old ones, then re-encrypts every stored credential under it
(records written before encryption existed are encrypted too) and prints how
many it rewrote. It is safe to run again: records already under the active
key are left alone.

Every ClusterManager must read the same key file. A running one re-reads its
file when it meets a record under a key it does not hold, so a rotation on a
shared file (or a Secret volume the kubelet refreshes) needs no restart; the
new file must reach every replica before or while rotate-key runs.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from dlsched.errors import DlschedError
from dlsched.kit import etcd
from dlsched.kit.envelope import KeyFileError, Keyring, add_key, generate_key_file

from .store import ClusterStore

ENV_KEY_FILE = "DLSCHED_ENCRYPTION_KEY_FILE"
KEY_FILE_HELP = (f"JSON key file (mode 0600) of the keys that encrypt cluster credentials in "
                 f"etcd; default ${ENV_KEY_FILE}. Create one with `python -m cluster_manager "
                 "generate-key --encryption-key-file PATH`")

log = logging.getLogger("cluster_manager.keys")


def add_key_file_flag(p: argparse.ArgumentParser) -> None:
    """``--encryption-key-file``; its default comes from the environment, read here only."""
    p.add_argument("--encryption-key-file", default=os.environ.get(ENV_KEY_FILE) or None,
                   help=KEY_FILE_HELP)


def load_or_exit(path: str | None) -> Keyring:
    """The keyring ClusterManager starts with; exits 2 with the reason when there
    is none, rather than ever storing credentials unencrypted."""
    try:
        if not path:
            raise KeyFileError(f"no encryption key: pass --encryption-key-file or set "
                               f"{ENV_KEY_FILE}; create a key file with `python -m "
                               "cluster_manager generate-key --encryption-key-file PATH`")
        return Keyring.load(path)
    except KeyFileError as e:
        log.error("cannot start: %s", e.message)
        print(f"cluster_manager: cannot start: {e.message}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None


async def rotate(etcd_options: etcd.EtcdOptions | str, prefix: str, key_file: str) -> tuple[str, int]:
    """Add a key to ``key_file`` and re-encrypt every credential: (new key id, rewritten)."""
    current = Keyring.load(key_file)  # a broken file fails before anything changes
    client = await etcd.connect(etcd_options)
    try:
        await ClusterStore(client, current, prefix).current_revision()  # etcd answers first
        keyring = add_key(key_file)
        return keyring.active_key_id, await ClusterStore(client, keyring, prefix).reencrypt_all()
    finally:
        await client.close()


def main(command: str, argv: Sequence[str]) -> int:
    """``generate-key`` or ``rotate-key``; the exit status."""
    p = argparse.ArgumentParser(prog=f"python -m cluster_manager {command}",
                                description=__doc__.split("\n\n")[1] if __doc__ else None)
    if command == "rotate-key":
        etcd.add_etcd_flags(p)
        p.add_argument("--prefix", default="/dlsched/", help="etcd key prefix")
    add_key_file_flag(p)
    a = p.parse_args(argv)
    if not a.encryption_key_file:
        p.error(f"--encryption-key-file (or ${ENV_KEY_FILE}) is required")
    try:
        if command == "generate-key":
            kr = generate_key_file(a.encryption_key_file)
            print(f"created {a.encryption_key_file} with key {kr.active_key_id}")
            return 0
        kid, n = asyncio.run(rotate(etcd.etcd_options_from_args(a, p), a.prefix, a.encryption_key_file))
    except DlschedError as e:
        print(f"cluster_manager {command}: {e.message}", file=sys.stderr)
        return 1
    print(f"re-encrypted {n} credential record(s) under key {kid}")
    return 0
