#!/bin/sh
# Create the compose secrets in ./secrets (or $1): a development CA, one server certificate valid for
# every service name, one client certificate, PS and federated token files, and one token file per
# client holding only its own line. Needs `tessera` on PATH (pip install -e . or the image:
#   docker run --rm -u "$(id -u)" -v "$PWD/secrets:/out" tessera:latest ... see README).
#
# Who can read what (compose bind-mounts each secret file with its host owner and mode; the image
# runs as uid 10001, TESSERA_UID to change it):
# - run as root: private keys and tokens are mode 0600 owned by TESSERA_UID, the containers' user;
# - run as anyone else (who cannot give a file away): they are 0644, so that the containers can read
#   them, inside the directory, which is 0700: no other user of this host can reach them.
# Certificates are public (0644). ca.key, the CA's private key, is deleted: nothing more can be
# signed with it. KEEP_CA_KEY=1 keeps it (0600, owned by you, never by the containers' user) to
# issue more certificates later; keep it off the servers.
set -eu
out="${1:-./secrets}"
uid="${TESSERA_UID:-10001}"
mkdir -p "$out"
chmod 700 "$out"
# TESSERA_HOSTS: the server names to certify (default: the compose file's services; Kubernetes: see
# deploy/k8s/tessera.yaml)
hosts="${TESSERA_HOSTS:-shard0,shard0-backup,shard1,shard1-backup,fed-server,localhost,127.0.0.1}"
# their own lines describe files this script goes on to change: it says what it did at the end
tessera cert --out-dir "$out" --clients client --hosts "$hosts" > /dev/null
# PS identities: w0 creates the tables (admin), the replicas reach each other as `replica`,
# the report only reads, and so does Prometheus (`metrics`: deploy/prometheus.yml reads its token
# from metrics.bearer, the token alone)
tessera tokens --out "$out/ps.tokens" w0:admin,worker w1:worker replica:replica report:reader metrics:reader > /dev/null
# federated clients; `metrics` (reader: /metrics only, never a client) with the PS's metrics token,
# so that Prometheus scrapes every server with the one metrics.bearer
tessera fed tokens --out "$out/fed.tokens" c0 c1 c2 > /dev/null
grep "^metrics " "$out/ps.tokens" >> "$out/fed.tokens"
for id in w0 w1 report; do grep "^$id " "$out/ps.tokens" > "$out/$id.token"; done
for id in c0 c1 c2; do grep "^$id " "$out/fed.tokens" > "$out/$id.token"; done
grep "^metrics " "$out/ps.tokens" | cut -d " " -f 2 > "$out/metrics.bearer"
chmod 644 "$out"/*.crt
if [ "${KEEP_CA_KEY:-0}" = 1 ]; then
  chmod 600 "$out/ca.key"
  ca="ca.key kept (mode 0600, owned by $(id -un)): it signs more certificates (tessera cert); keep it off the servers"
else
  rm -f "$out/ca.key"
  ca="ca.key deleted: nothing more can be signed with this CA (KEEP_CA_KEY=1 keeps it)"
fi
for f in "$out"/*.key "$out"/*.token "$out"/*.tokens "$out"/metrics.bearer; do
  [ "$f" = "$out/ca.key" ] && continue
  if [ "$(id -u)" = 0 ]; then
    chown "$uid" "$f"
    chmod 600 "$f"
  else
    chmod 644 "$f"
  fi
done
if [ "$(id -u)" = 0 ]; then
  keys="mode 0600, owned by uid $uid (the containers' user)"
else
  keys="mode 0644 so that the containers (uid $uid) can read them; the directory (0700) keeps other users out (run as root for 0600 owned by uid $uid)"
fi
echo "secrets written to $out (directory mode 0700)"
echo "private keys and tokens: $keys; certificates: mode 0644"
echo "$ca"
