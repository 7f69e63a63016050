"""run_lock: one writer per run folder, stale locks taken over, clear errors on bad folders."""

import contextlib
import json
import os
import pwd
import re
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from pope_jax import run_lock as run_lock_module
from pope_jax.run_lock import LOCK_NAME, RunLockedError, run_lock

# Child processes load run_lock.py by path: it is stdlib only, and skipping the package's JAX
# import keeps each child to a fraction of a second.
_LOAD = textwrap.dedent(f"""
    import importlib.util, sys, time
    spec = importlib.util.spec_from_file_location("run_lock", {run_lock_module.__file__!r})
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
""")


def _child(code: str, *args: str) -> subprocess.Popen:
  return subprocess.Popen([sys.executable, "-c", _LOAD + textwrap.dedent(code), *args],
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(path, timeout=60.0):
  deadline = time.monotonic() + timeout
  while not os.path.exists(path):
    assert time.monotonic() < deadline, f"{path} never appeared"
    time.sleep(0.02)


def test_lock_file_names_this_run_and_is_released(tmp_path):
  folder = tmp_path / "a" / "run"
  with run_lock(folder) as got:
    assert got == str(folder)
    holder = json.loads((folder / LOCK_NAME).read_text())
    assert holder["pid"] == os.getpid() and holder["host"] == socket.gethostname()
    assert holder["started"].endswith("+00:00")
    assert sorted(os.listdir(folder)) == [LOCK_NAME]     # No temp files left behind.
  assert os.listdir(folder) == []
  with run_lock(folder):                                   # Free again.
    pass


def test_second_writer_in_another_process_is_refused_naming_the_holder(tmp_path):
  with run_lock(tmp_path):
    child = _child("""
        try:
          with m.run_lock(sys.argv[1]):
            print("acquired")
        except m.RunLockedError as e:
          print(type(e).__name__, e.holder["pid"], e)
        """, str(tmp_path))
    out, err = child.communicate(timeout=120)
  assert child.returncode == 0, err
  assert out.startswith(f"RunLockedError {os.getpid()} ")
  assert f"pid {os.getpid()} on host {socket.gethostname()}, started 20" in out
  assert str(tmp_path) in out and "acquired" not in out
  assert not (tmp_path / LOCK_NAME).exists()


def test_same_process_is_refused_too(tmp_path):
  with run_lock(tmp_path):
    with pytest.raises(RunLockedError, match=f"in use by another run .pid {os.getpid()}"):
      with run_lock(tmp_path):
        pass
    assert (tmp_path / LOCK_NAME).exists()                 # The refused attempt kept it.


def test_lock_of_a_killed_run_is_taken_over_with_a_warning(tmp_path):
  child = _child("""
      with m.run_lock(sys.argv[1]):
        open(sys.argv[1] + "/ready", "w").close()
        time.sleep(600)
      """, str(tmp_path))
  try:
    _wait_for(tmp_path / "ready")
  finally:
    child.send_signal(signal.SIGKILL)
    child.wait()
  stale = json.loads((tmp_path / LOCK_NAME).read_text())
  assert stale["pid"] == child.pid
  with pytest.warns(UserWarning, match=re.escape(f"no longer alive (pid {child.pid} on host "
                                                 f"{socket.gethostname()}, started "
                                                 f"{stale['started']})")):
    with run_lock(tmp_path):
      assert json.loads((tmp_path / LOCK_NAME).read_text())["pid"] == os.getpid()
  assert not (tmp_path / LOCK_NAME).exists()


def _dead_pid() -> int:
  p = subprocess.Popen([sys.executable, "-c", "pass"])
  p.wait()
  return p.pid


def test_racing_takeovers_of_a_stale_lock_leave_one_holder(tmp_path):
  (tmp_path / LOCK_NAME).write_text(json.dumps(
      {"pid": _dead_pid(), "host": socket.gethostname(), "started": "2026-01-01T00:00:00+00:00"}))
  start = time.time() + 2.0
  children = [_child("""
      import warnings
      warnings.simplefilter("ignore")
      while time.time() < float(sys.argv[2]):
        pass
      try:
        with m.run_lock(sys.argv[1]):
          print("acquired", flush=True)
          time.sleep(3.0)
      except m.RunLockedError as e:
        print("refused", e.holder and e.holder["pid"])
      """, str(tmp_path), str(start)) for _ in range(4)]
  results = [c.communicate(timeout=120) for c in children]
  outs = [out.strip() for out, _ in results]
  assert all(c.returncode == 0 for c in children), [err for _, err in results]
  winners = [c.pid for c, out in zip(children, outs) if out == "acquired"]
  assert len(winners) == 1, outs
  assert sorted(o for o in outs if o != "acquired") == [f"refused {winners[0]}"] * 3
  assert os.listdir(tmp_path) == []


def test_lock_from_another_host_is_never_taken_over(tmp_path):
  holder = {"pid": _dead_pid(), "host": "elsewhere.example", "started": "2026-01-02T03:04:05"}
  (tmp_path / LOCK_NAME).write_text(json.dumps(holder))
  with pytest.raises(RunLockedError, match="another host or container .pid .* on host "
                                           "elsewhere.example, started 2026-01-02T03:04:05.*"
                                           "remove .*/.lock") as e:
    with run_lock(tmp_path):
      pass
  assert e.value.holder == holder and e.value.folder == str(tmp_path)
  assert json.loads((tmp_path / LOCK_NAME).read_text()) == holder


@pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="no pid namespaces")
def test_lock_from_another_pid_namespace_is_never_taken_over(tmp_path):
  other = os.stat("/proc/self/ns/pid").st_ino + 1
  holder = {"pid": _dead_pid(), "host": socket.gethostname(), "started": "2026-01-02T03:04:05",
            "pid_namespace": other}
  (tmp_path / LOCK_NAME).write_text(json.dumps(holder))
  with pytest.raises(RunLockedError, match="another host or container"):
    with run_lock(tmp_path):
      pass
  assert json.loads((tmp_path / LOCK_NAME).read_text()) == holder


@pytest.mark.parametrize("contents", ["", "{", '{"pid": 0, "host": "h"}', "[1]"])
def test_unreadable_lock_is_refused_not_taken_over(tmp_path, contents):
  (tmp_path / LOCK_NAME).write_text(contents)
  with pytest.raises(RunLockedError, match="cannot be read.*remove it"):
    with run_lock(tmp_path):
      pass
  assert (tmp_path / LOCK_NAME).read_text() == contents


def test_released_on_exception(tmp_path):
  with pytest.raises(KeyError, match="boom"):
    with run_lock(tmp_path):
      raise KeyError("boom")
  assert not (tmp_path / LOCK_NAME).exists()


def test_lock_replaced_by_hand_is_left_alone_with_a_warning(tmp_path):
  with pytest.warns(UserWarning, match="removed or replaced"):
    with run_lock(tmp_path):
      (tmp_path / LOCK_NAME).write_text("someone else's")
  assert (tmp_path / LOCK_NAME).read_text() == "someone else's"


def test_folder_that_is_a_file_is_named(tmp_path):
  path = tmp_path / "results.json"
  path.write_text("{}")
  with pytest.raises(NotADirectoryError, match=f"run folder {path} is a file"):
    with run_lock(path):
      pass
  with pytest.raises(NotADirectoryError, match=f"cannot create run folder {path}/run: "):
    with run_lock(path / "run"):
      pass


@contextlib.contextmanager
def _unprivileged():
  """Drops the effective uid when running as root (root writes to read-only folders)."""
  if os.geteuid() != 0:
    yield
    return
  try:
    nobody = pwd.getpwnam("nobody").pw_uid
  except KeyError:
    pytest.skip("running as root without a 'nobody' user")
  os.seteuid(nobody)
  try:
    yield
  finally:
    os.seteuid(0)


def test_read_only_folder_is_named():
  base = tempfile.mkdtemp()          # Not tmp_path: its parents are private to the owner.
  try:
    os.chmod(base, 0o755)
    folder = os.path.join(base, "ro")
    os.mkdir(folder, 0o555)
    with _unprivileged():
      with pytest.raises(PermissionError, match=f"run folder {folder} is not writable"):
        with run_lock(folder):
          pass
      with pytest.raises(PermissionError, match=f"cannot create run folder {folder}/run"):
        with run_lock(os.path.join(folder, "run")):
          pass
    assert os.listdir(folder) == []
  finally:
    os.chmod(os.path.join(base, "ro"), 0o755)
    for root, dirs, files in os.walk(base, topdown=False):
      for name in files:
        os.unlink(os.path.join(root, name))
      for name in dirs:
        os.rmdir(os.path.join(root, name))
    os.rmdir(base)
