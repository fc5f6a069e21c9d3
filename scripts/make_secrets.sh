#!/usr/bin/env bash
# TLS material and bearer tokens for a deployment, with openssl only (no Python environment needed):
#   a private CA, a server certificate for every name the services are reached by (compose and k8s names,
#   localhost, 127.0.0.1), a client certificate (for mutual TLS), two tokens and the tokens file the servers
#   read (sha256 digests only, never the tokens themselves). The same file names as `prorag security init`.
#
#   scripts/make_secrets.sh [--out DIR] [--k8s] [--host NAME ...] [--days N] [--force]
#     --out DIR   where to write (default ./secrets, git-ignored: the script writes DIR/.gitignore = *)
#     --k8s       also copy what the k8s secure component reads into k8s/components/secure/secrets/
#     --host      extra name or IP for the server certificate (repeatable), e.g. a public DNS name
#     --force     replace existing material (default: keep it, so tokens in use stay valid)
#
# Files: ca.pem ca.key server.pem server.key client.pem client.key token-admin token-client tokens.yaml
#   token-admin   scopes call + admin (trainer jobs, adapter management): give it to the trainer and operators
#   token-client  scope call (search, generate, score, judge): the other services and ordinary clients
# compose bind-mounts the files into containers that run as uid 10001: when run as root the files are made
# owned by 10001 (mode 0400); otherwise they stay 0600 and the script says what to run.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=secrets; K8S=0; DAYS=365; FORCE=0; EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --out) OUT="$2"; shift 2;;
    --k8s) K8S=1; shift;;
    --host) EXTRA+=("$2"); shift 2;;
    --days) DAYS="$2"; shift 2;;
    --force) FORCE=1; shift;;
    -h|--help) sed -n '2,18p' "$0"; exit 0;;
    *) echo "unknown argument $1" >&2; exit 2;;
  esac
done
command -v openssl >/dev/null || { echo "openssl is needed (apt-get install openssl)" >&2; exit 1; }
mkdir -p "$OUT"
printf '# TLS keys and tokens: never committed\n*\n' > "$OUT/.gitignore"
umask 077

HOSTS=(localhost 127.0.0.1 retriever policy prm judge trainer
       prorag-retriever prorag-policy prorag-policy-headless prorag-prm prorag-judge prorag-trainer "${EXTRA[@]}")
if [ "$FORCE" = 1 ] || [ ! -f "$OUT/tokens.yaml" ]; then
  san=""; i=0; j=0
  for h in "${HOSTS[@]}"; do
    if [[ "$h" =~ ^[0-9.]+$ ]] || [[ "$h" == *:* ]]; then i=$((i+1)); san="${san}IP.$i = $h"$'\n'
    else j=$((j+1)); san="${san}DNS.$j = $h"$'\n'; fi
  done
  tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
  cat >"$tmp/server.cnf" <<EOF
[req]
distinguished_name = dn
[dn]
[ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = @alt
[alt]
$san
EOF
  cat >"$tmp/client.cnf" <<'EOF'
[req]
distinguished_name = dn
[dn]
[ext]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature
extendedKeyUsage = clientAuth
EOF
  cat >"$tmp/ca.cnf" <<'EOF'
[req]
distinguished_name = dn
[dn]
[ext]
basicConstraints = critical, CA:TRUE, pathlen:0
keyUsage = critical, keyCertSign, cRLSign, digitalSignature
subjectKeyIdentifier = hash
EOF
  ec() { openssl genpkey -algorithm EC -pkeyopt ec_paramgen_curve:P-256 -out "$1" 2>/dev/null; }
  ec "$OUT/ca.key"
  openssl req -x509 -new -key "$OUT/ca.key" -subj "/O=prorag/CN=prorag CA" -days "$DAYS" \
    -config "$tmp/ca.cnf" -extensions ext -out "$OUT/ca.pem"
  for leaf in server client; do
    ec "$OUT/$leaf.key"
    cn="prorag $leaf"; [ "$leaf" = server ] && cn=localhost
    openssl req -new -key "$OUT/$leaf.key" -subj "/O=prorag/CN=$cn" -config "$tmp/$leaf.cnf" -out "$tmp/$leaf.csr"
    openssl x509 -req -in "$tmp/$leaf.csr" -CA "$OUT/ca.pem" -CAkey "$OUT/ca.key" -CAcreateserial \
      -days "$DAYS" -extfile "$tmp/$leaf.cnf" -extensions ext -out "$OUT/$leaf.pem" 2>/dev/null
  done
  rm -f "$OUT/ca.srl"
  {
    echo "# bearer tokens the servers accept (PRORAG_AUTH_TOKENS): sha256 digests only, scopes call / admin"
    echo "tokens:"
    for name in admin client; do
      token="$(openssl rand -base64 33 | tr '+/' '-_' | tr -d '=\n')"
      printf '%s' "$token" > "$OUT/token-$name"
      digest="$(printf '%s' "$token" | openssl dgst -sha256 -r | cut -d' ' -f1)"
      scopes="[call]"; [ "$name" = admin ] && scopes="[call, admin]"
      echo "  - {name: $name, token_sha256: \"$digest\", scopes: $scopes}"
    done
  } > "$OUT/tokens.yaml"
  openssl verify -CAfile "$OUT/ca.pem" "$OUT/server.pem" "$OUT/client.pem" >/dev/null
  echo "wrote CA, server and client certificates and tokens into $OUT/"
else
  echo "$OUT/ already holds secrets (tokens.yaml); --force replaces them"
fi

chmod 0600 "$OUT"/*.key "$OUT"/*.pem "$OUT"/token-* "$OUT/tokens.yaml"
if [ "$(id -u)" = 0 ]; then
  chown 10001:10001 "$OUT"/*.key "$OUT"/*.pem "$OUT"/token-* "$OUT/tokens.yaml"
  chmod 0400 "$OUT"/*.key "$OUT"/*.pem "$OUT"/token-* "$OUT/tokens.yaml"
else
  echo "note: the containers run as uid 10001 and compose bind-mounts these files as they are:" \
       "sudo chown 10001:10001 $OUT/* (or chmod 0644 on a single-user host)" >&2
fi

if [ "$K8S" = 1 ]; then
  dest=k8s/components/secure/secrets
  mkdir -p "$dest"
  for f in ca.pem server.pem server.key tokens.yaml token-client token-admin; do cp "$OUT/$f" "$dest/$f"; done
  chmod 0600 "$dest"/*.pem "$dest"/*.key "$dest"/token-* "$dest/tokens.yaml"
  echo "copied into $dest/ for the secure component (kubectl apply -k k8s/overlays/gpu-secure)"
fi
cat <<EOF
servers: PRORAG_TLS_CERT=$OUT/server.pem PRORAG_TLS_KEY=$OUT/server.key PRORAG_AUTH_TOKENS=$OUT/tokens.yaml
         [PRORAG_TLS_CLIENT_CA=$OUT/ca.pem for mutual TLS]
clients: PRORAG_TLS_CA=$OUT/ca.pem PRORAG_TOKEN_FILE=$OUT/token-client (admin: $OUT/token-admin)
         [PRORAG_TLS_CLIENT_CERT=$OUT/client.pem PRORAG_TLS_CLIENT_KEY=$OUT/client.key for mutual TLS]
compose: docker compose -f compose.yaml -f compose.secure.yaml --profile cpu up -d
EOF
