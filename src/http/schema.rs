//! Schema pieces the OpenAPI document shares with the types of other layers
//! (the admin views): a leaf that imports nothing of ours, so that
//! documenting a type never ties its module to the routes.

/// A recorded result: any JSON value, or null while there is none. Typeless,
/// so that `null` matches it once (a `oneOf` of null and any value would
/// match null twice, and a validator rejects it).
pub fn any_json_or_null() -> utoipa::openapi::schema::Object {
    utoipa::openapi::schema::ObjectBuilder::new()
        .schema_type(utoipa::openapi::schema::SchemaType::AnyValue)
        .description(Some(
            "The recorded result: any JSON value (object, array, string, number, boolean), or null while there is none",
        ))
        .build()
}
