//! Link-time details of the C library: give `libresmem.so` its SONAME, so that programs linked
//! against it record `libresmem.so.0` and keep working across compatible releases.

fn main() {
    let target_os = std::env::var("CARGO_CFG_TARGET_OS").unwrap_or_default();
    if target_os == "linux" {
        let major = std::env::var("CARGO_PKG_VERSION_MAJOR").unwrap_or_else(|_| "0".into());
        println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libresmem.so.{major}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
