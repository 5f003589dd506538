"""harbor-hpc's in-container command server (python3 standard library only).

The host starts it as the container's main process and speaks to it over the
container's stdin/stdout pipes, which only the host process holds: there is no
network listener, so no other user on the node can reach it.

Frames (the header is one ASCII line, payloads follow raw):
  host -> server  X <id> <timeout_ms|-> <length>\\n<script>   run a shell script
                  K <id>\\n                                   kill a running script
                  Q\\n                                        quit
  server -> host  H py <uid>\\n                               ready
                  O <id> <length>\\n<bytes>                   stdout chunk
                  E <id> <length>\\n<bytes>                   stderr chunk
                  R <id> <exit code> <-|t>\\n                 finished (t: timed out)

Each script runs in its own session (so a timeout or kill reaches its whole
process group). A bash is kept spawned ahead of time, waiting to source the next
script from a pipe, which takes the shell's start-up off the exec round trip.
"""

# The image's python3 runs this, which may be as old as 3.5: no f-strings. Every module it
# imports is read through the image's FUSE mount before the greeting: no contextlib.
# ruff: noqa: UP031, SIM105

import errno
import os
import select
import sys
import time

try:
    # The signal module's enums import enum, functools and collections: some 7 ms of every
    # container's start through the image's FUSE mounts. Its C part has all the server uses.
    import _signal as signal
except ImportError:  # before 3.5
    import signal

CHUNK = 65536
# After a script's shell exits, how long to wait for background processes that
# inherited its stdout/stderr before answering anyway.
LINGER_SEC = 0.2
SHELL = "/bin/bash" if os.access("/bin/bash", os.X_OK) else "/bin/sh"
# Two, used oldest first: in a quick series of commands the newest is still loading.
WARM_SHELLS = 2
# The shell waits for the line that comes before its script, acknowledges it on fd 4 (then
# closed: no process of the script holds it), and sources the script from fd 3, which reads it
# in a few large reads (`read` would go byte by byte). A shell that dies before its
# acknowledgement never began its script (a task's `kill -9 -1` killed the warm ones too, an
# instant before the next script came): the script runs in a fresh shell instead.
WARM_ARGV = [SHELL, "-c", "read -r _ <&3; printf . >&4; exec 4>&-; . /dev/fd/3"]
# Python ignores SIGPIPE; scripts must get the default back (`yes | head` ends).
RESET_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)
PR_SET_CHILD_SUBREAPER = 36
# Descriptors kept open on the container's tmpfs mounts: the host's memory watchdog reads how
# full they are through /proc/<our pid>/fd/<n> (it cannot enter the container's paths).
TMPFS_FDS = ((61, "/dev/shm"), (62, "/dev"))
# Docker's /dev (`become_subreaper`), remounted with the flags Apptainer mounted it with.
DEV_SIZE = b"size=65536k"
MS_NOSUID, MS_REMOUNT, MS_RELATIME = 2, 32, 1 << 21
# Variables Apptainer sets that a Docker container does not have (and LC_CTYPE, which this
# python3 set for itself when it found LANG=C: PEP 538), then those enroot sets.
APPTAINER_ONLY = ("PS1", "PROMPT_COMMAND", "LANG", "LC_CTYPE", "TERM", "SHELL", "USER", "SHLVL")
# The lock file enroot binds into the root it starts (enroot.py): no Docker container has it.
ENROOT_LOCK = "/.lock"
MNT_DETACH = 2
APPTAINER_PREFIXES = ("APPTAINER_", "SINGULARITY_")
APPTAINER_LIBS = "/.singularity.d/libs"
CLEAN = "clean"  # the last argument of the server started again in Docker's environment


class Poller:
    """The part of selectors.DefaultSelector the server uses, on select.poll: importing
    selectors (and contextlib) read a dozen modules more through the image's FUSE mount before
    the greeting, some 10 ms of every container's start."""

    def __init__(self):
        self.poll = select.poll()
        self.data = {}

    def register(self, fd, data):
        self.poll.register(fd, select.POLLIN)
        self.data[fd] = data

    def modify(self, fd, data):
        self.data[fd] = data

    def unregister(self, fd):
        self.poll.unregister(fd)
        del self.data[fd]

    def select(self, timeout):
        """(fd, data) of each descriptor readable or closed within `timeout` s (None: no limit)."""
        wait_ms = None if timeout is None else int(-(-timeout * 1000 // 1))
        return [(fd, self.data[fd]) for fd, _ in self.poll.poll(wait_ms) if fd in self.data]


class Job:
    def __init__(self, job_id, shell, deadline, script):
        self.id = job_id
        self.pid, out_fd, err_fd, self.ack_fd = shell
        self.fds = {out_fd: b"O", err_fd: b"E"}
        self.deadline = deadline
        self.script = script  # until its shell began it
        self.status = None
        self.exited_at = None
        self.timed_out = False
        self.killed = False  # by the host (a timeout, a kill, a stop): never run again
        self.answered = False


class Server:
    def __init__(self):
        # The channel moves off fds 0/1 so that no script inherits it.
        self.chan_in = os.dup(0)
        self.chan_out = os.dup(1)
        null = os.open(os.devnull, os.O_RDWR)
        os.dup2(null, 0)
        os.dup2(null, 1)
        os.close(null)
        self.selector = Poller()
        self.selector.register(self.chan_in, "channel")
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        os.set_blocking(wake_r, False)
        signal.set_wakeup_fd(wake_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        self.selector.register(wake_r, "wake")
        self.wake_r = wake_r
        self.inbuf = b""
        self.jobs = {}
        self.by_pid = {}
        self.warm = []
        self.running = True

    # -- output to the host -------------------------------------------------
    def send(self, data):
        view = memoryview(data)
        while view:
            try:
                written = os.write(self.chan_out, view)
            except InterruptedError:
                continue
            view = view[written:]

    # -- spawning ----------------------------------------------------------
    def spawn(self):
        """A shell waiting for its script: (pid, stdout, stderr, acknowledgement, script's pipe)."""
        ctl_r, ctl_w = os.pipe()
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        ack_r, ack_w = os.pipe()
        os.set_blocking(ack_r, False)
        pid = spawn_process(WARM_ARGV, ((out_w, 1), (err_w, 2), (ctl_r, 3), (ack_w, 4)))
        for fd in (out_w, err_w, ctl_r, ack_w):
            os.close(fd)
        return pid, out_r, err_r, ack_r, ctl_w

    def prepare_warm(self, count=WARM_SHELLS):
        if SHELL != "/bin/bash":
            return
        while len(self.warm) < count:
            self.warm.append(self.spawn())

    def start_job(self, job_id, timeout_ms, script):
        deadline = None if timeout_ms is None else time.monotonic() + timeout_ms / 1000.0
        if self.warm:
            # The oldest: a shell spawned a moment ago may still be loading.
            shell = self.warm.pop(0)
            self.send_script(shell[4], script)
            # The next warm shell starts while this script runs, not after it answered.
            self.prepare_warm()
        else:
            shell = self.spawn()
            self.send_script(shell[4], script)
        job = Job(job_id, shell[:4], deadline, script)
        self.jobs[job_id] = job
        self.by_pid[job.pid] = job
        for fd in job.fds:
            self.selector.register(fd, job)

    def run_again(self, job):
        """Run the script of `job`, whose shell died before it began it, in a fresh shell."""
        for fd in list(job.fds):
            self.selector.unregister(fd)
            os.close(fd)
        os.close(job.ack_fd)
        shell = self.spawn()
        self.send_script(shell[4], job.script)
        job.pid, out_fd, err_fd, job.ack_fd = shell[:4]
        job.fds = {out_fd: b"O", err_fd: b"E"}
        job.script = None  # once only: a shell that dies again answers as it died
        self.by_pid[job.pid] = job
        for fd in job.fds:
            self.selector.register(fd, job)

    def kill_job(self, job):
        job.killed = True
        kill_group(job.pid)

    @staticmethod
    def began(job):
        """Whether the (ended) shell of `job` acknowledged its script."""
        try:
            return os.read(job.ack_fd, 1) == b"."
        except OSError:  # still held open: only by a shell that is yet to acknowledge
            return False

    @staticmethod
    def send_script(ctl_w, script):
        # A script bigger than the pipe buffer would block us while the shell
        # reads it; the shell sources it as one unit, so write it all then close.
        # The line before it is the one the shell acknowledges.
        view = memoryview(b"\n" + script)
        while view:
            try:
                view = view[os.write(ctl_w, view) :]
            except OSError as exc:
                if exc.errno == errno.EPIPE:
                    break
                raise
        os.close(ctl_w)

    # -- the event loop ----------------------------------------------------
    def run(self):
        self.send(("H py %d\n" % os.getuid()).encode())
        # The host goes on (connects the network, starts its watchdog) while ctypes is imported
        # and the warm shells load: no script can start before the loop reads the channel (nor
        # see Apptainer's /dev). The subreaper first, so that every process the server forks is
        # under it (kernels before 4.11 do not pass it to processes forked before it).
        become_subreaper()
        # One before the first script: a second one loading beside it would slow it down, and
        # every container a node starts at once. The loop makes the second once a script came.
        self.prepare_warm(1)
        while self.running or self.jobs:
            for fd, data in self.selector.select(self.next_wait()):
                if data == "channel":
                    self.read_channel()
                elif data == "wake":
                    self.drain_wake()
                elif data == "orphan":
                    self.read_orphan(fd)
                else:
                    self.read_job(data, fd)
            self.reap()
            self.check_times()
            if self.running:
                self.prepare_warm()
        # Idle shells would outlive us (and keep Apptainer waiting for them).
        for shell in self.warm:
            kill_group(shell[0])
            for fd in shell[1:]:
                os.close(fd)
        kill_container_processes()

    def next_wait(self):
        now = time.monotonic()
        waits = []
        for job in self.jobs.values():
            if job.deadline is not None and not job.timed_out:
                waits.append(job.deadline - now)
            if job.exited_at is not None:
                waits.append(job.exited_at + LINGER_SEC - now)
        return max(0.0, min(waits)) if waits else None

    def read_channel(self):
        try:
            data = os.read(self.chan_in, CHUNK)
        except InterruptedError:
            return
        if not data:
            # The host is gone: nothing can receive results any more.
            self.running = False
            self.selector.unregister(self.chan_in)
            for job in list(self.jobs.values()):
                self.kill_job(job)
            return
        self.inbuf += data
        while True:
            line_end = self.inbuf.find(b"\n")
            if line_end < 0:
                return
            fields = self.inbuf[:line_end].split()
            if fields and fields[0] == b"X":
                length = int(fields[3])
                if len(self.inbuf) < line_end + 1 + length:
                    return
                script = self.inbuf[line_end + 1 : line_end + 1 + length]
                self.inbuf = self.inbuf[line_end + 1 + length :]
                timeout_ms = None if fields[2] == b"-" else int(fields[2])
                self.start_job(fields[1].decode(), timeout_ms, script)
                continue
            self.inbuf = self.inbuf[line_end + 1 :]
            if fields and fields[0] == b"K":
                job = self.jobs.get(fields[1].decode())
                if job is not None:
                    self.kill_job(job)
            elif fields and fields[0] == b"Q":
                self.running = False
                for job in list(self.jobs.values()):
                    self.kill_job(job)

    def drain_wake(self):
        try:
            while os.read(self.wake_r, 512):
                pass
        except (BlockingIOError, InterruptedError):
            pass

    def read_job(self, job, fd):
        try:
            data = os.read(fd, CHUNK)
        except InterruptedError:
            return
        if data:
            if not job.answered:
                header = "%s %s %d\n" % (job.fds[fd].decode(), job.id, len(data))
                self.send(header.encode() + data)
            return
        self.selector.unregister(fd)
        os.close(fd)
        del job.fds[fd]
        self.maybe_finish(job)

    def read_orphan(self, fd):
        # Output of background processes of a finished script: nobody wants it,
        # but reading keeps them from blocking on a full pipe.
        try:
            data = os.read(fd, CHUNK)
        except InterruptedError:
            return
        if not data:
            self.selector.unregister(fd)
            os.close(fd)

    def reap(self):
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            job = self.by_pid.pop(pid, None)
            if job is not None and job.script is not None and not job.killed:
                if not self.began(job):
                    self.run_again(job)
                    continue
                job.script = None
            if job is None:
                for shell in [shell for shell in self.warm if shell[0] == pid]:
                    # A warm shell died (killed from outside): the loop spawns another.
                    self.warm.remove(shell)
                    for fd in shell[1:]:
                        os.close(fd)
                continue
            job.status = exit_code(status)
            job.exited_at = time.monotonic()
            self.maybe_finish(job)

    def check_times(self):
        now = time.monotonic()
        for job in list(self.jobs.values()):
            if job.deadline is not None and not job.timed_out and now >= job.deadline:
                job.timed_out = True
                self.kill_job(job)
            if job.exited_at is not None and now >= job.exited_at + LINGER_SEC:
                for fd in list(job.fds):
                    self.selector.modify(fd, "orphan")
                job.fds.clear()
                self.maybe_finish(job)

    def maybe_finish(self, job):
        if job.status is None or job.fds or job.answered:
            return
        job.answered = True
        os.close(job.ack_fd)
        del self.jobs[job.id]
        flag = "t" if job.timed_out else "-"
        self.send(("R %s %d %s\n" % (job.id, job.status, flag)).encode())


def spawn_process(argv, fd_map):
    """Start `argv` in a session of its own, with the (source, target) descriptors of `fd_map`."""
    if hasattr(os, "posix_spawn"):  # Python 3.8 and later
        actions = [(os.POSIX_SPAWN_DUP2, source, target) for source, target in fd_map]
        return os.posix_spawn(
            argv[0], argv, os.environ, file_actions=actions, setsid=True, setsigdef=RESET_SIGNALS
        )
    pid = os.fork()
    if pid == 0:
        try:
            for signum in RESET_SIGNALS:
                signal.signal(signum, signal.SIG_DFL)
            os.setsid()
            for source, target in fd_map:
                if source == target:
                    os.set_inheritable(target, True)
                else:
                    os.dup2(source, target)
            os.execv(argv[0], argv)
        finally:
            os._exit(127)
    return pid


def kill_container_processes():
    """Kill what the scripts left running (daemons), before we go: whatever shares our
    mount namespace. Only where that namespace is the container's own, not our parent's
    (Apptainer's): run on a host, this must never touch the host's processes. This covers
    a host that died without stopping us; a normal stop kills them from the host too."""
    try:
        own = os.readlink("/proc/self/ns/mnt")
        if own == os.readlink("/proc/%d/ns/mnt" % os.getppid()):
            return
        entries = os.listdir("/proc")
    except OSError:
        return
    for entry in entries:
        if entry.isdigit() and int(entry) != os.getpid():
            try:
                if os.readlink("/proc/%s/ns/mnt" % entry) == own:
                    os.kill(int(entry), signal.SIGKILL)
            except OSError:
                pass


def kill_group(pid):
    try:
        os.killpg(pid, signal.SIGKILL)
    except OSError:
        pass


def exit_code(status):
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


def become_subreaper():
    """Orphans of the scripts (daemons that double-fork) become our children rather than
    leaving the container's process tree, where the host's memory watchdog and stop look.
    And Docker's /dev: a tmpfs of 64 MB. Apptainer's is as big as half the node's memory, so
    a task's file there grew its container's memory, where Docker's meets a full disk: the
    container's root owns the mount and remounts it (where it may not, Apptainer's stays).
    Under enroot, its lock file is unmounted and removed from the root."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        libc.mount(b"none", b"/dev", None, MS_REMOUNT | MS_NOSUID | MS_RELATIME, DEV_SIZE)
        with open("/proc/self/mountinfo", "rb") as mounts:
            enroot = (" %s " % ENROOT_LOCK).encode() in mounts.read()
        if enroot and libc.umount2(ENROOT_LOCK.encode(), MNT_DETACH) == 0:
            os.unlink(ENROOT_LOCK)
    except (OSError, AttributeError, ImportError):
        pass


def hold_tmpfs_fds():
    for number, path in TMPFS_FDS:
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            continue
        os.dup2(fd, number, inheritable=False)
        os.close(fd)


def docker_environment(image_env_file):
    """The environment a Docker container has: the image's ENV (written by the host from the
    image's config), HOME and PATH, without Apptainer's own variables and prompt."""
    for name in list(os.environ):
        if name.startswith(APPTAINER_PREFIXES) or name in APPTAINER_ONLY:
            del os.environ[name]
    libs = [part for part in os.environ.get("LD_LIBRARY_PATH", "").split(":") if part]
    if APPTAINER_LIBS in libs:
        libs.remove(APPTAINER_LIBS)
        if libs:
            os.environ["LD_LIBRARY_PATH"] = ":".join(libs)
        else:
            del os.environ["LD_LIBRARY_PATH"]
    try:
        with open(image_env_file, "rb") as file:
            items = file.read().split(b"\0")
    except OSError:
        return
    for item in items:
        name, _, value = item.partition(b"=")
        if name:
            os.environb[name] = value


def main():
    # The container's first process (Apptainer's --no-init), as a Docker container's init: the
    # kernel drops a signal sent to it from inside the container unless it handles that signal,
    # so a task's `kill -9 -1` or `kill -INT 1` cannot end it. Python handles SIGINT itself.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    # Docker's umask, whatever the user's (a cluster login often has 077): files the task's root
    # makes stay readable by its other users, as the task expects.
    os.umask(0o022)
    workdir = sys.argv[1] if len(sys.argv) > 1 else "/"
    image_env = sys.argv[2] if len(sys.argv) > 2 else ""
    docker_environment(image_env)
    if sys.argv[3:4] != [CLEAN] and sys.executable:
        # Once more with Docker's environment from the start: this process's /proc/PID/environ
        # (what a task reads of it, of PID 1 when the server is the container's init) is what
        # it was started with, whatever os.environ became. (Python's own locale coercion may
        # change os.environ again: the argument, not the environment, says it was done.)
        try:
            again = [sys.executable, "-I", "-S", sys.argv[0], workdir, image_env, CLEAN]
            os.execve(sys.executable, again, os.environ)
        except OSError:
            pass
    hold_tmpfs_fds()
    try:
        os.makedirs(workdir, exist_ok=True)
        os.chdir(workdir)
    except OSError as exc:
        sys.stderr.write("harbor-hpc server: cannot use workdir %s: %s\n" % (workdir, exc))
    Server().run()


if __name__ == "__main__":
    main()
