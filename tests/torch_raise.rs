//! `python/native/torch_raise.cpp`, the allocation functions `resmem.torch.install()` gives
//! PyTorch, called as PyTorch calls them (through a `std::function` made from the raw address)
//! by `tests/torch_raise/main.cpp`: a failure is thrown as `std::runtime_error` for PyTorch to
//! raise in Python, an out-of-memory saying "CUDA out of memory.", instead of the NULL that
//! PyTorch would turn into a tensor at address 0.

mod common;

use std::path::Path;
use std::process::Command;

use common::{artifacts, run, Driver};

#[test]
fn a_failure_is_thrown_for_pytorch_to_raise_and_a_success_is_rm_torch_malloc() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let exe = common::built_once("torch_raise".into(), || {
        let out = artifacts().work.join("torch_raise");
        let main = root.join("tests/torch_raise/main.cpp");
        let mut cmd = Command::new("g++");
        cmd.args(["-std=c++17", "-Wall", "-Wextra", "-Werror", "-I"])
            .arg(root.join("include"))
            .arg(root.join("python/native/torch_raise.cpp"))
            .arg(&main);
        common::link_resmem(&mut cmd, false);
        common::compile(cmd, &main, &out)
    });
    for driver in [Driver::InProcess, Driver::SimLibrary] {
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
    }
}
