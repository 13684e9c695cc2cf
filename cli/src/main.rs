//! `resmem`: see what the pool does for a workload, side by side with PyTorch's allocator.

use std::io::IsTerminal;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

use clap::error::ErrorKind;
use clap::{ArgGroup, Parser, Subcommand, ValueEnum};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use resmem::driver::pages::PageHandles;
use resmem::driver::sim::SimDriver;
use resmem::Driver;
use resmem_cli::allocator::Allocator;
use resmem_cli::env::{self, Device, Environment};
use resmem_cli::replay::{self, Outcome, Policy};
use resmem_cli::trace::Trace;
use resmem_cli::units::gib_or_mib;
use resmem_cli::{baseline, demo, generate, info, model, plot, report, seed, share_demo};

#[derive(Parser)]
#[command(
    name = "resmem",
    version,
    about = "resmem, a CUDA memory pool that counts its reusable memory as free: \
    the seed demo, trace replay against PyTorch's caching allocator, and device figures",
    after_help = "Every subcommand first checks RESMEM_DRIVER, RESMEM_CUDA_LIBRARY, RESMEM_CONF \
    and CUDA_SIM_DEVICES and refuses a bad value. demo and info run on the GPU when the CUDA \
    driver finds one and on simulated devices otherwise (saying so); RESMEM_DRIVER=sim asks for \
    simulated devices, RESMEM_DRIVER=cuda for the GPU or an error. replay always runs on fresh \
    simulated devices."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// The seed: consecutive loads of a bf16 model by transformers before PR #37920, each with
    /// generate() and the model deleted, by a loader that offloads what exceeds the reported free
    /// memory; PyTorch's policy and resmem get the same calls (on the GPU if the CUDA driver
    /// finds one, else on a simulated device, saying so).
    Demo {
        /// The simulated device's memory (ignored on a real GPU).
        #[arg(long, default_value = "24GiB", value_parser = env::device_memory)]
        device_memory: u64,
        /// The model's shapes: qwen3-4b, llama-3-8b, mistral-7b or qwen3-0.6b (default:
        /// qwen3-4b; llama-3-8b with --processes 2).
        #[arg(long, value_parser = model::preset)]
        model: Option<model::Shape>,
        /// How many loads.
        #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=1000))]
        loads: u32,
        /// Draw reserved and allocated memory over the calls to this SVG file.
        #[arg(long)]
        plot: Option<PathBuf>,
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
        /// The simulated device's memory (default: the trace's own, else 80GiB, or for a
        /// snapshot whose recorded peak needs more, a quarter more than that peak).
        #[arg(long, value_parser = env::device_memory)]
        device_memory: Option<u64>,
        /// PyTorch's policy with these PYTORCH_CUDA_ALLOC_CONF settings, in place of those a
        /// snapshot recorded (max_split_size_mb, max_non_split_rounding_mb,
        /// roundup_power2_divisions and expandable_segments are replayed; another backend is
        /// refused).
        #[arg(long, value_name = "CONF")]
        torch_conf: Option<String>,
        /// Which device's operations to replay (PyTorch snapshots and recorded traces; default
        /// 0, or the first device with allocations where device 0 has none).
        #[arg(long)]
        device: Option<usize>,
        /// Draw reserved and allocated memory over the trace to this SVG file.
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Also find the smallest device on which each policy runs the trace with no
        /// out-of-memory (bisection to 32 MiB, above the device memory if it needs more).
        #[arg(long)]
        min_device: bool,
        /// Print the figures as one JSON object instead of the table.
        #[arg(long)]
        json: bool,
        /// Write to standard error every operation after which a policy reserves a different
        /// amount, after what resmem's pool logged of its decisions while serving it.
        #[arg(long)]
        log: bool,
        /// Replay as on the CUDA driver, whose cuMemMap maps only from an allocation's start:
        /// resmem's page-granular handles made of one driver handle per 2 MiB page, as on a
        /// GPU (the same decisions, more virtual-memory calls). By default the simulated
        /// driver maps at offsets into an allocation, as the API's description allows.
        #[arg(long, conflicts_with = "handle_part")]
        one_page_handles: bool,
        /// Replay as on the CUDA driver with resmem's handles made of parts of this size
        /// (e.g. 8MiB, rounded up to a 2 MiB page), each lent only whole, as
        /// RESMEM_CONF=handle_part_mib:N makes them: fewer calls, less cache lent.
        #[arg(long, value_name = "SIZE", value_parser = env::part_size)]
        handle_part: Option<u64>,
    },
    /// Where the command finds devices, the pool's settings from RESMEM_CONF, and each
    /// device's total, driver-free and resmem-reusable memory (on the GPU if the CUDA driver
    /// finds one, else on the simulated devices of CUDA_SIM_DEVICES, saying so).
    Info,
    /// Write a trace generated from real layer shapes (see traces/README.md): one KIND, or
    /// --all of them.
    #[command(group(ArgGroup::new("what").required(true).args(["kind", "all"])))]
    GenTrace {
        /// The trace's kind.
        #[arg(value_parser = generate::KINDS)]
        kind: Option<String>,
        /// Write every kind as DIR/KIND.jsonl (DIR is created if needed).
        #[arg(long, value_name = "DIR", conflicts_with = "kind")]
        all: Option<PathBuf>,
        /// Write to this file instead of standard output.
        #[arg(short, long)]
        output: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Which {
    /// resmem's pool with its default settings.
    Resmem,
    /// resmem's pool with classic segments (vmm:false).
    ResmemClassic,
    /// resmem's pool on the virtual-memory API (vmm:true).
    ResmemVmm,
    /// resmem's default pool behind the per-thread front caches, as the C library and PyTorch
    /// programs use it.
    ResmemFront,
    /// PyTorch's caching-allocator policy.
    Torch,
    /// resmem's default and torch side by side.
    Both,
    /// torch, resmem-classic and resmem-vmm side by side, the default marked.
    All,
}

fn main() -> ExitCode {
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        // --help, --version, and the help when no subcommand is given.
        Err(e)
            if !e.use_stderr()
                || e.kind() == ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand =>
        {
            e.exit()
        }
        Err(e) => {
            eprintln!("resmem: {}", one_line(&e.render().to_string()));
            return ExitCode::from(2);
        }
    };
    let result = env::read().and_then(|env| run(cli.command, &env));
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("resmem: {message}");
            ExitCode::FAILURE
        }
    }
}

/// A command-line error as one line: clap's message up to its usage, without its `error: `.
fn one_line(message: &str) -> String {
    let text: Vec<&str> = message
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .map(str::trim)
        .collect();
    let text = text.join(" ");
    let text = text.strip_prefix("error: ").unwrap_or(&text);
    format!("{text} (see resmem --help)")
}

fn run(command: Command, env: &Environment) -> Result<(), String> {
    match command {
        Command::Demo {
            device_memory,
            model,
            processes: 2,
            ..
        } => share_demo::show(device_memory, model.as_ref()),
        Command::Demo {
            device_memory,
            model,
            loads,
            plot,
            processes: _,
        } => run_demo(
            env,
            device_memory,
            &model.unwrap_or(model::PRESETS[0]),
            loads,
            plot.as_deref(),
        ),
        Command::ShareLoader { model, keep } => share_demo::loader(&model, keep),
        Command::Replay {
            trace,
            policy,
            device_memory,
            device,
            plot,
            min_device,
            json,
            log,
            one_page_handles,
            handle_part,
            torch_conf,
        } => run_replay(
            &trace,
            (device, torch_conf.as_deref()),
            policy,
            device_memory,
            plot.as_deref(),
            (min_device, json),
            replay::How {
                log,
                handle_part: handle_part.or(one_page_handles.then_some(0)),
            },
        ),
        Command::Info => info::run(env),
        Command::GenTrace { kind, all, output } => run_gen(kind, all, output),
    }
}

fn run_demo(
    env: &Environment,
    device_memory: u64,
    shape: &model::Shape,
    loads: u32,
    plot_to: Option<&Path>,
) -> Result<(), String> {
    let (gpu, place) = match env.device()? {
        Device::Gpu(d) => {
            let place = format!("device 0 through {}", d.describe());
            (Some(d), place)
        }
        Device::Simulated(why) => (
            None,
            format!("a simulated {} device ({why})", gib_or_mib(device_memory)),
        ),
    };
    let one_warmup = seed::warmup_bytes(shape, shape.parameters().len());
    print!("{}", demo::intro(shape, loads, &place));
    let policies = [Policy::Torch, Policy::Resmem];
    let mut runs = Vec::new();
    for policy in policies {
        // Each policy starts from a device with nothing reserved.
        let driver: Arc<dyn Driver> = match &gpu {
            Some(d) => d.clone(),
            None => {
                let sim = env.simulated(&[device_memory]);
                Arc::new(PageHandles::with_part(
                    SimDriver::new(sim).map_err(|e| e.message)?,
                    env.settings.handle_part,
                ))
            }
        };
        let alloc = policy.build(driver);
        runs.push(demo::run(&*alloc, shape, loads)?);
        alloc.free_reusable(None).map_err(|e| e.message)?;
    }
    let titles = [
        "PyTorch's policy (free = driver's)",
        "resmem (free = driver's + cache)",
    ];
    let side: Vec<(&str, &demo::Run)> = titles.iter().copied().zip(runs.iter()).collect();
    println!();
    print!("{}", demo::table(&side));
    println!();
    // PyTorch's own answer to fragmentation, for comparison: its policy with expandable
    // segments (a stream's memory in one range grown by 20 MiB handles), from a bare device.
    let driver: Arc<dyn Driver> = match &gpu {
        Some(d) => d.clone(),
        None => Arc::new(PageHandles::with_part(
            SimDriver::new(env.simulated(&[device_memory])).map_err(|e| e.message)?,
            env.settings.handle_part,
        )),
    };
    let expandable = baseline::TorchAllocator::new(
        driver,
        baseline::TorchConfig {
            expandable_segments: true,
            ..baseline::TorchConfig::default()
        },
    )
    .map_err(|e| e.message)?;
    let expandable_run = demo::run(&expandable, shape, loads)?;
    expandable.free_reusable(None).map_err(|e| e.message)?;
    for (title, run) in [
        ("PyTorch's policy", &runs[0]),
        (
            "PyTorch's policy with expandable_segments:True",
            &expandable_run,
        ),
        ("resmem", &runs[1]),
    ] {
        println!("{}", demo::summary(title, run, one_warmup));
    }
    if let Some(out) = plot_to {
        let outcomes: Vec<Outcome> = policies
            .iter()
            .zip(&runs)
            .map(|(&policy, run)| demo::outcome(policy, run))
            .collect();
        let title = format!(
            "{} loads of {}: reserved and allocated memory",
            loads, shape.name
        );
        let svg = plot::svg(&title, &outcomes)?;
        std::fs::write(out, svg).map_err(|e| format!("cannot write {}: {e}", out.display()))?;
        println!("plot written to {}", out.display());
    }
    Ok(())
}

fn run_replay(
    path: &Path,
    (device, torch_conf): (Option<usize>, Option<&str>),
    which: Which,
    device_memory: Option<u64>,
    plot_to: Option<&Path>,
    (min_device, json): (bool, bool),
    how: replay::How,
) -> Result<(), String> {
    let mut trace = Trace::read(path, device)?;
    if let Some(conf) = torch_conf {
        trace.torch_settings = Some(baseline::conf::parse(conf)?);
    }
    let memory = device_memory.unwrap_or_else(|| trace.default_device_memory());
    if !json {
        // Another device than the one asked for (or 0) is said: it was picked.
        let of = match device {
            None if trace.device != 0 => format!(
                " of device {} (device 0 has nothing to replay)",
                trace.device
            ),
            _ => String::new(),
        };
        let (ops, allocs) = (trace.events.len(), trace.allocs());
        println!(
            "{}: {ops} operation{}{of} ({allocs} allocation{}) on a simulated {} device",
            trace.name,
            if ops == 1 { "" } else { "s" },
            if allocs == 1 { "" } else { "s" },
            gib_or_mib(memory)
        );
    }
    let policies: &[Policy] = match which {
        Which::Resmem => &[Policy::Resmem],
        Which::ResmemClassic => &[Policy::ResmemClassic],
        Which::ResmemVmm => &[Policy::ResmemVmm],
        Which::ResmemFront => &[Policy::ResmemFront],
        Which::Torch => &[Policy::Torch],
        Which::Both => &[Policy::Torch, Policy::Resmem],
        Which::All => &[Policy::Torch, Policy::ResmemClassic, Policy::ResmemVmm],
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
        outcomes.push(replay::replay_logged(&trace, policy, memory, how, |n| {
            bar.set_position(n)
        })?);
        bar.finish_and_clear();
    }
    let mut smallest = Vec::new();
    if min_device {
        for o in &outcomes {
            smallest.push(replay::min_device(&trace, o.policy, memory)?);
        }
    }
    if json {
        println!("{}", report::json(&trace, &outcomes, &smallest));
        return Ok(());
    }
    print!("{}", report::table(&trace, &outcomes, &smallest));
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
        std::fs::create_dir_all(&dir)
            .map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
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
