#!/usr/bin/env bash
# Fuzzes a target for a while on the stable toolchain: libFuzzer with
# coverage instrumentation (the same LLVM passes cargo-fuzz asks for), without
# sanitizers (nightly only; the code under test has no unsafe), debug
# assertions and overflow checks on. A panic stops it and leaves a crash-*
# file to replay: target/.../webhook_parse crash-<hash>.
#
#   fuzz/run.sh [TARGET] [SECONDS]      default: webhook_parse 300
set -euo pipefail
cd "$(dirname "$0")"
target="${1:-webhook_parse}"
seconds="${2:-300}"
triple="$(rustc -vV | sed -n 's/^host: //p')"
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-target}"
RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks" \
  cargo build --release --target "$triple" --bin "$target"
mkdir -p "corpus/$target"
"$CARGO_TARGET_DIR/$triple/release/$target" "corpus/$target" \
  -max_total_time="$seconds" -max_len=4096
