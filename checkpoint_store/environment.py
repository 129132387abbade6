"""Opening an LMDB folder of the cache that may be damaged or unusable, without crashing.

LMDB maps ``data.mdb`` into memory and trusts it: a file shorter than its meta pages say
makes the first read past its end a SIGBUS (the process dies with nothing logged), and a
damaged B-tree page can point past the end as well. So before the server maps a folder:

1. the meta pages are parsed here, and the file must hold every page they claim
   (``(last page + 1) × page size`` bytes);
2. a child process opens the folder read-only and touches the first and last byte of every
   value, as the store's reads will; if LMDB reports damage or the child dies of a signal,
   the file is damaged.

A damaged ``data.mdb`` is renamed ``data.mdb.damaged-<time>`` (kept for inspection) and the
cache starts empty in the same folder; a folder that cannot be used at all (not a folder,
read-only, no space to create the files) leaves the caller without a disk file (``None``):
one warning each, never an exception. Files are created 0600, a new folder 0700.

Several processes may share a folder (replicas of one model on one host): LMDB serializes their
write transactions and gives each reader a snapshot. The check above runs only when no other
process has the environment open (``in_use``): the file of a running server is being written, so
its size and meta pages may disagree for a moment, and moving it aside (or deleting its lock file)
under that server would split the cache in two. Openers of one folder take turns (``flock`` on the
folder) from the check through ``lmdb.open``, so two servers starting together check it once.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

import lmdb

log = logging.getLogger("checkpoint_store")

DATA_FILE = "data.mdb"
LOCK_FILE = "lock.mdb"
MDB_MAGIC = 0xBEEFC0DE
MDB_DATA_VERSION = 1  # LMDB 0.9.x
P_META = 0x08
# a meta page: 16-byte page header (pgno u64, pad u16, flags u16, lower/upper u16 u16), then MDB_meta:
# magic u32, version u32, address u64, mapsize u64, two MDB_db of 48 bytes (the first one's leading
# u32 is the page size), last_pg u64, txnid u64 (native byte order, 64-bit builds)
PAGE_FLAGS = struct.Struct("=10xH")
META = struct.Struct("=16xIIQQI44x48xQQ")
WALK_TIMEOUT_SECONDS = 300
WALK = """
import sys, lmdb
# with a reader slot (lock) if the folder is writable, so that a server writing to it meanwhile
# does not reuse the pages read here
env = lmdb.open(sys.argv[1], readonly=True, lock=sys.argv[2] == "lock", subdir=True, mode=0o600)
with env.begin(buffers=True) as txn:
    for _, value in txn.cursor():
        if len(value):
            value[0], value[len(value) - 1]
"""


class Meta:
    """What one meta page says: ``page_bytes``, ``last_page`` and the transaction it commits."""

    def __init__(self, raw: bytes, offset: int) -> None:
        if len(raw) < offset + META.size:
            raise ValueError("shorter than its meta pages")
        (flags,) = PAGE_FLAGS.unpack_from(raw, offset)
        magic, version, _, _, page_bytes, last_page, txn_id = META.unpack_from(raw, offset)
        if magic != MDB_MAGIC or not flags & P_META:
            raise ValueError("not an LMDB file (bad meta page)")
        if version != MDB_DATA_VERSION:
            raise ValueError(f"LMDB data format {version}, expected {MDB_DATA_VERSION}")
        if page_bytes < 512 or page_bytes & (page_bytes - 1):
            raise ValueError(f"bad page size {page_bytes}")
        self.page_bytes, self.last_page, self.txn_id = page_bytes, last_page, txn_id


def meta_problem(data_file: Path) -> str | None:
    """Why LMDB must not map ``data_file`` (None: the meta pages agree with the file size)."""
    if data_file.is_dir():
        return "a folder where the data file should be"
    size = data_file.stat().st_size
    try:
        with data_file.open("rb") as f:
            first = Meta(f.read(META.size + 64), 0)
            f.seek(first.page_bytes)
            second = Meta(f.read(META.size + 64), 0)
    except ValueError as exc:
        return str(exc)
    meta = max(first, second, key=lambda m: m.txn_id)
    needed = (meta.last_page + 1) * meta.page_bytes
    if size < needed:
        return f"truncated: {size} bytes, its meta page needs {needed}"
    return None


def walk_problem(folder: Path) -> str | None:
    """Why reading every value of ``folder`` fails (None: it does not), found in a child
    process so that a crash is the child's."""
    try:
        done = subprocess.run(
            [
                sys.executable,
                "-I",
                "-c",
                WALK,
                str(folder),
                "lock" if os.access(folder, os.W_OK) else "no-lock",
            ],
            capture_output=True,
            text=True,
            timeout=WALK_TIMEOUT_SECONDS,
            check=False,
        )
    except subprocess.TimeoutExpired:
        log.warning(
            "checkpoint store: checking %s took over %d s; opening it unchecked", folder, WALK_TIMEOUT_SECONDS
        )
        return None
    if done.returncode < 0:
        return f"reading it crashed the checking process ({_signal_name(-done.returncode)})"
    if done.returncode > 0:
        lines = done.stderr.strip().splitlines()
        return lines[-1] if lines else f"the check exited with status {done.returncode}"
    return None


def damage(folder: Path) -> str | None:
    """Why ``folder``'s data file is damaged, or None (also when there is none yet)."""
    data_file = folder / DATA_FILE
    if not data_file.exists() or (data_file.is_file() and data_file.stat().st_size == 0):
        return None  # nothing yet: LMDB writes a fresh file (and no child process is needed to read it)
    return meta_problem(data_file) or walk_problem(folder)


def in_use(folder: Path) -> bool:
    """Whether a process has the environment in ``folder`` open. LMDB holds a shared POSIX lock on
    the first byte of ``lock.mdb`` while it does; ``/proc/locks`` lists it (read there, not probed
    with ``fcntl``: closing a descriptor of the file would drop this process's own LMDB locks).
    False where ``/proc/locks`` cannot be read."""
    try:
        stat = (folder / LOCK_FILE).stat()
        locks = Path("/proc/locks").read_text()
    except OSError:
        return False
    file_id = f"{os.major(stat.st_dev):02x}:{os.minor(stat.st_dev):02x}:{stat.st_ino}"
    for line in locks.splitlines():
        fields = line.split()
        if len(fields) >= 8 and fields[1] == "POSIX" and fields[5] == file_id and fields[6] == "0":
            return True
    return False


def move_aside(data_file: Path) -> Path:
    aside = data_file.with_name(f"{data_file.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    data_file.rename(aside)
    (data_file.parent / LOCK_FILE).unlink(missing_ok=True)  # describes the old file's readers
    return aside


def open_env(
    folder: str | Path, map_bytes: int, what: str, without: str, **options
) -> lmdb.Environment | None:
    """The LMDB environment in ``folder`` (created 0700 if new, files 0600), or None after one
    warning naming ``what`` ("checkpoint store") and what happens ``without`` it; a damaged
    data file is moved aside first (see the module docstring)."""
    folder = Path(folder)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        with _openers_take_turns(folder):
            problem = None if in_use(folder) else damage(folder)
            if problem is not None:
                aside = move_aside(folder / DATA_FILE)
                log.warning(
                    "%s: %s is damaged (%s); moved it aside to %s and starting with an empty cache",
                    what,
                    folder / DATA_FILE,
                    problem,
                    aside.name,
                )
            env = lmdb.open(str(folder), map_size=map_bytes, subdir=True, mode=0o600, **options)
    except (lmdb.Error, OSError) as exc:
        log.warning("%s: cannot use %s (%s); %s", what, folder, exc, without)
        return None
    for name in (DATA_FILE, LOCK_FILE):  # files an earlier version created 0644
        with contextlib.suppress(OSError):
            (folder / name).chmod(0o600)
    env.reader_check()  # clear reader slots left by a killed process
    return env


@contextlib.contextmanager
def _openers_take_turns(folder: Path):
    fd = os.open(folder, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the flock


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"
