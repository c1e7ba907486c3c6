#!/usr/bin/env bash
# Re-cut a kit fetched by ../shared/device/*/fetch.sh (.fa4/, .vllmpeer/: 50 MB pieces) into 30 MiB pieces, so
# that one piece travels beside the working tree (~33 MB; a device call carries at most 64 MiB). Checks the
# whole against the kit's SHA256 first; assemble.sh joins piece-* as before.
# Usage: bash benchmarks/kits/recut.sh .fa4 [.vllmpeer ...]
set -euo pipefail
for kit in "$@"; do
  [ -f "$kit/SHA256" ] || { echo "$kit: no SHA256 (fetch the kit first)" >&2; exit 1; }
  (
    cd "$kit"
    cat piece-* > wheels.tar
    sha256sum -c --quiet SHA256 || { rm -f wheels.tar; echo "$kit: pieces do not match SHA256" >&2; exit 1; }
    rm piece-*
    split -b 30M -d wheels.tar piece-
    rm wheels.tar
    echo "$kit: $(ls piece-* | wc -l) pieces of at most 30 MiB"
  )
done
