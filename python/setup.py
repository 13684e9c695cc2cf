"""Build step of the resmem package: compile libresmem.so with cargo and put it inside the
package, with libresmem_torch.so compiled from native/torch_raise.cpp for resmem.torch, so that
an installed resmem (``pip install ./python``, or the wheel from ``pip wheel ./python``) loads
its own library with no variable set.

The Rust workspace is this folder's parent, so build from a checkout. ``RESMEM_CARGO_PROFILE``
picks the cargo profile (``release``, the default, or ``debug`` to reuse what ``cargo test``
built); ``CARGO`` and ``CARGO_TARGET_DIR`` are honoured as cargo honours them.
"""

import glob
import os
import shutil
import subprocess

from setuptools import Distribution, setup
from setuptools.command.build_py import build_py

try:
    from setuptools.command.bdist_wheel import bdist_wheel
except ImportError:  # setuptools < 70.1
    from wheel.bdist_wheel import bdist_wheel

HERE = os.path.dirname(os.path.abspath(__file__))
WORKSPACE = os.path.dirname(HERE)


def build_library():
    """Run cargo and return the path of the built libresmem.so."""
    profile = os.environ.get("RESMEM_CARGO_PROFILE", "release")
    if profile not in ("release", "debug"):
        raise SystemExit(f"RESMEM_CARGO_PROFILE={profile!r}: use release or debug")
    if not os.path.exists(os.path.join(WORKSPACE, "Cargo.toml")):
        raise SystemExit(
            f"resmem's Rust sources are not in {WORKSPACE}: build the package from a checkout "
            "(pip install ./python, or pip wheel ./python), not from a source archive"
        )
    cargo = os.environ.get("CARGO", "cargo")
    command = [cargo, "build", "-p", "resmem", "--lib"]
    if profile == "release":
        command.append("--release")
    try:
        subprocess.run(command, cwd=WORKSPACE, check=True)
    except FileNotFoundError:
        raise SystemExit(
            f"{cargo} was not found: building resmem needs Rust (https://rustup.rs)"
        ) from None
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"{' '.join(command)} failed ({e.returncode})") from None
    target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(WORKSPACE, "target")
    return os.path.join(WORKSPACE, target, profile, "libresmem.so")


def build_torch_raise(package):
    """Compile every native/*.cpp (torch_raise.cpp, graph_pools.cpp) into the package as
    libresmem_torch.so:
    the functions resmem.torch.install() gives PyTorch, which throw a failure for PyTorch to
    raise where rm_torch_malloc returns a NULL PyTorch does not check, and keep CUDA graphs'
    private pools (see those files). Only C++ may throw into PyTorch and take its std::function,
    so it needs a C++ compiler (``CXX``, else ``c++``); without one the package is built without
    it, said here, and install() warns, falls back to the NULL and refuses graph captures. It
    links the C++ runtime dynamically, as PyTorch does, so that PyTorch catches its exceptions."""
    compiler = os.environ.get("CXX", "c++")
    command = [
        compiler, "-std=c++17", "-O2", "-Wall", "-Wextra", "-shared", "-fPIC",
        "-fvisibility=hidden", "-I", os.path.join(WORKSPACE, "include"),
        *sorted(glob.glob(os.path.join(HERE, "native", "*.cpp"))),
        "-o", os.path.join(package, "libresmem_torch.so"), "-ldl",
    ]
    try:
        subprocess.run(command, check=True)
    except (FileNotFoundError, subprocess.CalledProcessError) as e:
        print(
            f"warning: {' '.join(command)} failed ({e}): the package has no libresmem_torch.so, "
            "and an out-of-memory under resmem.torch.install() will be a NULL PyTorch does not "
            "check; install a C++ compiler and build again"
        )


class BuildWithLibrary(build_py):
    """build_py, then libresmem.so and libresmem_torch.so into the built package."""

    def run(self):
        super().run()
        library = build_library()
        package = os.path.join(self.build_lib, "resmem")
        os.makedirs(package, exist_ok=True)
        shutil.copy2(library, os.path.join(package, "libresmem.so"))
        build_torch_raise(package)


class WithNativeLibrary(Distribution):
    """A distribution with a native library: installed as platform-specific (platlib)."""

    def has_ext_modules(self):
        return True


class PlatformWheel(bdist_wheel):
    """The wheel holds a native library but no Python extension: any Python 3, this platform."""

    def get_tag(self):
        _, _, platform = super().get_tag()
        return "py3", "none", platform


setup(
    distclass=WithNativeLibrary,
    cmdclass={"build_py": BuildWithLibrary, "bdist_wheel": PlatformWheel},
)
