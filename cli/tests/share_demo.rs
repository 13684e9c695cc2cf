//! `resmem demo --processes 2`: two loader processes on one shared simulated device.

use std::process::Command;

#[test]
fn with_sharing_the_second_process_loads_whole() {
    let out = Command::new(env!("CARGO_BIN_EXE_resmem"))
        .args(["demo", "--processes", "2"])
        .env_remove("RESMEM_CONF")
        .env_remove("CUDA_SIM_SHARED")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let row = |sharing: &str, loader: &str| -> Vec<String> {
        let line = stdout
            .lines()
            .find(|l| l.starts_with(&format!("{sharing:<9}{loader:<8}")))
            .unwrap_or_else(|| panic!("no row {sharing} {loader} in {stdout}"));
        // Columns are apart by two spaces or more; figures hold one, before their unit. The
        // warm-up time is left out.
        let columns: Vec<String> = line
            .split("  ")
            .map(str::trim)
            .filter(|c| !c.is_empty())
            .map(String::from)
            .collect();
        columns[2..7].to_vec()
    };
    // llama-3-8b is 14.96 GiB in bf16; the device has 24 GiB.
    assert_eq!(
        row("off", "2"),
        ["9.04 GiB", "9.03 GiB", "5.92 GiB", "0 B", "0 B"],
        "{stdout}"
    );
    assert_eq!(
        row("on", "1")[3..],
        ["14.96 GiB", "0 B"],
        "the first process gives its idle cache: {stdout}"
    );
    assert_eq!(
        row("on", "2"),
        ["24.00 GiB", "14.96 GiB", "no", "0 B", "14.96 GiB"],
        "{stdout}"
    );
    assert!(
        stdout.contains("with sharing it loads whole (14.96 GiB came back"),
        "{stdout}"
    );
}
