"""Which spools a new trainer sweeps (gspo.processes.links: make_spool, sweep_spools): only those
whose owner is dead, told by the owner's flock on the spool's lock file, not by the pid in its name.

The owners here are small processes (`python -c`, no torch) that hold a lock the way a trainer
does: in this pid namespace under a pid no process here has, in a pid namespace of their own
(`unshare`, where this machine allows it), or killed. Each test takes well under a second.
"""

import errno
import fcntl
import os
import shutil
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from gspo.processes import links

NO_PID = 2**22 + 17  # above pid_max's default (and its 64-bit maximum): no process here has it

# holds an exclusive flock on argv[1] until killed (or its stdin closes)
HOLDER = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
print("held", flush=True)
sys.stdin.read()
"""

# a trainer's side of a spool: links.make_spool(argv[1]), then it lives until killed (or its
# stdin closes). links.py is loaded with torch stubbed out: make_spool uses none of it, and
# importing torch takes seconds
TRAINER = """
import importlib.util, os, sys, types
from pathlib import Path
sys.modules["torch"] = torch = types.ModuleType("torch")
sys.modules["torch.distributed"] = torch.distributed = types.ModuleType("torch.distributed")
spec = importlib.util.spec_from_file_location("links", sys.argv[2])
links = importlib.util.module_from_spec(spec)
spec.loader.exec_module(links)
print(os.getpid(), links.make_spool(Path(sys.argv[1])), flush=True)
sys.stdin.read()
"""


def _spool(root: Path, name: str = "abc", lock: bool = True) -> Path:
    """A spool as a trainer with a pid no process here has leaves it: a result not yet read, and
    (unless `lock` is False, as gspo 0.3.0 left them) its lock file, which no one holds."""
    spool = root / f"{links.SPOOL_PREFIX}{NO_PID}-{name}"
    spool.mkdir()
    (spool / "worker0-1.pkl").write_bytes(b"x" * 1000)
    if lock:
        (spool / links.SPOOL_LOCK).touch()
    return spool


def _start(args: list[str]) -> tuple[subprocess.Popen, str]:
    """A process started with `args`, once it has printed its first line (its lock is held)."""
    proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline().strip()
    if not line:
        proc.kill()
        raise AssertionError(f"{args[0]} exited with {proc.wait()} before holding its lock")
    return proc, line


def _kill(proc: subprocess.Popen) -> None:
    proc.kill()  # as the OOM killer would: nothing of its own clean-up runs
    proc.wait()


@pytest.mark.slow  # starts a process
def test_a_spool_whose_lock_a_live_process_holds_is_kept_whatever_its_pid(tmp_path):
    # a trainer in another container sharing /dev/shm: its pid (in the spool's name) means
    # nothing here, only its lock says that it lives. Before the lock, this spool was swept.
    spool = _spool(tmp_path)
    holder, _ = _start([sys.executable, "-c", HOLDER, str(spool / links.SPOOL_LOCK)])
    try:
        mine = links.make_spool(tmp_path)  # sweeps first
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([spool.name, mine.name])
        assert (spool / "worker0-1.pkl").read_bytes() == b"x" * 1000
        links.remove_spool(mine)
    finally:
        _kill(holder)
    mine = links.make_spool(tmp_path)  # its owner is dead now: swept
    assert [p.name for p in tmp_path.iterdir()] == [mine.name]
    links.remove_spool(mine)
    assert not list(tmp_path.iterdir())


def test_spools_of_trainers_that_are_gone_are_removed_and_only_those(tmp_path):
    dead = _spool(tmp_path)  # lock file present, no one holds it
    (dead / "worker1-3.part").write_bytes(b"\0" * 100)  # a worker killed mid-write, too
    legacy = _spool(tmp_path, "old", lock=False)  # gspo 0.3.0's: no lock file
    making = tmp_path / f"{links.SPOOL_PREFIX}{NO_PID}-new"  # one being made: its lock not yet in place
    making.mkdir()
    (making / f".{links.SPOOL_LOCK}-new").touch()
    mine = links.make_spool(tmp_path)
    try:
        # legacy: its pid is nowhere here, yet its trainer may live in another pid namespace
        assert sorted(p.name for p in tmp_path.iterdir()) == sorted([legacy.name, making.name, mine.name])
        assert (mine / links.SPOOL_LOCK).is_file()
        assert [p.name for p in mine.iterdir()] == [links.SPOOL_LOCK]  # the lock under its own name only
    finally:
        links.remove_spool(mine)
    assert not mine.exists()


@pytest.mark.slow  # starts a process
def test_a_spool_made_by_this_process_survives_its_next_one_where_flock_is_a_posix_lock(tmp_path, monkeypatch):
    # on NFS, Linux runs flock as a POSIX lock: the same process's second lock on a file is granted,
    # and closing any descriptor of the file drops the first. A trainer making a second link must
    # neither sweep its first spool nor drop its lock.
    posix = fcntl.lockf
    monkeypatch.setattr(links.fcntl, "flock", lambda fd, op: posix(fd, op))
    first = links.make_spool(tmp_path)
    second = links.make_spool(tmp_path)
    try:
        assert sorted(tmp_path.iterdir()) == sorted([first, second])
        probe = ("import fcntl, os, sys\nfd = os.open(sys.argv[1], os.O_RDWR)\n"
                 "try:\n    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)\nexcept OSError:\n    sys.exit(3)\n")
        taken = subprocess.run([sys.executable, "-c", probe, str(first / links.SPOOL_LOCK)])
        assert taken.returncode == 3  # still held
    finally:
        links.remove_spool(first)
        links.remove_spool(second)


def _unshare() -> list[str]:
    """The command that runs a process in a new pid namespace, or skip saying why there is none."""
    if shutil.which("unshare") is None:
        pytest.skip("no `unshare` (util-linux) on this machine: the other-pid-namespace case needs it")
    cmd = ["unshare", "--pid", "--fork", "--map-root-user"]
    probe = subprocess.run([*cmd, "true"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f"`unshare --pid --fork --map-root-user` fails here ({probe.stderr.strip()[:200]}): "
                    "unprivileged user namespaces are off (common in containers)")
    return cmd


@pytest.mark.slow  # starts a process
def test_a_trainer_in_another_pid_namespace_keeps_its_spool_and_its_death_frees_it(tmp_path):
    # a container sharing /dev/shm (--ipc=host): its trainer is pid 1 there, a pid that is always
    # alive here. Its spool stays while it lives, and goes once it is dead (by pid it never would).
    proc, line = _start([*_unshare(), sys.executable, "-c", TRAINER, str(tmp_path), links.__file__])
    inner_pid, path = line.split(" ", 1)
    spool = Path(path)
    try:
        assert inner_pid == "1" and spool.name.startswith(f"{links.SPOOL_PREFIX}1-")
        (spool / "worker0-1.pkl").write_bytes(b"x" * 1000)
        mine = links.make_spool(tmp_path)
        assert sorted(tmp_path.iterdir()) == sorted([spool, mine])
        links.remove_spool(mine)
    finally:
        # the trainer itself, by its pid here (killing `unshare` would not reach it); `unshare`
        # reaps it, then exits: once it has, the trainer is gone and its lock dropped
        try:
            os.kill(int(Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()[0]), signal.SIGKILL)
        finally:
            proc.stdin.close()  # (if it was not found: it leaves on its own)
            proc.wait()
    mine = links.make_spool(tmp_path)
    assert [p.name for p in tmp_path.iterdir()] == [mine.name]
    links.remove_spool(mine)


def test_a_spool_dir_without_locks_is_refused_in_one_line(tmp_path, monkeypatch):
    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, os.strerror(errno.ENOLCK))  # NFS without its lock service

    monkeypatch.setattr(links.fcntl, "flock", no_locks)
    with pytest.raises(OSError, match=r"could not lock the spool .* \(No locks available\); set GSPO_SPOOL_DIR"):
        links.make_spool(tmp_path)
    assert not list(tmp_path.iterdir())  # nothing left behind



def test_a_lock_that_no_trainer_made_is_never_opened(tmp_path, monkeypatch):
    # /dev/shm is everyone's: a local process may plant a spool whose `lock` is a fifo, a link to a
    # device (a serial port's open waits for its carrier; a terminal becomes the controlling one)
    # or to the user's own file, or a spool that is a link to a directory. A trainer makes its lock
    # a regular file of the spool itself: anything else is left alone, unopened
    planted = {name: tmp_path / f"{links.SPOOL_PREFIX}{NO_PID}-{name}" for name in ("fifo", "linked", "spool-link")}
    victim = tmp_path / "victim"
    victim.mkdir()
    (victim / links.SPOOL_LOCK).write_text("the user's own")
    planted["fifo"].mkdir()
    os.mkfifo(planted["fifo"] / links.SPOOL_LOCK)
    planted["linked"].mkdir()
    (planted["linked"] / links.SPOOL_LOCK).symlink_to(victim / links.SPOOL_LOCK)
    planted["spool-link"].symlink_to(victim)
    opened, real_open = [], os.open

    def recording(*args, **kwargs):  # what each descriptor the sweep opens is
        fd = real_open(*args, **kwargs)
        st = os.fstat(fd)
        opened.append("fifo" if stat.S_ISFIFO(st.st_mode) else "victim" if
                      (st.st_dev, st.st_ino) == ((v := (victim / links.SPOOL_LOCK).stat()).st_dev, v.st_ino) else "")
        return fd

    monkeypatch.setattr(links.os, "open", recording)
    links.sweep_spools(tmp_path)
    assert "fifo" not in opened and "victim" not in opened, opened
    assert all(p.exists() or p.is_symlink() for p in planted.values())
    assert (victim / links.SPOOL_LOCK).read_text() == "the user's own"
