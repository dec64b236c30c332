//! libFuzzer on everything a webhook request meets before a claim: signature
//! headers of four schemes and key derivation from headers and body. The body
//! of the target is shared with the stable property test
//! `dedupe-webhook/tests/hostile.rs`, which runs it in every test run.
#![no_main]

#[path = "../../dedupe-webhook/tests/support/parse_anything.rs"]
mod parse_anything;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    if let Err(problem) = parse_anything::parse_anything(data) {
        panic!("{problem}");
    }
});
