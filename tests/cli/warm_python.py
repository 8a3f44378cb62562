"""Child processes forked from a warm Python: a server process that imported torch, transformers and conveyor's
run path once, and forks one child per request. Each child is a real process of its own (its own pid, exit status,
signals, SIGKILL, locks, stdin/stdout/stderr), started in about a tenth of a second instead of the 8-10 s of a core
that a fresh interpreter spends importing. The tests whose claim is about the interpreter's start itself (signals
while the libraries import, what `--help` imports) start fresh ones instead.

A server is kept per worker process and per value of the environment variables that libraries read when they import
(a child whose environment differs there gets a server of its own); it writes nothing to stderr while it imports, or
it refuses to start (a warning at import that a fresh child would print is not hidden). It forks from one thread, and
no torch thread pool exists in it (no tensor is computed before the fork).
"""

from __future__ import annotations

import atexit
import json
import os
import select
import socket
import subprocess
import sys
import tempfile
import time

# What a `conveyor run` imports that costs (torch, transformers and the model code of the tiny test models, the
# tokenizers, Parquet), and conveyor's run path.
_WARM_IMPORTS = ("torch", "transformers", "transformers.models.llama.modeling_llama", "tokenizers", "safetensors.torch",
                 "pyarrow.parquet", "jinja2", "conveyor.cli.app", "conveyor.io.run", "conveyor.core.engine")
# Environment variables read at import time by those libraries (or by the interpreter): a server serves only children
# whose values of these equal its own.
_IMPORT_TIME_PREFIXES = ("HF_", "HUGGINGFACE", "TRANSFORMERS", "TORCH", "PYTORCH", "OMP_", "MKL_", "KMP_", "GOMP_",
                         "TRITON", "TOKENIZERS", "ARROW", "PYTHON", "LD_", "CUDA", "XDG_")

_SERVER = r"""
import json, os, runpy, select, socket, sys
sock = socket.socket(fileno=int(sys.argv[1]))
for name in sys.argv[2].split(","):
    __import__(name)
sys.stdout.flush(); sys.stderr.flush()
sock.send(b'{"ready": true}')
children, request = set(), None
while request is None:
    readable, _, _ = select.select([sock], [], [], 0.02)
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            break
        if pid == 0:
            break
        children.discard(pid)
        code = -os.WTERMSIG(status) if os.WIFSIGNALED(status) else os.WEXITSTATUS(status)
        sock.send(json.dumps({"exit": pid, "code": code}).encode())
    if not readable:
        continue
    message, fds, _, _ = socket.recv_fds(sock, 1 << 20, 3)
    if not message:
        sys.exit(0)  # the tests' process is gone
    sys.stdout.flush(); sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        sock.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        request = json.loads(message)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = request["argv"]
        break
    for fd in fds:
        os.close(fd)
    children.add(pid)
    sock.send(json.dumps({"started": pid}).encode())
del sock, children, readable, message, fds, pid
if request["module"]:
    runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
else:
    exec(compile(request["code"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
"""


def _import_time_env(env: dict[str, str]) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_IMPORT_TIME_PREFIXES)))


class _Server:
    def __init__(self, env: dict[str, str]) -> None:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        with tempfile.TemporaryFile() as err:
            self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, str(theirs.fileno()), ",".join(_WARM_IMPORTS)],
                                         pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, stderr=err, env=env)
            theirs.close()
            self.sock = ours
            ready = self.sock.recv(1 << 16)
            err.seek(0)
            said = err.read().decode(errors="replace")
        if not ready or said:
            self.proc.kill()
            raise RuntimeError(f"the warm Python's imports failed or wrote to stderr (a fresh child would too):\n{said}")
        self.exits: dict[int, int] = {}

    def start(self, request: dict, fds: list[int]) -> int:
        socket.send_fds(self.sock, [json.dumps(request).encode()], fds)
        while True:
            message = self._receive(None)
            if "started" in message:
                return message["started"]

    def _receive(self, timeout: float | None) -> dict | None:
        if timeout is not None and not select.select([self.sock], [], [], timeout)[0]:
            return None
        data = self.sock.recv(1 << 16)
        if not data:
            raise RuntimeError(f"the warm Python (pid {self.proc.pid}) ended: exit code {self.proc.poll()}")
        message = json.loads(data)
        if "exit" in message:
            self.exits[message["exit"]] = message["code"]
        return message

    def exit_code(self, pid: int, timeout: float) -> int | None:
        """The child's exit code once it has ended (waiting up to `timeout` seconds), else None."""
        deadline = time.monotonic() + timeout
        while pid not in self.exits:
            left = deadline - time.monotonic()
            if self._receive(max(left, 0.0)) is None and left <= 0:
                return None
        return self.exits[pid]

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(30)


_servers: dict[tuple, _Server] = {}


@atexit.register
def _close_servers() -> None:
    for server in _servers.values():
        server.close()


class WarmProcess:
    """A child forked from the warm Python, with the part of `subprocess.Popen`'s interface the tests use: `python
    -m MODULE` (`module`) or `python -c CODE` (`code`) with `argv` as sys.argv (its first item replaced by the module's
    file for `module`, as `-m` does), its stdin/stdout/stderr on the given file descriptors."""

    def __init__(self, argv: list[str], env: dict[str, str], stdin: int, stdout: int, stderr: int,
                 module: str | None = None, code: str | None = None, cwd: str | os.PathLike | None = None) -> None:
        key = _import_time_env(env)
        if key not in _servers:
            _servers[key] = _Server(env)
        self._server = _servers[key]
        request = {"argv": argv, "env": env, "cwd": str(cwd or os.getcwd()), "module": module, "code": code}
        self.pid = self._server.start(request, [stdin, stdout, stderr])
        self.returncode: int | None = None
        self.args = argv

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self._server.exit_code(self.pid, 1e9 if timeout is None else timeout)
            if self.returncode is None:
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(9)


def run_warm(argv: list[str], env: dict[str, str], stdin: bytes | None = None, timeout: float = 600,
             module: str | None = None, code: str | None = None,
             cwd: str | os.PathLike | None = None) -> subprocess.CompletedProcess:
    """Like `subprocess.run(..., capture_output=True)` (bytes) for a warm child; kills it on a timeout."""
    with tempfile.TemporaryFile() as inp, tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        inp.write(stdin or b"")
        inp.seek(0)
        proc = WarmProcess(argv, env, inp.fileno(), out.fileno(), err.fileno(), module=module, code=code, cwd=cwd)
        try:
            returncode = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise
        out.seek(0)
        err.seek(0)
        return subprocess.CompletedProcess(argv, returncode, out.read(), err.read())
