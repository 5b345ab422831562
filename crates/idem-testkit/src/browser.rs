//! Real headless Chromium for the operator pages' tests: Debian's `chromium` driven by its `chromedriver` on a
//! free loopback port, through fantoccini (WebDriver). Stopped when dropped.

pub use fantoccini::Locator;
/// The WebDriver errors a test may wait out (a stale element after a navigation).
pub use fantoccini::error::{CmdError, ErrorStatus};
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// The programs, as Debian's `chromium` and `chromium-driver` packages install them.
const CHROMIUM: &str = "/usr/bin/chromium";
const CHROMEDRIVER: &str = "/usr/bin/chromedriver";

/// A headless Chromium session and the chromedriver behind it.
pub struct Browser {
    driver: Child,
    /// The WebDriver session: navigate, find, click, screenshot.
    pub client: fantoccini::Client,
}

impl Browser {
    /// Starts chromedriver on a free loopback port and opens a headless session with a `width` x `height`
    /// window. `None` (a skip) when the programs are missing, unless `IDEM_TEST_REQUIRE_BACKENDS` is set.
    pub async fn start(width: u32, height: u32) -> Option<Self> {
        if !Path::new(CHROMEDRIVER).exists() || !Path::new(CHROMIUM).exists() {
            crate::missing("chromium or chromedriver is not installed (apt-get install chromium chromium-driver)");
            return None;
        }
        let spawn = |port: u16| {
            Command::new(CHROMEDRIVER)
                .args([format!("--port={port}"), "--allowed-ips=127.0.0.1".to_owned()])
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("start chromedriver")
        };
        let mut port = crate::free_port();
        let mut driver = spawn(port);
        let mut caps = serde_json::Map::new();
        caps.insert(
            "goog:chromeOptions".into(),
            serde_json::json!({
                "binary": CHROMIUM,
                "args": ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                         "--no-first-run", "--hide-scrollbars", format!("--window-size={width},{height}")],
            }),
        );
        // chromedriver answers once it listens; a session may take a few seconds on a loaded machine.
        let deadline = Instant::now() + Duration::from_secs(60);
        let client = loop {
            let mut builder = fantoccini::ClientBuilder::new(hyper_util::client::legacy::connect::HttpConnector::new());
            match builder.capabilities(caps.clone()).connect(&format!("http://127.0.0.1:{port}")).await {
                Ok(c) => break c,
                // Polls the condition "chromedriver accepts a session", bounded by the deadline. A chromedriver
                // that exited (the free port taken by another test's server meanwhile: it cannot listen) never
                // will: another is started on another port (CI met one answering nothing for the whole minute).
                Err(_) if Instant::now() < deadline => {
                    if driver.try_wait().ok().flatten().is_some() {
                        port = crate::free_port();
                        driver = spawn(port);
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Err(e) => panic!("cannot open a Chromium session through chromedriver: {e}"),
            }
        };
        let browser = Self { driver, client };
        browser.client.set_window_size(width, height).await.expect("window size");
        Some(browser)
    }

    /// A PNG of what the window shows.
    pub async fn screenshot(&self, path: &Path) {
        let png = self.client.screenshot().await.expect("screenshot");
        std::fs::write(path, png).expect("write screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        let _ = self.driver.kill();
        let _ = self.driver.wait();
    }
}
