#!/usr/bin/env bash
# A one-node Ceph cluster for tests and benchmarks: one monitor and one
# OSD on memstore (data in memory), no authentication, pool size 1, a
# pool `rbd` ready for images, on a loopback address of its own.
#
#   scripts/ceph-cluster.sh start DIR [MEMSTORE_BYTES] [rgw]   # DIR/ceph.conf
#   scripts/ceph-cluster.sh stop DIR
#
# With `rgw` (or CEPH_RGW=1) it also starts radosgw, Ceph's S3 gateway, on
# the cluster's loopback address and a free port, with a user whose keys
# are fixed test keys, and writes DIR/s3.env (AWS_ENDPOINT_URL,
# AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_REGION, as KEY=VALUE
# lines a shell can source). radosgw needs no manager.
#
# DIR must be empty or missing; `stop` kills the daemons (the caller
# removes DIR). One cluster starts at a time on the machine (two started
# side by side confuse each other's OSD registration, "wrong fsid"): the
# caller holds the lock it likes; the test fixture holds
# $TMPDIR/diskit-test-ceph.lock while its cluster runs.
set -euo pipefail

usage() { echo "usage: $0 start DIR [MEMSTORE_BYTES] [rgw] | stop DIR" >&2; exit 2; }
[ $# -ge 2 ] || usage
cmd=$1
D=$(realpath -m "$2")

stop() {
  for daemon in client.rgw.a osd.0 mon.a; do
    pid=$(cat "$D/run/$daemon.pid" 2>/dev/null || true)
    [ -n "$pid" ] && kill -9 "$pid" 2>/dev/null || true
  done
}

case $cmd in
stop) stop; exit 0 ;;
start) ;;
*) usage ;;
esac

rgw=${CEPH_RGW:-0}
bytes=1073741824
for arg in "${@:3}"; do
  case $arg in
  rgw) rgw=1 ;;
  *) bytes=$arg ;;
  esac
done
mkdir -p "$D"/{run,log,mon.a,osd.0}
# Any address 127.x.y.z is loopback: each cluster picks its own.
ip="127.$((RANDOM % 250 + 1)).$((RANDOM % 256)).$((RANDOM % 250 + 1))"
port=$(python3 -c 'import socket,sys; s=socket.socket(); s.bind((sys.argv[1],0)); print(s.getsockname()[1])' "$ip")
fsid=$(cat /proc/sys/kernel/random/uuid)
cat >"$D/ceph.conf" <<EOF
[global]
fsid = $fsid
mon host = v1:$ip:$port
auth cluster required = none
auth service required = none
auth client required = none
osd pool default size = 1
osd pool default min size = 1
# Small pools (radosgw makes several), and room for many: the tests give
# each test a pool of its own.
osd pool default pg num = 8
osd pool default pgp num = 8
osd pool default pg autoscale mode = off
mon max pg per osd = 2000
osd crush chooseleaf type = 0
mon allow pool size one = true
mon allow pool delete = true
run dir = $D/run
log file = $D/log/\$name.log
pid file = $D/run/\$name.pid
osd objectstore = memstore
memstore device bytes = $bytes
mon data avail crit = 0
mon data avail warn = 0
ms bind ipv6 = false
[mon]
admin socket = $D/run/\$name.asok
[osd]
admin socket = $D/run/\$name.asok
[mon.a]
mon data = $D/mon.a
public addr = $ip:$port
[osd.0]
osd data = $D/osd.0
EOF
c=$D/ceph.conf

# A step that fails shows what it said and the daemons' last log lines.
fail() {
  echo "$1" >&2
  for l in mon.a osd.0 client.rgw.a; do
    [ -f "$D/log/$l.log" ] && { echo "--- $l.log (last lines)" >&2; tail -15 "$D/log/$l.log" >&2; }
  done
  exit 1
}
step() {
  local out
  out=$(cd "$D" && timeout 60 "$@" 2>&1) || fail "$* failed: $out"
}

trap 'stop' EXIT
step monmaptool --create --fsid "$fsid" --addv a "[v1:$ip:$port]" "$D/monmap"
step ceph-mon -c "$c" --mkfs -i a --monmap "$D/monmap"
step ceph-mon -c "$c" -i a
# The monitor answers commands only once it has formed its quorum of one
# and loaded its command table, and it may lose that for a while when the
# OSD joins (meanwhile "EPERM: problem getting command descriptions"): a
# monitor command is tried again until it is taken.
mon_step() {
  local out try
  for try in $(seq 40); do
    if out=$(cd "$D" && timeout 20 "$@" 2>&1); then
      return 0
    fi
    [ "$try" -lt 40 ] || fail "$* failed: $out"
    sleep 0.5
  done
}
mon_step ceph -c "$c" osd create
step ceph-osd -c "$c" -i 0 --mkfs
# The OSD may ask the monitor before it has the monitor's map, with a
# null fsid ("wrong fsid"), and stop: a race in Ceph's start-up; another
# start gets past it.
for attempt in 1 2 3 4 5; do
  if out=$(cd "$D" && timeout 60 ceph-osd -c "$c" -i 0 2>&1); then
    break
  fi
  if [ "$attempt" -lt 5 ] && grep -q "wrong fsid" <<<"$out$(tail -15 "$D/log/osd.0.log" 2>/dev/null)"; then
    sleep 0.5
    continue
  fi
  fail "ceph-osd -i 0 failed: $out"
done
mon_step ceph -c "$c" osd pool create rbd 8
mon_step rbd -c "$c" pool init rbd
if [ "$rgw" = 1 ]; then
  rgw_port=$(python3 -c 'import socket,sys; s=socket.socket(); s.bind((sys.argv[1],0)); print(s.getsockname()[1])' "$ip")
  cat >>"$c" <<EOF
[client.rgw.a]
rgw frontends = beast endpoint=$ip:$rgw_port
rgw data = $D/rgw
admin socket = $D/run/\$name.asok
EOF
  mkdir -p "$D/rgw"
  step radosgw -c "$c" -n client.rgw.a
  # radosgw makes its pools before it answers.
  up=0
  for _ in $(seq 240); do
    if python3 -c 'import sys,urllib.request; urllib.request.urlopen(sys.argv[1], timeout=2)' "http://$ip:$rgw_port/" >/dev/null 2>&1; then
      up=1
      break
    fi
    sleep 0.25
  done
  [ $up = 1 ] || fail "radosgw did not answer on $ip:$rgw_port"
  step radosgw-admin -c "$c" user create --uid=diskit --display-name=diskit \
    --access-key=DISKITTESTKEY --secret=diskit-test-secret
  cat >"$D/s3.env" <<EOF
AWS_ENDPOINT_URL=http://$ip:$rgw_port
AWS_ACCESS_KEY_ID=DISKITTESTKEY
AWS_SECRET_ACCESS_KEY=diskit-test-secret
AWS_REGION=us-east-1
EOF
fi
trap - EXIT
echo "$c"
