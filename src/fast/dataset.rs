//! The Redis dataset the fleet agreed on: an id the fleet records in
//! Postgres and writes into Redis (`<prefix>dataset`), so that a Redis that
//! restarted empty (or any other Redis behind the same address) is told
//! apart from the one whose journal the fleet drained. The consume script
//! checks it before a fast decision; [`FastTier::journal_state`] reads it with
//! the journal's length. The protocol is [`crate::fleet`]'s.

use uuid::Uuid;

use super::{FastError, FastTier};

/// The journal stream as seen in one atomic read with the dataset key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum JournalState {
    /// Redis holds the dataset asked about, and its journal has this many
    /// entries.
    Agreed { len: u64 },
    /// Redis holds another dataset, or none (it restarted empty, was
    /// flushed, or is another server): its journal says nothing about the
    /// decisions made on the agreed one.
    Foreign,
    /// Not checked: no dataset agreed yet, or a cluster (the dataset key and
    /// the journal stream live in different slots, and scripts touch only
    /// their token's). The journal's length alone.
    Unchecked { len: u64 },
}

impl FastTier {
    pub fn dataset_key(&self) -> String {
        format!("{}dataset", self.settings.key_prefix)
    }

    /// Whether scripts and journal reads check the dataset: on a standalone
    /// Redis. On a cluster every script touches only its token's slot.
    pub fn checks_dataset(&self) -> bool {
        !self.cluster
    }

    /// Writes the fleet's dataset id into Redis (the first member, and the
    /// member that ends an episode, inside the Postgres transaction that
    /// records it).
    pub async fn write_dataset(&self, dataset: Uuid) -> Result<(), FastError> {
        let key = &self.dataset_key();
        let id = dataset.to_string();
        let id = id.as_str();
        self.call_background("dataset", |mut c| async move {
            redis::cmd("SET")
                .arg(key)
                .arg(id)
                .query_async::<()>(&mut c)
                .await
        })
        .await
    }

    /// The journal's length, with whether Redis holds `agreed` (read in
    /// one `MULTI`, so that a restart cannot fall between the two).
    pub async fn journal_state(&self, agreed: Option<Uuid>) -> Result<JournalState, FastError> {
        let (Some(agreed), true) = (agreed, self.checks_dataset()) else {
            return Ok(JournalState::Unchecked {
                len: self.journal_len().await?,
            });
        };
        let (dataset_key, journal_key) = (&self.dataset_key(), &self.journal_key());
        let (held, len): (Option<String>, u64) = self
            .call_background("xlen", |mut c| async move {
                redis::pipe()
                    .atomic()
                    .cmd("GET")
                    .arg(dataset_key)
                    .cmd("XLEN")
                    .arg(journal_key)
                    .query_async(&mut c)
                    .await
            })
            .await?;
        Ok(match held {
            Some(id) if id == agreed.to_string() => JournalState::Agreed { len },
            _ => JournalState::Foreign,
        })
    }
}
