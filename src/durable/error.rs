//! [`DurableError`]: what a Postgres call can end in, and whether the
//! outcome is unknown (unavailable) or a refusal.

#[derive(Debug, thiserror::Error)]
pub enum DurableError {
    /// Postgres could not be reached or did not answer in time: nothing was
    /// decided (or the outcome is unknown and the caller must retry).
    #[error("postgres unavailable")]
    Unavailable(#[source] sqlx::Error),
    /// No answer within the client-side bound (a stopped or partitioned
    /// server never trips `statement_timeout`): the outcome is unknown.
    #[error("postgres did not answer within {0:?}")]
    TimedOut(std::time::Duration),
    #[error("postgres")]
    Other(#[source] sqlx::Error),
    /// The batched statement this call was part of ([`batch`]) failed as a
    /// whole, with this error (shared by every item of the batch); `None`:
    /// the batch was abandoned without an answer (the service stopping), so
    /// its outcome is unknown.
    #[error("the batched statement failed")]
    Batch(#[source] Option<std::sync::Arc<DurableError>>),
}

impl From<sqlx::Error> for DurableError {
    fn from(e: sqlx::Error) -> Self {
        let unavailable = match &e {
            sqlx::Error::PoolTimedOut
            | sqlx::Error::PoolClosed
            | sqlx::Error::Io(_)
            | sqlx::Error::Tls(_)
            | sqlx::Error::Protocol(_)
            | sqlx::Error::WorkerCrashed => true,
            sqlx::Error::Database(db) => {
                let code = db.code().unwrap_or_default();
                // 08: connection exception; 57: operator intervention (query
                // canceled by statement_timeout, admin shutdown); 53: out of
                // resources; 40001/40P01: serialization failure and deadlock
                // (retryable).
                code.starts_with("08")
                    || code.starts_with("57")
                    || code.starts_with("53")
                    || code == "40001"
                    || code == "40P01"
            }
            _ => false,
        };
        if unavailable {
            DurableError::Unavailable(e)
        } else {
            DurableError::Other(e)
        }
    }
}

impl DurableError {
    pub fn is_unavailable(&self) -> bool {
        match self {
            DurableError::Unavailable(_) | DurableError::TimedOut(_) => true,
            DurableError::Other(_) => false,
            DurableError::Batch(cause) => cause.as_ref().is_none_or(|e| e.is_unavailable()),
        }
    }
}
