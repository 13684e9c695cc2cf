//! `resmem demo --processes 2`: two loaders in two processes on one simulated device whose
//! capacity they share (`CUDA_SIM_SHARED`), without and with `RESMEM_CONF=share:true`.
//!
//! The first process loads the model and drops it, so that its pool keeps the model's memory
//! as idle cache, and stays alive. The second then loads the same model, planning with the free
//! memory `rm_mem_get_info` reports (offloading to the CPU what does not fit), warming the pool
//! up and reserving every parameter, as transformers does. Without sharing the first process's
//! cache is lost to the second, which offloads; with sharing (and `share_count`) the second
//! sees the first's idle cache as free, and gets it when its warm-up asks: it loads whole.
//!
//! Each loader is this same command run as `resmem share-loader`; it goes through the
//! process-wide pool of the library, exactly as a program linking `libresmem.so` does.

use std::io::{BufRead, BufReader, Read, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Instant;

use crate::model::Shape;
use crate::units::gib_or_mib;

/// The hidden subcommand that runs one loader.
pub const LOADER_COMMAND: &str = "share-loader";

/// What one loader reports.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Load {
    /// The free memory `rm_mem_get_info` reported before the load.
    pub reported_free: u64,
    /// Bytes of parameters placed on the device.
    pub on_device: u64,
    /// Bytes of parameters left on the CPU.
    pub offloaded: u64,
    /// Microseconds the warm-up took (where a request to the other process happens).
    pub warmup_us: u64,
    /// Bytes this process returned at the other's request.
    pub given: u64,
    /// Bytes the other process returned at this one's request.
    pub received: u64,
}

impl Load {
    fn line(&self) -> String {
        format!(
            "load reported_free={} on_device={} offloaded={} warmup_us={} given={} received={}",
            self.reported_free,
            self.on_device,
            self.offloaded,
            self.warmup_us,
            self.given,
            self.received
        )
    }

    fn parse(line: &str) -> Result<Load, String> {
        let field = |name: &str| -> Result<u64, String> {
            line.split_whitespace()
                .find_map(|kv| kv.strip_prefix(name)?.strip_prefix('='))
                .and_then(|v| v.parse().ok())
                .ok_or_else(|| format!("a loader printed {line:?}, without {name}"))
        };
        Ok(Load {
            reported_free: field("reported_free")?,
            on_device: field("on_device")?,
            offloaded: field("offloaded")?,
            warmup_us: field("warmup_us")?,
            given: field("given")?,
            received: field("received")?,
        })
    }
}

/// One run: both loaders' reports, the first one's taken after the second finished.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Run {
    /// Whether the processes shared.
    pub sharing: bool,
    /// The first loader (its model dropped, its cache idle).
    pub first: Load,
    /// The second loader.
    pub second: Load,
}

fn fail(what: &str) -> impl Fn(resmem::Error) -> String + '_ {
    move |e| format!("{what}: {}", e.message)
}

/// The loader (run in its own process, as `resmem share-loader`): load `shape` on device 0
/// through the process-wide pool and print a report line. With `keep`, drop the model, print
/// "ready", wait for the end of standard input, and print the report again (its figures now).
pub fn loader(shape: &Shape, keep: bool) -> Result<(), String> {
    let sizes: Vec<u64> = shape.parameters().iter().map(|p| p * 2).collect();
    let (free, _) = resmem::runtime::mem_get_info(0).map_err(fail("mem_get_info"))?;
    let mut placed = Vec::new();
    let mut on_device = 0u64;
    for &size in &sizes {
        if on_device + size <= free {
            on_device += size;
            placed.push(size);
        }
    }
    let start = Instant::now();
    resmem::runtime::warmup(0, on_device).map_err(fail("warm-up"))?;
    let warmup_us = start.elapsed().as_micros() as u64;
    let mut ptrs = Vec::with_capacity(placed.len());
    for size in placed {
        ptrs.push(resmem::runtime::reserve(0, size, 0).map_err(fail("reserve"))?);
    }
    let mut load = Load {
        reported_free: free,
        on_device,
        offloaded: sizes.iter().sum::<u64>() - on_device,
        warmup_us,
        ..Load::default()
    };
    let pool = resmem::runtime::pool().map_err(fail("pool"))?;
    let report = |load: &mut Load| -> Result<(), String> {
        let reusable = pool.stats(0).map_err(fail("stats"))?.reusable_bytes;
        (load.given, load.received) = resmem::runtime::share_counts(0, reusable);
        println!("{}", load.line());
        let _ = std::io::stdout().flush();
        Ok(())
    };
    if keep {
        for ptr in ptrs {
            pool.release(ptr).map_err(fail("release"))?;
        }
        // Reporting also tells the other process what this one could give up.
        report(&mut load)?;
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
    }
    report(&mut load)
}

/// A scratch directory for one run's shared device and registry, removed on drop.
struct Scratch(PathBuf);

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn spawn(
    exe: &Path,
    scratch: &Path,
    memory: u64,
    shape: &Shape,
    sharing: bool,
    keep: bool,
) -> Result<Child, String> {
    let mut cmd = Command::new(exe);
    cmd.arg(LOADER_COMMAND).args(["--model", shape.name]);
    if keep {
        cmd.arg("--keep");
    }
    for (key, _) in std::env::vars_os() {
        let key = key.to_string_lossy().into_owned();
        if key.starts_with("RESMEM_") || key.starts_with("CUDA_SIM_") {
            cmd.env_remove(key);
        }
    }
    cmd.env("RESMEM_DRIVER", "sim")
        .env("CUDA_SIM_DEVICES", memory.to_string())
        .env("CUDA_SIM_SHARED", scratch.join("capacity"))
        .env("RESMEM_SHARE_DIR", scratch);
    if sharing {
        cmd.env("RESMEM_CONF", "share:true,share_count:true");
    }
    cmd.stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .map_err(|e| format!("cannot start {}: {e}", exe.display()))
}

fn read_load(child: &mut Child, reader: &mut impl BufRead) -> Result<Load, String> {
    let mut line = String::new();
    reader
        .read_line(&mut line)
        .map_err(|e| format!("reading a loader: {e}"))?;
    if line.is_empty() {
        let status = child.wait().map_err(|e| e.to_string())?;
        return Err(format!("a loader ended ({status}) without a report"));
    }
    Load::parse(line.trim_end())
}

/// Run both loaders of `shape` on a simulated device of `memory` bytes shared by the two
/// processes, `exe` being this command, with or without sharing.
pub fn run(exe: &Path, memory: u64, shape: &Shape, sharing: bool) -> Result<Run, String> {
    let dir = std::env::temp_dir().join(format!(
        "resmem-demo-{}-{}",
        std::process::id(),
        if sharing { "on" } else { "off" }
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let scratch = Scratch(dir);
    let mut first = spawn(exe, &scratch.0, memory, shape, sharing, true)?;
    let mut first_out = BufReader::new(first.stdout.take().expect("piped"));
    let first_stdin = first.stdin.take();
    let outcome = (|| -> Result<Load, String> {
        read_load(&mut first, &mut first_out)?;
        let mut second = spawn(exe, &scratch.0, memory, shape, sharing, false)?;
        drop(second.stdin.take());
        let mut second_out = BufReader::new(second.stdout.take().expect("piped"));
        let second_load = read_load(&mut second, &mut second_out)?;
        let _ = second.wait();
        Ok(second_load)
    })();
    drop(first_stdin);
    let first_load = read_load(&mut first, &mut first_out);
    let _ = first.wait();
    Ok(Run {
        sharing,
        first: first_load?,
        second: outcome?,
    })
}

/// `resmem demo --processes 2`: both runs and their table, printed.
pub fn show(memory: u64, shape: Option<&Shape>) -> Result<(), String> {
    let shape = shape.copied().unwrap_or(crate::model::PRESETS[1]);
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this command: {e}"))?;
    println!(
        "two processes each load {} ({} in bf16) on one simulated {} device; the first drops \
         its model and keeps its cache",
        shape.name,
        gib_or_mib(shape.parameter_count() * 2),
        gib_or_mib(memory)
    );
    let runs = [
        run(&exe, memory, &shape, false)?,
        run(&exe, memory, &shape, true)?,
    ];
    print!("\n{}", table(&runs));
    let [off, on] = runs;
    println!(
        "\nwithout sharing the second load offloads {}; with sharing it {} ({} came back from \
         the first process during its warm-up of {:.2} ms)",
        gib_or_mib(off.second.offloaded),
        if on.second.offloaded == 0 {
            "loads whole".to_string()
        } else {
            format!("still offloads {}", gib_or_mib(on.second.offloaded))
        },
        gib_or_mib(on.second.received),
        on.second.warmup_us as f64 / 1000.0
    );
    Ok(())
}

/// The table of both runs.
pub fn table(runs: &[Run]) -> String {
    let mut out = format!(
        "{:<9}{:<8}{:>15}{:>12}{:>12}{:>12}{:>12}{:>13}\n",
        "sharing",
        "loader",
        "reported free",
        "on device",
        "offloaded",
        "given",
        "received",
        "warm-up"
    );
    for run in runs {
        for (i, load) in [run.first, run.second].iter().enumerate() {
            let offloaded = if load.offloaded == 0 {
                "no".to_string()
            } else {
                gib_or_mib(load.offloaded)
            };
            out.push_str(&format!(
                "{:<9}{:<8}{:>15}{:>12}{:>12}{:>12}{:>12}{:>10.2} ms\n",
                if run.sharing { "on" } else { "off" },
                i + 1,
                gib_or_mib(load.reported_free),
                gib_or_mib(load.on_device),
                offloaded,
                gib_or_mib(load.given),
                gib_or_mib(load.received),
                load.warmup_us as f64 / 1000.0
            ));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_lines_round_trip() {
        let load = Load {
            reported_free: 1,
            on_device: 2,
            offloaded: 3,
            warmup_us: 4,
            given: 5,
            received: 6,
        };
        assert_eq!(Load::parse(&load.line()).unwrap(), load);
        assert!(Load::parse("load reported_free=1").is_err());
    }
}
