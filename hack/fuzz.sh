#!/usr/bin/env bash
# The bounded coverage-guided fuzz run of the transport's packet parser, handshake and
# live connection (transport/fuzz, cargo-fuzz + libFuzzer). Not part of the test command
# (which replays the committed corpus on stable): it needs the pinned nightly below.
#
#   bash hack/fuzz.sh [SECONDS]      # default 300
#
# Works on a copy of the corpus; prints what it found. New inputs that add coverage are
# minimised into transport/fuzz/corpus/packets/ (review, then commit the small ones); a
# crash leaves its input under transport/fuzz/artifacts/ and fails the run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../transport/fuzz"
NIGHTLY_DATE=2026-05-19
SECONDS_MAX="${1:-300}"
say() { printf '[fuzz] %s\n' "$*" >&2; }

# The pinned nightly: installed under its dated name, or the plain `nightly` when that
# is the same build (rustup installs offline machines' nightlies under that name).
toolchain=""
for t in "nightly-$NIGHTLY_DATE" nightly; do
    if v=$(rustc "+$t" --version 2>/dev/null) && [[ "$v" == *"$NIGHTLY_DATE"* ]]; then
        toolchain="$t"; break
    fi
done
if [[ -z "$toolchain" ]]; then
    say "FAIL: needs the nightly of $NIGHTLY_DATE: rustup toolchain install nightly-$NIGHTLY_DATE"
    exit 1
fi
command -v cargo-fuzz >/dev/null || { say "FAIL: needs cargo-fuzz: cargo +$toolchain install cargo-fuzz --locked"; exit 1; }
export CARGO_TARGET_DIR="${XDG_CACHE_HOME:-$HOME/.cache}/metaroce/fuzz-target"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp corpus/packets/* "$work/"
before=$(ls "$work" | wc -l)
say "cargo +$toolchain fuzz run packets for ${SECONDS_MAX}s (corpus: $before inputs)"
cargo "+$toolchain" fuzz run packets "$work" -- -max_total_time="$SECONDS_MAX" -print_final_stats=1 2>&1 |
    grep -E '^#[0-9]+[[:space:]]+(INITED|DONE)|stat::|ERROR|panicked|SUMMARY' || true
rc=${PIPESTATUS[0]}
if [[ $rc -ne 0 ]]; then
    say "FAIL: the fuzzer found a crash (rc $rc): see transport/fuzz/artifacts/packets/"
    exit 1
fi
say "merging inputs that add coverage into corpus/packets"
cargo "+$toolchain" fuzz cmin packets "$work" >/dev/null 2>&1 || true
added=0
for f in "$work"/*; do
    [[ -e "corpus/packets/$(basename "$f")" ]] && continue
    [[ $(stat -c %s "$f") -le 4096 ]] || continue
    cp "$f" corpus/packets/ && added=$((added + 1))
done
say "done: ran ${SECONDS_MAX}s, no crash; $added new corpus inputs (<= 4 KiB each)"
