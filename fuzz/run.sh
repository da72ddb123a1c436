#!/bin/sh
# Short fuzzing runs of ttlab's fuzz targets (see docs/fuzzing.md). Not run in CI.
#
#   fuzz/run.sh                 every target, 60 s each
#   fuzz/run.sh TARGET [SECONDS]
#   fuzz/run.sh all SECONDS
#
# Uses cargo-fuzz (`cargo install cargo-fuzz`) with the stable toolchain: cargo-fuzz needs
# nightly-only flags, which RUSTC_BOOTSTRAP=1 unlocks on stable. Sanitizers are off by
# default (ttlab forbids unsafe code; panics and failed assertions are what the targets
# look for, and a plain build runs several times faster); set FUZZ_SANITIZER=address to
# turn AddressSanitizer on. Seeds come from fuzz/seeds/TARGET; the growing corpus is kept in
# fuzz/corpus/TARGET and crashes in fuzz/artifacts/TARGET (both ignored by git).
#
# Environment: FUZZ_JOBS (parallel fuzzing processes, default 1), FUZZ_TOOLCHAIN (default
# the active one), FUZZ_SANITIZER (default none), FUZZ_RSS_MB (default 2048).
set -eu

here=$(cd "$(dirname "$0")" && pwd)
cd "$here"

targets="lesson instructions cloudinit agent_http api_request console_relay"
target=${1:-all}
seconds=${2:-60}
jobs=${FUZZ_JOBS:-1}
sanitizer=${FUZZ_SANITIZER:-none}
rss=${FUZZ_RSS_MB:-2048}
toolchain=${FUZZ_TOOLCHAIN:+"+$FUZZ_TOOLCHAIN"}

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "cargo-fuzz is not installed: cargo install cargo-fuzz" >&2
    exit 2
fi
case "$target" in
    all) set -- $targets ;;
    lesson|instructions|cloudinit|agent_http|api_request|console_relay) set -- "$target" ;;
    *) echo "unknown target $target (one of: $targets, all)" >&2; exit 2 ;;
esac

export RUSTC_BOOTSTRAP=1
status=0
for t in "$@"; do
    mkdir -p "corpus/$t" "artifacts/$t"
    if [ -d "seeds/$t" ]; then
        cp -n seeds/"$t"/* "corpus/$t/" 2>/dev/null || true
    fi
    echo "== $t: ${seconds}s, $jobs job(s), sanitizer $sanitizer"
    features=""
    if [ "$t" = api_request ]; then
        features="--features api"
    fi
    parallel=""
    if [ "$jobs" -gt 1 ]; then
        parallel="-jobs=$jobs -workers=$jobs"
    fi
    # shellcheck disable=SC2086
    if ! cargo $toolchain fuzz run -s "$sanitizer" $features "$t" "corpus/$t" -- \
        -max_total_time="$seconds" -rss_limit_mb="$rss" -timeout=20 \
        -artifact_prefix="artifacts/$t/" -print_final_stats=1 $parallel; then
        echo "== $t: FAILED (see fuzz/artifacts/$t/)" >&2
        status=1
    fi
done
exit $status
