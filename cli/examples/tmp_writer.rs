use resmem::record::Recorder;
use std::time::Instant;
fn cpu_of(name: &str) -> f64 {
    let mut total = 0.0;
    for t in std::fs::read_dir("/proc/self/task").unwrap() {
        let p = t.unwrap().path();
        let comm = std::fs::read_to_string(p.join("comm")).unwrap();
        if comm.trim() == name {
            let stat = std::fs::read_to_string(p.join("stat")).unwrap();
            let f: Vec<&str> = stat
                .rsplit(')')
                .next()
                .unwrap()
                .split_whitespace()
                .collect();
            total += (f[11].parse::<f64>().unwrap() + f[12].parse::<f64>().unwrap()) / 100.0;
        }
    }
    total
}
fn main() {
    let r = Recorder::open("/dev/null", None).unwrap();
    let n = 5_000_000u64;
    let t = Instant::now();
    for k in 0..n {
        r.alloc(0, 512, 0, 0x7f00_0000_0000 + 512 * (k & 1023));
        r.release(0x7f00_0000_0000 + 512 * (k & 1023), || Ok(()))
            .unwrap();
    }
    r.flush();
    let wall = t.elapsed().as_secs_f64();
    let w = cpu_of("resmem-record");
    println!(
        "wall {:.1} ns/pair; writer cpu {:.1} ns/record",
        wall * 1e9 / n as f64,
        w * 1e9 / (2 * n) as f64
    );
}
