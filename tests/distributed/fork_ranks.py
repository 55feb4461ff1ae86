"""Start the CPU ranks of a script as torchrun does, forked from a process that imported torch
and Megatron once.

    python tests/distributed/fork_ranks.py [--preload MOD,...] NPROC SCRIPT [ARGS...]
    python tests/distributed/fork_ranks.py [--preload MOD,...] --serve

On CPU ranks, a short multi-rank run of the tests' tiny models spends most of its time
starting: every rank imports torch and Megatron (seconds of CPU each), torchrun's agent
imports torch as well, and every process tears its interpreter down at the end (a second
with torch loaded). Here the modules named by ``--preload`` (third-party ones: torch,
megatron.*) are imported once, and the ranks are forked from that process. Each rank gets
torchrun's variables (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT), runs SCRIPT as ``__main__`` (``sys.path[0]`` its folder), prints an uncaught
exception as the interpreter does, runs the exit handlers (``atexit``) and flushes its
output, then ends without tearing the interpreter down. When a rank fails, the others are
stopped (they may be waiting in a collective) and the launch ends with the failed rank's
exit code, as torchrun does.

``NPROC SCRIPT``: one launch; its output goes where this process's goes. ``--serve``: the
tests' fork server (``helpers.start_ranks``), which imports once for a whole test session. It
reads one JSON request a line on stdin, ``{"id", "nproc", "argv": [SCRIPT, ARGS...], "env",
"out"}``, and starts the launch in a process of its own (a new process group, output to the
file ``out``, the environment ``env``), answering ``STARTED id pid`` (``kill -- -pid`` stops
it), then ``DONE id exit-code``; ``REFUSED id reason`` for an ``env`` that differs from the
server's own in a variable the server was started with (the preloaded modules read their
environment at import). At the end of its input it stops what still runs and exits. A
request with ``"plain": true`` is one process instead of ranks (``helpers.run_python``): no
torchrun variables but those ``env`` has, and ``argv`` as ``python`` takes it, ``[SCRIPT,
ARGS...]`` or ``["-m", MODULE, ARGS...]``.

The tests use it on hosts without CUDA and without Transformer Engine only
(``helpers.FORK_RANKS``): CUDA must not be initialised before a fork, and the multi-rank
scripts hide TE from Megatron before importing it, which a preloaded Megatron would not see.
The process that forks runs one thread (forking is safe) and no torch op.
"""

from __future__ import annotations

import argparse
import atexit
import importlib
import json
import os
import select
import signal
import socket
import sys
import traceback


def _rank(rank: int, nproc: int, port: int, script: str, args: list[str]) -> None:
    """A forked rank: run ``script`` as torchrun's rank ``rank`` would, then end."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
                      WORLD_SIZE=str(nproc), LOCAL_WORLD_SIZE=str(nproc),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    _run_main([script, *args])


def _run_main(argv: list[str]) -> None:
    """Run ``argv`` (``SCRIPT ARGS...`` or ``-m MODULE ARGS...``) as ``__main__``, as ``python``
    would, then end with its exit code."""
    import runpy

    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = argv[1:]  # run_module puts the module's file first, as python -m does
            sys.path[0] = os.getcwd()
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(argv)
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        code = stop.code
    except BaseException:  # noqa: BLE001  (what the interpreter prints, then exit code 1)
        traceback.print_exc()
        code = 1
    if code is None:
        code = 0
    elif not isinstance(code, int):  # sys.exit("message")
        print(code, file=sys.stderr)
        code = 1
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def _launch(nproc: int, script: str, args: list[str]) -> int:
    """Fork ``nproc`` ranks of ``script``, wait for them; the launch's exit code."""
    if os.path.isdir("/proc/self/task"):
        assert len(os.listdir("/proc/self/task")) == 1, "fork_ranks.py: a thread is running"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    sys.stdout.flush()
    sys.stderr.flush()
    ranks = {}
    for rank in range(nproc):
        pid = os.fork()
        if pid == 0:
            _rank(rank, nproc, port, script, args)  # does not return
        ranks[pid] = rank
    failed = 0
    while ranks:
        pid, status = os.wait()
        rank, code = ranks.pop(pid), os.waitstatus_to_exitcode(status)
        if code != 0 and not failed:
            failed = code if code > 0 else 1
            print(f"fork_ranks.py: rank {rank} exited with {code}; stopping the other ranks",
                  file=sys.stderr, flush=True)
            for other in ranks:
                os.kill(other, signal.SIGKILL)
    sys.stdout.flush()
    sys.stderr.flush()
    return failed


def _start(request: dict, server_env: dict) -> int | str:
    """Fork the process of one launch (its own process group); its pid, or why not."""
    env = request["env"]
    differs = sorted(k for k, v in server_env.items() if env.get(k) != v)
    if differs:
        return f"the environment differs from the server's in {', '.join(differs)}"
    pid = os.fork()
    if pid == 0:
        try:
            os.setpgid(0, 0)
            out = os.open(request["out"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.dup2(out, 1)
            os.dup2(out, 2)
            os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
            os.environ.clear()
            os.environ.update(env)
            if request.get("plain"):
                _run_main(request["argv"])  # does not return
            script, *args = request["argv"]
            code = _launch(int(request["nproc"]), script, args)
        except BaseException:  # noqa: BLE001
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    try:
        os.setpgid(pid, pid)
    except OSError:  # the child has already set it (or ended)
        pass
    return pid


def _serve() -> None:
    """The fork server's loop (see the module's docstring)."""
    server_env = dict(os.environ)
    running: dict[int, str] = {}

    def reply(line: str) -> None:
        os.write(1, (line + "\n").encode())

    pending = b""
    while True:
        while running:  # reap the launches that ended
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in running:
                reply(f"DONE {running.pop(pid)} {os.waitstatus_to_exitcode(status)}")
        readable, _, _ = select.select([0], [], [], 0.05)
        if not readable:
            continue
        data = os.read(0, 1 << 16)
        if not data:
            break
        pending += data
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            if not line.strip():
                continue
            request = json.loads(line)
            started = _start(request, server_env)
            if isinstance(started, str):
                reply(f"REFUSED {request['id']} {started}")
            else:
                running[started] = str(request["id"])
                reply(f"STARTED {request['id']} {started}")
    for pid in running:  # the tests are done with us
        try:
            os.killpg(pid, signal.SIGKILL)
        except OSError:
            pass
    os._exit(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preload", default="torch",
                        help="comma-separated third-party modules to import before forking")
    parser.add_argument("--serve", action="store_true", help="the tests' fork server")
    parser.add_argument("nproc", type=int, nargs="?")
    parser.add_argument("script", nargs="?")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    opts = parser.parse_args()
    if not opts.serve and (opts.nproc is None or opts.script is None):
        parser.error("NPROC SCRIPT or --serve")

    import torch

    if torch.cuda.is_available():
        raise SystemExit("fork_ranks.py: CPU ranks only (CUDA must not be initialised before "
                         "a fork); use torchrun")
    for name in filter(None, opts.preload.split(",")):
        importlib.import_module(name)
    if opts.serve:
        _serve()
    os._exit(_launch(opts.nproc, opts.script, opts.args))  # nothing of its own to tear down


if __name__ == "__main__":
    main()
