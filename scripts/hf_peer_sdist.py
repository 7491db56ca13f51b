"""transformers' own test modules (tests/test_modeling_common.py and its
neighbours), read from the source distribution of the installed transformers,
for scripts/hf_peer_suite.py. Nothing of theirs is kept in this repository:
the sdist is downloaded with pip at the first run into a cache folder, and
its tests/ folder extracted there.

The cache folder is $TORCH_XLA_EXT_SDIST_CACHE, by default
~/.cache/torch_xla_ext/transformers-sdist; it holds
transformers-VERSION/tests/ for each version used.

The sdist's tests/ is imported as the package `transformers_sdist_tests`
(its modules import each other relatively). It lacks two folders that
test_modeling_common.py imports from, exporters/ and generation/: empty
stand-ins of the two mixins it takes from them take their place, so the
export tests and `generate()` tests are not run.
"""
from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import types
from pathlib import Path

CACHE_VARIABLE = "TORCH_XLA_EXT_SDIST_CACHE"
DEFAULT_CACHE = Path.home() / ".cache" / "torch_xla_ext" / "transformers-sdist"
PACKAGE = "transformers_sdist_tests"
# The modules test_modeling_common.py imports that the sdist does not ship,
# each with the mixin class it takes from it.
STAND_INS = {"exporters.test_export": "ExportTesterMixin",
             "generation.test_utils": "GenerationTesterMixin"}
PIP_OUTPUT_LINES = 15


class SdistUnavailable(RuntimeError):
    """The sdist could not be downloaded or read."""


def installed_version() -> str:
    from importlib.metadata import version

    return version("transformers")


def cache_folder() -> Path:
    return Path(os.environ.get(CACHE_VARIABLE) or DEFAULT_CACHE)


def tests_folder(version: str | None = None) -> Path:
    """Where the tests/ of transformers `version` (the installed one if None)
    are, once `ensure_tests` has run."""
    return cache_folder() / f"transformers-{version or installed_version()}" / "tests"


def ensure_tests(version: str | None = None) -> Path:
    """tests_folder(version), downloading and extracting the sdist first if
    it is not there; raises SdistUnavailable saying why and how to get it
    by hand when it cannot."""
    version = version or installed_version()
    folder = tests_folder(version)
    if (folder / "test_modeling_common.py").is_file():
        return folder
    cache = cache_folder()
    try:
        cache.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise SdistUnavailable(f"cannot create the sdist cache {cache} ({error}); set "
                               f"{CACHE_VARIABLE} to a folder you can write") from error
    # A folder of its own for each download, moved into place whole at the end:
    # two runs at once (pytest's workers) never see half a folder.
    with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as scratch:
        archive = _download(version, Path(scratch))
        extracted = Path(scratch) / "extracted"
        _extract_tests(archive, version, extracted)
        try:
            (extracted / f"transformers-{version}").rename(folder.parent)
        except OSError:
            if not (folder / "test_modeling_common.py").is_file():
                raise  # not another run that got there first
    return folder


def _download(version: str, into: Path) -> Path:
    command = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
               "--no-deps", "--no-binary", ":all:", f"transformers=={version}", "-d", str(into)]
    done = subprocess.run(command, capture_output=True, text=True)
    archives = sorted(into.glob(f"transformers-{version}.tar.gz"))
    if done.returncode != 0 or not archives:
        output = "\n".join((done.stderr or done.stdout).strip().splitlines()[-PIP_OUTPUT_LINES:])
        raise SdistUnavailable(
            f"could not download the source distribution of transformers {version}, whose "
            f"tests/ the peer suite runs (`{' '.join(command[2:-2])}` exited with "
            f"{done.returncode}):\n{output}\nDownload it by hand into {cache_folder()} and "
            f"extract its tests/ folder there (transformers-{version}/tests/), or set "
            f"{CACHE_VARIABLE} to a folder that has it.")
    return archives[0]


def _extract_tests(archive: Path, version: str, into: Path) -> None:
    prefix = f"transformers-{version}/tests/"
    with tarfile.open(archive) as sdist:
        members = [member for member in sdist.getmembers()
                   if member.name.startswith(prefix) and (member.isfile() or member.isdir())]
        if not any(member.name == prefix + "test_modeling_common.py" for member in members):
            raise SdistUnavailable(f"{archive.name} has no {prefix}test_modeling_common.py")
        sdist.extractall(into, members=members, filter="data")


def import_tests_module(name: str, version: str | None = None) -> types.ModuleType:
    """The sdist's tests/`name`.py (such as "test_modeling_common"), imported
    as `transformers_sdist_tests.name` from the cache (`ensure_tests` must
    have run: this one downloads nothing)."""
    folder = tests_folder(version)
    if not (folder / "test_modeling_common.py").is_file():
        raise SdistUnavailable(f"no transformers tests in {folder}; scripts/hf_peer_sdist.py's "
                               f"ensure_tests() downloads them")
    _install_package(folder)
    return importlib.import_module(f"{PACKAGE}.{name}")


def _install_package(folder: Path) -> None:
    if PACKAGE in sys.modules:
        return
    package = importlib.util.module_from_spec(
        importlib.machinery.ModuleSpec(PACKAGE, None, is_package=True))
    package.__path__ = [str(folder)]
    sys.modules[PACKAGE] = package
    for module_path, mixin in STAND_INS.items():
        if (folder / (module_path.replace(".", "/") + ".py")).is_file():
            continue  # a sdist that ships it: the real one is imported
        _stand_in(module_path, mixin)


def _stand_in(module_path: str, mixin: str) -> None:
    """Module `module_path` of the package (and the folders above it), holding
    an empty class named `mixin`."""
    parts = module_path.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join([PACKAGE, *parts[:depth]])
        if name in sys.modules:
            continue
        module = types.ModuleType(name, "A stand-in for a module the transformers sdist lacks.")
        if depth < len(parts):
            module.__path__ = []
        sys.modules[name] = module
    leaf = sys.modules[".".join([PACKAGE, *parts])]
    setattr(leaf, mixin, type(mixin, (), {"__module__": leaf.__name__,
                                          "__doc__": "Stand-in: the sdist lacks its tests."}))

