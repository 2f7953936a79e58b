//! The test proxy of `helpers::link` does what the fault tests rely on: a
//! stalled link holds a call until it opens, a slow one delays it, a cut one
//! fails it, and opening it again lets new connections through.

use std::time::{Duration, Instant};

use crate::helpers::link::Link;

async fn ping(port: u16, within: Duration) -> Result<String, String> {
    let client =
        redis::Client::open(format!("redis://127.0.0.1:{port}/2")).map_err(|e| e.to_string())?;
    tokio::time::timeout(within, async move {
        let mut c = client
            .get_multiplexed_async_connection()
            .await
            .map_err(|e| e.to_string())?;
        redis::cmd("PING")
            .query_async::<String>(&mut c)
            .await
            .map_err(|e| e.to_string())
    })
    .await
    .map_err(|_| "timed out".to_owned())?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_link_stalls_slows_and_cuts_one_path_to_a_server() {
    let link = Link::to(6379).await;
    let second = Duration::from_secs(1);
    assert_eq!(ping(link.port(), second).await.as_deref(), Ok("PONG"));

    link.stall();
    assert_eq!(
        ping(link.port(), Duration::from_millis(300)).await,
        Err("timed out".to_owned())
    );
    // A stalled call goes through once the link opens.
    let held = tokio::spawn(ping(link.port(), Duration::from_secs(5)));
    tokio::time::sleep(Duration::from_millis(300)).await;
    link.open();
    assert_eq!(held.await.expect("join").as_deref(), Ok("PONG"));

    link.slow(Duration::from_millis(200));
    let start = Instant::now();
    assert_eq!(
        ping(link.port(), Duration::from_secs(5)).await.as_deref(),
        Ok("PONG")
    );
    assert!(
        start.elapsed() >= Duration::from_millis(400),
        "two chunks each way, each delayed"
    );

    link.cut();
    assert!(ping(link.port(), second).await.is_err());
    link.open();
    assert_eq!(ping(link.port(), second).await.as_deref(), Ok("PONG"));
}
