//! Loading and validating whole configurations.

use std::time::Duration;

use super::parse::parse_rate;
use super::*;
use crate::domain::BizType;

#[test]
fn defaults_load() {
    let s = Settings::load_with_env(None, Vec::new()).expect("defaults are valid");
    assert_eq!(s.env, Environment::Development);
    assert_eq!(s.biz.len(), 3);
    assert_eq!(s.clients.len(), 5);
    assert!(!s.development_secrets_in_use().is_empty());
}

#[test]
fn env_overrides_and_names_bad_keys() {
    let s = Settings::load_with_env(
        None,
        vec![
            ("LEDGER__BIZ__ORDER__TTL".into(), "90s".into()),
            ("LEDGER__SERVER__LISTEN".into(), "127.0.0.1:9999".into()),
        ],
    )
    .expect("valid");
    assert_eq!(
        s.biz[&BizType::parse("order").unwrap()].ttl,
        Duration::from_secs(90)
    );
    assert_eq!(s.server.listen.port(), 9999);

    let err = Settings::load_with_env(
        None,
        vec![("LEDGER__TOKENS__RETENTION".into(), "soon".into())],
    )
    .unwrap_err();
    assert!(err.to_string().contains("tokens.retention"), "{err}");
}

#[test]
fn production_refuses_dev_secrets() {
    let err = Settings::load_with_env(None, vec![("LEDGER__ENV".into(), "production".into())])
        .unwrap_err();
    assert!(err.to_string().contains("development"), "{err}");
}

#[test]
fn lists_replace_whole() {
    let s = Settings::from_toml_over_defaults(
        r#"
        [[clients]]
        name = "only"
        role = "admin"
        key_sha256 = "0000000000000000000000000000000000000000000000000000000000000000"
        "#,
    )
    .expect("valid");
    assert_eq!(s.clients.len(), 1);
}

#[test]
fn cluster_nodes_alone_replace_the_default_url_but_both_are_an_error() {
    let nodes = vec!["redis://127.0.0.1:7000".to_owned()];
    let s =
        Settings::from_toml_over_defaults("[redis]\ncluster_nodes = [\"redis://127.0.0.1:7000\"]")
            .expect("a file naming only cluster nodes");
    assert_eq!(s.redis.topology, RedisTopology::Cluster(nodes.clone()));
    let s = Settings::load_with_env(
        None,
        vec![(
            "LEDGER__REDIS__CLUSTER_NODES".into(),
            "[\"redis://127.0.0.1:7000\"]".into(),
        )],
    )
    .expect("the environment naming only cluster nodes");
    assert_eq!(s.redis.topology, RedisTopology::Cluster(nodes));
    let err = Settings::from_toml_over_defaults(
        "[redis]\nurl = \"redis://127.0.0.1:6379\"\ncluster_nodes = [\"redis://127.0.0.1:7000\"]",
    )
    .unwrap_err();
    assert!(err.to_string().contains("redis.cluster_nodes"), "{err}");
}

#[test]
fn degraded_mode_keys_are_checked() {
    let s = Settings::load_with_env(None, Vec::new()).expect("defaults are valid");
    assert_eq!(s.redis.slow_threshold, Duration::from_millis(200));
    assert_eq!(s.redis.degraded_sample, 0.1);
    assert_eq!(s.postgres.acquire_timeout, Duration::from_secs(1));
    let err = Settings::from_toml_over_defaults("[redis]\ndegraded_sample = 1.5").unwrap_err();
    assert!(err.to_string().contains("redis.degraded_sample"), "{err}");
    let err = Settings::from_toml_over_defaults("[redis]\nslow_window = \"10ms\"").unwrap_err();
    assert!(err.to_string().contains("redis.slow_window"), "{err}");
    let err = Settings::from_toml_over_defaults("[redis]\nfallback_rate = \"fast\"").unwrap_err();
    assert!(err.to_string().contains("redis.fallback_rate"), "{err}");
}

#[test]
fn tls_settings_are_checked_when_the_configuration_loads() {
    let err = Settings::from_toml_over_defaults(
        "[postgres]\nurl = \"postgres://u@h/db?sslmode=sometimes\"",
    )
    .unwrap_err();
    assert!(err.to_string().contains("postgres.url"), "{err}");
    let err = Settings::from_toml_over_defaults(
        "[postgres]\nurl = \"postgres://u@h/db?sslmode=verify-full&sslrootcert=/no/ca.pem\"",
    )
    .unwrap_err();
    assert!(err.to_string().contains("/no/ca.pem"), "{err}");
    let err = Settings::from_toml_over_defaults(
        "[redis]\nurl = \"rediss://h:6380\"\nca_file = \"/no/ca.pem\"",
    )
    .unwrap_err();
    assert!(err.to_string().contains("redis.ca_file"), "{err}");
    let err =
        Settings::from_toml_over_defaults("[redis]\nca_file = \"/etc/hostname\"").unwrap_err();
    assert!(err.to_string().contains("rediss://"), "no TLS URL: {err}");
    let err = Settings::from_toml_over_defaults("[redis]\nurl = \"rediss://h:6380/#insecure\"")
        .unwrap_err();
    assert!(err.to_string().contains("redis.url"), "{err}");
}

#[test]
fn rates() {
    assert_eq!(parse_rate("k", "100/s").unwrap().get(), 100);
    assert_eq!(parse_rate("k", "90/m").unwrap().get(), 2);
    assert!(parse_rate("k", "0/s").is_err());
    assert!(parse_rate("k", "fast").is_err());
}

#[test]
fn audit_seal_keys_are_checked_named_in_production_and_redacted() {
    let s = Settings::load_with_env(None, Vec::new()).expect("defaults");
    assert_eq!(s.audit.seal_every, Duration::from_secs(60));
    assert_eq!(s.audit.seal_keys.len(), 1);
    assert_eq!(s.audit.seal_keys[0].id, "a1");
    assert!(
        !format!("{:?}", s.audit).contains("development-only"),
        "Debug never shows a seal secret"
    );
    assert!(s
        .development_secrets_in_use()
        .contains(&"audit.seal_keys[a1]".to_owned()));

    for (toml, key) in [
        ("[audit]\nseal_keys = []", "audit.seal_keys"),
        (
            "[audit]\nseal_keys = [{ id = \"a2\", secret = \"short\" }]",
            "audit.seal_keys[0].secret",
        ),
        (
            "[audit]\nseal_keys = [{ id = \"not an id\", secret = \"0123456789abcdef0123456789abcdef\" }]",
            "audit.seal_keys[0].id",
        ),
        (
            "[audit]\nseal_keys = [{ id = \"a2\", secret = \"0123456789abcdef0123456789abcdef\" }, { id = \"a2\", secret = \"fedcba9876543210fedcba9876543210\" }]",
            "audit.seal_keys[1].id",
        ),
        ("[audit]\nseal_every = \"10ms\"", "audit.seal_every"),
        ("[audit]\nseal_every = \"often\"", "audit.seal_every"),
    ] {
        let err = Settings::from_toml_over_defaults(toml).unwrap_err();
        assert!(err.to_string().contains(key), "{toml}: {err}");
    }

    // Production: a replaced seal key is fine, the development one is named.
    let prod_keys = r#"
        env = "production"
        [tokens]
        signing_keys = [{ id = "k9", secret = "a-production-signing-secret-of-32-bytes" }]
        [[clients]]
        name = "only"
        role = "admin"
        key_sha256 = "0000000000000000000000000000000000000000000000000000000000000000"
        "#;
    let err = Settings::from_toml_over_defaults(prod_keys).unwrap_err();
    assert!(err.to_string().contains("audit.seal_keys[a1]"), "{err}");
    let s = Settings::from_toml_over_defaults(&format!(
        "{prod_keys}\n[audit]\nseal_keys = [{{ id = \"a2\", secret = \"a-production-seal-secret-of-32-bytes!\" }}, {{ id = \"a1\", secret = \"development-only-audit-seal-secret-0123456789\" }}]"
    ))
    .unwrap_err();
    assert!(
        s.to_string().contains("audit.seal_keys[a1]"),
        "a development key kept for verifying is refused too: {s}"
    );
    let ok = Settings::from_toml_over_defaults(&format!(
        "{prod_keys}\n[audit]\nseal_keys = [{{ id = \"a2\", secret = \"a-production-seal-secret-of-32-bytes!\" }}]"
    ))
    .expect("production with its own seal key");
    assert_eq!(ok.audit.seal_keys[0].id, "a2");

    // `config check` prints no seal secret.
    let (_, table) = Settings::effective_with_env(None, Vec::new()).expect("effective");
    let printed = toml::to_string(&table).expect("toml");
    assert!(
        !printed.contains("development-only-audit-seal"),
        "{printed}"
    );
    assert!(printed.contains(REDACTED), "{printed}");
}

#[test]
fn processing_leases_parse_and_bad_ones_are_named() {
    let s = Settings::from_toml_over_defaults(
        r#"
        [biz.like]
        processing_lease = "30s"
        on_lease_expiry = "release"
        "#,
    )
    .expect("valid");
    let like = &s.biz[&BizType::parse("like").unwrap()];
    assert_eq!(
        like.lease,
        Some(ProcessingLease {
            length: Duration::from_secs(30),
            on_expiry: LeaseExpiry::Release,
        })
    );
    assert_eq!(
        s.biz[&BizType::parse("refund").unwrap()].lease,
        None,
        "none by default"
    );
    let s = Settings::from_toml_over_defaults("[biz.refund]\nprocessing_lease = \"2m\"")
        .expect("valid");
    assert_eq!(
        s.biz[&BizType::parse("refund").unwrap()].lease,
        Some(ProcessingLease {
            length: Duration::from_secs(120),
            on_expiry: LeaseExpiry::Uncertain,
        }),
        "uncertain by default"
    );
    for (bad, key) in [
        (
            "[biz.like]\nprocessing_lease = \"0s\"",
            "biz.like.processing_lease",
        ),
        (
            "[biz.like]\nprocessing_lease = \"1500ms\"",
            "biz.like.processing_lease",
        ),
        (
            "[biz.like]\non_lease_expiry = \"release\"",
            "biz.like.on_lease_expiry",
        ),
    ] {
        let err = Settings::from_toml_over_defaults(bad).unwrap_err();
        assert!(err.to_string().contains(key), "{bad}: {err}");
    }
    let err = Settings::from_toml_over_defaults(
        "[biz.like]\nprocessing_lease = \"5s\"\non_lease_expiry = \"retry\"",
    )
    .unwrap_err();
    assert!(err.to_string().contains("on_lease_expiry"), "{err}");
}

#[test]
fn audit_retention_is_for_ever_unless_set_and_never_shorter_than_the_tokens() {
    let s = Settings::load_with_env(None, Vec::new()).expect("defaults");
    assert_eq!(s.audit.retention, None, "audit is kept for ever by default");
    let s = Settings::load_with_env(
        None,
        vec![("LEDGER__AUDIT__RETENTION".into(), "400d".into())],
    )
    .expect("valid");
    assert_eq!(s.audit.retention, Some(Duration::from_secs(400 * 86_400)));
    for (retention, tokens) in [("6d", "7d"), ("12h", "1h"), ("soon", "7d")] {
        let err = Settings::load_with_env(
            None,
            vec![
                ("LEDGER__AUDIT__RETENTION".into(), retention.into()),
                ("LEDGER__TOKENS__RETENTION".into(), tokens.into()),
            ],
        )
        .unwrap_err();
        assert!(
            err.to_string().contains("audit.retention"),
            "{retention}: {err}"
        );
    }
}
