#!/usr/bin/env bash
# Builds the shipped agent (profile `agent`) and prints what goes into the cloud-init Secret:
# raw, gzipped and base64-of-gzipped sizes, and the newest glibc symbol version it needs.
# Fails if the base64 form reaches 400 KiB or a symbol needs glibc newer than 2.34.
set -euo pipefail
cd "$(dirname "$0")/../.."
cargo build --quiet -p ttlab-agent-bin --profile agent
bin=target/agent/ttlab-agent
raw=$(stat -c%s "$bin")
gz=$(gzip -9c "$bin" | wc -c)
b64=$(gzip -9c "$bin" | base64 -w0 | wc -c)
glibc=$(objdump -T "$bin" | grep -o 'GLIBC_[0-9.]*' | sort -uV | tail -n1)
echo "ttlab-agent (profile agent): raw ${raw} B, gzip ${gz} B, base64 ${b64} B; newest symbol ${glibc}"
if (( b64 >= 400 * 1024 )); then
    echo "base64 form is over 400 KiB" >&2
    exit 1
fi
newest=$(printf '%s\n' "${glibc#GLIBC_}" 2.34 | sort -V | tail -n1)
if [[ "$newest" != 2.34 ]]; then
    echo "needs ${glibc}, newer than GLIBC_2.34" >&2
    exit 1
fi
