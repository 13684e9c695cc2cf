//! `resmem`: see what the pool does for a workload, side by side with PyTorch's allocator.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::{Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use resmem::driver::cuda::CudaDriver;
use resmem::driver::sim::SimDriver;
use resmem::Driver;
use resmem_cli::replay::{self, Outcome, Policy};
use resmem_cli::trace::Trace;
use resmem_cli::units::{gib_or_mib, parse_size};
use resmem_cli::{demo, generate, model, plot, share_demo};

#[derive(Parser)]
#[command(
    name = "resmem",
    version,
    about = "resmem, a CUDA memory pool that counts its reusable memory as free: \
    the seed demo, trace replay against PyTorch's caching allocator, and device figures"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Consecutive loads of a bf16 model by a loader that offloads what exceeds the reported
    /// free memory, under resmem and under PyTorch's policy (on the GPU if the CUDA driver finds
    /// one, else on a simulated device).
    Demo {
        /// The simulated device's memory (ignored on a real GPU).
        #[arg(long, default_value = "24GiB", value_parser = parse_size)]
        device_memory: u64,
        /// The model's shapes (default: qwen3-4b; llama-3-8b with --processes 2).
        #[arg(long, value_parser = model::preset)]
        model: Option<model::Shape>,
        /// How many loads.
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1000))]
        loads: u32,
        /// 2: one load in each of two processes on one simulated device, without and with
        /// RESMEM_CONF=share:true (the processes give each other their idle cache).
        #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=2))]
        processes: u32,
    },
    /// One loader of `demo --processes 2` (run by it).
    #[command(name = "share-loader", hide = true)]
    ShareLoader {
        #[arg(long, value_parser = model::preset)]
        model: model::Shape,
        /// Drop the model, report, and wait for the end of standard input.
        #[arg(long)]
        keep: bool,
    },
    /// Replay an allocation trace (JSON lines, or a pickled torch.cuda.memory._snapshot()) on a
    /// simulated device and compare peaks, fragmentation, driver calls and out-of-memory events.
    Replay {
        /// The trace file.
        trace: PathBuf,
        /// Which policy to replay.
        #[arg(long, value_enum, default_value_t = Which::Both)]
        policy: Which,
        /// The simulated device's memory (default: the trace's own, else 80GiB).
        #[arg(long, value_parser = parse_size)]
        device_memory: Option<u64>,
        /// For PyTorch snapshots: whose device trace to take.
        #[arg(long, default_value_t = 0)]
        device: usize,
        /// Draw reserved and allocated memory over the trace to this SVG file.
        #[arg(long)]
        plot: Option<PathBuf>,
    },
    /// Each device's total, driver-free and resmem-reusable memory and the pool's figures, from
    /// the environment's settings (RESMEM_DRIVER, RESMEM_CUDA_LIBRARY, RESMEM_CONF).
    Info,
    /// Write a trace generated from real layer shapes (see traces/README.md).
    GenTrace {
        /// The trace's kind (qwen3-4b-loads, llama-3-8b-decode, qwen3-0.6b-training,
        /// transformers-37436).
        #[arg(required_unless_present = "all")]
        kind: Option<String>,
        /// Write every kind as DIR/KIND.jsonl.
        #[arg(long, value_name = "DIR", conflicts_with = "kind")]
        all: Option<PathBuf>,
        /// Write to this file instead of standard output.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Which {
    /// resmem's pool with classic segments.
    Resmem,
    /// resmem's pool stitching segments with the virtual-memory API (vmm:true).
    ResmemVmm,
    /// PyTorch's caching-allocator policy.
    Torch,
    /// resmem and torch side by side.
    Both,
    /// resmem, resmem-vmm and torch side by side.
    All,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Demo {
            device_memory,
            model,
            loads: _,
            processes: 2,
        } => share_demo::show(device_memory, model.as_ref()),
        Command::Demo {
            device_memory,
            model,
            loads,
            processes: _,
        } => run_demo(device_memory, &model.unwrap_or(model::PRESETS[0]), loads),
        Command::ShareLoader { model, keep } => share_demo::loader(&model, keep),
        Command::Replay {
            trace,
            policy,
            device_memory,
            device,
            plot,
        } => run_replay(&trace, policy, device_memory, device, plot.as_deref()),
        Command::Info => run_info(),
        Command::GenTrace { kind, all, output } => run_gen(kind, all, output),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("resmem: {message}");
            ExitCode::FAILURE
        }
    }
}

fn run_demo(device_memory: u64, shape: &model::Shape, loads: u32) -> Result<(), String> {
    let model_bytes = shape.parameter_count() * 2;
    let gpu = CudaDriver::load("libcuda.so.1")
        .ok()
        .filter(|d| d.device_count() > 0);
    let place = match &gpu {
        Some(d) => format!("device 0 through {}", d.describe()),
        None => format!(
            "a simulated {} device (no CUDA driver or GPU found)",
            gib_or_mib(device_memory)
        ),
    };
    println!(
        "{loads} loads of {} ({} parameters, {} in bf16, {} tensors) on {place}",
        shape.name,
        shape.parameter_count(),
        gib_or_mib(model_bytes),
        shape.parameters().len()
    );
    let gpu: Option<Arc<dyn Driver>> = gpu.map(|d| Arc::new(d) as Arc<dyn Driver>);
    let mut peaks = Vec::new();
    for policy in [Policy::Resmem, Policy::Torch] {
        // Each policy starts from a device with nothing reserved.
        let driver: Arc<dyn Driver> = match &gpu {
            Some(d) => d.clone(),
            None => {
                let sim = Box::leak(Box::new(cuda_sim::Sim::new(&[device_memory])));
                Arc::new(SimDriver::new(sim).map_err(|e| e.message)?)
            }
        };
        let alloc = policy.build(driver);
        let rows = demo::run(&*alloc, shape, loads)?;
        let view = match policy {
            Policy::Resmem | Policy::ResmemVmm => "reported free = driver free + reusable",
            Policy::Torch => "reported free = the driver's (cudaMemGetInfo)",
        };
        println!("\n{} ({view})", policy.name());
        print!("{}", demo::table(&rows));
        let s = alloc.stats(0).map_err(|e| e.message)?;
        let offloads = rows.iter().filter(|r| r.offloaded > 0).count();
        println!(
            "peak reserved {} ({:.4} x the model), {} driver allocations, {offloads} of {loads} loads offloaded",
            gib_or_mib(s.peak_reserved_bytes),
            s.peak_reserved_bytes as f64 / model_bytes as f64,
            s.driver_allocs
        );
        peaks.push(s.peak_reserved_bytes);
        alloc.free_reusable(None).map_err(|e| e.message)?;
    }
    println!(
        "\npeak reserved: resmem {}, PyTorch's policy {} (resmem / torch = {:.3})",
        gib_or_mib(peaks[0]),
        gib_or_mib(peaks[1]),
        peaks[0] as f64 / peaks[1].max(1) as f64
    );
    Ok(())
}

fn run_replay(
    path: &Path,
    which: Which,
    device_memory: Option<u64>,
    device: usize,
    plot_to: Option<&Path>,
) -> Result<(), String> {
    let trace = Trace::read(path, device)?;
    let memory = device_memory.or(trace.device_memory).unwrap_or(80 << 30);
    println!(
        "{}: {} operations ({} allocations) on a simulated {} device",
        trace.name,
        trace.events.len(),
        trace.allocs(),
        gib_or_mib(memory)
    );
    let policies: &[Policy] = match which {
        Which::Resmem => &[Policy::Resmem],
        Which::ResmemVmm => &[Policy::ResmemVmm],
        Which::Torch => &[Policy::Torch],
        Which::Both => &[Policy::Resmem, Policy::Torch],
        Which::All => &[Policy::Resmem, Policy::ResmemVmm, Policy::Torch],
    };
    let mut outcomes: Vec<Outcome> = Vec::new();
    for &policy in policies {
        let bar = ProgressBar::new(trace.events.len() as u64);
        if trace.events.len() < 50_000 || !std::io::stderr().is_terminal() {
            bar.set_draw_target(ProgressDrawTarget::hidden());
        }
        bar.set_style(
            ProgressStyle::with_template("{prefix:>7} [{bar:40}] {pos}/{len} operations")
                .expect("a valid template")
                .progress_chars("=> "),
        );
        bar.set_prefix(policy.name());
        outcomes.push(replay::replay(&trace, policy, memory, |n| {
            bar.set_position(n)
        })?);
        bar.finish_and_clear();
    }
    print!("{}", replay::table(&trace, &outcomes));
    for o in &outcomes {
        if let Some(message) = &o.first_oom {
            println!("first out-of-memory under {}: {message}", o.policy.name());
        }
    }
    if let Some(out) = plot_to {
        let title = format!("{}: reserved and allocated memory", trace.name);
        let svg = plot::svg(&title, &outcomes)?;
        std::fs::write(out, svg).map_err(|e| format!("cannot write {}: {e}", out.display()))?;
        println!("plot written to {}", out.display());
    }
    Ok(())
}

fn run_info() -> Result<(), String> {
    let pool = resmem::runtime::pool().map_err(|e| e.message)?;
    println!(
        "{} with {} device(s)",
        pool.driver().describe(),
        pool.device_count()
    );
    for device in 0..pool.device_count() {
        let (driver_free, total) = pool
            .driver()
            .mem_get_info(device)
            .map_err(|e| e.to_string())?;
        let s = pool.stats(device).map_err(|e| e.message)?;
        println!(
            "device {device}: total {}, driver free {}, resmem reusable {}, reported free {}",
            gib_or_mib(total),
            gib_or_mib(driver_free),
            gib_or_mib(s.reusable_bytes),
            gib_or_mib(driver_free + s.reusable_bytes)
        );
        println!("  {s:#?}");
    }
    Ok(())
}

fn run_gen(
    kind: Option<String>,
    all: Option<PathBuf>,
    output: Option<PathBuf>,
) -> Result<(), String> {
    let write = |trace: &Trace, to: Option<&Path>| -> Result<(), String> {
        match to {
            Some(path) => {
                let file = std::fs::File::create(path)
                    .map_err(|e| format!("cannot create {}: {e}", path.display()))?;
                let mut out = std::io::BufWriter::new(file);
                trace
                    .write_json_lines(&mut out)
                    .and_then(|()| std::io::Write::flush(&mut out))
                    .map_err(|e| format!("cannot write {}: {e}", path.display()))
            }
            None => trace
                .write_json_lines(std::io::stdout().lock())
                .map_err(|e| format!("cannot write the trace: {e}")),
        }
    };
    if let Some(dir) = all {
        for kind in generate::KINDS {
            let path = dir.join(format!("{kind}.jsonl"));
            write(&generate::by_name(kind)?, Some(&path))?;
            eprintln!("wrote {}", path.display());
        }
        return Ok(());
    }
    let kind = kind.expect("clap requires a kind without --all");
    write(&generate::by_name(&kind)?, output.as_deref())
}
