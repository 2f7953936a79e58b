//! Fast consumes' journal entries built by hand, as the consume script
//! completes them, for the tests that apply them to Postgres directly.

use std::collections::HashMap;

use idempotency_ledger::durable::tokens::TokenRecord;
use idempotency_ledger::fast::JournalEntry;
use idempotency_ledger::journal::{self, AT, GEN};

/// The journal entry of a fast consume of `rec` by request `rid`, decided at
/// `at_ms` at generation 1, with the stream id `id`.
pub fn consume_entry(id: &str, rec: &TokenRecord, rid: &str, at_ms: i64) -> JournalEntry {
    let mut fields: HashMap<String, Vec<u8>> = journal::consume_fields(rec, Some(rid), None)
        .fields()
        .into_iter()
        .map(|(k, v)| (k.to_owned(), v.into_bytes()))
        .collect();
    fields.insert(AT.to_owned(), at_ms.to_string().into_bytes());
    fields.insert(GEN.to_owned(), b"1".to_vec());
    JournalEntry {
        id: id.to_owned(),
        fields,
    }
}
