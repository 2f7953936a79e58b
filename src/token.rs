//! Tokens, pure and without I/O: the text codec with its HMAC tags
//! ([`codec`]) and time-ordered unique ids ([`snowflake`]), both on the
//! service's one clock ([`crate::clock`]).

pub mod codec;
pub mod snowflake;

pub use codec::{Claims, TokenCodec, TokenError, VerifiedToken, MAX_TOKEN_LEN};
pub use snowflake::{IdGenerator, SnowflakeId};
