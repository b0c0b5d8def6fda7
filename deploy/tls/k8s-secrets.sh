#!/bin/sh
# The Kubernetes one-shot step (docs/security.md, "Kubernetes"): the Secrets
# the base's mutual TLS mounts, printed as manifests for kubectl apply.
#
#   deploy/tls/k8s-secrets.sh [OUT_DIR] | kubectl apply -f -
#
# Runs deploy/tls/make-certs.sh into OUT_DIR (default deploy/tls/out/k8s,
# which git ignores; the CA key stays there, never in a Secret) with the
# shards' Service names as SANs, then prints
#   Secret gtopk-tls-shards   ca.crt, shard-<s>.crt, shard-<s>.key (s < S)
#   Secret gtopk-tls-workers  ca.crt, worker.crt, worker.key (CN gtopk-worker:
#                             any rank, bound to the rank it joined as by the
#                             member token)
# in the namespace GTOPK_NAMESPACE (default gtopk, the base's). S is
# GTOPK_SHARDS from the environment, else from deploy/cluster.env. Needs the
# openssl CLI and kubectl (offline: --dry-run=client). Every run makes a new
# CA: apply it, then restart the pods (they read certificates at start).
set -eu
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here/out/k8s}
ns=${GTOPK_NAMESPACE:-gtopk}
shards=${GTOPK_SHARDS:-$(sed -n 's/^GTOPK_SHARDS=//p' "$here/../cluster.env" | tail -n 1)}
case "$shards" in
  ''|*[!0-9]*)
    echo "$0: GTOPK_SHARDS must be a non-negative integer, got '$shards'" >&2
    exit 2 ;;
esac
sans=""
s=0
while [ "$s" -lt "$shards" ]; do
  name="gtopk-shard-$s.gtopk-shard.$ns.svc"
  sans="$sans $name $name.cluster.local"
  s=$((s + 1))
done
# shellcheck disable=SC2086  # one SAN per word
"$here/make-certs.sh" "$out" "$shards" 0 $sans >&2

set -- --from-file="$out/ca.crt"
s=0
while [ "$s" -lt "$shards" ]; do
  set -- "$@" --from-file="$out/shard-$s.crt" --from-file="$out/shard-$s.key"
  s=$((s + 1))
done
kubectl create secret generic gtopk-tls-shards -n "$ns" "$@" \
  --dry-run=client -o yaml
echo ---
kubectl create secret generic gtopk-tls-workers -n "$ns" \
  --from-file="$out/ca.crt" --from-file="$out/worker.crt" \
  --from-file="$out/worker.key" --dry-run=client -o yaml
