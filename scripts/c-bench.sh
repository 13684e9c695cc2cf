# Sourced by the C benchmarks (bench-c.sh, bench-misses.sh, bench-trace.sh), from the
# repository's root.
#
# c_bench_build NAME DIR: builds the release library and the simulated driver library, compiles
# benches/c/NAME.c into DIR/NAME against the shipped libresmem.so (linked beside it under its
# SONAME, libresmem.so.0, where the program finds it), and points the library at the simulated
# driver as libcuda.so.1 (RESMEM_DRIVER=cuda).
c_bench_build() {
  cargo build --release -q -p resmem -p libcuda-sim
  mkdir -p "$2"
  ln -sf "$PWD/target/release/libresmem.so" "$2/libresmem.so.0"
  gcc -O2 -std=c11 -Wall -Wextra -Iinclude "benches/c/$1.c" -o "$2/$1" \
    -Ltarget/release -lresmem -Wl,-rpath,"$PWD/$2" -lpthread -ldl
  export RESMEM_DRIVER=cuda RESMEM_CUDA_LIBRARY="$PWD/target/release/libcuda_sim.so"
}
