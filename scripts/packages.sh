# Sourced by the test scripts (scripts/test, blksum.sh, nbd-tester.sh,
# libnbd-interop.sh): installing the Debian packages they need.

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
