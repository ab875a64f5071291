"""The suite's forked commands (tests/helpers/zygote.py) behave as fresh ones, and start fresh where they
would not."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import psutil
import pytest

from helpers import zygote


@pytest.fixture(scope="module")
def zygotes():
    made: list[zygote.Zygote] = []
    yield made
    for z in made:
        z.proc.kill()


@pytest.fixture
def forks(zygotes):
    """The module's zygote (each imports torch: ~9 s of CPU), or a new one where a test ended it."""
    if not zygotes or zygotes[-1].proc.poll() is not None:
        zygotes.append(zygote.Zygote())
    return zygotes[-1]


def fresh(*args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "asyncrl", *args], capture_output=True, text=True, cwd=cwd, timeout=120
    )


def test_a_forked_command_prints_and_exits_as_a_fresh_one(forks, tmp_path):
    for args in (("prepare", "--cfg", "seed=3"), ("prepare", "trainer.optim.lrr=1"), ("nonsense",)):
        got = forks.run(args, 120, tmp_path)
        assert got is not None, args
        want = fresh(*args, cwd=tmp_path)
        assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr), args
    assert forks.run(("prepare", "trainer.optim.lrr=1"), 120, tmp_path).returncode == 2


def test_the_working_directory_comes_first_on_the_path_as_with_python_m(forks, tmp_path):
    """A user's transport beside the command, named by import path, is found as in a fresh start; and missed
    the same way where it is not there."""
    mine = "from asyncrl.transport.files import Files\n\nclass Mine(Files):\n    name = 'mine'\n"
    (tmp_path / "mine.py").write_text(mine)
    for cwd, code in ((tmp_path, 0), (tmp_path.parent, 2)):
        got = forks.run(("prepare", "--cfg", "weights.transport=mine:Mine"), 120, cwd)
        assert got is not None and got.returncode == code, (cwd, got)
        assert got.stderr == fresh("prepare", "--cfg", "weights.transport=mine:Mine", cwd=cwd).stderr


def test_a_pythonpath_of_its_own_is_searched_as_in_a_fresh_start(forks, tmp_path):
    """A user's transport in a directory on ``PYTHONPATH`` is found by a forked command as by a fresh one, in
    the same place on the path; a directory that would shadow a module the zygote imported (here
    ``transformers``) starts fresh, as does an environment that differs in more than ``PYTHONPATH``."""
    plugins, shadow = tmp_path / "plugins", tmp_path / "shadow"
    plugins.mkdir()
    (plugins / "mine.py").write_text(
        "import sys\nfrom asyncrl.transport.files import Files\n\n"
        "print(sys.path.index(__file__.rpartition('/')[0]))\n\n\nclass Mine(Files):\n    name = 'mine'\n"
    )
    (shadow / "transformers").mkdir(parents=True)
    args = ("prepare", "--cfg", "weights.transport=mine:Mine")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(plugins), os.environ.get("PYTHONPATH")])),
    }
    got = forks.run(args, 120, tmp_path, env)
    want = subprocess.run(
        [sys.executable, "-m", "asyncrl", *args], capture_output=True, text=True, cwd=tmp_path, env=env
    )
    assert got is not None and (got.returncode, got.stdout, got.stderr) == (0, want.stdout, want.stderr)
    assert want.stdout.splitlines()[0] == "1", want.stdout  # right after the working directory
    assert forks.run(args, 120, tmp_path, {**env, "PYTHONPATH": f"{shadow}{os.pathsep}{plugins}"}) is None
    assert forks.run(args, 120, tmp_path, {**env, "SOMETHING_ELSE": "1"}) is None
    assert forks.run(args, 120, tmp_path).returncode == 2  # and the zygote's own path stays as it was


def test_a_command_whose_numerics_load_other_kernels_starts_fresh(forks, tmp_path):
    assert forks.run(("prepare", "--cfg", "numerics=fast"), 120, tmp_path) is None
    assert forks.run(("prepare", "--cfg", "numerics=reproducible"), 120, tmp_path) is not None


def test_a_changed_import_time_variable_starts_fresh(forks, tmp_path, monkeypatch):
    monkeypatch.setenv("ATEN_CPU_CAPABILITY", "default")
    assert forks.run(("prepare", "--cfg"), 120, tmp_path) is None


def test_past_its_timeout_the_forked_command_and_its_session_go(forks, tmp_path):
    """The hang guard of subprocess.run: TimeoutExpired, and nothing the command started left; the zygote
    serves on."""
    # a user's transport whose import starts a process and hangs: the config check imports it
    (tmp_path / "hangs.py").write_text(
        "import subprocess, time\nsubprocess.Popen(['sleep', '61.5'])\ntime.sleep(60)\n"
    )
    with pytest.raises(subprocess.TimeoutExpired):
        forks.run(("prepare", "--cfg", "weights.transport=hangs:X"), 3, tmp_path)
    time.sleep(0.5)
    left = [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "61.5"]]
    assert not left and not psutil.Process(forks.proc.pid).children(recursive=True), left
    assert forks.run(("prepare", "--cfg"), 120, tmp_path) is not None


def test_an_exit_code_already_in_the_pipe_is_read_not_waited_for(forks, tmp_path, monkeypatch):
    """On a busy machine the zygote may write a fast command's pid and exit code before the test reads
    either."""
    read = forks._line

    def late(timeout):
        time.sleep(2)  # the command ends meanwhile: both lines wait in the pipe
        return read(timeout)

    monkeypatch.setattr(forks, "_line", late)
    start = time.monotonic()
    got = forks.run(("fly",), 20, tmp_path)
    assert got is not None and got.returncode == 2 and time.monotonic() - start < 15


def test_a_background_command_shows_its_command_line_beside_other_commands(forks, tmp_path):
    """:meth:`Zygote.start`, as the crash tests and the sidecar fixtures use it: ``pid`` is the command's own
    process, whose title, and the title a process it forks gives itself (as the launcher's children do), is
    what the tests find processes by; other commands fork meanwhile; killed, its exit code is the signal's,
    as Popen's."""
    child = "python -m asyncrl orchestrate --config-file x"
    (tmp_path / "forks_one.py").write_text(  # imported by the config check, as a user's transport
        "import os, time, setproctitle\nif os.fork() == 0:\n"
        f"    setproctitle.setproctitle({child!r})\n    time.sleep(60)\n    os._exit(0)\ntime.sleep(60)\n"
    )
    forked = forks.start(("prepare", "--cfg", "weights.transport=forks_one:X"), tmp_path, tmp_path / "log")
    assert forked is not None and forked.poll() is None
    try:
        deadline = time.monotonic() + 60
        while not psutil.Process(forked.pid).children() and time.monotonic() < deadline:
            time.sleep(0.1)
        title = " ".join(psutil.Process(forked.pid).cmdline())
        assert title.startswith(f"{sys.executable} -m asyncrl prepare --cfg"), title
        assert [" ".join(p.cmdline()).strip() for p in psutil.Process(forked.pid).children()] == [child]
        # the zygote serves on meanwhile
        assert forks.run(("prepare", "--cfg"), 120, tmp_path).returncode == 0
        assert forked.poll() is None
    finally:
        os.killpg(forked.pid, 9)
    assert forked.wait(30) == -9


# where a test does not start the command itself (DVC's stages): the shim `asyncrl` on PATH


# imported by the config check
PROBE = "import os, pathlib\npathlib.Path('parent').write_text(str(os.getppid()))\n"


def shim_run(forks, tmp_path, *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["asyncrl", *args], env=forks.shim_env({**os.environ, **env}), cwd=tmp_path, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip


def test_a_shim_command_is_forked_with_the_callers_streams_and_exit_code(forks, tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    for args in (("prepare", "--cfg", "seed=3"), ("prepare", "trainer.optim.lrr=1"), ("nonsense",)):
        got, want = shim_run(forks, tmp_path, *args), fresh(*args, cwd=tmp_path)
        assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr), args
    got = shim_run(forks, tmp_path, "prepare", "--cfg", "weights.transport=probe:X")
    # the zygote's child
    assert got.returncode == 2 and int((tmp_path / "parent").read_text()) == forks.proc.pid


def test_a_shim_command_under_other_startup_variables_starts_fresh(forks, tmp_path):
    (tmp_path / "probe.py").write_text(PROBE)
    got = shim_run(forks, tmp_path, "prepare", "--cfg", "weights.transport=probe:X", PYTHONHASHSEED="7")
    # the shim became it
    assert got.returncode == 2 and int((tmp_path / "parent").read_text()) == os.getpid()
    got = shim_run(forks, tmp_path, "prepare", "--cfg", "numerics=fast", "seed=5")
    # the child asked for a fresh start: the shim made it
    assert got.returncode == 0 and "seed: 5" in got.stdout


def test_a_signal_to_the_shim_stops_the_commands_session(forks, tmp_path):
    (tmp_path / "hangs.py").write_text(
        "import subprocess, time\nsubprocess.Popen(['sleep', '62.5'])\ntime.sleep(60)\n"
    )
    shim = subprocess.Popen(
        ["asyncrl", "prepare", "--cfg", "weights.transport=hangs:X"], env=forks.shim_env(dict(os.environ)),
        cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "62.5"]]:
        assert time.monotonic() < deadline and shim.poll() is None
        time.sleep(0.1)
    shim.terminate()
    assert shim.wait(timeout=30) == 128 + 15
    time.sleep(0.5)
    assert not [p for p in psutil.process_iter(["cmdline"]) if p.info["cmdline"] == ["sleep", "62.5"]]
    assert shim_run(forks, tmp_path, "prepare", "--cfg").returncode == 0  # the zygote serves on


def test_a_module_the_zygote_preloads_is_imported_in_its_later_forks(forks, tmp_path):
    (tmp_path / "probe.py").write_text("import sys\nprint('wave' in sys.modules)\n")  # imported by the check
    args = ("prepare", "--cfg", "weights.transport=probe:X")
    assert forks.run(args, 120, tmp_path).stdout.splitlines()[0] == "False"
    forks.preload(["wave"])
    assert forks.run(args, 120, tmp_path).stdout.splitlines()[0] == "True"


SERVER_SCRIPT = """
import multiprocessing, os, sys

def report(conn):  # the fork server's parent, and whether torch came with the fork
    import psutil
    conn.send([psutil.Process(os.getppid()).ppid(), "torch" in sys.modules])

if __name__ == "__main__":
    multiprocessing.set_executable(sys.argv[1])  # what a forked command's multiprocessing has
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["json"])
    ours, theirs = context.Pipe()
    child = context.Process(target=report, args=(theirs,))
    child.start()
    print(*ours.recv())
    child.join()
"""


def test_a_commands_fork_server_forks_from_the_zygote_unless_its_imports_would_differ(forks, tmp_path):
    """multiprocessing's fork server (each orchestrator's, for its env workers) starts through the zygote's
    ``python``: forked from the zygote, its children find torch imported; under other kernel variables it
    starts fresh, as it would without the zygote."""
    (tmp_path / "server.py").write_text(SERVER_SCRIPT)
    python = os.path.join(forks.dir, "python")
    capability = "avx2" if forks.base.get("ATEN_CPU_CAPABILITY") == "default" else "default"
    other = {**forks.base, "ATEN_CPU_CAPABILITY": capability}  # read when torch is imported
    for env, forked in ((forks.base, True), (other, False)):
        argv = [sys.executable, "server.py", python]
        run = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        assert run.returncode == 0, run.stderr
        parent, has_torch = run.stdout.split()
        assert (int(parent) == forks.proc.pid) is forked and (has_torch == "True") is forked, run.stdout


# last: it ends the module's zygote
def test_the_zygote_ends_when_its_worker_closes_the_pipe_and_takes_its_commands_along(forks, tmp_path):
    (tmp_path / "stays.py").write_text("import time\ntime.sleep(60)\n")  # imported by the config check
    forked = forks.start(("prepare", "--cfg", "weights.transport=stays:X"), tmp_path, tmp_path / "log")
    assert forked is not None and psutil.pid_exists(forked.pid)
    assert forks.close(timeout=120) == 0
    deadline = time.monotonic() + 10
    while not _gone(forked.pid):
        assert time.monotonic() < deadline, "the worker's background command outlived its zygote"
        time.sleep(0.1)


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE  # ended, not yet reaped by init
    except psutil.NoSuchProcess:
        return True
