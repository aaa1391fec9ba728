#!/bin/sh
# Create the compose secrets in ./secrets (or $1): a development CA, one server certificate valid for
# every service name, one client certificate, PS and federated token files, and one token file per
# client holding only its own line. Needs `tessera` on PATH (pip install -e . or the image:
#   docker run --rm -u "$(id -u)" -v "$PWD/secrets:/out" tessera:latest ... see README).
set -eu
out="${1:-./secrets}"
mkdir -p "$out"
chmod 700 "$out"
# TESSERA_HOSTS: the server names to certify (default: the compose file's services; Kubernetes: see
# deploy/k8s/tessera.yaml)
hosts="${TESSERA_HOSTS:-shard0,shard0-backup,shard1,shard1-backup,fed-server,localhost,127.0.0.1}"
tessera cert --out-dir "$out" --clients client --hosts "$hosts"
# PS identities: w0 creates the tables (admin), the replicas reach each other as `replica`,
# the report only reads, and so does Prometheus (`metrics`: deploy/prometheus.yml reads its token
# from metrics.bearer, the token alone)
tessera tokens --out "$out/ps.tokens" w0:admin,worker w1:worker replica:replica report:reader metrics:reader
tessera tokens --out "$out/fed.tokens" c0 c1 c2
for id in w0 w1 report; do grep "^$id " "$out/ps.tokens" > "$out/$id.token"; done
for id in c0 c1 c2; do grep "^$id " "$out/fed.tokens" > "$out/$id.token"; done
grep "^metrics " "$out/ps.tokens" | cut -d " " -f 2 > "$out/metrics.bearer"
# compose bind-mounts file secrets with their host mode; the image runs as uid 10001, so they must
# be readable by it: world-readable files inside the owner-only directory
chmod 644 "$out"/*.crt "$out"/*.key "$out"/*.token "$out"/*.tokens "$out"/metrics.bearer
rm -f "$out/ca.key"  # nothing more to sign; keep it instead if you will issue more certificates
echo "secrets written to $out"
