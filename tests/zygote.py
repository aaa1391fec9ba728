"""A fork server for the suite's Python child processes: the interpreter and torch are loaded once.

Most of the suite's CPU went to starting Python processes (shards, workers, ranks, bench children):
each paid about 2-3 CPU-s for ``import torch``, hundreds of times. Under the suite, a per-worker
zygote process imports the heavy third-party libraries once and *forks* a child for each Python
command a test (or a process a test started) runs: ``python -m MOD ...``, ``python SCRIPT ...``, the
``tessera`` console script. The child is a real process with its own pid, signals, file
descriptors, environment and exit status, running the real program from its ``__main__``; only the
interpreter start and the third-party imports are shared. The project's own modules are *not*
preloaded, so each child imports them fresh under its own environment.

How a start is routed: ``install()`` replaces ``subprocess.Popen`` with ``ZygotePopen``, which
forks through the zygote named by ``$TESSERA_TEST_ZYGOTE`` in the caller's own environment (not in
the ``env=`` it passes) when the command is a plain Python invocation of this interpreter, alone or
after ``ip netns exec NS`` (the child then joins that network namespace), and execs as usual
otherwise (``-c`` snippets, other programs, ``preexec_fn``/``pass_fds``/uid changes). A process forked from the zygote inherits
the patch, so a torchrun agent's ranks or a bench's shard children are forked too. Tests about the
interpreter itself (what a fresh process imports, how it exits) opt out: ``conftest.REAL_PROCESSES``.

Why it is safe to fork: the zygote has only its main thread and BLAS's idle pool (fork-safe), and
never runs a parallel torch op (libgomp's pool does not survive a fork); it checks its thread count
after preloading and refuses to serve otherwise.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import selectors
import signal
import socket
import struct
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

ENV = "TESSERA_TEST_ZYGOTE"
# a JSON {"netns": PATH, "hostname": NAME, "binds": [[SRC, DST], ...]} in a child's environment: the
# child enters that network namespace and a private mount and UTS namespace of its own with those bind
# mounts, as ``ip netns exec NS unshare --uts --mount ... mount --bind`` would put it (tests/cluster);
# {"netns": PATH} alone, the network only (what ZygotePopen sends for ``ip netns exec NS python ...``)
NAMESPACES = "TESSERA_TEST_NAMESPACES"
# not grpc: its C core reads $GRPC_VERBOSITY (which tessera's CLI sets to hide core log lines) when
# imported, so each child imports it under its own environment (0.04 CPU-s)
PRELOAD = ("numpy", "torch", "torch.nn", "torch._dynamo", "torch.distributed", "torch.distributed.run", "torch.distributed.tensor",
           "sympy", "google.protobuf", "msgpack", "cryptography.x509", "tqdm")
_LEN = struct.Struct("!q")
_REAL_POPEN = subprocess.Popen
_BIN = Path(sys.executable).parent
_FILTERS: list = []  # the zygote's warning filters after preloading (a child starts from them)


# ----------------------------------------------------------------------------------------- client


def python_command(args: list[str]) -> list[str] | None:
    """What a forked child should run, as ``["-m", mod, *argv]`` / ``[script, *argv]``, or None when
    the command is not a plain Python program of this interpreter (it is then exec'd as usual)."""
    if not args:
        return None
    prog = os.fspath(args[0])
    rest = [os.fspath(a) for a in args[1:]]
    if prog in (sys.executable, "python", "python3") or Path(prog) in (Path(sys.executable), _BIN / "python", _BIN / "python3"):
        while rest and rest[0] == "-u":
            rest = rest[1:]
        if not rest or (rest[0].startswith("-") and rest[0] != "-m"):
            return None  # -c, -X, -I ...: exec a real interpreter
        if rest[0] == "-m":
            return rest if len(rest) >= 2 else None
        return rest if rest[0].endswith(".py") else None
    if Path(prog).parent == _BIN and Path(prog).name == "tessera":
        return [str(_BIN / "tessera"), *rest]  # the console script: a Python file
    return None


class ZygotePopen(_REAL_POPEN):  # type: ignore[misc, valid-type]
    """``subprocess.Popen`` that forks Python commands from the zygote (see the module docstring)."""

    _zconn: socket.socket | None = None  # the zygote's connection: our child's exit status arrives on it
    _forked = False

    def _execute_child(self, args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo, creationflags,
                       shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite, restore_signals, gid, gids, uid,
                       umask, start_new_session, process_group):  # noqa: ANN001 (subprocess's own signature)
        # the calling process's environment decides, not ``env``: a test module that copied os.environ
        # when it was imported (before the session's zygote started) still forks its children
        path = os.environ.get(ENV, "")
        argv = None if isinstance(args, (str, bytes, os.PathLike)) else list(args)
        netns = ""
        if argv and len(argv) > 4 and Path(os.fspath(argv[0])).name == "ip" and list(argv[1:3]) == ["netns", "exec"]:
            netns, argv = os.fspath(argv[3]), argv[4:]  # a Python program in a network namespace: forked into it
        command = python_command(argv) if argv and not shell and executable is None else None
        if (not path or command is None or preexec_fn is not None or pass_fds or uid is not None or gid is not None
                or gids is not None or umask >= 0):
            return super()._execute_child(args, executable, preexec_fn, close_fds, pass_fds, cwd, env, startupinfo,
                                          creationflags, shell, p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite,
                                          restore_signals, gid, gids, uid, umask, start_new_session, process_group)
        child_env = dict(env if env is not None else os.environ, **{ENV: path})  # its own children fork too
        if netns:
            child_env[NAMESPACES] = json.dumps({"netns": f"/run/netns/{netns}"})
        if argv and len(argv) > 1 and os.fspath(argv[1]) == "-u":
            child_env["PYTHONUNBUFFERED"] = "1"
        request = json.dumps({
            "command": command, "env": child_env,
            "cwd": os.fspath(cwd) if cwd is not None else os.getcwd(),
            "new_session": bool(start_new_session), "pgid": process_group if process_group is not None else -1,
        }).encode()
        fds = [p2cread if p2cread != -1 else 0, c2pwrite if c2pwrite != -1 else 1, errwrite if errwrite != -1 else 2]
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            conn.connect(path)
            socket.send_fds(conn, [_LEN.pack(len(request))], fds)
            conn.sendall(request)
            (pid,) = _LEN.unpack(_recv_exact(conn, _LEN.size))
        except BaseException:
            conn.close()
            raise
        finally:  # the child holds its copies now; ours close as after a fork (never a caller's own fd)
            self._close_pipe_fds(p2cread, p2cwrite, c2pread, c2pwrite, errread, errwrite)
        if pid < 0:
            conn.close()
            raise OSError(-pid, f"zygote could not start {command[:2]}")
        self.pid = pid
        self._child_created = True
        self._forked = True
        self._zconn = conn

    def _zstatus(self, timeout: float | None) -> int | None:
        conn = self._zconn
        assert conn is not None
        conn.settimeout(timeout)
        try:
            data = _recv_exact(conn, _LEN.size)
        except (socket.timeout, BlockingIOError):
            return None
        finally:
            if self._zconn is not None:
                conn.settimeout(None)
        conn.close()
        self._zconn = None
        return _LEN.unpack(data)[0] if data else -signal.SIGKILL  # zygote gone: treat as killed

    # One thread at a time reads the zygote connection, under Popen's own _waitpid_lock as subprocess
    # reaps a child: a poll while another thread waits answers None (as subprocess's does), and no
    # caller closes the connection under another one's read.
    def _internal_poll(self, _deadstate=None, _waitpid=os.waitpid, _WNOHANG=os.WNOHANG, _ECHILD=10):  # noqa: ANN001, N803
        if not self._forked:
            return super()._internal_poll(_deadstate, _waitpid, _WNOHANG, _ECHILD)
        if self.returncode is None and self._waitpid_lock.acquire(False):
            try:
                if self.returncode is None and self._zconn is not None:
                    self.returncode = self._zstatus(0.0)
            finally:
                self._waitpid_lock.release()
        return self.returncode

    def _wait(self, timeout):  # noqa: ANN001
        if not self._forked or self.returncode is not None:
            return super()._wait(timeout) if not self._forked else self.returncode
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._waitpid_lock.acquire(timeout=-1 if timeout is None else max(0.0, timeout)):
            raise subprocess.TimeoutExpired(self.args, timeout)
        try:
            if self.returncode is None:
                code = self._zstatus(None if deadline is None else max(0.0, deadline - time.monotonic()))
                if code is None:
                    raise subprocess.TimeoutExpired(self.args, timeout)
                self.returncode = code
            return self.returncode
        finally:
            self._waitpid_lock.release()


def _recv_exact(conn: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = conn.recv(n - len(buf))
        if not chunk:
            return b""
        buf += chunk
    return buf


def install() -> None:
    """Route this process's Python child starts through the zygote named by ``$TESSERA_TEST_ZYGOTE``
    (``subprocess.Popen``, and torchrun's own reference to it when that is already imported)."""
    subprocess.Popen = ZygotePopen  # type: ignore[misc]
    handler = sys.modules.get("torch.distributed.elastic.multiprocessing.subprocess_handler.subprocess_handler")
    if handler is not None:
        handler.Popen = ZygotePopen  # type: ignore[attr-defined]


def start(socket_path: str) -> subprocess.Popen:
    """Start a zygote serving ``socket_path``; returns once it serves (its preloading done)."""
    proc = _REAL_POPEN([sys.executable, __file__, socket_path, str(os.getpid())], stdin=subprocess.DEVNULL,
                       stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline() if proc.stdout else ""
    if line.strip() != "ready":
        proc.kill()
        raise RuntimeError(f"zygote did not start: {line.strip() or 'exited'}")
    return proc


# ----------------------------------------------------------------------------------------- server


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


def serve(socket_path: str, parent: int, ready_fd: int = 1) -> None:
    install()  # first: a preloaded module that does `from subprocess import Popen` (torchrun's) takes ours
    for name in PRELOAD:
        __import__(name)
    if "grpc" in sys.modules:
        raise RuntimeError("a preloaded module imported grpc: a child could not set its $GRPC_VERBOSITY")
    threads = _threads()
    global _FILTERS
    _FILTERS = list(warnings.filters)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    # a session zygote's path names its leader's pid: a file there is a dead one's of the same pid
    # (pids wrap at /proc/sys/kernel/pid_max, 32768 here, and the suite's threads take pids too)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(socket_path)
    listener.bind(socket_path)
    listener.listen(64)
    rfd, wfd = os.pipe()
    os.set_blocking(rfd, False)
    os.set_blocking(wfd, False)
    signal.set_wakeup_fd(wfd)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ, "accept")
    sel.register(rfd, selectors.EVENT_READ, "chld")
    waiting: dict[int, socket.socket] = {}
    os.write(ready_fd, b"ready\n")
    os.dup2(os.open(os.devnull, os.O_WRONLY), 1)  # nobody reads our stdout after this line
    while True:
        if os.getppid() != parent:  # the test process is gone
            return
        for key, _ in sel.select(timeout=1.0):
            if key.data == "chld":
                try:
                    while os.read(rfd, 512):
                        pass
                except BlockingIOError:
                    pass
            else:
                conn, _ = listener.accept()
                if _threads() > threads:  # something started a pool that would not survive a fork
                    conn.sendall(_LEN.pack(-35))  # EDEADLK
                    conn.close()
                    continue
                pid = _fork_child(conn, listener, sel, waiting, rfd, wfd)
                if pid is not None:
                    waiting[pid] = conn
        while waiting:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is not None:
                try:
                    conn.sendall(_LEN.pack(os.waitstatus_to_exitcode(status)))
                except OSError:
                    pass
                conn.close()


def _fork_child(conn, listener, sel, waiting, rfd, wfd) -> int | None:  # noqa: ANN001
    try:
        fds: list[int] = []
        msg, fds, _, _ = socket.recv_fds(conn, _LEN.size, 3)
        (n,) = _LEN.unpack(msg)
        req = json.loads(_recv_exact(conn, n))
    except (OSError, ValueError, struct.error):
        conn.close()
        for fd in fds:
            os.close(fd)
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        for fd in fds:
            os.close(fd)
        conn.sendall(_LEN.pack(pid))
        return pid
    # the child: drop the server's descriptors, become the requested process, run, exit
    try:
        signal.set_wakeup_fd(-1)
        sel.close()
        listener.close()
        for c in waiting.values():
            c.close()
        conn.close()
        os.close(rfd)
        os.close(wfd)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        for fd in set(fds):
            if fd > 2:
                os.close(fd)
        code = _become(req)
    except BaseException:  # noqa: BLE001 (the child must never return into the server loop)
        import traceback

        traceback.print_exc()
        code = 1
    os._exit(code)


def _become(req: dict) -> int:
    import atexit
    import runpy
    import threading

    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    env = req["env"]
    entered = NAMESPACES in env
    if entered:  # first: the zygote made below and every descendant then live in them too
        _enter(json.loads(env.pop(NAMESPACES)))
    if req["new_session"]:
        os.setsid()
    elif req["pgid"] >= 0:
        os.setpgid(0, req["pgid"])
    if req["new_session"] or entered:
        env[ENV] = _session_zygote(env[ENV])
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(env)
    warnings.filters[:] = _FILTERS  # then $PYTHONWARNINGS, as an interpreter applies it at start
    sys.warnoptions[:] = [o for o in env.get("PYTHONWARNINGS", "").split(",") if o]
    warnings._processoptions(sys.warnoptions)  # type: ignore[attr-defined]
    unbuffered = bool(env.get("PYTHONUNBUFFERED"))
    sys.stdin = io.TextIOWrapper(io.BufferedReader(io.FileIO(0, "r", closefd=False)), encoding="utf-8")
    sys.stdout = _text_out(1, unbuffered, "strict")
    sys.stderr = _text_out(2, True, "backslashreplace")
    sys.__stdin__, sys.__stdout__, sys.__stderr__ = sys.stdin, sys.stdout, sys.stderr
    if env.get("OMP_NUM_THREADS", "").isdigit():  # libgomp read it when the zygote loaded torch
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    import numpy

    numpy.random.seed()  # a fresh process's global RNG is seeded from the OS; the zygote's was copied
    command = req["command"]
    base = [p for p in sys.path[1:] if p]
    extra = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    code = 0
    try:
        _sitecustomize(extra + base)
        if command[0] == "-m":
            sys.argv = [command[1], *command[2:]]
            sys.path[:] = [os.getcwd(), *extra, *base]
            runpy._run_module_as_main(command[1], alter_argv=True)  # what `python -m` does
        else:
            sys.argv = list(command)
            sys.path[:] = [str(Path(command[0]).resolve().parent), *extra, *base]
            runpy.run_path(command[0], run_name="__main__")
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    except BaseException:  # noqa: BLE001 (an uncaught error: the traceback, exit 1, as Python does)
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # wait for non-daemon threads, as at exit
    atexit._run_exitfuncs()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):
            pass
    return code


def _enter(spec: dict) -> None:
    """Join ``spec["netns"]`` and unshare a private mount and UTS namespace with ``spec["binds"]``
    (a forked child is single-threaded, as unshare(CLONE_NEWNS) needs). Python 3.11 has no os.setns."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)

    def check(rc: int, what: str) -> None:
        if rc != 0:
            e = ctypes.get_errno()
            raise OSError(e, f"{what}: {os.strerror(e)}")

    fd = os.open(spec["netns"], os.O_RDONLY)
    try:
        check(libc.setns(fd, 0x40000000), f"setns {spec['netns']}")  # CLONE_NEWNET
    finally:
        os.close(fd)
    if "hostname" not in spec and not spec.get("binds"):
        return  # the network alone, as ``ip netns exec`` gives it (but /sys is not remounted)
    check(libc.unshare(0x00020000 | 0x04000000), "unshare")  # CLONE_NEWNS | CLONE_NEWUTS
    check(libc.mount(b"none", b"/", None, 0x4000 | 0x40000, None), "mount --make-rprivate /")  # MS_REC | MS_PRIVATE
    name = spec["hostname"].encode()
    check(libc.sethostname(name, len(name)), "sethostname")
    for src, dst in spec["binds"]:
        check(libc.mount(src.encode(), dst.encode(), None, 0x1000, None), f"mount --bind {src} {dst}")  # MS_BIND


def _session_zygote(parent_socket: str) -> str:
    """A zygote for the new session this process leads, or for the namespaces it entered: forked now,
    while this process is still a clean copy of the zygote, it serves this process's descendants, so
    they are in its session, process group and namespaces as exec'd ones would be (``os.killpg``, "no process of the session is left" checks
    see them). It dies with this process (PR_SET_PDEATHSIG). Returns its socket's path."""
    import ctypes

    path = f"{parent_socket}.{os.getpid()}"
    leader = os.getpid()
    r, w = os.pipe()
    if os.fork() == 0:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
            if os.getppid() != leader:
                os._exit(0)
            os.close(r)
            null = os.open(os.devnull, os.O_RDWR)
            for fd in (0, 1, 2):
                os.dup2(null, fd)
            serve(path, leader, ready_fd=w)
        except BaseException as e:  # noqa: BLE001 - said on the ready pipe: its stderr is /dev/null
            os.write(w, f"{type(e).__name__}: {e}".replace("\n", " ").encode() + b"\n")
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r, "rb") as f:
        line = f.readline().strip()
    if line != b"ready":
        raise RuntimeError(f"the session's zygote did not start: {line.decode(errors='replace') or 'exited'}")
    return path


def _sitecustomize(path: list[str]) -> None:
    """What ``site`` does at an interpreter's start: import ``sitecustomize`` from the path (a test's
    $PYTHONPATH may hold one), before the program runs."""
    import importlib.machinery

    sys.modules.pop("sitecustomize", None)
    if importlib.machinery.PathFinder.find_spec("sitecustomize", path) is not None:
        sys.path[:] = path
        import sitecustomize  # noqa: F401


def _text_out(fd: int, unbuffered: bool, errors: str) -> io.TextIOWrapper:
    raw = io.FileIO(fd, "w", closefd=False)
    tty = os.isatty(fd)
    return io.TextIOWrapper(raw if unbuffered else io.BufferedWriter(raw), encoding="utf-8", errors=errors,
                            line_buffering=tty or errors != "strict", write_through=unbuffered)


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
