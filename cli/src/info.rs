//! `resmem info`: where the command finds devices, the settings the environment gives the pool,
//! and each device's memory, as a table for people.

use std::sync::Arc;

use resmem::driver::pages::PageHandles;
use resmem::driver::sim::SimDriver;
use resmem::{Driver, Pool};

use crate::env::{Device, Environment};
use crate::units::gib_or_mib;

/// One device's line.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Row {
    /// The device's ordinal.
    pub device: i32,
    /// Its memory.
    pub total: u64,
    /// What the driver reports free.
    pub driver_free: u64,
    /// What this process's pool holds unused.
    pub reusable: u64,
    /// How cached memory is reused: `pages` (page-granular, with the virtual-memory API),
    /// `parts` (the same in parts of `handle_part_mib`, where the driver maps only from an
    /// allocation's start) or `segments` (classic).
    pub reuse: &'static str,
}

/// The devices as a table: total, driver-free, reusable, the free memory resmem reports
/// (driver free + reusable), and how the cache is reused.
pub fn table(rows: &[Row]) -> String {
    let mut out = format!(
        "{:<8}{:>14}{:>14}{:>14}{:>16}{:>10}\n",
        "device", "total", "driver free", "reusable", "reported free", "reuse"
    );
    for r in rows {
        out.push_str(&format!(
            "{:<8}{:>14}{:>14}{:>14}{:>16}{:>10}\n",
            r.device,
            gib_or_mib(r.total),
            gib_or_mib(r.driver_free),
            gib_or_mib(r.reusable),
            gib_or_mib(r.driver_free + r.reusable),
            r.reuse
        ));
    }
    out
}

/// Print what `resmem info` shows.
pub fn run(env: &Environment) -> Result<(), String> {
    let (driver, place): (Arc<dyn Driver>, String) = match env.device()? {
        Device::Gpu(driver) => {
            let place = driver.describe();
            (driver, place)
        }
        Device::Simulated(why) => {
            let sim = env.simulated(&env.sim_devices);
            let driver = SimDriver::new(sim).map_err(|e| e.message)?;
            let place = format!("simulated devices from CUDA_SIM_DEVICES ({why})");
            (
                Arc::new(PageHandles::with_part(driver, env.settings.handle_part)),
                place,
            )
        }
    };
    let pool = Pool::new(Arc::clone(&driver), env.settings.pool);
    let c = env.settings.pool;
    println!("resmem {} on {place}", env!("CARGO_PKG_VERSION"));
    println!(
        "settings (RESMEM_CONF): release_before_grow {}, vmm {}, logging {}, \
         preload_allocations {}, record {}, handle_part_mib {}",
        c.release_before_grow,
        c.vmm,
        c.logging,
        env.settings.preload_allocations,
        env.settings.record.as_deref().unwrap_or("off"),
        env.settings.handle_part >> 20
    );
    let mut rows = Vec::new();
    for device in 0..pool.device_count() {
        let (driver_free, total) = driver.mem_get_info(device).map_err(|e| e.to_string())?;
        let s = pool.stats(device).map_err(|e| e.message)?;
        let pages = pool.reuses_pages(device).map_err(|e| e.message)?;
        // Asked once the pool has asked the driver whether it maps pages.
        let parts = driver
            .vmm_part(device)
            .zip(driver.vmm_granularity(device))
            .is_some_and(|(part, page)| part > page);
        rows.push(Row {
            device,
            total,
            driver_free,
            reusable: s.reusable_bytes,
            reuse: match (pages, parts) {
                (true, true) => "parts",
                (true, false) => "pages",
                (false, _) => "segments",
            },
        });
    }
    print!("\n{}", table(&rows));
    println!(
        "\nreuse: pages (cached memory mapped again page by page, with the virtual-memory API), \
         parts (the same in parts of handle_part_mib, where the driver maps only from an \
         allocation's start) or segments (classic: vmm:false, or a driver without the API)"
    );
    if pool.device_count() > 1 {
        let can = |d: i32, peer: i32| driver.can_access_peer(d, peer).unwrap_or(false);
        print!("{}", peers(pool.device_count(), can));
    }
    Ok(())
}

/// Which devices each can use the memory of (`cuDeviceCanAccessPeer`): those its ranges give
/// access to once both serve requests of one process.
fn peers(count: i32, can: impl Fn(i32, i32) -> bool) -> String {
    let mut out = String::from(
        "\npeers (the devices whose memory each device can use; a device's ranges give access to \
         those of them that serve requests of the same process):\n",
    );
    for d in 0..count {
        let list: Vec<String> = (0..count)
            .filter(|&p| p != d && can(d, p))
            .map(|p| p.to_string())
            .collect();
        let list = if list.is_empty() {
            "none".to_string()
        } else {
            list.join(", ")
        };
        out.push_str(&format!("{d}: {list}\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_are_listed_by_device() {
        assert_eq!(
            peers(3, |d, p| d != 2 && p != 2),
            "\npeers (the devices whose memory each device can use; a device's ranges give \
             access to those of them that serve requests of the same process):\n\
             0: 1\n1: 0\n2: none\n"
        );
    }

    #[test]
    fn the_table_lines_up_for_people() {
        let rows = [
            Row {
                device: 0,
                total: 24 << 30,
                driver_free: 16 << 30,
                reusable: 512 << 20,
                reuse: "pages",
            },
            Row {
                device: 1,
                total: 80 << 30,
                driver_free: 80 << 30,
                reusable: 0,
                reuse: "segments",
            },
        ];
        assert_eq!(
            table(&rows),
            "device           total   driver free      reusable   reported free     reuse\n\
             0            24.00 GiB     16.00 GiB    512.00 MiB       16.50 GiB     pages\n\
             1            80.00 GiB     80.00 GiB           0 B       80.00 GiB  segments\n"
        );
    }
}
