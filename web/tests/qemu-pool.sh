#!/usr/bin/env bash
# A measurement, not part of the test suite: "Start lab" → a root prompt in the browser for a
# click a warm pool serves and for a cold one, with real qemu guests (web/tests/qemu-pool.mjs).
# Needs qemu, TTLAB_GUEST_IMAGE (`ttlabctl guest-image`), Chromium and a built ttlabctl
# (TTLABCTL, default target/release/ttlabctl, with ttlab-server and ttlab-agent beside it).
# About 6 to 10 minutes on two cores without KVM.
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
ttlabctl="${TTLABCTL:-$root/target/release/ttlabctl}"
: "${TTLAB_GUEST_IMAGE:?set TTLAB_GUEST_IMAGE to a guest image directory}"
log="$(mktemp -d)"
demo=""
stop() {
  if [ -n "$demo" ] && kill -0 "$demo" 2>/dev/null; then
    kill -TERM "$demo" 2>/dev/null || true
    for _ in $(seq 1 300); do kill -0 "$demo" 2>/dev/null || break; sleep 0.2; done
    kill -KILL "$demo" 2>/dev/null || true
  fi
  rm -rf "$log"
}
trap stop EXIT
"$ttlabctl" demo --port 0 --guest qemu --guest-image "$TTLAB_GUEST_IMAGE" >"$log/out" 2>"$log/err" &
demo=$!
for _ in $(seq 1 900); do
  grep -q '^ttlab demo ready:' "$log/out" 2>/dev/null && break
  kill -0 "$demo" 2>/dev/null || { cat "$log/err" >&2; exit 1; }
  sleep 0.2
done
student="$(sed -n 's/^ *student: *\([^ ]*\).*/\1/p' "$log/out" | head -n 1)"
admin="$(sed -n 's/^ *admin: *\([^ ]*\).*/\1/p' "$log/out" | head -n 1)"
TTLAB_STUDENT_URL="$student" TTLAB_ADMIN_URL="$admin" node "$root/web/tests/qemu-pool.mjs"
