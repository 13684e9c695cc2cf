//! `python/native/torch_raise.cpp` and `graph_pools.cpp`, the functions `resmem.torch.install()`
//! gives PyTorch, called as PyTorch calls them (through `std::function` objects made from the raw
//! addresses) by `tests/torch_raise/main.cpp`: a failure is thrown as `std::runtime_error` for
//! PyTorch to raise in Python, an out-of-memory saying "CUDA out of memory.", instead of the NULL
//! that PyTorch would turn into a tensor at address 0; and a graph's memory stays in its pool
//! while a graph uses it.

mod common;

use std::path::Path;
use std::process::Command;

use common::{artifacts, run, Driver};

/// Every `python/native/*.cpp`, as the package's build (`python/setup.py`) compiles them.
fn native_sources(root: &Path) -> Vec<std::path::PathBuf> {
    let dir = root.join("python/native");
    let mut sources: Vec<_> = std::fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
        .map(|entry| entry.expect("a directory entry").path())
        .filter(|path| path.extension().is_some_and(|ext| ext == "cpp"))
        .collect();
    sources.sort();
    assert!(!sources.is_empty(), "no C++ sources in {}", dir.display());
    sources
}

#[test]
fn a_failure_is_thrown_for_pytorch_to_raise_and_a_graphs_memory_stays_in_its_pool() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = common::built_once("torch_raise".into(), || {
        let out = artifacts().work.join("torch_raise");
        let main = root.join("tests/torch_raise/main.cpp");
        let mut cmd = Command::new("g++");
        cmd.args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-I"])
            .arg(root.join("include"))
            .args(native_sources(root))
            .arg(&main)
            .args(["-ldl", "-pthread"]);
        common::link_resmem(&mut cmd, false);
        common::compile(cmd, &main, &out)
    });
    for driver in [Driver::InProcess, Driver::SimLibrary] {
        let library = matches!(driver, Driver::SimLibrary);
        let out = run(&exe, &[], driver, &[]);
        let line = |case: &str| {
            out.lines()
                .find(|l| l.starts_with(&format!("{case}: ")))
                .unwrap_or_else(|| panic!("no line for {case}:\n{out}"))
                .to_string()
        };
        assert!(
            line("before init").contains("threw: resmem: libresmem_torch.so was called before"),
            "{out}"
        );
        assert_eq!(line("init with NULL"), "init with NULL: -1");
        assert_eq!(line("init"), "init: 0");
        assert_eq!(line("1 MiB"), "1 MiB: returned a block");
        assert_eq!(line("0 bytes"), "0 bytes: returned NULL");
        let oom = line("128 MiB past a 64 MiB cap");
        assert!(
            oom.starts_with(
                "128 MiB past a 64 MiB cap: threw: CUDA out of memory. resmem: rm_reserve: "
            ),
            "{oom}"
        );
        assert!(oom.contains("memory limit of 64.00 MiB"), "{oom}");
        let huge = line("more than the address space");
        assert!(
            huge.starts_with("more than the address space: threw: resmem: rm_reserve: "),
            "{huge}"
        );
        assert_eq!(line("32 MiB kept"), "32 MiB kept: allocated 33554432");
        assert_eq!(line("freed"), "freed: allocated 0");
        // A graph's pool: a block freed in the capture stays with the graph (allocated to
        // resmem), serves the capture's later requests, and no allocation after it.
        const MIB: u64 = 1 << 20;
        let alloc = |mib: u64| format!("allocated {}", mib * MIB);
        assert_eq!(
            line("freed in the capture"),
            format!("freed in the capture: {}", alloc(8))
        );
        assert_eq!(
            line("4 MiB in the capture"),
            "4 MiB in the capture: the freed 8 MiB block"
        );
        assert_eq!(
            line("8 MiB after the capture"),
            format!("8 MiB after the capture: another block; {}", alloc(32))
        );
        assert_eq!(
            line("the graph's output freed"),
            format!("the graph's output freed: {}", alloc(24))
        );
        assert_eq!(
            line("others freed"),
            format!(
                "others freed: one in the 8 MiB block's slot: yes; {}",
                alloc(24)
            )
        );
        assert_eq!(
            line("12 MiB in the second capture"),
            "12 MiB in the second capture: the 16 MiB block"
        );
        // The pool lives until the last graph using it is released; then its blocks are
        // retired (its last replay may still run), and go back to resmem at empty_cache.
        assert_eq!(
            line("one graph released"),
            format!("one graph released: {}", alloc(24))
        );
        assert_eq!(
            line("both released"),
            format!("both released: {}", alloc(24))
        );
        assert_eq!(
            line("the last block freed"),
            format!("the last block freed: {}", alloc(24))
        );
        assert_eq!(line("empty_cache"), format!("empty_cache: {}", alloc(0)));
        assert_eq!(line("8 MiB after"), "8 MiB after: the released block");
        if library {
            // New memory for the capture, not the warm-up's block of another stream, whose
            // reuse would order the capturing stream after that stream's work.
            assert_eq!(
                line("real capture"),
                "real capture: begun 0, allocated 64 MiB, ended 0"
            );
            assert_eq!(
                line("after the capture"),
                "after the capture: 1 MiB: returned a block"
            );
            assert_eq!(
                line("real capture released"),
                "real capture released: allocated 0"
            );
        } else {
            assert_eq!(line("real capture"), "real capture: no driver library");
        }
    }
}
