//! Rebuilds the crate when a migration is added or changed: the migrations
//! are embedded at compile time (`refinery::embed_migrations!`), and cargo
//! does not otherwise look at `migrations/`.
fn main() {
    println!("cargo:rerun-if-changed=migrations");
}
