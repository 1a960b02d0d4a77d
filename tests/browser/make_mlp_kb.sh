#!/usr/bin/env bash
# Writes a fresh knowledge base with mlp_train: 4 ranks as threads, rank 1 on
# a small device, costly samples. Fails when no incident was recorded.
set -euo pipefail
BIN=$1 DB=$2
rm -f "$DB" "$DB-wal" "$DB-shm"
"$BIN" --steps 20 --global-batch 512 --hidden 64 --dist threads --ranks 4 --rank-budget-mib 1=0.3 \
  --costly-samples --kb "$DB" --quiet
test -s "$DB"
