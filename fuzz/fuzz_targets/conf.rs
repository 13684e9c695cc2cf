//! `RESMEM_CONF` and `RESMEM_DRIVER` text from arbitrary bytes: parsing never panics, an error
//! is always `RM_ERROR_INVALID_VALUE` with a short message, and a successful parse is stable
//! (the same text parses the same way with spaces and empty items added).

#![no_main]

use libfuzzer_sys::fuzz_target;
use resmem::config::{parse_conf, Settings};
use resmem::rm_status;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    match parse_conf(&text) {
        Ok(config) => {
            let padded = format!(" ,{},, ", text.replace(',', " , "));
            assert_eq!(parse_conf(&padded).ok(), Some(config), "{text:?}");
        }
        Err(e) => {
            assert_eq!(e.status, rm_status::RM_ERROR_INVALID_VALUE);
            assert!(
                e.message.len() < 400,
                "{} bytes for {text:?}",
                e.message.len()
            );
        }
    }
    if let Err(e) = Settings::from_vars(Some(&text), Some(&text), Some(&text)) {
        assert_eq!(e.status, rm_status::RM_ERROR_INVALID_VALUE);
        assert!(e.message.len() < 400, "{} bytes", e.message.len());
    }
});
