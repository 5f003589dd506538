"""The first process of an environment's own user, mount and pid namespaces (containers/holder.py).

Started by `unshare --user --map-root-user --map-auto --mount --pid --fork --kill-child
--mount-proc` with the host's python3 (`-I -S`: nothing but the standard library). It mounts each
container's root as the driver asks, one JSON line per request on stdin, one JSON line answered on
stdout, and reaps the namespace's orphans. It ends when its stdin does (the driver ended, even by
SIGKILL), and with it every process and mount of the namespaces.
"""

import json
import os
import select
import signal
import stat
import subprocess
import sys


def run(argv, pass_fds=()):
    done = subprocess.run(
        argv, stdin=subprocess.DEVNULL, capture_output=True, timeout=120, pass_fds=pass_fds
    )
    if done.returncode != 0:
        said = (done.stderr or done.stdout).decode(errors="replace").strip()
        said = said or f"exit status {done.returncode}"
        raise OSError(f"{os.path.basename(argv[0])}: {said}")


def make_targets(merged, dirs, files):
    """The mount points Apptainer binds onto (it makes none in a --writable folder), made inside
    the container's root: a link in the image (/var/run -> /run) leads into it, never out."""
    child = os.fork()
    if child == 0:
        code = 0
        try:
            os.chroot(merged)
            os.chdir("/")
            for folder in dirs:
                os.makedirs(folder, exist_ok=True)
            for name in files:
                if not os.path.lexists(name):
                    os.makedirs(os.path.dirname(name) or "/", exist_ok=True)
                    os.close(os.open(name, os.O_WRONLY | os.O_CREAT, 0o644))
        except OSError as exc:
            os.write(2, f"{exc}\n".encode())
            code = 1
        os._exit(code)
    _, status = os.waitpid(child, 0)
    if os.waitstatus_to_exitcode(status) != 0:
        raise OSError(f"cannot make the mount points in {merged}")


def mount(request):
    lower = request["lower"]
    if request.get("sif"):
        # allow_other: the image's other users (a task's USER, apt's _apt) read it too.
        # The image by descriptor, as Apptainer hands it over: no process names its path.
        options = f"offset={request['offset']},allow_other"
        image = os.open(request["sif"], os.O_RDONLY)
        try:
            run([request["squashfuse"], "-o", options, f"/proc/self/fd/{image}", lower], (image,))
        finally:
            os.close(image)
    # The root folder of an overlay is its upper's: the image's own owner and mode, not the
    # user's umask.
    image_root = os.stat(lower)
    os.chown(request["upper"], image_root.st_uid, image_root.st_gid)
    os.chmod(request["upper"], stat.S_IMODE(image_root.st_mode))
    # A snapshot's layers (topmost first) between the upper and the image.
    lowers = ":".join([*request.get("above", []), lower])
    dirs = f"lowerdir={lowers},upperdir={request['upper']},workdir={request['work']}"
    # Its options (holder.py OVERLAY_OPTIONS): userxattr, and volatile (no sync of the disk).
    overlay = f"{dirs},{request['options']}"
    run(["mount", "-t", "overlay", "overlay", "-o", overlay, request["merged"]])
    if request.get("shm"):
        # The container's /dev/shm, as Docker's: a tmpfs of its own, 64 MB unless told.
        options = f"size={request['shm_size']},mode=1777,nosuid,nodev"
        run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", request["shm"]])
    make_targets(request["merged"], request.get("dirs", []), request.get("files", []))


def reap():
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def main():
    os.chdir("/")
    os.umask(0o022)  # mount points as Docker makes them, whatever the user's umask
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    requests = sys.stdin.buffer
    print(json.dumps({"ready": os.getpid()}), flush=True)
    while True:
        ready, _, _ = select.select([requests, wake_read], [], [])
        if wake_read in ready:
            os.read(wake_read, 512)
            reap()
        if requests in ready:
            line = requests.readline()
            if not line:
                return  # the driver is gone: the namespaces end with this process
            try:
                mount(json.loads(line))
                answer = {"ok": True}
            except (OSError, subprocess.SubprocessError, KeyError, ValueError) as exc:
                answer = {"ok": False, "error": str(exc)}
            print(json.dumps(answer), flush=True)
            reap()


main()
