#!/usr/bin/env bash
# Put mermaid.min.js (the diagram renderer the documentation site ships, so diagrams render
# offline: nothing is loaded from a CDN when the site is viewed) into DEST_DIR, from the npm
# registry's tarball of a pinned version, checked against its sha256.
# Usage: scripts/fetch-mermaid.sh DEST_DIR
set -euo pipefail

VERSION=11.9.0
SHA256=457d14c241bf63fdca6fd6ef0463d3a15f2061496429769c01b28c9203442320
URL="https://registry.npmjs.org/mermaid/-/mermaid-${VERSION}.tgz"

dest=${1:?usage: $0 DEST_DIR}
mkdir -p "$dest"
if [ -f "$dest/mermaid.min.js" ] && [ "$(cat "$dest/.mermaid-version" 2>/dev/null)" = "$VERSION" ]; then
    exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
curl -sSfL --retry 3 -o "$tmp/mermaid.tgz" "$URL"
echo "$SHA256  $tmp/mermaid.tgz" | sha256sum -c --quiet -
tar -xzf "$tmp/mermaid.tgz" -C "$tmp" package/dist/mermaid.min.js package/LICENSE
cp "$tmp/package/dist/mermaid.min.js" "$dest/mermaid.min.js.part"
cp "$tmp/package/LICENSE" "$dest/mermaid.LICENSE"
mv "$dest/mermaid.min.js.part" "$dest/mermaid.min.js"
echo "$VERSION" > "$dest/.mermaid-version"
echo "mermaid $VERSION -> $dest/mermaid.min.js"
