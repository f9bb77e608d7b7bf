"""embed: where libspecexport (the C/C++ library over this runtime) is, as compiler and CMake flags, like
python3-config; or build and install it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import click

from specexport.embed import SOURCE_DIR
from specexport.errors import UserError

LIB_DIRS = ("lib", "lib64")


def installed_lib_dir(prefix: Path) -> Path:
    """The lib folder of `prefix` holding libspecexport; one line saying how to build it when none does."""
    for name in LIB_DIRS:
        if (prefix / name / "libspecexport.so").exists():
            return prefix / name
    raise UserError(f"libspecexport is not installed in {prefix}: build it with 'specexport embed --build"
                    f"{'' if prefix == Path(sys.prefix) else f' --prefix {prefix}'}' (needs cmake and a C/C++ compiler)")


def build(prefix: Path) -> None:
    """CMake configure, build and install into `prefix`, against this interpreter's environment."""
    if shutil.which("cmake") is None:
        raise UserError("building libspecexport needs cmake (3.18 or later) and a C/C++ compiler on PATH")
    with tempfile.TemporaryDirectory(prefix="specexport-embed-") as work:
        for command in (["cmake", "-S", str(SOURCE_DIR), "-B", work, f"-DSPECEXPORT_PYTHON={sys.executable}",
                         "-DCMAKE_BUILD_TYPE=Release", "-DCMAKE_INSTALL_LIBDIR=lib"],
                        ["cmake", "--build", work, "--parallel"],
                        ["cmake", "--install", work, "--prefix", str(prefix)]):
            if subprocess.run(command, stdout=sys.stderr).returncode != 0:  # stdout stays free for the flags
                raise UserError(f"'{' '.join(command[:2])}' failed (its output is above)")


@click.command()
@click.option("--cflags", is_flag=True, help="Compiler flags: -I for specexport.h and specexport.hpp.")
@click.option("--libs", is_flag=True, help="Linker flags: -L, -lspecexport and a run path.")
@click.option("--cmake-prefix", is_flag=True, help="The prefix for CMAKE_PREFIX_PATH (find_package(specexport)).")
@click.option("--include-dir", is_flag=True, help="The folder holding the installed headers.")
@click.option("--lib-dir", is_flag=True, help="The folder holding the installed libspecexport.so.")
@click.option("--pkg-config-path", is_flag=True, help="The folder for PKG_CONFIG_PATH (specexport.pc).")
@click.option("--source-dir", is_flag=True, help="The shipped C/C++ sources and CMake project (cmake -S ...).")
@click.option("--build", "do_build", is_flag=True,
              help="Build libspecexport with CMake and install it into --prefix first (headers, library, CMake "
                   "package, pkg-config file, the example specexport-service).")
@click.option("--prefix", type=click.Path(path_type=Path), default=None,
              help="Where libspecexport is (or goes) installed. [default: this Python environment]")
def embed(cflags, libs, cmake_prefix, include_dir, lib_dir, pkg_config_path, source_dir, do_build, prefix):
    """Flags to compile and link C/C++ against libspecexport, which runs this runtime (one per line, like
    python3-config), or build and install it.

    \b
    Examples:
      specexport embed --build                         # into this environment (once)
      g++ -std=c++17 app.cpp $(specexport embed --cflags --libs)
      cmake -S . -B build -DCMAKE_PREFIX_PATH=$(specexport embed --cmake-prefix)
      cmake -S $(specexport embed --source-dir) -B build   # or build it yourself
    """
    prefix = (prefix or Path(sys.prefix)).absolute()
    if do_build:
        build(prefix)
    if not any((cflags, libs, cmake_prefix, include_dir, lib_dir, pkg_config_path, source_dir)):
        if do_build:
            click.echo(f"libspecexport installed in {prefix}", err=True)
            return
        raise click.UsageError("give at least one of --cflags, --libs, --cmake-prefix, --include-dir, --lib-dir, "
                               "--pkg-config-path, --source-dir, --build")
    if source_dir:
        click.echo(SOURCE_DIR)
    if not any((cflags, libs, cmake_prefix, include_dir, lib_dir, pkg_config_path)):
        return
    libdir = installed_lib_dir(prefix)
    includes = prefix / "include"
    lines = [(cflags, f"-I{includes}"), (libs, f"-L{libdir} -lspecexport -Wl,-rpath,{libdir}"),
             (cmake_prefix, prefix), (include_dir, includes), (lib_dir, libdir),
             (pkg_config_path, libdir / "pkgconfig")]
    for wanted, text in lines:
        if wanted:
            click.echo(text)
