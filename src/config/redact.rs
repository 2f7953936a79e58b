//! Secrets replaced in printed configuration (`config check`).

/// What replaces a secret in printed configuration.
pub const REDACTED: &str = "REDACTED";

/// Replaces every secret in a configuration tree: values of keys named like
/// a secret (`secret`, `password`, `*_secret`, `*_password`), and the
/// password of any URL (`scheme://user:password@host`, or a `password`
/// query parameter). Key hashes (`key_sha256`) are not secrets and stay.
pub fn redact(table: &mut toml::Table) {
    for (key, value) in table.iter_mut() {
        redact_value(key, value);
    }
}

fn is_secret_key(key: &str) -> bool {
    let k = key.to_ascii_lowercase();
    k == "secret" || k == "password" || k.ends_with("_secret") || k.ends_with("_password")
}

fn redact_value(key: &str, value: &mut toml::Value) {
    match value {
        toml::Value::String(s) if is_secret_key(key) => *s = REDACTED.to_owned(),
        toml::Value::String(s) => {
            if let Some(r) = redact_url(s) {
                *s = r;
            }
        }
        toml::Value::Array(items) => {
            for item in items {
                redact_value(key, item);
            }
        }
        toml::Value::Table(t) => redact(t),
        other if is_secret_key(key) => *other = toml::Value::String(REDACTED.to_owned()),
        _ => {}
    }
}

/// The URL with its password replaced, or `None` when it holds none (or is
/// not a URL).
pub fn redact_url(text: &str) -> Option<String> {
    if !text.contains("://") {
        return None;
    }
    let Ok(mut url) = url::Url::parse(text) else {
        // Unparsable but URL-like: hide whatever sits before an `@`.
        return text.rfind('@').map(|at| {
            let scheme_end = text.find("://").map(|i| i + 3).unwrap_or(0);
            format!("{}{REDACTED}{}", &text[..scheme_end], &text[at..])
        });
    };
    let mut changed = false;
    if url.password().is_some() {
        // Only fails for URLs that cannot have a password (no host).
        changed = url.set_password(Some(REDACTED)).is_ok();
    }
    let pairs: Vec<(String, String)> = url
        .query_pairs()
        .map(|(k, v)| (k.into_owned(), v.into_owned()))
        .collect();
    if pairs
        .iter()
        .any(|(k, _)| k.to_ascii_lowercase().contains("password"))
    {
        let mut q = url.query_pairs_mut();
        q.clear();
        for (k, v) in &pairs {
            if k.to_ascii_lowercase().contains("password") {
                q.append_pair(k, REDACTED);
            } else {
                q.append_pair(k, v);
            }
        }
        drop(q);
        changed = true;
    }
    changed.then(|| url.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Settings;

    #[test]
    fn a_read_url_is_optional_checked_and_its_password_redacted() {
        let defaults = Settings::from_toml_over_defaults("").expect("defaults");
        assert_eq!(defaults.postgres.read_url, None);
        let url = "postgres://ro:s3cret@replica:5432/ledger?sslmode=require";
        let s = Settings::from_toml_over_defaults(&format!("[postgres]\nread_url = \"{url}\""))
            .expect("a replica URL");
        assert_eq!(s.postgres.read_url.as_deref(), Some(url));
        for bad in [
            "mysql://replica/ledger",
            "postgres://replica/ledger?sslmode=sometimes",
        ] {
            let err =
                Settings::from_toml_over_defaults(&format!("[postgres]\nread_url = \"{bad}\""))
                    .expect_err(bad);
            assert!(
                err.to_string().contains("postgres.read_url"),
                "{bad}: {err}"
            );
        }

        let mut table: toml::Table = format!("[postgres]\nread_url = \"{url}\"")
            .parse()
            .expect("TOML");
        redact(&mut table);
        let printed = toml::to_string(&table).expect("TOML");
        assert!(!printed.contains("s3cret"), "{printed}");
        assert!(printed.contains(REDACTED), "{printed}");
    }
}
