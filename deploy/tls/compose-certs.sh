#!/bin/sh
# The docker-compose cluster's set-up step (docs/security.md, "Compose"):
# certificates for the mutual TLS that deploy/docker-compose.yml runs by
# default, laid out so that each service mounts only its own files.
#
#   deploy/tls/compose-certs.sh [OUT_DIR]          (or: make compose-certs)
#
# OUT_DIR (default deploy/tls/out, which git ignores; the compose file reads
# it from GTOPK_COMPOSE_TLS_DIR, default ./tls/out) gets
#   shard-<s>/   ca.crt, shard-<s>.crt, shard-<s>.key    (CN gtopk-shard-<s>)
#   worker-<r>/  ca.crt, worker-<r>.crt, worker-<r>.key  (CN gtopk-worker-<r>:
#                that worker may act only as rank r)
#   ca/          the rest of make-certs.sh's output: the CA key, the any-rank
#                worker certificate, the tokens. Mounted by no service.
# for s < S and r < P, S and P being GTOPK_SHARDS and GTOPK_WORKERS from the
# environment, else from deploy/cluster.env (as docker-compose reads them).
# Service shard-<s> mounts OUT_DIR/shard-<s> read-only at /etc/gtopk/tls,
# worker-<r> OUT_DIR/worker-<r>. Every run makes a new CA and new keys.
#
# The containers run as uid 10001 (GTOPK_COMPOSE_UID to change it) and the
# keys are mode 0600: as root the keys are given to that uid; otherwise the
# script fails unless that uid is yours (a container could not read them),
# saying to rerun it with sudo. OUT_DIR is made 0700, so on the host only
# its owner reaches the keys. Needs the openssl CLI (make-certs.sh).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/out}
uid=${GTOPK_COMPOSE_UID:-10001}
env_file=$here/../cluster.env

setting() {  # NAME: from the environment, else from cluster.env
  eval "v=\${$1:-}"
  if [ -z "$v" ]; then
    v=$(sed -n "s/^$1=//p" "$env_file" | tail -n 1)
  fi
  case "$v" in
    ''|*[!0-9]*)
      echo "$0: $1 must be a non-negative integer (environment or $env_file), got '$v'" >&2
      exit 2 ;;
  esac
  echo "$v"
}
shards=$(setting GTOPK_SHARDS)
workers=$(setting GTOPK_WORKERS)
case "$uid" in
  ''|*[!0-9]*) echo "$0: GTOPK_COMPOSE_UID must be a uid, got '$uid'" >&2; exit 2 ;;
esac
me=$(id -u)
if [ "$me" != 0 ] && [ "$me" != "$uid" ]; then
  echo "$0: the containers run as uid $uid and could not read keys of uid $me" \
    "(mode 0600): run it as root, e.g. sudo $0${1:+ $1}" >&2
  exit 1
fi

# A service started before this step leaves its mount source as an empty
# directory made by the engine (root's): fine when it is ours to write.
# OUT_DIR itself is 0700: on this machine only its owner reaches the keys
# (the engine mounts each service's directory as root).
mkdir -p "$out"
chmod 0700 "$out"
for d in "$out"/ca "$out"/shard-* "$out"/worker-*; do
  if [ -e "$d" ] && ! [ -w "$d" ]; then
    echo "$0: $d is not writable (made by docker when compose started" \
      "before this step?): remove it (sudo rm -r $d) or run this as root" >&2
    exit 1
  fi
done

"$here/make-certs.sh" "$out/ca" "$shards" "$workers" >/dev/null

# place NAME: OUT_DIR/NAME/ gets ca.crt and NAME.{crt,key}.
place() {
  mkdir -p "$out/$1"
  chmod 0755 "$out/$1"
  cp "$out/ca/ca.crt" "$out/$1/ca.crt"
  mv -f "$out/ca/$1.crt" "$out/$1/$1.crt"
  mv -f "$out/ca/$1.key" "$out/$1/$1.key"
  chmod 0644 "$out/$1/ca.crt" "$out/$1/$1.crt"
  chmod 0600 "$out/$1/$1.key"
  if [ "$me" != "$uid" ]; then
    chown "$uid:$uid" "$out/$1/$1.key"
  fi
}
s=0
while [ "$s" -lt "$shards" ]; do place "shard-$s"; s=$((s + 1)); done
r=0
while [ "$r" -lt "$workers" ]; do place "worker-$r"; r=$((r + 1)); done
echo "compose-certs: CA, $shards shard and $workers worker certificates in" \
  "$out/{shard,worker}-N/ (keys for uid $uid); CA key in $out/ca/"
