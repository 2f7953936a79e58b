//! Secrets: signing keys rotate without refusing live tokens, production
//! refuses the development keys and secret (through the built binary), and
//! the server's log holds no API key and no full token.

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use reqwest::StatusCode;
use serde_json::{json, Value};

use crate::helpers::*;

const DEV_KEYS: [&str; 4] = [
    "dev-payments-key",
    "dev-refunds-key",
    "dev-reconciler-key",
    "dev-admin-key",
];
const DEV_SECRET: &str = "development-only-signing-secret-0123456789";

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn signing_keys_rotate_without_refusing_live_tokens() {
    let base = Stores::fresh();
    let dev1 = format!("{{ id = \"dev1\", secret = \"{DEV_SECRET}\" }}");
    let k2 = "{ id = \"k2\", secret = \"second-signing-secret-for-rotation-0123\" }";
    // Step 0: only dev1.
    let old = spawn_app_on(base.clone()).await;
    let by_old: Vec<String> = futures_util::future::join_all(
        (0..3).map(|i| old.issue(PAYMENTS, "order", if i == 0 { "a" } else { "b" })),
    )
    .await;
    assert!(by_old.iter().all(|t| t.starts_with("order_dev1_")));

    // Steps 1 and 2: k2 added and made active; dev1 stays listed (retired).
    let new = spawn_app_on(
        base.clone()
            .with(&format!("tokens.signing_keys = [{k2}, {dev1}]")),
    )
    .await;
    let by_new = new.issue(PAYMENTS, "order", "c").await;
    assert!(by_new.starts_with("order_k2_"), "{by_new}");
    let (_, _, body) = answer(
        new.consume(PAYMENTS, &by_old[0], &json!({"subject": "a"}))
            .await,
    )
    .await;
    assert_eq!(
        body["outcome"], "consumed",
        "a retired-but-listed key still verifies"
    );
    // An instance that was never told of k2 refuses its tokens: add the key
    // everywhere before making it active (docs/operations.md, "Rotating the signing key").
    let (s, _, body) = answer(
        old.consume(PAYMENTS, &by_new, &json!({"subject": "c"}))
            .await,
    )
    .await;
    assert_eq!(
        (s, body["error"].as_str()),
        (StatusCode::BAD_REQUEST, Some("token_invalid"))
    );

    // Step 3: dev1 removed.
    let gone = spawn_app_on(base.with(&format!("tokens.signing_keys = [{k2}]"))).await;
    for (t, subject) in [(&by_old[1], "b"), (&by_old[2], "b")] {
        let (s, _, body) = answer(
            gone.consume(PAYMENTS, t, &json!({"subject": subject}))
                .await,
        )
        .await;
        assert_eq!(
            (s, body["error"].as_str()),
            (StatusCode::BAD_REQUEST, Some("token_invalid")),
            "a removed key no longer verifies"
        );
    }
    let (_, _, body) = answer(
        gone.consume(PAYMENTS, &by_new, &json!({"subject": "c"}))
            .await,
    )
    .await;
    assert_eq!(body["outcome"], "consumed");
    // The retired token consumed under dev1 still answers duplicate where dev1 is listed.
    let (_, replayed, body) = answer(
        new.consume(PAYMENTS, &by_old[0], &json!({"subject": "a"}))
            .await,
    )
    .await;
    assert_eq!(
        (body["outcome"].as_str(), replayed),
        (Some("duplicate"), true)
    );
}

fn binary() -> Command {
    Command::new(env!("CARGO_BIN_EXE_idempotency-ledger"))
}

#[test]
fn production_refuses_the_development_config_through_the_binary() {
    let out = binary()
        .arg("serve")
        .env("LEDGER__ENV", "production")
        .env_remove("RUST_LOG")
        .output()
        .expect("binary runs");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{stderr}");
    for named in [
        "tokens.signing_keys[dev1]",
        "audit.seal_keys[a1]",
        "clients[payments]",
        "clients[refunds]",
        "clients[reconciler]",
        "clients[admin]",
    ] {
        assert!(stderr.contains(named), "{named} not named: {stderr}");
    }
    assert!(
        !stderr.contains(DEV_SECRET),
        "the secret itself is never printed"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_server_log_holds_no_api_key_and_no_full_token() {
    let stores = Stores::fresh();
    let port = free_port();
    let dir = tempfile::tempdir().expect("tempdir");
    let config = dir.path().join("ledger.toml");
    std::fs::write(
        &config,
        format!(
            r#"
[server]
listen = "127.0.0.1:{port}"
workers = 1

[postgres]
url = "{db}"

[redis]
url = "{redis}"
key_prefix = "{prefix}"
"#,
            db = stores.db_url(),
            redis = stores.redis_url,
            prefix = stores.prefix,
        ),
    )
    .expect("config written");
    let mut child = binary()
        .args(["--config", config.to_str().expect("utf-8 path"), "serve"])
        .env("RUST_LOG", "info,idempotency_ledger=debug")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .expect("binary starts");
    let log = Arc::new(Mutex::new(String::new()));
    let mut stderr = child.stderr.take().expect("stderr");
    let reader = {
        let log = log.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 8192];
            while let Ok(n) = stderr.read(&mut buf) {
                if n == 0 {
                    break;
                }
                log.lock()
                    .unwrap()
                    .push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        })
    };
    let base = format!("http://127.0.0.1:{port}");
    let http = reqwest::Client::new();
    eventually(60, || {
        let (http, base) = (http.clone(), base.clone());
        async move {
            let r = http.get(format!("{base}/healthz")).send().await.ok()?;
            r.status().is_success().then_some(())
        }
    })
    .await;

    let post = |key: &str, path: String, body: Value| {
        http.post(format!("{base}{path}"))
            .bearer_auth(key)
            .json(&body)
            .send()
    };
    let mut tokens = Vec::new();
    for (biz, subject) in [
        ("order", "user-1"),
        ("like", "user-2"),
        ("refund", "user-3"),
    ] {
        let r = post(
            PAYMENTS,
            "/v1/tokens".into(),
            json!({"biz_type": biz, "subject": subject}),
        )
        .await
        .unwrap();
        assert_eq!(r.status(), StatusCode::CREATED);
        let t = r.json::<Value>().await.unwrap()["token"]
            .as_str()
            .unwrap()
            .to_owned();
        tokens.push((t, subject));
    }
    let r = http
        .get(format!(
            "{base}/api/token/generate?bizType=order&userId=user-4"
        ))
        .bearer_auth(PAYMENTS)
        .send()
        .await
        .unwrap();
    tokens.push((
        r.json::<Value>().await.unwrap()["token"]
            .as_str()
            .unwrap()
            .to_owned(),
        "user-4",
    ));
    for (t, subject) in &tokens {
        for _ in 0..2 {
            // consumed, then duplicate
            let r = post(
                PAYMENTS,
                format!("/v1/tokens/{t}/consume"),
                json!({"subject": subject}),
            )
            .await
            .unwrap();
            assert_eq!(r.status(), StatusCode::OK);
        }
    }
    let (t0, s0) = &tokens[0];
    let r = post(
        PAYMENTS,
        format!("/v1/tokens/{t0}/result"),
        json!({"subject": s0, "result": {"ok": 1}}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let (t2, s2) = &tokens[2];
    let r = post(
        PAYMENTS,
        format!("/v1/tokens/{t2}/release"),
        json!({"subject": s2}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    // Refusals: wrong and near-miss keys, someone else's token, a forged one,
    // an unknown route holding a token.
    for key in ["dev-payments-keyX", "xdev-admin-key", "nope"] {
        let r = post(
            key,
            format!("/v1/tokens/{t0}/consume"),
            json!({"subject": s0}),
        )
        .await
        .unwrap();
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    }
    let r = post(
        REFUNDS,
        format!("/v1/tokens/{t0}/consume"),
        json!({"subject": s0}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::FORBIDDEN);
    let r = post(
        PAYMENTS,
        format!("/v1/tokens/{t0}x/consume"),
        json!({"subject": s0}),
    )
    .await
    .unwrap();
    assert_eq!(r.status(), StatusCode::BAD_REQUEST);
    // A read of the token's state logs no full token either.
    let r = http
        .get(format!("{base}/v1/tokens/{t0}?subject={s0}"))
        .bearer_auth(PAYMENTS)
        .send()
        .await
        .unwrap();
    assert_eq!(r.status(), StatusCode::OK);
    let r = http
        .get(format!("{base}/v1/tokens/{t0}/history"))
        .bearer_auth(ADMIN)
        .send()
        .await
        .unwrap();
    assert!(r.status().is_client_error());

    // SIGTERM: the service drains and logs its shutdown.
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let exited = (0..100).any(|_| {
        std::thread::sleep(Duration::from_millis(100));
        matches!(child.try_wait(), Ok(Some(_)))
    });
    if !exited {
        let _ = child.kill();
        let _ = child.wait();
    }
    let _ = reader.join();
    let log = log.lock().unwrap().clone();

    assert!(
        log.contains("handled"),
        "requests are logged (our crate at debug, everything else at info):\n{log}"
    );
    for key in DEV_KEYS
        .iter()
        .chain(["dev-payments-keyX", "xdev-admin-key"].iter())
    {
        assert!(!log.contains(key), "API key {key} in the log:\n{log}");
    }
    assert!(!log.contains(DEV_SECRET), "signing secret in the log");
    for (t, _) in &tokens {
        assert!(
            !log.contains(t.as_str()),
            "full token {t} in the log:\n{log}"
        );
        // Not even the tag-carrying body of it.
        // (after `<biz>_<kid>_`: base64url may itself contain `_`).
        let body = t.splitn(3, '_').nth(2).unwrap();
        assert!(!log.contains(body), "token body of {t} in the log");
    }
}
