"""Build step of the resmem package: compile libresmem.so with cargo and put it inside the
package, so that an installed resmem (``pip install ./python``, or the wheel from ``pip wheel
./python``) loads its own library with no variable set.

The Rust workspace is this folder's parent, so build from a checkout. ``RESMEM_CARGO_PROFILE``
picks the cargo profile (``release``, the default, or ``debug`` to reuse what ``cargo test``
built); ``CARGO`` and ``CARGO_TARGET_DIR`` are honoured as cargo honours them.
"""

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


class BuildWithLibrary(build_py):
    """build_py, then libresmem.so into the built package."""

    def run(self):
        super().run()
        library = build_library()
        package = os.path.join(self.build_lib, "resmem")
        os.makedirs(package, exist_ok=True)
        shutil.copy2(library, os.path.join(package, "libresmem.so"))


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
