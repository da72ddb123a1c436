#!/usr/bin/env bash
# Browser tests of the student and admin pages (browser.mjs), of the student's terminal
# (terminal.mjs, against the same demo afterwards), of what the student sees of the console
# (student.mjs, after them: "Connected" only once the VM's console is reached, a new lab's
# terminal without the previous one's, a warning not repeated), of a crashed server
# replica's consoles (replicas.mjs: a second ttlab-server beside the demo's, killed), of the
# waitlist (waitlist.mjs, against a
# demo of its own with room for one VM), of a lesson's instructions (instructions.mjs,
# against a demo of its own serving web/tests/lessons/ on two sites) and of that demo's
# admin page with its sites (sites.mjs): headless Chromium (Debian's
# `chromium`, driven by playwright-core) against `ttlabctl demo` (PostgreSQL, kube-sim,
# ttlab-server, ttlab-reaper).
# Beside them, from the start, qemu.mjs against `ttlabctl demo --guest qemu --no-reaper`: a real
# guest of TTLAB_GUEST_IMAGE, from Start lab to its own power-off at the hard deadline (about
# 5½ minutes); without qemu or the image it is SKIPPED, and fails under CI=true.
# Beside them too, qemu-claims.mjs against a `ttlabctl demo --guest qemu` of its own: a warm
# pool of one serves three claims in a row, each reaching a root prompt in the browser (the
# pool prepares the next member while the student works); skipped and failed alike.
#
#   web/tests/run.sh            # from anywhere in the checkout
#
# Installs what is missing (Chromium through apt when run as root, the npm packages with
# `npm ci`), builds the binaries (unless TTLAB_PREBUILT=1), starts the demo on a free loopback port, runs the tests and
# stops the demo. Screenshots go to artifacts/browser/ (override with TTLAB_ARTIFACTS).
# When Chromium or npm cannot be had it prints a SKIPPED line and exits 0, except under
# CI=true, where it exits 1 with the reason (CI installs every tool the tests need).
set -euo pipefail
root="$(cd "$(dirname "$0")/../.." && pwd)"
web="$root/web"
artifacts="${TTLAB_ARTIFACTS:-$root/artifacts/browser}"
chromium="${TTLAB_CHROMIUM:-/usr/bin/chromium}"

say() { printf 'browser tests: %s\n' "$*"; }
in_ci() { case "${CI:-}" in true | TRUE | True | 1) return 0 ;; *) return 1 ;; esac; }
# A missing tool: exit 0 with a SKIPPED line, or exit 1 under CI=true.
skip_or_fail() {
  if in_ci; then
    say "FAILED: CI=true and a tool the browser tests need is missing: $*"
    exit 1
  fi
  say "SKIPPED: $*"
  exit 0
}

# Chromium
if [ ! -x "$chromium" ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing Chromium (apt-get install chromium)"
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium >/dev/null; }; then
      skip_or_fail "Chromium could not be installed (apt-get install chromium failed)"
    fi
  fi
fi
if [ ! -x "$chromium" ]; then
  skip_or_fail "no Chromium at $chromium (install Debian's 'chromium' package, or set TTLAB_CHROMIUM)"
fi

# Node packages (xterm for the pages, playwright-core for the tests)
if ! command -v npm >/dev/null 2>&1 || ! command -v node >/dev/null 2>&1; then
  skip_or_fail "npm or node is not on PATH (install Node.js with npm)"
fi
if [ ! -d "$web/node_modules/playwright-core" ] || [ ! -d "$web/node_modules/@xterm/xterm" ]; then
  say "npm ci in web/"
  (cd "$web" && npm ci --no-audit --no-fund >/dev/null)
fi

# Binaries (TTLAB_PREBUILT=1: the caller built them, and may be holding cargo's lock with
# another build or test run, as .ci/run does)
if [ "${TTLAB_PREBUILT:-}" = 1 ]; then
  say "using the binaries built in target/debug"
else
  say "building ttlabctl, ttlab-server, ttlab-reaper, ttlab-agent"
  (cd "$root" && cargo build -q -p ttlab-ttlabctl-bin -p ttlab-server-bin -p ttlab-reaper-bin -p ttlab-agent-bin)
fi

# The qemu demo (qemu.mjs): `ttlabctl demo --guest qemu --no-reaper` with a real guest of
# TTLAB_GUEST_IMAGE (as the Rust real-guest tests get it; .ci/run exports it), on a port of its
# own, beside the tests below: its guest boots for minutes on one core while they run (3 to 4
# minutes to ready, loaded). A 6-minute lifespan leaves time to do the lab after that, and a
# 20 s grace puts the guest's own power-off 6 min 20 s after Start lab.
# Its output is kept and printed at the end; its failure fails the script.
qemu_pid=""
claims_pid=""
qemu_log="$(mktemp -d)"
qemu_skipped=""
stop_qemu_job() {
  if [ -n "$qemu_pid" ] && kill -0 "$qemu_pid" 2>/dev/null; then
    kill -TERM "$qemu_pid" 2>/dev/null || true
    wait "$qemu_pid" 2>/dev/null || true
  fi
  qemu_pid=""
  if [ -n "$claims_pid" ] && kill -0 "$claims_pid" 2>/dev/null; then
    kill -TERM "$claims_pid" 2>/dev/null || true
    wait "$claims_pid" 2>/dev/null || true
  fi
  claims_pid=""
  rm -rf "$qemu_log"
}
trap stop_qemu_job EXIT
qemu_missing=""
command -v qemu-system-x86_64 >/dev/null 2>&1 || qemu_missing="qemu-system-x86_64 is not installed (apt-get install qemu-system-x86)"
if [ -z "$qemu_missing" ] && [ -z "${TTLAB_GUEST_IMAGE:-}" ]; then
  qemu_missing="TTLAB_GUEST_IMAGE is not set (build the image with \`sudo ttlabctl guest-image\` and set it to the directory printed)"
elif [ -z "$qemu_missing" ] && [ ! -f "$TTLAB_GUEST_IMAGE/manifest.json" ]; then
  qemu_missing="TTLAB_GUEST_IMAGE=$TTLAB_GUEST_IMAGE is not a guest image directory (no manifest.json)"
fi
# Runs in a subshell of its own: its variables and traps are its own.
run_qemu_test() {
  qemu_demo=""
  qemu_node=""
  # Stops what this job started, by pid: the test, then the demo (which stops its guest).
  stop_qemu_demo() {
    if [ -n "$qemu_node" ] && kill -0 "$qemu_node" 2>/dev/null; then kill -TERM "$qemu_node" 2>/dev/null || true; fi
    if [ -n "$qemu_demo" ] && kill -0 "$qemu_demo" 2>/dev/null; then
      kill -TERM "$qemu_demo" 2>/dev/null || true
      for _ in $(seq 1 300); do kill -0 "$qemu_demo" 2>/dev/null || break; sleep 0.2; done
      if kill -0 "$qemu_demo" 2>/dev/null; then kill -KILL "$qemu_demo" 2>/dev/null || true; fi
    fi
    qemu_demo=""
    qemu_node=""
  }
  trap stop_qemu_demo EXIT
  trap 'exit 143' TERM INT
  local grace=20s max=4m30s status=0
  TTLAB_SESSION_TTL=$max TTLAB_SESSION_MAX=$max TTLAB_MAX_EXTENSIONS=0 TTLAB_HARD_DEADLINE_GRACE=$grace \
    "$root/target/debug/ttlabctl" demo --port 0 --guest qemu --guest-image "$TTLAB_GUEST_IMAGE" --no-reaper \
    >"$qemu_log/out" 2>"$qemu_log/err" &
  qemu_demo=$!
  for _ in $(seq 1 900); do
    grep -q '^ttlab demo ready:' "$qemu_log/out" 2>/dev/null && break
    kill -0 "$qemu_demo" 2>/dev/null || break
    sleep 0.2
  done
  if ! grep -q '^ttlab demo ready:' "$qemu_log/out"; then
    echo "FAILED: the qemu demo did not start within 180 s"
    return 1
  fi
  local student admin sim
  student="$(sed -n 's/^ *student: *\([^ ]*\).*/\1/p' "$qemu_log/out" | head -n 1)"
  admin="$(sed -n 's/^ *admin: *\([^ ]*\).*/\1/p' "$qemu_log/out" | head -n 1)"
  sim="$(sed -n 's/^ *cluster: *kube-sim at *\([^ ]*\).*/\1/p' "$qemu_log/out" | head -n 1)"
  echo "qemu demo at ${student%%\?*}"
  TTLAB_STUDENT_URL="$student" TTLAB_ADMIN_URL="$admin" TTLAB_SIM_URL="$sim" TTLAB_SIM_NAMESPACE=ttlab-vms \
    TTLAB_SESSION_MAX=$max TTLAB_HARD_DEADLINE_GRACE=$grace TTLAB_QEMU_READY_TIMEOUT=300 \
    TTLAB_ARTIFACTS="$artifacts" TTLAB_CHROMIUM="$chromium" node "$web/tests/qemu.mjs" &
  qemu_node=$!
  wait "$qemu_node" || status=$?
  qemu_node=""
  # The demo stops cleanly on SIGTERM, and its guests with it.
  kill -TERM "$qemu_demo" 2>/dev/null || true
  local stopped="" code=0
  for _ in $(seq 1 300); do
    if ! kill -0 "$qemu_demo" 2>/dev/null; then stopped=1; break; fi
    sleep 0.2
  done
  if [ -n "$stopped" ]; then
    wait "$qemu_demo" || code=$?
    qemu_demo=""
    if [ "$code" != 0 ]; then
      echo "FAILED: the qemu demo exited with status $code on SIGTERM"
      status=1
    fi
  else
    echo "FAILED: the qemu demo did not stop within 60 s of SIGTERM"
    status=1
  fi
  return "$status"
}
# The warm pool's claims with real guests (qemu-claims.mjs): a demo of its own, with the
# reaper, in a subshell of its own like run_qemu_test.
run_qemu_claims_test() {
  claims_demo=""
  claims_node=""
  stop_claims_demo() {
    if [ -n "$claims_node" ] && kill -0 "$claims_node" 2>/dev/null; then kill -TERM "$claims_node" 2>/dev/null || true; fi
    if [ -n "$claims_demo" ] && kill -0 "$claims_demo" 2>/dev/null; then
      kill -TERM "$claims_demo" 2>/dev/null || true
      for _ in $(seq 1 300); do kill -0 "$claims_demo" 2>/dev/null || break; sleep 0.2; done
      if kill -0 "$claims_demo" 2>/dev/null; then kill -KILL "$claims_demo" 2>/dev/null || true; fi
    fi
    claims_demo=""
    claims_node=""
  }
  trap stop_claims_demo EXIT
  trap 'exit 143' TERM INT
  local status=0 began
  began=$(date +%s)
  "$root/target/debug/ttlabctl" demo --port 0 --guest qemu --guest-image "$TTLAB_GUEST_IMAGE" \
    >"$qemu_log/claims-out" 2>"$qemu_log/claims-err" &
  claims_demo=$!
  for _ in $(seq 1 900); do
    grep -q '^ttlab demo ready:' "$qemu_log/claims-out" 2>/dev/null && break
    kill -0 "$claims_demo" 2>/dev/null || break
    sleep 0.2
  done
  if ! grep -q '^ttlab demo ready:' "$qemu_log/claims-out"; then
    echo "FAILED: the qemu claims demo did not start within 180 s"
    tail -n 40 "$qemu_log/claims-err"
    return 1
  fi
  local student admin
  student="$(sed -n 's/^ *student: *\([^ ]*\).*/\1/p' "$qemu_log/claims-out" | head -n 1)"
  admin="$(sed -n 's/^ *admin: *\([^ ]*\).*/\1/p' "$qemu_log/claims-out" | head -n 1)"
  echo "qemu claims demo at ${student%%\?*}"
  TTLAB_STUDENT_URL="$student" TTLAB_ADMIN_URL="$admin" TTLAB_QEMU_READY_TIMEOUT=600 \
    TTLAB_ARTIFACTS="$artifacts" TTLAB_CHROMIUM="$chromium" node "$web/tests/qemu-claims.mjs" &
  claims_node=$!
  wait "$claims_node" || status=$?
  claims_node=""
  if [ "$status" != 0 ]; then
    echo "the qemu claims demo's log (last 40 lines):"
    tail -n 40 "$qemu_log/claims-err"
  fi
  stop_claims_demo
  echo "qemu claims test took $(($(date +%s) - began)) s"
  return "$status"
}
mkdir -p "$artifacts"
if [ -n "$qemu_missing" ]; then
  if in_ci; then
    say "FAILED: CI=true and the qemu browser test cannot run: $qemu_missing"
  else
    say "SKIPPED: the qemu browser test: $qemu_missing"
  fi
  qemu_skipped=1
else
  say "starting ttlabctl demo --guest qemu --no-reaper and qemu.mjs in the background"
  (run_qemu_test) >"$qemu_log/test" 2>&1 &
  qemu_pid=$!
  say "starting ttlabctl demo --guest qemu and qemu-claims.mjs in the background"
  (run_qemu_claims_test) >"$qemu_log/claims" 2>&1 &
  claims_pid=$!
fi

# The demo stack, on a free port, with a short lifespan so the 5-minute warning shows at once,
# and an extend window that opens 40 s into it.
log="$(mktemp -d)"
# Stops the demo of pid $1 if it runs: SIGTERM, then up to 20 s for it to end.
stop_pid() {
  if [ -n "$1" ] && kill -0 "$1" 2>/dev/null; then
    kill -TERM "$1" 2>/dev/null || true
    for _ in $(seq 1 100); do kill -0 "$1" 2>/dev/null || break; sleep 0.2; done
  fi
}
# Waits up to 120 s for the demo of pid $1 to print its ready line into the file $2; fails
# when the demo stops first.
wait_ready() {
  for _ in $(seq 1 600); do
    grep -q '^ttlab demo ready:' "$2" 2>/dev/null && return 0
    kill -0 "$1" 2>/dev/null || return 1
    sleep 0.2
  done
  return 1
}
demo_pid=""
stop_demo() {
  stop_pid "$demo_pid"
  rm -rf "$log"
}
trap 'stop_demo; stop_qemu_job' EXIT

say "starting ttlabctl demo"
# Its secret is known here: replicas.mjs starts a second server replica with it.
secret="$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
TTLAB_SESSION_TTL=5m TTLAB_SESSION_MAX=30m TTLAB_EXTEND_WINDOW=4m20s TTLAB_SIM_BOOT=2s TTLAB_SIM_SETUP=2s \
  "$root/target/debug/ttlabctl" demo --port 0 --auth-secret "$secret" >"$log/out" 2>"$log/err" &
demo_pid=$!
for _ in $(seq 1 600); do
  grep -q '^ttlab demo ready:' "$log/out" 2>/dev/null && break
  if ! kill -0 "$demo_pid" 2>/dev/null; then
    say "FAILED: the demo stopped while starting:"
    tail -n 30 "$log/err" >&2
    exit 1
  fi
  sleep 0.2
done
if ! grep -q '^ttlab demo ready:' "$log/out"; then
  say "FAILED: the demo did not start within 120 s:"
  tail -n 30 "$log/err" >&2
  exit 1
fi
student="$(sed -n 's/^ *student: *\([^ ]*\).*/\1/p' "$log/out" | head -n 1)"
admin="$(sed -n 's/^ *admin: *\([^ ]*\).*/\1/p' "$log/out" | head -n 1)"
sim="$(sed -n 's/^ *cluster: *kube-sim at *\([^ ]*\).*/\1/p' "$log/out" | head -n 1)"
say "demo at ${student%%\?*}"

mkdir -p "$artifacts"
status=0
TTLAB_STUDENT_URL="$student" TTLAB_ADMIN_URL="$admin" TTLAB_SIM_URL="$sim" TTLAB_SIM_NAMESPACE=ttlab-vms \
  TTLAB_ARTIFACTS="$artifacts" TTLAB_CHROMIUM="$chromium" node "$web/tests/browser.mjs" || status=$?
# The terminal: its size in the guest, warnings, instructions, a console that drops.
TTLAB_STUDENT_URL="$student" TTLAB_SIM_URL="$sim" TTLAB_SIM_NAMESPACE=ttlab-vms \
  TTLAB_ARTIFACTS="$artifacts" TTLAB_CHROMIUM="$chromium" \
  node "$web/tests/terminal.mjs" || status=$?
# What the student sees of the console: "Connected", a new lab's terminal, warnings once.
TTLAB_STUDENT_URL="$student" TTLAB_SIM_URL="$sim" TTLAB_SIM_NAMESPACE=ttlab-vms \
  TTLAB_ARTIFACTS="$artifacts" TTLAB_CHROMIUM="$chromium" \
  node "$web/tests/student.mjs" || status=$?
# A crashed server replica's consoles: a second ttlab-server beside the demo's, killed.
database="$(sed -n 's/^ *database: *\([^ ]*\).*/\1/p' "$log/out" | head -n 1)"
kubeconfig="$(sed -n 's/^ *kubectl: *KUBECONFIG=\([^ ]*\).*/\1/p' "$log/out" | head -n 1)"
TTLAB_STUDENT_URL="$student" TTLAB_ADMIN_URL="$admin" TTLAB_DATABASE_URL="$database" \
  TTLAB_KUBECONFIG="$kubeconfig" TTLAB_AUTH_SECRET="$secret" TTLAB_ROOT="$root" \
  TTLAB_SIM_NAMESPACE=ttlab-vms TTLAB_ARTIFACTS="$artifacts" TTLAB_CHROMIUM="$chromium" \
  node "$web/tests/replicas.mjs" || status=$?
if [ "$status" != 0 ]; then
  say "server and reaper log (last 40 lines):"
  tail -n 40 "$log/err" >&2
fi

# The waitlist (waitlist.mjs): a demo of its own with room for one VM, and a second student
# whose token is minted with that demo's secret. The first demo is stopped first.
stop_pid "$demo_pid"
wl_pid=""
stop_waitlist_demo() { stop_pid "$wl_pid"; }
trap 'stop_waitlist_demo; stop_demo; stop_qemu_job' EXIT
wl_secret="$(od -An -N32 -tx1 /dev/urandom | tr -d ' \n')"
say "starting ttlabctl demo with TTLAB_VM_LIMIT=1 (waitlist)"
wl_max_wait=1m
TTLAB_VM_LIMIT=1 TTLAB_WAITLIST_HOLD=2m TTLAB_WAITLIST_MAX_WAIT=$wl_max_wait TTLAB_SIM_BOOT=2s TTLAB_SIM_SETUP=2s \
  "$root/target/debug/ttlabctl" demo --port 0 --auth-secret "$wl_secret" >"$log/wl-out" 2>"$log/wl-err" &
wl_pid=$!
if wait_ready "$wl_pid" "$log/wl-out"; then
  wl_first="$(sed -n 's/^ *student: *\([^ ]*\).*/\1/p' "$log/wl-out" | head -n 1)"
  wl_token="$("$root/target/debug/ttlabctl" token --user second-student --auth-secret "$wl_secret")"
  wl_second="${wl_first%%\?*}?token=$wl_token"
  wl_status=0
  TTLAB_STUDENT_URL="$wl_first" TTLAB_SECOND_URL="$wl_second" TTLAB_WAITLIST_MAX_WAIT="$wl_max_wait" \
    TTLAB_ARTIFACTS="$artifacts" \
    TTLAB_CHROMIUM="$chromium" node "$web/tests/waitlist.mjs" || wl_status=$?
  if [ "$wl_status" != 0 ]; then
    status=$wl_status
    say "waitlist demo's server and reaper log (last 40 lines):"
    tail -n 40 "$log/wl-err" >&2
  fi
else
  status=1
  say "FAILED: the waitlist demo did not start:"
  tail -n 30 "$log/wl-err" >&2
fi
stop_waitlist_demo

# A lesson's instructions (instructions.mjs): a demo of its own serving the test lessons of
# web/tests/lessons/ (the showcase of what authors write and of what must never run), on two
# sites; then the admin page of those sites (sites.mjs).
ins_pid=""
stop_instructions_demo() { stop_pid "$ins_pid"; }
trap 'stop_instructions_demo; stop_waitlist_demo; stop_demo; stop_qemu_job' EXIT
say "starting ttlabctl demo --sites 2 with the test lessons of web/tests/lessons (instructions, sites)"
TTLAB_SIM_BOOT=2s TTLAB_SIM_SETUP=2s \
  "$root/target/debug/ttlabctl" demo --port 0 --lessons "$web/tests/lessons" --sites 2 --site-vm-limit 3 \
  >"$log/ins-out" 2>"$log/ins-err" &
ins_pid=$!
if wait_ready "$ins_pid" "$log/ins-out"; then
  ins_student="$(sed -n 's/^ *student: *\([^ ]*\).*/\1/p' "$log/ins-out" | head -n 1)"
  ins_status=0
  TTLAB_STUDENT_URL="$ins_student" TTLAB_ARTIFACTS="$artifacts" TTLAB_CHROMIUM="$chromium" \
    node "$web/tests/instructions.mjs" || ins_status=$?
  ins_admin="$(sed -n 's/^ *admin: *\([^ ]*\).*/\1/p' "$log/ins-out" | head -n 1)"
  TTLAB_ADMIN_URL="$ins_admin" TTLAB_SITE_VM_LIMIT=3 TTLAB_ARTIFACTS="$artifacts" TTLAB_CHROMIUM="$chromium" \
    node "$web/tests/sites.mjs" || ins_status=$?
  if [ "$ins_status" != 0 ]; then
    status=$ins_status
    say "instructions demo's server and reaper log (last 40 lines):"
    tail -n 40 "$log/ins-err" >&2
  fi
else
  status=1
  say "FAILED: the instructions demo did not start:"
  tail -n 30 "$log/ins-err" >&2
fi
stop_instructions_demo

# The qemu demo's test, started first: its result.
if [ -n "$qemu_pid" ]; then
  say "waiting for the qemu browser test"
  qemu_status=0
  wait "$qemu_pid" || qemu_status=$?
  qemu_pid=""
  cat "$qemu_log/test"
  if [ "$qemu_status" != 0 ]; then
    status=1
    say "FAILED: the qemu browser test (exit $qemu_status); its demo's log (last 40 lines):"
    tail -n 40 "$qemu_log/err" >&2
  fi
elif [ -n "$qemu_skipped" ] && in_ci; then
  status=1
fi
if [ -n "$claims_pid" ]; then
  say "waiting for the qemu claims test"
  claims_status=0
  wait "$claims_pid" || claims_status=$?
  claims_pid=""
  cat "$qemu_log/claims"
  if [ "$claims_status" != 0 ]; then
    status=1
    say "FAILED: the qemu claims test (exit $claims_status)"
  fi
fi
say "screenshots in $artifacts"
exit "$status"
