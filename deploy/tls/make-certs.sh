#!/bin/sh
# One-shot certificates for a gtopk cluster with mutual TLS (docs/security.md):
# a throwaway CA, one certificate per shard (CN gtopk-shard-<s>), one per
# worker rank (CN gtopk-worker-<r>: that worker may act only as rank r) and
# one for workers of any rank (CN gtopk-worker), all signed by the CA, plus
# the workers' and shards' tokens for token authentication.
#
#   deploy/tls/make-certs.sh OUT_DIR SHARDS WORKERS [SAN...]
#
# SANs: host names and IP addresses the shards are dialled at, added to every
# shard certificate beside localhost and 127.0.0.1 (e.g. shard-0 shard-1 for
# compose; the k8s Service names for Kubernetes). Writes OUT_DIR/ca.crt,
# shard-<s>.{crt,key}, worker-<r>.{crt,key}, worker.{crt,key}, token,
# shard-token. Keys are 0600. The CA key stays in OUT_DIR/ca.key: keep it
# out of images and volumes (the deployments mount only what they need).
# Needs the openssl CLI. Idempotent only in the sense that it overwrites.
set -eu
if [ $# -lt 3 ]; then
  echo "usage: $0 OUT_DIR SHARDS WORKERS [SAN...]" >&2
  exit 2
fi
out=$1 shards=$2 workers=$3
shift 3
days=${GTOPK_CERT_DAYS:-30}
# Counts: 0 or more (0: a CA and tokens only, e.g. a second CA for tests);
# days: 1 or more.
for pair in "SHARDS:$shards" "WORKERS:$workers" "GTOPK_CERT_DAYS:$days"; do
  name=${pair%%:*} value=${pair#*:}
  case "$value" in
    ''|*[!0-9]*)
      echo "$0: $name must be a non-negative integer, got '$value'" >&2
      exit 2 ;;
  esac
done
if [ "$days" -lt 1 ]; then
  echo "$0: GTOPK_CERT_DAYS must be at least 1, got '$days'" >&2
  exit 2
fi
mkdir -p "$out"
umask 077
san="DNS:localhost,IP:127.0.0.1"
for name in "$@"; do
  case "$name" in
    *[!0-9.]*) san="$san,DNS:$name" ;;
    *) san="$san,IP:$name" ;;
  esac
done

openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -days "$days" \
  -keyout "$out/ca.key" -out "$out/ca.crt" -subj "/CN=gtopk throwaway CA" \
  -addext "basicConstraints=critical,CA:TRUE" \
  -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null

# issue NAME CN EXT: key + certificate signed by the CA.
issue() {
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:prime256v1 -nodes -keyout "$out/$1.key" \
    -out "$out/$1.csr" -subj "/CN=$2" 2>/dev/null
  printf '%s\n' "$3" > "$out/$1.ext"
  openssl x509 -req -in "$out/$1.csr" -CA "$out/ca.crt" -CAkey "$out/ca.key" \
    -CAcreateserial -days "$days" -extfile "$out/$1.ext" \
    -out "$out/$1.crt" 2>/dev/null
  rm -f "$out/$1.csr" "$out/$1.ext"
}

s=0
while [ "$s" -lt "$shards" ]; do
  # Shards are servers (to workers and shards) and clients (to the leader).
  issue "shard-$s" "gtopk-shard-$s" \
    "subjectAltName=$san,DNS:shard-$s
extendedKeyUsage=serverAuth,clientAuth"
  s=$((s + 1))
done
r=0
while [ "$r" -lt "$workers" ]; do
  issue "worker-$r" "gtopk-worker-$r" "extendedKeyUsage=clientAuth"
  r=$((r + 1))
done
issue worker gtopk-worker "extendedKeyUsage=clientAuth"
rm -f "$out/ca.srl"
openssl rand -hex 32 > "$out/token"
openssl rand -hex 32 > "$out/shard-token"
chmod 0644 "$out"/*.crt
echo "make-certs: CA, $shards shard and $workers+1 worker certificates, tokens in $out"
