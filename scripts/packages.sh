# Sourced by the test scripts (scripts/test, blksum.sh, nbd-tester.sh,
# libnbd-interop.sh): installing the Debian packages they need, and what
# the scripts building vendored C sources share.

# apt_install PKG...: installs the packages (as root, or with sudo),
# quietly; what apt says goes to stderr.
apt_install() {
  local sudo="" pkgs
  [ "$(id -u)" -eq 0 ] || sudo="sudo"
  mapfile -t pkgs < <(printf '%s\n' "$@" | sort -u)
  $sudo apt-get update -qq >&2
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
    "${pkgs[@]}" >&2
}

# install_missing WHO [PKG...]: installs what is given (nothing when
# nothing is), saying so on stderr in WHO's name.
install_missing() {
  local who=$1
  shift
  [ $# -gt 0 ] || return 0
  echo "== $who: installing: $*" >&2
  apt_install "$@"
}

# install_build_needs: what building diskit needs besides Rust and a C
# compiler: the system's CPython for the python plugin (python3-dev:
# headers, python3-config, libpython3), when missing.
install_build_needs() {
  [ -x /usr/bin/python3-config ] || install_missing "the build" python3-dev
}

# c_build_setup NAME: for a script, run from the top of the tree, that
# builds the C sources vendored in third_party/NAME: sets src (those
# sources), target (cargo's target directory) and need, the packages to
# install (gcc and pkg-config when missing; need_pkg adds to it).
c_build_setup() {
  src=$PWD/third_party/$1
  target=${CARGO_TARGET_DIR:-$PWD/target}
  need=()
  command -v cc >/dev/null || need+=(gcc)
  command -v pkg-config >/dev/null || need+=(pkg-config)
}

# need_pkg MODULE PACKAGE: PACKAGE into need when pkg-config does not
# find MODULE.
need_pkg() {
  { command -v pkg-config >/dev/null && pkg-config --exists "$1"; } || need+=("$2")
}
