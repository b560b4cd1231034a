#!/usr/bin/env bash
# Builds blkhash's blksum (vendored in third_party/blkhash) and prints its
# path: the reference that diskit checksum and diskit copy --blkhash are
# tested and benchmarked against.
#
# Installs the build dependencies when missing (a C compiler, pkg-config,
# OpenSSL's and libnbd's headers), builds once per version of the sources
# (cached under target/blksum/), and prints the binary's path on stdout;
# everything else goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/packages.sh
c_build_setup blkhash
need_pkg openssl libssl-dev
need_pkg libnbd libnbd-dev
# blksum reads image files through qemu-nbd.
command -v qemu-nbd >/dev/null || need+=(qemu-utils)
install_missing blksum "${need[@]}"

cache=$target/blksum
stamp=$(cat "$src"/*/*.c "$src"/*/*.h "$src"/*.h "$0" | sha256sum | cut -c1-16)
blksum=$cache/blksum-$stamp
mkdir -p "$cache"
# Tests running side by side ask for it at once: one builds, the others
# wait for it.
exec 9>"$cache/lock"
flock 9
if [ ! -x "$blksum" ]; then
  echo "== blksum: building blksum" >&2
  rm -f "$cache"/blksum-*
  # As upstream's meson build: gnu99, optimized (its default build type
  # is debugoptimized).
  # shellcheck disable=SC2046
  cc -O2 -g -std=gnu99 -pthread -I"$src" -I"$src/include" -I"$src/lib" -I"$src/common" \
    $(pkg-config --cflags openssl libnbd) -o "$blksum.tmp" \
    "$src"/lib/*.c "$src"/common/util.c "$src"/bin/*.c \
    $(pkg-config --libs openssl libnbd) >&2
  mv "$blksum.tmp" "$blksum"
fi
echo "$blksum"
