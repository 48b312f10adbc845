"""`python -m harness.install_horovod [--force]`: build Horovod 0.28.1 into this venv.

    make horovod                               # the same, once the venv exists
    python -m harness.install_horovod --force  # rebuild even if it is built
    HOROVOD_GPU_OPERATIONS=NCCL python -m harness.install_horovod   # with NCCL operations

Horovod's last release asks CMake for C++14, which the headers of every torch since
2.1 refuse (the upstream fix came after the release). So this fetches the release's
sdist from the package index, raises the C++ standard in CMakeLists.txt and
horovod/torch/CMakeLists.txt to what the installed torch's ATen/ATen.h demands (17, or
20 from torch 2.14), makes its process sets' Gloo contexts bind HOROVOD_GLOO_IFACE as
its global one does (`fix_gloo_iface`), and builds it with pip against the torch that
is there (no build isolation, which would build against a fresh torch from the index):
Gloo for CPU tensors and the control plane, no MPI, TensorFlow or MXNet. With
HOROVOD_GPU_OPERATIONS=NCCL in the environment it builds NCCL operations for GPU
tensors too, against HOROVOD_NCCL_HOME (or _INCLUDE / _LIB) where set, else against the
NCCL pip package torch came with (nvidia-nccl-*): it has only libnccl.so.2, and Horovod's
CMake looks for libnccl_static.a or libnccl.so, so the build gets a folder of links to
it (<venv>/horovod-build/nccl) as HOROVOD_NCCL_HOME and HOROVOD_NCCL_LINK=SHARED. A torch
built for CUDA makes Horovod's CMake look for a CUDA toolkit; CUDA_HOME,
HOROVOD_CUDA_HOME, CUDAToolkit_ROOT and CUDACXX then name the one found (CUDA_HOME,
CUDA_PATH, /usr/local/cuda), and its bin/ goes first on PATH (nvcc). The sdist and its
unpacked, patched copy stay in <venv>/horovod-build/, outside the repository. Nothing is
built when this Horovod is already built against this torch and with the NCCL asked for
(none, or its version code: a CPU build is rebuilt once NCCL is asked for, and the other
way round); `--force` rebuilds.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from harness.config import usage
from harness.config.engine import VERSION

CMAKE_FILES = ("CMakeLists.txt", "horovod/torch/CMakeLists.txt")
CXX14 = re.compile(r"set\(CMAKE_CXX_STANDARD 14\)")
BUILD_ENV = {"HOROVOD_WITH_PYTORCH": "1", "HOROVOD_WITH_GLOO": "1", "HOROVOD_WITHOUT_MPI": "1",
             "HOROVOD_WITHOUT_TENSORFLOW": "1", "HOROVOD_WITHOUT_MXNET": "1"}
# Horovod's setup_requires: present beforehand, so that setup.py fetches nothing itself
RUNTIME_DEPS = ("cloudpickle", "psutil", "pyyaml", "packaging", "cffi>=1.4.0")
GLOO_FILE = "horovod/common/gloo/gloo_context.cc"
GLOO_FUNCTION = "void GlooContext::InitializeForProcessSet("
GLOO_IFACE = "device_attr.iface = gloo_iface_;"
GLOO_FIXED = ("gloo_iface_ = global_context.gloo_iface_;  // ddlbench: was left empty\n"
              "  device_attr.iface = gloo_iface_;")
PATCHES = "cxx-standard,process-set-gloo-iface"  # what a build changed, recorded beside it


class InstallError(RuntimeError):
    """What stops the build, and what to do about it."""


def _pip(*args: str, env: dict[str, str] | None = None) -> None:
    cmd = [sys.executable, "-m", "pip", "--disable-pip-version-check", *args]
    if subprocess.run(cmd, env=env).returncode != 0:
        raise InstallError(f"`{' '.join(cmd[2:])}` failed (its output is above)")


def cxx_standard(torch_include: Path) -> int:
    """The C++ standard torch's headers require (ATen.h errors out below it), at least 17."""
    header = (torch_include / "ATen" / "ATen.h").read_text()
    found = re.search(r"__cplusplus\s*<\s*(\d{4})\d{2}L", header)
    return max(17, int(found.group(1)) - 2000) if found else 17


def cuda_toolkit() -> Path | None:
    """A CUDA toolkit (a folder with bin/nvcc and include/cuda_runtime.h), or None."""
    for candidate in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"),
                      "/usr/local/cuda"):
        if candidate and (Path(candidate) / "bin" / "nvcc").exists() and \
                (Path(candidate) / "include" / "cuda_runtime.h").exists():
            return Path(candidate)
    return None


def _record(torch_version: str, nccl: int) -> dict[str, str | int]:
    """What a build was, kept beside it: `nccl` is its NCCL's version code, 0 for none."""
    return {"horovod": VERSION, "torch": torch_version, "patches": PATCHES, "nccl": nccl}


def probe() -> list | None:
    """[version, Gloo built, the torch it was built against, NCCL version code or 0] of the
    Horovod this venv imports (in a fresh interpreter), or None where it does not load."""
    code = ("import json, os, horovod, horovod.torch.mpi_ops as m; "
            "print(json.dumps([horovod.__version__, m.gloo_built(), json.load(open("
            "os.path.join(os.path.dirname(horovod.__file__), 'metadata.json'))).get('pytorch'), "
            "m.nccl_built()]))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    try:
        return json.loads(out.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return None


def installed_for(torch_version: str, work: Path, *, nccl: int = 0) -> bool:
    """Whether this Horovod is installed, loads, and was built here against `torch_version`
    with this installer's patches and NCCL version code `nccl` (0: without NCCL), by the
    loaded library and by its record in `work`."""
    if probe() != [VERSION, True, torch_version, nccl]:
        return False
    try:
        recorded = json.loads((work / "installed.json").read_text())
    except (ValueError, OSError):
        return False
    # records from before NCCL was recorded: the library's own answer (above) decides
    return isinstance(recorded, dict) and {"nccl": nccl, **recorded} == _record(torch_version,
                                                                                 nccl)


def nccl_asked(env: dict[str, str]) -> bool:
    """Whether the build is to have NCCL operations (HOROVOD_GPU_OPERATIONS or
    HOROVOD_GPU_ALLREDUCE is NCCL)."""
    return "NCCL" in (env.get("HOROVOD_GPU_OPERATIONS", "").upper(),
                      env.get("HOROVOD_GPU_ALLREDUCE", "").upper())


def nccl_version(header: Path) -> int:
    """NCCL_VERSION_CODE of an nccl.h (what Horovod's nccl_built() reports)."""
    text = header.read_text(errors="replace")
    found = re.search(r"#define\s+NCCL_VERSION_CODE\s+(\d+)", text)
    if found:
        return int(found.group(1))
    major, minor, patch = (int(re.search(rf"#define\s+NCCL_{k}\s+(\d+)", text).group(1))
                           for k in ("MAJOR", "MINOR", "PATCH"))
    return major * 1000 + minor * 100 + patch if (major, minor) <= (2, 8) else \
        major * 10000 + minor * 100 + patch


def pip_nccl(paths: list[str] | None = None) -> Path | None:
    """The folder of the NCCL pip package (nvidia/nccl: include/nccl.h, lib/libnccl.so.2)
    on `paths` (default sys.path), or None."""
    for base in sys.path if paths is None else paths:
        folder = Path(base) / "nvidia" / "nccl"
        if (folder / "include" / "nccl.h").is_file() and list((folder / "lib").glob("libnccl.so*")):
            return folder
    return None


def nccl_build(env: dict[str, str], work: Path) -> tuple[dict[str, str], int]:
    """The environment a build needs to find NCCL, and its version code: ({}, 0) where no
    NCCL is asked; ({}, version) where HOROVOD_NCCL_HOME or _INCLUDE names one; else a
    folder of links to the pip package's (`work`/nccl: include, lib/libnccl.so), linked
    shared."""
    if not nccl_asked(env):
        return {}, 0
    named = env.get("HOROVOD_NCCL_INCLUDE") or (
        str(Path(env["HOROVOD_NCCL_HOME"]) / "include") if env.get("HOROVOD_NCCL_HOME") else "")
    if named:
        header = Path(named) / "nccl.h"
        if not header.is_file():
            raise InstallError(f"HOROVOD_GPU_OPERATIONS=NCCL but {header} does not exist; point "
                               "HOROVOD_NCCL_HOME (or HOROVOD_NCCL_INCLUDE) at an NCCL")
        return {}, nccl_version(header)
    package = pip_nccl()
    if package is None:
        raise InstallError("HOROVOD_GPU_OPERATIONS=NCCL but no NCCL was found: torch's pip "
                           "package nvidia-nccl-* is not installed; set HOROVOD_NCCL_HOME to an "
                           "NCCL (with include/nccl.h and lib/libnccl.so)")
    home = work / "nccl"
    (home / "lib").mkdir(parents=True, exist_ok=True)
    library = sorted((package / "lib").glob("libnccl.so*"))[-1]
    for link, target in ((home / "include", package / "include"),
                         (home / "lib" / "libnccl.so", library)):
        if link.is_symlink() or link.exists():
            link.unlink()
        link.symlink_to(target)
    return ({"HOROVOD_NCCL_HOME": str(home), "HOROVOD_NCCL_LINK": "SHARED"},
            nccl_version(package / "include" / "nccl.h"))


def fetch(work: Path) -> Path:
    """The unpacked sdist of Horovod VERSION in `work`, fresh (an old copy is replaced)."""
    sdist = work / f"horovod-{VERSION}.tar.gz"
    if not sdist.exists():
        _pip("download", f"horovod=={VERSION}", "--no-deps", "--no-binary", ":all:",
             "--no-build-isolation", "--dest", str(work))
    source = work / f"horovod-{VERSION}"
    shutil.rmtree(source, ignore_errors=True)
    with tarfile.open(sdist) as archive:
        try:
            archive.extractall(work, filter="data")
        except TypeError:  # Python < 3.10.12 / 3.11.4: no extraction filters
            archive.extractall(work)  # noqa: S202 - the package index's own sdist
    return source


def _not_found(source: Path, name: str, what: str) -> InstallError:
    sdist = source.parent / f"horovod-{VERSION}.tar.gz"
    return InstallError(f"{source / name} has no {what} to patch; is {sdist} Horovod "
                        f"{VERSION}'s sdist? delete it and retry")


def raise_cxx_standard(source: Path, standard: int) -> None:
    """Raise Horovod's C++ standard from 14 to `standard` in both CMake files."""
    for name in CMAKE_FILES:
        path = source / name
        text, count = CXX14.subn(f"set(CMAKE_CXX_STANDARD {standard})", path.read_text())
        if count == 0:
            raise _not_found(source, name, "set(CMAKE_CXX_STANDARD 14)")
        path.write_text(text)


def fix_gloo_iface(source: Path) -> None:
    """Horovod 0.28.1 builds the Gloo contexts of every process set (the global one too,
    which carries all the all-reduces) on a device of an empty interface name, so they
    bind the address the host name resolves to, whatever HOROVOD_GLOO_IFACE says: ranks in
    network namespaces of one host (cluster=emulated), or on hosts whose name resolves to
    127.0.1.1, cannot reach each other. They take the global context's interface."""
    path = source / GLOO_FILE
    text = path.read_text()
    start = text.find(GLOO_FUNCTION)
    at = text.find(GLOO_IFACE, start) if start >= 0 else -1
    if at < 0:
        raise _not_found(source, GLOO_FILE, f"{GLOO_IFACE!r} in InitializeForProcessSet")
    path.write_text(text[:at] + GLOO_FIXED + text[at + len(GLOO_IFACE):])


def build_env(torch_cuda: str | None, nccl: dict[str, str] | None = None) -> dict[str, str]:
    """The environment of the build: Horovod's switches, the CUDA toolkit of a CUDA torch,
    where NCCL is (`nccl_build`), and as many compile jobs as this machine has cores
    (Horovod's default is 8)."""
    env = {**os.environ, **BUILD_ENV, **(nccl or {})}
    env.setdefault("MAKEFLAGS", f"-j{len(os.sched_getaffinity(0))}")
    if torch_cuda:
        toolkit = cuda_toolkit()
        if toolkit is None:
            raise InstallError(f"this torch is built for CUDA {torch_cuda}, so Horovod's build "
                               "needs a CUDA toolkit (bin/nvcc, include/cuda_runtime.h) and none "
                               "was found; set CUDA_HOME to one, or install a CPU torch")
        # Horovod's CMake reads CUDAToolkit_ROOT and CUDACXX, its setup.py HOROVOD_CUDA_HOME
        # and nvcc on PATH: all name the one toolkit
        env.update(CUDA_HOME=str(toolkit), HOROVOD_CUDA_HOME=str(toolkit),
                   CUDAToolkit_ROOT=str(toolkit), CUDACXX=str(toolkit / "bin" / "nvcc"),
                   PATH=os.pathsep.join([str(toolkit / "bin"), env.get("PATH", os.defpath)]))
    return env


def install(*, force: bool) -> None:
    import torch

    work = Path(sys.prefix) / "horovod-build"
    work.mkdir(parents=True, exist_ok=True)
    nccl_env, nccl = nccl_build(dict(os.environ), work)
    if not force and installed_for(torch.__version__, work, nccl=nccl):
        print(f"Horovod {VERSION} is already built against torch {torch.__version__} "
              f"({f'NCCL {nccl}' if nccl else 'no NCCL'}); nothing to do (--force rebuilds)")
        return
    started = time.monotonic()
    (work / "installed.json").unlink(missing_ok=True)
    source = fetch(work)
    standard = cxx_standard(Path(torch.__file__).parent / "include")
    raise_cxx_standard(source, standard)
    fix_gloo_iface(source)
    env = build_env(torch.version.cuda, nccl_env)
    extras = [f"CUDA toolkit {env['CUDA_HOME']}" if torch.version.cuda else "",
              f"GPU operations {env.get('HOROVOD_GPU_OPERATIONS', '')}"
              if env.get("HOROVOD_GPU_OPERATIONS") else "",
              f"NCCL {nccl} ({env.get('HOROVOD_NCCL_HOME') or 'HOROVOD_NCCL_INCLUDE'})"
              if nccl else ""]
    print(f"building Horovod {VERSION} against torch {torch.__version__} with "
          f"{', '.join([f'C++{standard}', *filter(None, extras)])} (a few minutes)", flush=True)
    _pip("install", "--quiet", *RUNTIME_DEPS)
    _pip("install", "--no-build-isolation", "--no-cache-dir", "--force-reinstall", "--no-deps",
         str(source), env=env)
    (work / "installed.json").write_text(json.dumps(_record(torch.__version__, nccl)))
    if not installed_for(torch.__version__, work, nccl=nccl):
        raise InstallError(f"Horovod was built but does not load with this torch (or not with "
                           f"NCCL {nccl}); run `python -c 'import horovod.torch.mpi_ops as m; "
                           "print(m.nccl_built())'` to see why")
    print(f"Horovod {VERSION} built and installed in {time.monotonic() - started:.0f} s")


def main(argv: list[str]) -> int:
    argv = ["--help"] if usage.asked(argv) else argv  # -help, help: argparse's help
    parser = usage.Parser(prog="python -m harness.install_horovod",
                          description=usage.description(__doc__),
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--force", action="store_true", help="rebuild even if installed")
    args = parser.parse_args(argv)
    try:
        install(force=args.force)
    except InstallError as exc:
        print(f"ddlbench: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
