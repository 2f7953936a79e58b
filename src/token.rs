//! Tokens, pure and without I/O: the text codec with its HMAC tags
//! ([`codec`]), time-ordered unique ids ([`snowflake`]) and the clock both use
//! ([`clock`]).

pub mod clock;
pub mod codec;
pub mod snowflake;

pub use clock::{Clock, ManualClock, SystemClock};
pub use codec::{Claims, TokenCodec, TokenError, VerifiedToken, MAX_TOKEN_LEN};
pub use snowflake::{IdGenerator, SnowflakeId};
