//! Fuzzes everything that parses attacker-controlled text before any I/O:
//! the token codec (any bytes, as the path segment a request could carry),
//! the log redaction, the JSON nesting scan and the issuance-notification
//! payload decoder. None may panic; a text the codec accepts must be one it
//! could have produced.

#![no_main]

use std::sync::OnceLock;

use idempotency_ledger::config::SigningKey;
use idempotency_ledger::durable::bloom::decode;
use idempotency_ledger::http::extract::nesting_exceeds;
use idempotency_ledger::token::codec::redact;
use idempotency_ledger::token::{TokenCodec, MAX_TOKEN_LEN};
use libfuzzer_sys::fuzz_target;

fn codec() -> &'static TokenCodec {
    static CODEC: OnceLock<TokenCodec> = OnceLock::new();
    CODEC.get_or_init(|| {
        TokenCodec::new(vec![
            SigningKey {
                id: "k2".into(),
                secret: b"fuzzing-secret-fuzzing-secret-fuzzing-secret".to_vec(),
            },
            SigningKey {
                id: "dev1".into(),
                secret: b"development-only-signing-secret-0123456789".to_vec(),
            },
        ])
    })
}

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    if let Ok(token) = codec().verify(&text) {
        // Only a text carrying a valid tag gets here.
        assert!(text.len() <= MAX_TOKEN_LEN);
        assert_eq!(token.text, text);
        assert!(token.claims.id.as_i64() >= 0);
        assert!(text.starts_with(token.claims.biz_type.as_str()));
    }
    let shortened = redact(&text);
    assert!(shortened.chars().count() <= 32 + 2 + 4);
    let _ = nesting_exceeds(data, 32);
    if let Ok(s) = std::str::from_utf8(data) {
        let _ = decode(s);
    }
});
