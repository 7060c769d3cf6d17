//! Settings that cannot work, and the debounce arithmetic.

use std::time::{Duration, Instant};

use crate::reconcile::run::debounce_wait;
use crate::reconcile::{ConfigError, SyncConfig};

/// N2: settings that cannot work are rejected with the flag named.
#[test]
fn config_validation_rejects_bad_settings() {
    assert_eq!(SyncConfig::default().validate(), Ok(()));
    for t in [f64::NAN, 0.0, 1.0, -0.5, 1.5, f64::INFINITY] {
        let cfg = SyncConfig {
            mass_delete_threshold: t,
            ..SyncConfig::default()
        };
        let err = cfg.validate().unwrap_err();
        assert!(matches!(err, ConfigError::MassDeleteThreshold { .. }), "{t}");
        assert!(err.to_string().contains("--mass-delete-threshold"), "{err}");
    }
    let cfg = SyncConfig {
        stats_interval: Duration::ZERO,
        ..SyncConfig::default()
    };
    assert_eq!(
        cfg.validate(),
        Err(ConfigError::StatsInterval { value: Duration::ZERO })
    );
}

/// N2: a debounce too large to add to an instant does not panic.
#[test]
fn huge_debounce_does_not_overflow() {
    let now = Instant::now();
    assert_eq!(debounce_wait(Some(now), Duration::MAX, now), Duration::MAX);
    assert_eq!(debounce_wait(None, Duration::MAX, now), Duration::MAX);
    let ms = Duration::from_millis(u64::MAX);
    assert_eq!(debounce_wait(Some(now), ms, now), ms);
    let d = Duration::from_millis(20);
    assert_eq!(
        debounce_wait(Some(now), d, now + Duration::from_millis(5)),
        Duration::from_millis(15)
    );
    assert_eq!(
        debounce_wait(Some(now), d, now + Duration::from_secs(1)),
        Duration::ZERO
    );
}
