//! Postgres enum types (`token_state`, `order_state`) as Rust enums: each
//! travels as its text label, checked on the way back.

use sqlx::encode::IsNull;
use sqlx::error::BoxDynError;
use sqlx::postgres::{PgArgumentBuffer, PgTypeInfo, PgValueRef};
use sqlx::{Decode, Encode, Postgres, Type};

use super::tokens::TokenState;
use crate::domain::order::OrderState;

/// Implements sqlx's `Type`, `Encode` and `Decode` for a closed set stored
/// as a Postgres enum, from its `as_str` and its list of values.
macro_rules! pg_enum {
    ($ty:ty, $pg_name:literal, $all:expr) => {
        impl Type<Postgres> for $ty {
            fn type_info() -> PgTypeInfo {
                PgTypeInfo::with_name($pg_name)
            }
        }

        impl Encode<'_, Postgres> for $ty {
            fn encode_by_ref(&self, buf: &mut PgArgumentBuffer) -> Result<IsNull, BoxDynError> {
                <&str as Encode<Postgres>>::encode(self.as_str(), buf)
            }
        }

        impl<'r> Decode<'r, Postgres> for $ty {
            fn decode(value: PgValueRef<'r>) -> Result<Self, BoxDynError> {
                let label = <&str as Decode<Postgres>>::decode(value)?;
                $all.into_iter()
                    .find(|v| v.as_str() == label)
                    .ok_or_else(|| format!("{label:?} is not a {}", $pg_name).into())
            }
        }
    };
}

pg_enum!(TokenState, "token_state", TokenState::ALL);
pg_enum!(OrderState, "order_state", OrderState::ALL);
