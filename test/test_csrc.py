"""Builds and runs the plain C++ unit tests in test/csrc against the C++ core.

Each test/csrc/*_test.cc becomes one binary, linked with the csrc sources and
torch's libc10/libtorch_cpu, built with g++ in a pytest temporary directory.
All translation units compile in parallel (one job per core), once per session.
"""
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
TEST_CSRC = ROOT / "test" / "csrc"
CORE_SOURCES = ["placeholder_data.cc", "parameter_table.cc"]
TEST_SOURCES = sorted(p.name for p in TEST_CSRC.glob("*_test.cc"))
CXX = os.environ.get("CXX", "g++")


def _torch_build_flags():
    import torch
    from torch.utils import cpp_extension

    abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
    compile_flags = ["-std=c++17", "-O1", "-fPIC", f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
                     f"-I{CSRC}", f"-I{TEST_CSRC}"]
    compile_flags += [f"-I{path}" for path in cpp_extension.include_paths()]
    link_flags = []
    for path in cpp_extension.library_paths():
        link_flags += [f"-L{path}", f"-Wl,-rpath,{path}"]
    link_flags += ["-lc10", "-ltorch_cpu", "-pthread"]
    return compile_flags, link_flags


def _run(cmd, timeout=300):
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _check_built(proc, what):
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (exit {proc.returncode}):\n$ {' '.join(proc.args)}\n"
                    f"{proc.stdout}{proc.stderr}", pytrace=False)


@pytest.fixture(scope="session")
def csrc_test_binaries(tmp_path_factory):
    """Compiles every translation unit in parallel, then links one binary per
    test file. Returns {test source name: binary path}."""
    if shutil.which(CXX) is None:
        pytest.skip(f"no C++ compiler ({CXX}) on PATH")
    out = tmp_path_factory.mktemp("csrc_tests")
    compile_flags, link_flags = _torch_build_flags()
    sources = [CSRC / name for name in CORE_SOURCES] + [TEST_CSRC / name for name in TEST_SOURCES]
    objects = {src: out / (src.stem + ".o") for src in sources}

    start = time.monotonic()
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as pool:
        results = list(pool.map(
            lambda src: _run([CXX, *compile_flags, "-c", str(src), "-o", str(objects[src])]),
            sources))
    for src, proc in zip(sources, results):
        _check_built(proc, f"compiling {src.relative_to(ROOT)}")

    core_objects = [str(objects[CSRC / name]) for name in CORE_SOURCES]
    binaries = {}
    for name in TEST_SOURCES:
        binary = out / Path(name).stem
        proc = _run([CXX, str(objects[TEST_CSRC / name]), *core_objects, *link_flags,
                     "-o", str(binary)])
        _check_built(proc, f"linking {name}")
        binaries[name] = binary
    print(f"[test_csrc] built {len(binaries)} C++ test binaries in "
          f"{time.monotonic() - start:.1f}s", file=sys.stderr)
    return binaries


def test_csrc_tests_exist():
    assert "placeholder_data_test.cc" in TEST_SOURCES
    assert "parameter_table_test.cc" in TEST_SOURCES


@pytest.mark.parametrize("source", TEST_SOURCES)
def test_csrc(source, csrc_test_binaries):
    binary = csrc_test_binaries[source]
    proc = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, (
        f"{source} exited with {proc.returncode}; its output:\n{output}")
    assert "checks passed" in output, output
