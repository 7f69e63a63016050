"""One writer per run folder: `with run_lock(folder): ...` holds `folder/.lock` while a run writes.

The lock file holds JSON {"pid", "host", "started"} and appears atomically with its contents: it is
written under a unique temp name, then hard-linked to `.lock` (the link fails if `.lock` exists).
A second writer refuses at once with `RunLockedError`, naming the holder. A lock whose holder ran
on this host and is no longer alive (`os.kill(pid, 0)` finds no process) was left by a killed run:
it is taken over with a warning. A lock from another host (or another pid namespace, i.e. another
container, on Linux) is never taken over automatically: the error says which file to remove once
that run is known to be gone.

Taking over a stale lock is serialised by a guard file (`.lock.takeover`, created with O_EXCL): the
holder of the guard re-reads the lock and removes it only if it is still the stale one it judged,
so two processes racing to take over never both end up holding the folder.

Stdlib only, so that any tool can use it without importing JAX.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
import time
import uuid
import warnings
from typing import Iterator

LOCK_NAME = ".lock"
_GUARD_SUFFIX = ".takeover"
_TAKEOVER_WAIT_S = 5.0      # How long to wait for another process's takeover of a stale lock.
_PARTIAL_READ_WAIT_S = 0.5  # How long an empty lock file may be "being written" (no-link fallback).


class RunLockedError(RuntimeError):
  """The run folder is locked by another run (or its lock cannot be judged safely).

  Attributes:
    folder: the run folder.
    lock_path: its lock file.
    holder: the lock's JSON ({"pid", "host", "started"}), or None if it could not be read.
  """

  def __init__(self, message: str, *, folder: str, lock_path: str, holder: dict | None):
    super().__init__(message)
    self.folder, self.lock_path, self.holder = folder, lock_path, holder


@contextlib.contextmanager
def run_lock(folder: str | os.PathLike) -> Iterator[str]:
  """Holds the run folder's lock for the duration of the `with` block.

  Creates `folder` (and its parents) if needed. Not re-entrant: a second `run_lock` on the same
  folder, even from the same process, is refused. Released on exit, also on exceptions; a lock
  that is no longer this run's at exit (removed or replaced by hand) is left alone, with a warning.

  Args:
    folder: the run folder (e.g. an experiment's `--out`).

  Yields:
    The folder path, as a str.

  Raises:
    RunLockedError: another live run holds the folder (names pid, host, start time and the lock
      file), the holder is on another host, or the lock file cannot be read.
    NotADirectoryError: `folder` (or a parent) is a file.
    PermissionError: the folder cannot be created or written (e.g. read-only).
    OSError: other failures creating the folder or the lock, naming the path.
  """
  folder = os.fspath(folder)
  _make_folder(folder)
  lock_path = os.path.join(folder, LOCK_NAME)
  mine = _acquire(folder, lock_path)
  try:
    yield folder
  finally:
    _release(lock_path, mine)


def _make_folder(folder: str) -> None:
  if os.path.exists(folder) and not os.path.isdir(folder):
    raise NotADirectoryError(f"run folder {folder} is a file, not a folder")
  try:
    os.makedirs(folder, exist_ok=True)
  except (FileExistsError, NotADirectoryError):
    raise NotADirectoryError(f"cannot create run folder {folder}: a part of its path is a "
                             f"file") from None
  except PermissionError as e:
    raise PermissionError(f"cannot create run folder {folder}: {e.strerror}") from None
  except OSError as e:
    raise OSError(e.errno, f"cannot create run folder {folder}: {e.strerror}") from None


def _now() -> str:
  return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


def _acquire(folder: str, lock_path: str) -> bytes:
  """Takes the lock; returns the bytes written (to recognise our own lock at release)."""
  mine = json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "started": _now(),
                     "pid_namespace": _pid_namespace()}).encode()
  deadline = time.monotonic() + _TAKEOVER_WAIT_S
  while True:
    if _create(folder, lock_path, mine):
      return mine
    raw = _read(lock_path)
    if raw is None:      # Released between our attempt and the read: try again.
      continue
    holder = _parse(raw)
    if holder is None:
      raise RunLockedError(
          f"run folder {folder} has a lock file {lock_path} that cannot be read "
          f"({raw[:80]!r}); if no run is writing this folder, remove it and start again",
          folder=folder, lock_path=lock_path, holder=None)
    if not _is_stale(holder):
      raise RunLockedError(_locked_message(folder, lock_path, holder), folder=folder,
                           lock_path=lock_path, holder=holder)
    removed = _remove_stale(lock_path, raw)
    if removed:
      warnings.warn(f"run folder {folder}: taking over the lock of a run that is no longer "
                    f"alive ({_describe(holder)})", stacklevel=4)
    elif removed is False:  # The lock changed meanwhile: judge the new one.
      continue
    elif time.monotonic() > deadline:
      raise RunLockedError(
          f"run folder {folder}: another process has been taking over its stale lock for over "
          f"{_TAKEOVER_WAIT_S:g} s; if none is, remove {lock_path}{_GUARD_SUFFIX} and start "
          f"again", folder=folder, lock_path=lock_path, holder=holder)
    else:
      time.sleep(0.05)


def _create(folder: str, lock_path: str, contents: bytes) -> bool:
  """Creates the lock with `contents` atomically; False if a lock already exists."""
  tmp = f"{lock_path}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
  try:
    _write_new(tmp, contents)
    try:
      os.link(tmp, lock_path)
      return True
    except FileExistsError:
      return False
    except OSError as e:
      if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.ENOSYS):
        raise
    try:  # No hard links on this filesystem: O_EXCL on the lock itself, then write.
      _write_new(lock_path, contents)
      return True
    except FileExistsError:
      return False
  except PermissionError as e:
    raise PermissionError(f"run folder {folder} is not writable: cannot create its lock file "
                          f"({e.strerror})") from None
  except OSError as e:
    raise OSError(e.errno, f"run folder {folder}: cannot create its lock file {lock_path} "
                           f"({e.strerror})") from None
  finally:
    with contextlib.suppress(FileNotFoundError):
      os.unlink(tmp)


def _write_new(path: str, contents: bytes) -> None:
  fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
  try:
    os.write(fd, contents)
    os.fsync(fd)
  finally:
    os.close(fd)


def _read(path: str) -> bytes | None:
  """The lock's bytes; None if there is no lock. Waits briefly for an empty (new) lock to fill."""
  deadline = time.monotonic() + _PARTIAL_READ_WAIT_S
  while True:
    try:
      with open(path, "rb") as f:
        raw = f.read()
    except FileNotFoundError:
      return None
    if raw or time.monotonic() > deadline:
      return raw
    time.sleep(0.02)


def _parse(raw: bytes) -> dict | None:
  try:
    holder = json.loads(raw)
  except ValueError:
    return None
  if not isinstance(holder, dict) or not isinstance(holder.get("host"), str):
    return None
  pid = holder.get("pid")
  if isinstance(pid, bool) or not isinstance(pid, int) or pid <= 0:
    return None   # Also pid 0 / negative: os.kill would probe a whole process group.
  return holder


def _pid_namespace() -> int | None:
  """This process's pid namespace (Linux): a container's pids are not judged from another."""
  try:
    return os.stat("/proc/self/ns/pid").st_ino
  except OSError:
    return None


def _same_machine(holder: dict) -> bool:
  """The holder's pid means the same process here: same host name and pid namespace (if known)."""
  theirs, ours = holder.get("pid_namespace"), _pid_namespace()
  return holder["host"] == socket.gethostname() and (None in (theirs, ours) or theirs == ours)


def _is_stale(holder: dict) -> bool:
  """The holder ran here (`_same_machine`) and its process is gone; else never judged stale."""
  if not _same_machine(holder):
    return False
  try:
    os.kill(holder["pid"], 0)
  except ProcessLookupError:
    return True
  except PermissionError:   # Alive, owned by another user.
    return False
  except OverflowError:     # Not a pid this system can have.
    return True
  return False


def _remove_stale(lock_path: str, stale: bytes) -> bool | None:
  """Removes the lock if it still holds `stale`, under the takeover guard.

  Returns:
    True: removed. False: the lock changed or went meanwhile. None: another process holds the
    guard (it is taking over the same stale lock).
  """
  guard = lock_path + _GUARD_SUFFIX
  try:
    os.close(os.open(guard, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
  except FileExistsError:
    return None
  try:
    if _read(lock_path) != stale:
      return False
    os.unlink(lock_path)   # Only the guard holder removes another run's lock: no lost update.
    return True
  finally:
    os.unlink(guard)


def _release(lock_path: str, mine: bytes) -> None:
  if json.loads(mine)["pid"] != os.getpid():   # A forked child leaving the block: not its lock.
    return
  raw = _read(lock_path)
  if raw == mine:
    os.unlink(lock_path)
  else:
    warnings.warn(f"{lock_path} was removed or replaced while this run held it; left as found",
                  stacklevel=4)


def _describe(holder: dict) -> str:
  return (f"pid {holder['pid']} on host {holder['host']}, started "
          f"{holder.get('started', 'at an unknown time')}")


def _locked_message(folder: str, lock_path: str, holder: dict) -> str:
  if not _same_machine(holder):
    return (f"run folder {folder} is locked by a run on another host or container "
            f"({_describe(holder)}); "
            f"use another folder, or, once that run is known to be gone, remove {lock_path} and "
            f"start again")
  return (f"run folder {folder} is in use by another run ({_describe(holder)}); wait for it to "
          f"finish or use another folder (if pid {holder['pid']} is not that run, remove "
          f"{lock_path})")
