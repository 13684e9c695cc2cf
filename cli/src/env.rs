//! The environment, read once and the same way for every subcommand, before it runs:
//! `RESMEM_DRIVER`, `RESMEM_CUDA_LIBRARY` and `RESMEM_CONF` through the library's own parser
//! (an unknown key or a bad value is refused, exactly as the library refuses it), and
//! `CUDA_SIM_DEVICES` and `CUDA_SIM_VMM` through the simulator's. Then where a subcommand that
//! needs a device runs ([`Environment::device`]): the GPU, or simulated devices with the reason
//! said ([`Environment::simulated`] makes them; `replay` makes its own, with the API in full, to
//! compare policies).

use std::sync::Arc;

use resmem::config::{DriverChoice, Settings};
use resmem::driver::cuda::CudaDriver;
use resmem::driver::pages::PageHandles;
use resmem::Driver;

/// What the environment says, validated.
#[derive(Clone, Debug)]
pub struct Environment {
    /// The library's settings (`RESMEM_DRIVER`, `RESMEM_CUDA_LIBRARY`, `RESMEM_CONF`).
    pub settings: Settings,
    /// Whether `RESMEM_DRIVER` was given (`cuda` then means the GPU or an error).
    pub driver_given: bool,
    /// `CUDA_SIM_DEVICES`' capacities (one 24 GiB device when unset).
    pub sim_devices: Vec<u64>,
    /// `CUDA_SIM_VMM`: the simulated devices' virtual-memory API (in full when unset).
    pub sim_vmm: cuda_sim::VmmSetting,
}

/// Where a subcommand runs.
pub enum Device {
    /// The CUDA driver, with at least one GPU.
    Gpu(Arc<dyn Driver>),
    /// Simulated devices, and why (for the line that says so).
    Simulated(String),
}

/// The variables' values as a lookup (`None`: unset), so that tests need not touch the process.
pub fn from_vars(var: impl Fn(&str) -> Option<String>) -> Result<Environment, String> {
    let driver = var("RESMEM_DRIVER");
    let settings = Settings::from_vars(
        driver.as_deref(),
        var("RESMEM_CUDA_LIBRARY").as_deref(),
        var("RESMEM_CONF").as_deref(),
    )
    .map_err(|e| e.message)?;
    let sim_devices =
        cuda_sim::parse_devices(var("CUDA_SIM_DEVICES").as_deref().unwrap_or("24GiB"))
            .map_err(|e| format!("CUDA_SIM_DEVICES: {e}"))?;
    let sim_vmm = var("CUDA_SIM_VMM")
        .map(|v| cuda_sim::VmmSetting::parse(&v))
        .transpose()?
        .unwrap_or_default();
    Ok(Environment {
        settings,
        driver_given: driver.is_some_and(|d| !d.trim().is_empty()),
        sim_devices,
        sim_vmm,
    })
}

/// The process's environment (privileged processes ignore what the library ignores).
pub fn read() -> Result<Environment, String> {
    from_vars(resmem::runtime::var)
}

impl Environment {
    /// Simulated devices of these capacities, with the virtual-memory API `CUDA_SIM_VMM` asks
    /// for. Kept for the life of the process, as a driver's devices are.
    pub fn simulated(&self, capacities: &[u64]) -> &'static cuda_sim::Sim {
        let sim = Box::leak(Box::new(cuda_sim::Sim::new(capacities)));
        sim.set_vmm(self.sim_vmm);
        sim
    }

    /// `RESMEM_DRIVER=sim`: simulated devices. Unset: the CUDA driver when it loads and finds a
    /// GPU, else simulated devices. `RESMEM_DRIVER=cuda`: the CUDA driver, or an error.
    pub fn device(&self) -> Result<Device, String> {
        let library = match &self.settings.driver {
            DriverChoice::Sim => return Ok(Device::Simulated("RESMEM_DRIVER=sim".into())),
            DriverChoice::Cuda(library) => library,
        };
        let found = CudaDriver::load(library)
            .map_err(|e| e.message)
            .and_then(|d| match d.device_count() {
                0 => Err(format!(
                    "{} sees no GPU; set RESMEM_DRIVER=sim to use simulated devices",
                    d.describe()
                )),
                _ => Ok(d),
            });
        match found {
            Ok(driver) => Ok(Device::Gpu(Arc::new(PageHandles::with_part(
                driver,
                self.settings.handle_part,
            )))),
            Err(why) if self.driver_given => Err(format!("RESMEM_DRIVER=cuda, but {why}")),
            Err(why) => Ok(Device::Simulated(format!("no GPU: {why}"))),
        }
    }
}

/// One simulated device's memory, for `--device-memory`: a size of at least one 2 MiB page.
pub fn device_memory(text: &str) -> Result<u64, String> {
    match cuda_sim::parse_devices(text)?.as_slice() {
        [one] => Ok(*one),
        _ => Err(format!("{text:?} is not one size; write e.g. 24GiB")),
    }
}

/// A part size for `replay --handle-part`: a size of at most 1 GiB, as `handle_part_mib` takes.
pub fn part_size(text: &str) -> Result<u64, String> {
    match cuda_sim::parse_devices(text).as_deref() {
        Ok([size]) if *size <= 1 << 30 => Ok(*size),
        _ => Err(format!(
            "{text:?} is not a size up to 1GiB; write e.g. 8MiB"
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(vars: &[(&str, &str)]) -> Result<Environment, String> {
        let vars: Vec<(String, String)> = vars
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        from_vars(|name| vars.iter().find(|(k, _)| k == name).map(|(_, v)| v.clone()))
    }

    #[test]
    fn bad_values_are_refused_with_what_to_do() {
        let e = env(&[("RESMEM_DRIVER", "nvidia")]).unwrap_err();
        assert_eq!(
            e,
            "RESMEM_DRIVER=\"nvidia\" is not a driver: use cuda (the default) or sim"
        );
        let e = env(&[("RESMEM_CONF", "bogus:true")]).unwrap_err();
        assert!(
            e.starts_with("RESMEM_CONF: unknown key \"bogus\"; the keys are "),
            "{e}"
        );
        let e = env(&[("CUDA_SIM_DEVICES", "banana")]).unwrap_err();
        assert_eq!(
            e,
            "CUDA_SIM_DEVICES: device 0: \"banana\" is not a size (examples: \"24GiB\", \
             \"512MiB\", \"24GB\")"
        );
    }

    #[test]
    fn defaults_and_simulated_devices() {
        let e = env(&[]).unwrap();
        assert_eq!(e.sim_devices, [24 << 30]);
        assert!(!e.driver_given);
        let e = env(&[("RESMEM_DRIVER", "sim"), ("CUDA_SIM_DEVICES", "1GiB,2GiB")]).unwrap();
        assert_eq!(e.sim_devices, [1 << 30, 2 << 30]);
        match e.device().unwrap() {
            Device::Simulated(why) => assert_eq!(why, "RESMEM_DRIVER=sim"),
            Device::Gpu(_) => panic!("RESMEM_DRIVER=sim gave the GPU"),
        }
    }

    #[test]
    fn a_missing_driver_falls_back_unless_cuda_was_asked_for() {
        let lib = [("RESMEM_CUDA_LIBRARY", "/nonexistent/libcuda.so.1")];
        match env(&lib).unwrap().device().unwrap() {
            Device::Simulated(why) => assert!(why.starts_with("no GPU: "), "{why}"),
            Device::Gpu(_) => panic!("a missing library gave a GPU"),
        }
        let asked = env(&[lib[0], ("RESMEM_DRIVER", "cuda")]).unwrap();
        let e = match asked.device() {
            Err(e) => e,
            Ok(_) => panic!("RESMEM_DRIVER=cuda without a driver was accepted"),
        };
        assert!(e.starts_with("RESMEM_DRIVER=cuda, but "), "{e}");
        assert!(
            e.ends_with("set RESMEM_DRIVER=sim to use simulated devices"),
            "{e}"
        );
    }

    #[test]
    fn a_device_has_at_least_one_page() {
        assert_eq!(device_memory("24GiB").unwrap(), 24 << 30);
        assert_eq!(
            device_memory("0").unwrap_err(),
            "device 0: capacity \"0\" is smaller than one 2 MiB page"
        );
        assert!(device_memory("1GiB,1GiB")
            .unwrap_err()
            .contains("not one size"));
    }
}
