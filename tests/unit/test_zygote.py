"""The suite's fork server (tests/zygote.py) behaves as ``subprocess.Popen`` does for the processes
it forks: pid, exit status (a code, an uncaught error, a signal), pipes, environment, working
directory, sessions, ``-u`` and ``$PYTHONWARNINGS``; and what it must not fork (``-c``) is exec'd.
Reference: the same command exec'd with the zygote switched off, where a difference could hide."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import zygote  # type: ignore[import-not-found]



@pytest.fixture(autouse=True)
def _zygote_on() -> None:
    if not os.environ.get(zygote.ENV):
        pytest.skip("the zygote is off (TESSERA_TEST_FORK=0)")

CHILD = textwrap.dedent("""
    import json, os, sys, warnings
    warnings.warn("a future change", FutureWarning)
    print(json.dumps({"pid": os.getpid(), "cwd": os.getcwd(), "env": os.environ.get("ZTEST"), "argv": sys.argv[1:],
                      "torch": "torch" in sys.modules, "sid": os.getsid(0) == os.getpid()}))
    sys.stdout.flush()
    what = sys.argv[1]
    if what == "code":
        sys.exit(7)
    if what == "raise":
        raise RuntimeError("boom")
    if what == "sleep":
        sys.stdin.read()
""")


@pytest.fixture
def script(tmp_path):
    p = tmp_path / "child.py"
    p.write_text(CHILD)
    return p


def _run(script, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True, timeout=60, **kw)


def test_a_forked_child_is_its_own_process_with_the_callers_env_cwd_and_exit_status(script, tmp_path) -> None:
    import json

    r = _run(script, "code", "x", env={**os.environ, "ZTEST": "yes", "PYTHONWARNINGS": "ignore::FutureWarning"},
             cwd=tmp_path)
    out = json.loads(r.stdout)
    assert r.returncode == 7 and out["pid"] != os.getpid() and out["argv"] == ["code", "x"], r
    assert out["cwd"] == str(tmp_path) and out["env"] == "yes" and r.stderr == "", r
    assert out["torch"], "not forked from the zygote (torch would not be loaded)"
    r = _run(script, "raise")
    assert r.returncode == 1 and "RuntimeError: boom" in r.stderr and "FutureWarning" in r.stderr, r


def test_signals_sessions_and_pipes_reach_the_forked_child(script) -> None:
    p = subprocess.Popen([sys.executable, "-u", str(script), "sleep"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    line = p.stdout.readline()  # -u: the line arrives while the child still runs
    assert '"sid": true' in line and p.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        p.wait(0.2)
    os.killpg(p.pid, signal.SIGTERM)
    assert p.wait(30) == -signal.SIGTERM


def test_c_snippets_are_execed_not_forked() -> None:
    r = subprocess.run([sys.executable, "-c", "import sys; print('torch' in sys.modules)"], capture_output=True,
                       text=True, timeout=60)
    assert r.stdout.strip() == "False", r


PARENT = textwrap.dedent("""
    import os, subprocess, sys
    kid = subprocess.Popen([sys.executable, sys.argv[1], "sleep"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    kid.stdout.readline()
    print(kid.pid, os.getsid(kid.pid), os.getpgid(kid.pid), flush=True)
    sys.stdin.read()
""")


def test_a_new_sessions_descendants_are_in_its_session_and_group(script, tmp_path) -> None:
    """A child started with start_new_session=True gets a zygote of its own, so what it starts is in
    its session and process group (as exec'd children are): killpg reaches them."""
    parent = tmp_path / "parent.py"
    parent.write_text(PARENT)
    p = subprocess.Popen([sys.executable, str(parent), str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, start_new_session=True)
    try:
        kid, sid, pgid = map(int, p.stdout.readline().split())
        assert sid == p.pid and pgid == p.pid and kid != p.pid
        with open(f"/proc/{kid}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[3]) == p.pid  # its session, as /proc says
    finally:
        os.killpg(p.pid, signal.SIGKILL)
    assert p.wait(30) == -signal.SIGKILL
    for _ in range(300):  # the grandchild and the session's zygote are gone with the group
        try:
            os.killpg(p.pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.1)
    else:
        raise AssertionError(f"a process of group {p.pid} outlived its killpg")


def test_a_sitecustomize_on_the_pythonpath_runs_first(tmp_path) -> None:
    """As ``site`` does at an interpreter's start (test_cli_errors_under_load records threads that way)."""
    (tmp_path / "sitecustomize.py").write_text("import builtins\nbuiltins.SITE_RAN = True\n")
    prog = tmp_path / "prog.py"
    prog.write_text("import builtins, sys\nprint(getattr(builtins, 'SITE_RAN', False), 'torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=60,
                       env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert r.stdout.split() == ["True", "True"], r  # ran, and in a forked child
    r = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=60)
    assert r.stdout.split() == ["False", "True"], r


NS_CHILD = textwrap.dedent("""
    import json, os, socket, subprocess, sys
    kid = subprocess.run([sys.executable, "-c", "import os; print(os.readlink('/proc/self/ns/net'))"],
                         capture_output=True, text=True)  # a descendant (exec'd) is in the namespaces too
    print(json.dumps({"net": os.readlink("/proc/self/ns/net"), "mnt": os.readlink("/proc/self/ns/mnt"),
                      "host": socket.gethostname(), "seen": open(sys.argv[1]).read(), "kid_net": kid.stdout.strip(),
                      "env": "TESSERA_TEST_NAMESPACES" in os.environ}))
""")


def test_a_forked_child_enters_the_namespaces_it_is_given(tmp_path) -> None:
    """``zygote.NAMESPACES``: the child joins the network namespace, gets its own mount and UTS
    namespaces with the bind mounts, and this process's mounts and hostname are untouched.
    Reference: what ``ip netns exec`` + ``unshare`` + ``mount --bind`` give (tests/cluster)."""
    import json
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    ns = f"tz{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        (tmp_path / "src").mkdir()
        (tmp_path / "src" / "f").write_text("bound")
        (tmp_path / "dst").mkdir()
        (tmp_path / "dst" / "f").write_text("host's")
        (tmp_path / "child.py").write_text(NS_CHILD)
        spec = {"netns": f"/run/netns/{ns}", "hostname": "zhost", "binds": [[str(tmp_path / "src"), str(tmp_path / "dst")]]}
        r = subprocess.run([sys.executable, str(tmp_path / "child.py"), str(tmp_path / "dst" / "f")], capture_output=True,
                           text=True, timeout=60, env={**os.environ, zygote.NAMESPACES: json.dumps(spec)})
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        ns_ino = "net:[%d]" % os.stat(f"/run/netns/{ns}").st_ino
        assert out["net"] == ns_ino == out["kid_net"] and out["net"] != os.readlink("/proc/self/ns/net"), out
        assert out["mnt"] != os.readlink("/proc/self/ns/mnt") and out["host"] == "zhost" and out["seen"] == "bound", out
        assert not out["env"], "the spec must not reach the child's program (its descendants would enter again)"
        assert (tmp_path / "dst" / "f").read_text() == "host's" and os.uname().nodename != "zhost"
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


NET_CHILD = textwrap.dedent("""
    import json, os, subprocess, sys
    if sys.argv[1:] == ["kid"]:
        print(os.readlink("/proc/self/ns/net"), "torch" in sys.modules)
        raise SystemExit
    kid = subprocess.run([sys.executable, __file__, "kid"], capture_output=True, text=True)  # forked in turn
    print(json.dumps({"net": os.readlink("/proc/self/ns/net"), "forked": "torch" in sys.modules,
                      "kid": kid.stdout.split(), "mnt": os.readlink("/proc/self/ns/mnt")}))
""")


def test_ip_netns_exec_python_is_forked_into_the_network_namespace(tmp_path) -> None:
    """``ip netns exec NS python ...`` (worker.netns.Fabric.prefix: tests/multiproc/test_ps_faults.py)
    is forked into NS, with an ``env=`` that lacks the zygote's variable (a test's copy of os.environ
    made at import); the child's own Python child is forked into NS too. Reference: the namespace
    ``ip netns exec`` would give, and this process's own."""
    import json
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2")
    ns = f"tn{os.getpid()}"
    subprocess.run(["ip", "netns", "add", ns], check=True)
    try:
        (tmp_path / "child.py").write_text(NET_CHILD)
        env = {k: v for k, v in os.environ.items() if k != zygote.ENV}
        r = subprocess.run(["ip", "netns", "exec", ns, sys.executable, str(tmp_path / "child.py")], capture_output=True,
                           text=True, timeout=60, env=env)
        assert r.returncode == 0, r.stderr
        out = json.loads(r.stdout)
        ns_ino = "net:[%d]" % os.stat(f"/run/netns/{ns}").st_ino
        assert out["forked"] and out["net"] == ns_ino != os.readlink("/proc/self/ns/net"), out
        assert out["kid"] == [ns_ino, "True"], out
        assert out["mnt"] == os.readlink("/proc/self/ns/mnt"), "the network alone: no mount namespace of its own"
    finally:
        subprocess.run(["ip", "netns", "del", ns], check=False)


def test_a_zygote_serves_where_a_dead_one_left_its_socket(tmp_path) -> None:
    """A session zygote's socket is named after its leader's pid, and pids wrap (32768 here, the
    suite's threads taking pids too): a later leader with the same pid finds the dead one's file
    there. Before, bind failed and every process that leader started failed with "the session's
    zygote did not start"; now the zygote takes the path over."""
    import socket

    path = str(tmp_path / "sock")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as stale:
        stale.bind(path)  # closed without unlinking: the file stays, as a killed zygote's does
    proc = zygote.start(path)
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(path)  # served by the new zygote
    finally:
        proc.kill()
        proc.wait()


def test_one_thread_waits_while_another_polls(script) -> None:
    """As with subprocess's own Popen, a thread may wait() for a forked child while others poll()
    it: every caller gets the child's exit status or None, and no call fails (before the fix, a
    poll closed the zygote connection under the waiting thread: OSError EBADF, or a lost status).
    Reference: the status the child exits with (7), as an exec'd child gives it."""
    import threading

    for _ in range(20):
        p = subprocess.Popen([sys.executable, str(script), "code"], stdout=subprocess.DEVNULL)
        got: list[object] = []

        def wait(p: subprocess.Popen = p) -> None:
            try:
                got.append(p.wait(30))
            except BaseException as e:  # noqa: BLE001 - reported by the assert below
                got.append(e)

        waiters = [threading.Thread(target=wait) for _ in range(2)]
        for t in waiters:
            t.start()
        polled = []
        while any(t.is_alive() for t in waiters):
            polled.append(p.poll())
        for t in waiters:
            t.join()
        assert got == [7, 7], got
        assert set(polled) <= {None, 7} and p.poll() == 7 and p.returncode == 7, polled
