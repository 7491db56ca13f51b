"""Runs test scenarios (Python source) each in its own process, fast.

A scenario may crash its process (that is often what it tests), so it cannot run
in pytest's. A fresh interpreter costs about 10 s here: 8 to import torch,
torch_xla and transformers, 2 to tear them down. So one server process per test
session imports them once and forks a child per scenario; the child starts with
everything imported and no XLA client yet (the server never creates one), runs
the scenario, and leaves with `os._exit` after what a normal exit does for user
code (joining threads, atexit), skipping the module teardown. A crash takes down
only the child.

A scenario is either source or a function defined at the top level of a test
module (`call_source`): the child imports that module and calls it.

Run as a script, this file is the server: it reads one JSON request a line on
stdin and answers each with one JSON line on stdout.
"""
import ast
import atexit
import importlib
import inspect
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import traceback
import types

# Imported before forking: what scenarios import, minus torch_xla_ext, which
# each scenario imports afresh (the code under test may have changed on disk,
# and import-time behaviour is itself tested).
PRELOADED = (
    "numpy", "torch", "torch_xla", "torch_xla.core.xla_model", "torch_xla.core.xla_builder",
    "torch_xla.debug.metrics", "torch_xla.runtime", "torch_xla.distributed.spmd",
    "torch_xla.utils.checkpoint", "functorch.compile", "transformers",
    # The base of transformers' models, which the first model a scenario makes
    # imports otherwise: about 0.8 s of every such scenario.
    "transformers.modeling_utils",
)


# --- the server (this file run as a script) ---------------------------------

def _import_time_changes(before: dict) -> dict:
    """The variables the preloaded imports set, which a fresh interpreter would
    set too when the scenario imports them."""
    return {k: v for k, v in os.environ.items() if before.get(k) != v}


def _scenario_environment(requested: dict, import_changes: dict) -> dict:
    environment = dict(requested)
    for name, value in import_changes.items():
        if name == "XLA_FLAGS":
            # torch_xla adds its flags to the caller's; keep both.
            flags = environment.get(name, "").split()
            flags += [flag for flag in value.split() if flag not in flags]
            environment[name] = " ".join(flags)
        else:
            environment.setdefault(name, value)
    return environment


def _run_child(request: dict, import_changes: dict, base_path: list) -> None:
    """In the forked child: becomes the scenario's process and never returns."""
    code = 1
    try:
        os.setpgid(0, 0)  # so a timeout can kill the scenario with its children
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(os.open(request["stdout"], os.O_WRONLY), 1)
        os.dup2(os.open(request["stderr"], os.O_WRONLY), 2)
        environment = _scenario_environment(request["env"], import_changes)
        os.environ.clear()
        os.environ.update(environment)
        extra_path = [p for p in environment.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = ["", *extra_path, *base_path]
        main = types.ModuleType("__main__")
        main.__builtins__ = __builtins__
        sys.modules["__main__"] = main
        sys.argv = ["-c"]
        try:
            exec(compile(request["source"], "<string>", "exec"), main.__dict__)
            code = 0
        except SystemExit as exit_request:
            if exit_request.code is None or isinstance(exit_request.code, int):
                code = exit_request.code or 0
            else:
                print(exit_request.code, file=sys.stderr)
        except BaseException:
            traceback.print_exc()
        threading._shutdown()  # what interpreter exit does: join non-daemon threads
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve() -> None:
    before = dict(os.environ)
    for name in PRELOADED:
        importlib.import_module(name)
    import_changes = _import_time_changes(before)
    base_path = [p for p in sys.path if p not in ("", os.path.dirname(__file__))]
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run_child(request, import_changes, base_path)
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), flush=True)


# --- the client (in pytest's process) ----------------------------------------

def call_source(function, args: tuple = ()) -> tuple[str, str]:
    """Source that imports `function`'s module and calls `function(*args)`,
    and the folder to import that module from. `function` must be defined at
    the top level of its module, and `args` be literals (they are passed as
    their repr)."""
    if not inspect.isfunction(function) or function.__qualname__ != function.__name__:
        raise TypeError(f"a scenario function must be defined at the top level of its module; "
                        f"{function!r} is not")
    for arg in args:
        try:
            if ast.literal_eval(repr(arg)) != arg:
                raise ValueError
        except (ValueError, SyntaxError):
            raise TypeError(f"a scenario's arguments are passed as their repr; {arg!r} is not "
                            "a literal") from None
    module = function.__module__
    folder = os.path.dirname(os.path.abspath(inspect.getfile(function)))
    return f"import {module}\n{module}.{function.__name__}(*{args!r})\n", folder


class ForkServer:
    """The pytest side: `run(source, ...)` behaves as `subprocess.run([python,
    "-c", source], capture_output=True, text=True, timeout=..., env=...)`."""

    def __init__(self, environment: dict):
        self._environment = environment
        self._process = None

    def _start(self) -> None:
        self._process = subprocess.Popen(
            [sys.executable, __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            text=True, env=self._environment)
        if self._read(timeout=600).get("ready") is not True:
            raise RuntimeError("the scenario server did not start")

    def _read(self, timeout: float | None) -> dict:
        ready, _, _ = select.select([self._process.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError
        line = self._process.stdout.readline()
        if not line:
            raise RuntimeError(f"the scenario server exited (rc {self._process.wait()})")
        return json.loads(line)

    def run(self, source: str, timeout: float, env: dict) -> subprocess.CompletedProcess:
        if self._process is None or self._process.poll() is not None:
            self._start()
        source = textwrap.dedent(source)
        with tempfile.TemporaryDirectory() as scratch:
            paths = {stream: os.path.join(scratch, stream) for stream in ("stdout", "stderr")}
            for path in paths.values():
                open(path, "w").close()
            request = {"source": source, "env": env, **paths}
            self._process.stdin.write(json.dumps(request) + "\n")
            self._process.stdin.flush()
            pid = self._read(timeout=60)["pid"]
            try:
                returncode = self._read(timeout=timeout)["returncode"]
                timed_out = False
            except TimeoutError:
                os.killpg(pid, signal.SIGKILL)
                self._read(timeout=60)
                timed_out = True
            output = {stream: open(path, errors="replace").read()
                      for stream, path in paths.items()}
        command = [sys.executable, "-c", source]
        if timed_out:
            raise subprocess.TimeoutExpired(command, timeout, output["stdout"], output["stderr"])
        return subprocess.CompletedProcess(command, returncode, output["stdout"], output["stderr"])

    def close(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.stdin.close()
            self._process.wait(timeout=60)


if __name__ == "__main__":
    serve()
