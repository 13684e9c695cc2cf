#!/usr/bin/env bash
# Install resmem for C and C++ programs under a prefix:
#   PREFIX/lib/libresmem.so.X.Y.Z, libresmem.so.X -> it (the SONAME), libresmem.so -> libresmem.so.X
#   PREFIX/lib/libresmem.a, PREFIX/lib/libresmem_preload.so
#   PREFIX/include/resmem.h
#   PREFIX/lib/pkgconfig/resmem.pc                      pkg-config --cflags --libs resmem
#                                                       (with -Wl,-rpath,PREFIX/lib: the
#                                                       programs start with no variable set)
#   PREFIX/lib/cmake/resmem/resmemConfig.cmake (+ ConfigVersion)
#                                                       find_package(resmem) -> resmem::resmem
#
#   scripts/install.sh --prefix DIR              build the release libraries, then install
#   scripts/install.sh --prefix DIR --from DIR2  install libraries already built in DIR2
#                                                (e.g. target/debug), without building
set -euo pipefail
cd "$(dirname "$0")/.."

prefix="" from=""
while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) prefix=$2; shift 2 ;;
    --from) from=$2; shift 2 ;;
    *) echo "usage: $0 --prefix DIR [--from BUILT_LIBRARY_DIR]" >&2; exit 2 ;;
  esac
done
[ -n "$prefix" ] || { echo "usage: $0 --prefix DIR [--from BUILT_LIBRARY_DIR]" >&2; exit 2; }

if [ -z "$from" ]; then
  cargo build --release -p resmem -p resmem-preload --lib
  from=target/release
fi
version=$(sed -n '/^\[workspace.package\]/,/^\[/s/^version = "\(.*\)"/\1/p' Cargo.toml)
major=${version%%.*}
mkdir -p "$prefix/lib/pkgconfig" "$prefix/lib/cmake/resmem" "$prefix/include"
prefix=$(cd "$prefix" && pwd)
lib=$prefix/lib

install -m 0755 "$from/libresmem.so" "$lib/libresmem.so.$version"
ln -sfn "libresmem.so.$version" "$lib/libresmem.so.$major"
ln -sfn "libresmem.so.$major" "$lib/libresmem.so"
install -m 0644 "$from/libresmem.a" "$lib/libresmem.a"
install -m 0755 "$from/libresmem_preload.so" "$lib/libresmem_preload.so"
install -m 0644 include/resmem.h "$prefix/include/resmem.h"

cat > "$lib/pkgconfig/resmem.pc" <<PC
prefix=$prefix
libdir=\${prefix}/lib
includedir=\${prefix}/include

Name: resmem
Description: CUDA device-memory caching pool that counts reserved-but-unused memory as free
Version: $version
Libs: -L\${libdir} -Wl,-rpath,\${libdir} -lresmem
Libs.private: -lpthread -ldl -lm
Cflags: -I\${includedir}
PC

cat > "$lib/cmake/resmem/resmemConfig.cmake" <<CMAKE
# resmem $version: find_package(resmem) gives the imported targets resmem::resmem (shared) and
# resmem::resmem_static. The prefix is found from this file's location, so the tree can move.
get_filename_component(_resmem_prefix "\${CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE)
if(NOT TARGET resmem::resmem)
  add_library(resmem::resmem SHARED IMPORTED)
  set_target_properties(resmem::resmem PROPERTIES
    IMPORTED_LOCATION "\${_resmem_prefix}/lib/libresmem.so.$version"
    IMPORTED_SONAME "libresmem.so.$major"
    INTERFACE_INCLUDE_DIRECTORIES "\${_resmem_prefix}/include")
endif()
if(NOT TARGET resmem::resmem_static)
  find_package(Threads REQUIRED)
  add_library(resmem::resmem_static STATIC IMPORTED)
  set_target_properties(resmem::resmem_static PROPERTIES
    IMPORTED_LOCATION "\${_resmem_prefix}/lib/libresmem.a"
    INTERFACE_INCLUDE_DIRECTORIES "\${_resmem_prefix}/include"
    INTERFACE_LINK_LIBRARIES "Threads::Threads;\${CMAKE_DL_LIBS};m")
endif()
set(resmem_PRELOAD_LIBRARY "\${_resmem_prefix}/lib/libresmem_preload.so")
unset(_resmem_prefix)
CMAKE

cat > "$lib/cmake/resmem/resmemConfigVersion.cmake" <<CMAKE
# Compatible when the requested version is not newer than $version and has the same major
# number (for 0.x, the same minor number too: 0.x releases may break the ABI).
set(PACKAGE_VERSION "$version")
set(PACKAGE_VERSION_COMPATIBLE FALSE)
if(PACKAGE_FIND_VERSION VERSION_LESS_EQUAL PACKAGE_VERSION)
  string(REPLACE "." ";" _have "\${PACKAGE_VERSION}")
  list(GET _have 0 _have_major)
  list(GET _have 1 _have_minor)
  if(PACKAGE_FIND_VERSION_MAJOR EQUAL _have_major AND
     (NOT _have_major EQUAL 0 OR PACKAGE_FIND_VERSION_MINOR EQUAL _have_minor))
    set(PACKAGE_VERSION_COMPATIBLE TRUE)
  endif()
endif()
if(PACKAGE_FIND_VERSION VERSION_EQUAL PACKAGE_VERSION)
  set(PACKAGE_VERSION_EXACT TRUE)
endif()
CMAKE

echo "installed resmem $version under $prefix"
