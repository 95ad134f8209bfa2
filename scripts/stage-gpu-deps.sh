#!/usr/bin/env bash
# Stages the Debian packages a GPU node lacks (no apt, no internet there: see docs/gpu.md) into
# one relocatable prefix and packs it as a tarball to copy to the node.
#
# Run on any Debian 12 (bookworm) machine with apt; no root needed (apt-get download only
# fetches .deb files). Usage:
#   scripts/stage-gpu-deps.sh [--out DIR] [--no-tests] [--no-gloo]
# Makes DIR/prefix (default DIR: build-gpu-deps/, git-ignored) and DIR/dnallm-gpu-deps.tar.gz.
# On the GPU node: tar xzf dnallm-gpu-deps.tar.gz -C SOMEWHERE; scripts/build.sh --cuda
# --deps SOMEWHERE/prefix.
#
# What goes in: htslib (libhts3, libhtscodecs2, libdeflate0 and -dev), TOML++, xxHash,
# GoogleTest/GoogleMock (the GPU tests), and Gloo with its run-time libraries (so that two
# ranks can share a GPU over the staged CPU backend). The .pc files are rewritten to the
# prefix (they name /usr), htslib.pc loses Requires.private (zlib/liblzma have no .pc on
# the node), and everything under usr/lib/x86_64-linux-gnu is moved to lib/ so one -L and
# one RPATH entry cover it.
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
out="$root/build-gpu-deps"
tests=1
gloo=1
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out="$2"; shift 2 ;;
    --no-tests) tests=0; shift ;;
    --no-gloo) gloo=0; shift ;;
    -h|--help) sed -n '2,17p' "$0"; exit 0 ;;
    *) echo "stage-gpu-deps.sh: unknown argument '$1' (see --help)" >&2; exit 2 ;;
  esac
done
command -v apt-get >/dev/null && command -v dpkg >/dev/null || {
  echo "stage-gpu-deps.sh: needs apt-get and dpkg (run it on a Debian 12 machine, then copy" \
       "the tarball to the GPU node)" >&2
  exit 2
}

packages=(libhts3 libhtscodecs2 libdeflate0 libhts-dev libdeflate-dev
          libtomlplusplus3 libtomlplusplus-dev libxxhash0 libxxhash-dev)
# GoogleTest is static (libgtest.a) with a CMake config: enough to build the GPU tests.
[ "$tests" = 1 ] && packages+=(libgtest-dev libgmock-dev)
# Gloo's shared library needs hiredis and ibverbs (and libnl) at run time; its -dev package's
# hiredis/ibverbs -dev dependencies are only for headers we never include.
[ "$gloo" = 1 ] && packages+=(libgloo0 libgloo-dev libhiredis0.14 libibverbs1 libnl-3-200
                              libnl-route-3-200)

debs="$out/debs"
prefix="$out/prefix"
rm -rf "$debs" "$prefix"
mkdir -p "$debs" "$prefix"
echo "downloading ${#packages[@]} packages into $debs"
(cd "$debs" && apt-get download "${packages[@]}")
raw="$out/raw"
rm -rf "$raw"
mkdir -p "$raw"
for deb in "$debs"/*.deb; do dpkg -x "$deb" "$raw"; done

# One flat layout: include/, lib/ (shared libs, static libs, pkgconfig, cmake configs).
mkdir -p "$prefix/include" "$prefix/lib"
cp -a "$raw/usr/include/." "$prefix/include/"
for libdir in "$raw/usr/lib/x86_64-linux-gnu" "$raw/usr/lib" "$raw/lib/x86_64-linux-gnu"; do
  [ -d "$libdir" ] || continue
  find "$libdir" -maxdepth 1 \( -type f -o -type l \) -exec cp -a {} "$prefix/lib/" \;
  for sub in pkgconfig cmake; do
    [ -d "$libdir/$sub" ] && cp -a "$libdir/$sub/." "$prefix/lib/$sub/" 2>/dev/null ||
      { [ -d "$libdir/$sub" ] && mkdir -p "$prefix/lib/$sub" && cp -a "$libdir/$sub/." "$prefix/lib/$sub/"; }
  done
done
# CMake package configs installed under usr/share/cmake (Gloo's) go to lib/cmake too.
if [ -d "$raw/usr/share/cmake" ]; then
  mkdir -p "$prefix/lib/cmake"
  cp -a "$raw/usr/share/cmake/." "$prefix/lib/cmake/"
fi
# pkg-config files: relocatable via ${pcfiledir}, so the prefix can be unpacked anywhere.
for pc in "$prefix"/lib/pkgconfig/*.pc; do
  # Some (htslib.pc) have no prefix= line: drop any, then define it first.
  sed -i -E \
    -e '/^(prefix|exec_prefix)=/d' \
    -e 's|^includedir=.*|includedir=${prefix}/include|' \
    -e 's|^libdir=.*|libdir=${prefix}/lib|' \
    "$pc"
  sed -i -e '1i prefix=${pcfiledir}/../..' -e '1i exec_prefix=${prefix}' "$pc"
done
[ -f "$prefix/lib/pkgconfig/htslib.pc" ] && sed -i '/^Requires.private:/d' "$prefix/lib/pkgconfig/htslib.pc"
# CMake package configs. Debian's compute their prefix from their own location
# (usr/lib/x86_64-linux-gnu/cmake/X, four levels below /) and name the multiarch lib folder;
# here they sit in lib/cmake/X, three levels below the prefix. GoogleTest's and Gloo's are
# removed: CMake's FindGTest and our cmake/FindGloo.cmake find the files through
# CMAKE_PREFIX_PATH without them. TOML++ (found only by its config) is rewritten.
rm -rf "$prefix/lib/cmake/GTest" "$prefix/lib/cmake/Gloo"
toml_config="$prefix/lib/cmake/tomlplusplus/tomlplusplusConfig.cmake"
if [ -f "$toml_config" ]; then
  sed -i -e 's|CMAKE_CURRENT_LIST_DIR}/../../../..|CMAKE_CURRENT_LIST_DIR}/../../..|' \
         -e 's|PACKAGE_PREFIX_DIR}/lib/x86_64-linux-gnu/|PACKAGE_PREFIX_DIR}/lib/|' "$toml_config"
  grep -q 'CMAKE_CURRENT_LIST_DIR}/../../.." ABSOLUTE' "$toml_config" &&
    grep -q 'PACKAGE_PREFIX_DIR}/lib/libtomlplusplus.so' "$toml_config" || {
    echo "stage-gpu-deps.sh: $toml_config has an unexpected layout; fix the rewrite" >&2
    exit 1
  }
fi
rm -rf "$raw"
{
  echo "dnallm-dist GPU-node dependency prefix, staged $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "from: $(. /etc/os-release && echo "$PRETTY_NAME")"
  for deb in "$debs"/*.deb; do dpkg-deb -f "$deb" Package Version | paste -sd' '; done
} > "$prefix/STAGED.txt"
tar -C "$out" -czf "$out/dnallm-gpu-deps.tar.gz" prefix
size=$(du -sh "$out/dnallm-gpu-deps.tar.gz" | cut -f1)
echo "staged $(ls "$debs" | wc -l) packages into $prefix"
echo "packed: $out/dnallm-gpu-deps.tar.gz ($size)"
echo "on the GPU node:  mkdir -p deps && tar xzf dnallm-gpu-deps.tar.gz -C deps &&"
echo "                  scripts/build.sh --cuda --deps \$PWD/deps/prefix"
