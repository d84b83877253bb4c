#!/usr/bin/env bash
# The training Job's init container `prepare-data` (manifests/render.py embeds this file in the
# pod spec as `bash -c`): the first pod builds the corpus on FSx, every pod waits for it.
set -euo pipefail
if [ -f "$DATA_DIR/meta.json" ]; then echo "data ready in $DATA_DIR"; exit 0; fi
if [ "$JOB_COMPLETION_INDEX" = 0 ]; then
  TMP="$DATA_DIR.tmp.$HOSTNAME"
  rm -rf "$TMP"
  python -m training prepare --stdlib --out "$TMP"
  mkdir -p "${DATA_DIR%/*}"
  mv -T "$TMP" "$DATA_DIR" 2>/dev/null || rm -rf "$TMP"  # another job won the race: fine
fi
for _ in {1..360}; do [ -f "$DATA_DIR/meta.json" ] && exit 0; sleep 5; done
echo "no $DATA_DIR/meta.json after 30 min" >&2; exit 1
