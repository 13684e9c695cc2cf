//! Loads `libcuda_sim.so` with `dlopen`, as a program would load
//! `libcuda.so.1`, and checks the exported driver API.
//!
//! Everything runs in one test function: the library's state (one
//! process-wide simulator configured from the environment) is shared.

use std::ffi::{c_char, c_int, c_uint, c_void, CStr, CString};
use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;

extern "C" {
    fn dlopen(filename: *const c_char, flags: c_int) -> *mut c_void;
    fn dlsym(handle: *mut c_void, symbol: *const c_char) -> *mut c_void;
    fn dlerror() -> *mut c_char;
}

const RTLD_NOW: c_int = 2;
const RTLD_LOCAL: c_int = 0;

type Ptr = *mut c_void;

/// Builds the cdylib (cargo does not build it for another package's tests)
/// and returns its path.
fn library_path() -> &'static PathBuf {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let workspace = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .parent()
            .expect("cuda-sim lives inside the workspace")
            .to_path_buf();
        let mut cmd = Command::new(env!("CARGO"));
        cmd.current_dir(&workspace)
            .args(["build", "-p", "libcuda-sim"]);
        if !cfg!(debug_assertions) {
            cmd.arg("--release");
        }
        let status = cmd
            .status()
            .unwrap_or_else(|e| panic!("could not run `cargo build -p libcuda-sim`: {e}"));
        assert!(
            status.success(),
            "`cargo build -p libcuda-sim` failed ({status}); libcuda_sim.so cannot be tested"
        );
        let exe = std::env::current_exe().expect("test binary path");
        // target/<profile>/deps/<test binary> -> target/<profile>/
        let dir = exe
            .parent()
            .and_then(|deps| deps.parent())
            .expect("test binary lives in target/<profile>/deps");
        let path = dir.join("libcuda_sim.so");
        assert!(path.exists(), "{} was not built", path.display());
        path
    })
}

struct Lib(Ptr);

impl Lib {
    fn open() -> Lib {
        let path = CString::new(library_path().to_str().expect("UTF-8 path")).unwrap();
        // SAFETY: `path` is a valid NUL-terminated string; loading the library
        // runs no initializers beyond Rust's own.
        let handle = unsafe { dlopen(path.as_ptr(), RTLD_NOW | RTLD_LOCAL) };
        if handle.is_null() {
            // SAFETY: dlerror returns NULL or a valid C string.
            let msg = unsafe {
                let e = dlerror();
                if e.is_null() {
                    "unknown".to_string()
                } else {
                    CStr::from_ptr(e).to_string_lossy().into_owned()
                }
            };
            panic!("dlopen({path:?}) failed: {msg}");
        }
        Lib(handle)
    }

    /// Resolves `name` as a function pointer of type `F`.
    ///
    /// # Safety
    /// `F` must be the `extern "C"` function pointer type of the symbol.
    unsafe fn sym<F: Copy>(&self, name: &str) -> F {
        assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<Ptr>());
        let c = CString::new(name).unwrap();
        // SAFETY: the handle is live and `c` is NUL-terminated.
        let p = unsafe { dlsym(self.0, c.as_ptr()) };
        assert!(!p.is_null(), "symbol {name} is not exported");
        // SAFETY: the caller guarantees `F` is the symbol's function type and
        // the sizes match (checked above).
        unsafe { std::mem::transmute_copy(&p) }
    }
}

type FnU = unsafe extern "C" fn(c_uint) -> c_int;
type FnPInt = unsafe extern "C" fn(*mut c_int) -> c_int;
type FnPIntInt = unsafe extern "C" fn(*mut c_int, c_int) -> c_int;
type FnName = unsafe extern "C" fn(*mut c_char, c_int, c_int) -> c_int;
type FnTotal = unsafe extern "C" fn(*mut usize, c_int) -> c_int;
type FnRetain = unsafe extern "C" fn(*mut Ptr, c_int) -> c_int;
type FnInt = unsafe extern "C" fn(c_int) -> c_int;
type FnPtr = unsafe extern "C" fn(Ptr) -> c_int;
type FnPPtr = unsafe extern "C" fn(*mut Ptr) -> c_int;
type FnVoid = unsafe extern "C" fn() -> c_int;
type FnInfo = unsafe extern "C" fn(*mut usize, *mut usize) -> c_int;
type FnAlloc = unsafe extern "C" fn(*mut u64, usize) -> c_int;
type FnFree = unsafe extern "C" fn(u64) -> c_int;
type FnCreate = unsafe extern "C" fn(*mut Ptr, c_uint) -> c_int;
type FnWait = unsafe extern "C" fn(Ptr, Ptr, c_uint) -> c_int;
type FnRecord = unsafe extern "C" fn(Ptr, Ptr) -> c_int;
type FnErr = unsafe extern "C" fn(c_int, *mut *const c_char) -> c_int;
type FnStat = unsafe extern "C" fn(c_int) -> u64;

const GIB: usize = 1 << 30;
const PAGE: usize = 2 << 20;

#[test]
fn driver_api_through_dlopen() {
    // The library reads the variable on first use, after this point; nothing
    // else in this test binary reads the environment concurrently.
    std::env::set_var("CUDA_SIM_DEVICES", "24GiB,8GiB");
    let lib = Lib::open();
    // SAFETY: every type below matches the exported function's C signature,
    // and every pointer passed is valid for the access the function makes.
    unsafe {
        let cu_init: FnU = lib.sym("cuInit");
        let version: FnPInt = lib.sym("cuDriverGetVersion");
        let count: FnPInt = lib.sym("cuDeviceGetCount");
        let device_get: FnPIntInt = lib.sym("cuDeviceGet");
        let get_name: FnName = lib.sym("cuDeviceGetName");
        let total_mem: FnTotal = lib.sym("cuDeviceTotalMem_v2");
        let retain: FnRetain = lib.sym("cuDevicePrimaryCtxRetain");
        let release: FnInt = lib.sym("cuDevicePrimaryCtxRelease_v2");
        let push: FnPtr = lib.sym("cuCtxPushCurrent_v2");
        let pop: FnPPtr = lib.sym("cuCtxPopCurrent_v2");
        let get_current: FnPPtr = lib.sym("cuCtxGetCurrent");
        let set_current: FnPtr = lib.sym("cuCtxSetCurrent");
        let ctx_device: FnPInt = lib.sym("cuCtxGetDevice");
        let ctx_sync: FnVoid = lib.sym("cuCtxSynchronize");
        let mem_info: FnInfo = lib.sym("cuMemGetInfo_v2");
        let mem_alloc: FnAlloc = lib.sym("cuMemAlloc_v2");
        let mem_free: FnFree = lib.sym("cuMemFree_v2");
        let stream_create: FnCreate = lib.sym("cuStreamCreate");
        let stream_destroy: FnPtr = lib.sym("cuStreamDestroy_v2");
        let stream_sync: FnPtr = lib.sym("cuStreamSynchronize");
        let stream_query: FnPtr = lib.sym("cuStreamQuery");
        let stream_wait: FnWait = lib.sym("cuStreamWaitEvent");
        let event_create: FnCreate = lib.sym("cuEventCreate");
        let event_record: FnRecord = lib.sym("cuEventRecord");
        let event_query: FnPtr = lib.sym("cuEventQuery");
        let event_sync: FnPtr = lib.sym("cuEventSynchronize");
        let event_destroy: FnPtr = lib.sym("cuEventDestroy_v2");
        let error_name: FnErr = lib.sym("cuGetErrorName");
        let error_string: FnErr = lib.sym("cuGetErrorString");
        let enqueue: FnPtr = lib.sym("cudasim_enqueue_work");
        let complete: FnPtr = lib.sym("cudasim_complete_work");
        let used_bytes: FnStat = lib.sym("cudasim_used_bytes");
        let live_allocs: FnStat = lib.sym("cudasim_live_allocations");

        let name_of = |code: c_int| {
            let mut s: *const c_char = std::ptr::null();
            assert_eq!(error_name(code, &mut s), 0, "cuGetErrorName({code})");
            CStr::from_ptr(s).to_str().unwrap().to_owned()
        };

        // Before cuInit.
        let mut n: c_int = 0;
        let mut ctx: Ptr = std::ptr::null_mut();
        let mut dptr: u64 = 0;
        assert_eq!(version(&mut n), 0);
        assert_eq!(n, 12040);
        assert_eq!(count(&mut n), 3);
        assert_eq!(retain(&mut ctx, 0), 3);
        assert_eq!(mem_alloc(&mut dptr, 1), 3);
        assert_eq!(name_of(3), "CUDA_ERROR_NOT_INITIALIZED");

        // Error strings.
        assert_eq!(name_of(0), "CUDA_SUCCESS");
        assert_eq!(name_of(2), "CUDA_ERROR_OUT_OF_MEMORY");
        assert_eq!(name_of(201), "CUDA_ERROR_INVALID_CONTEXT");
        let mut s: *const c_char = std::ptr::null();
        assert_eq!(error_string(2, &mut s), 0);
        assert_eq!(CStr::from_ptr(s).to_str().unwrap(), "out of memory");
        s = c"sentinel".as_ptr();
        assert_eq!(error_name(123_456, &mut s), 1);
        assert!(s.is_null(), "unknown code sets *pStr = NULL");
        assert_eq!(error_string(-5, std::ptr::null_mut()), 1);

        // cuInit.
        assert_eq!(cu_init(1), 1);
        assert_eq!(cu_init(0), 0);
        assert_eq!(cu_init(0), 0);
        assert_eq!(version(std::ptr::null_mut()), 1);
        assert_eq!(count(&mut n), 0);
        assert_eq!(n, 2);
        let mut dev: c_int = -1;
        assert_eq!(device_get(&mut dev, 1), 0);
        assert_eq!(dev, 1);
        assert_eq!(device_get(&mut dev, 2), 101);
        assert_eq!(device_get(std::ptr::null_mut(), 0), 1);
        let mut buf = [0 as c_char; 64];
        assert_eq!(get_name(buf.as_mut_ptr(), 64, 0), 0);
        assert_eq!(
            CStr::from_ptr(buf.as_ptr()).to_str().unwrap(),
            "cuda-sim device 0 (24 GiB)"
        );
        assert_eq!(get_name(buf.as_mut_ptr(), 9, 1), 0);
        assert_eq!(CStr::from_ptr(buf.as_ptr()).to_str().unwrap(), "cuda-sim");
        assert_eq!(get_name(buf.as_mut_ptr(), 0, 0), 1);
        assert_eq!(get_name(buf.as_mut_ptr(), 64, 7), 101);
        let mut total: usize = 0;
        assert_eq!(total_mem(&mut total, 1), 0);
        assert_eq!(total, 8 * GIB);

        // Context rules: nothing current yet.
        let mut free: usize = 0;
        assert_eq!(mem_alloc(&mut dptr, 1), 201);
        assert_eq!(mem_info(&mut free, &mut total), 201);
        assert_eq!(ctx_sync(), 201);
        assert_eq!(ctx_device(&mut dev), 201);
        assert_eq!(pop(&mut ctx), 201);
        assert_eq!(stream_sync(std::ptr::null_mut()), 201);
        assert_eq!(get_current(&mut ctx), 0);
        assert!(ctx.is_null());

        // Primary contexts: the same handle per device, refcounted.
        let mut ctx0: Ptr = std::ptr::null_mut();
        let mut ctx0b: Ptr = std::ptr::null_mut();
        let mut ctx1: Ptr = std::ptr::null_mut();
        assert_eq!(retain(&mut ctx0, 0), 0);
        assert_eq!(retain(&mut ctx0b, 0), 0);
        assert_eq!(retain(&mut ctx1, 1), 0);
        assert_eq!(retain(std::ptr::null_mut(), 0), 1);
        assert_eq!(retain(&mut ctx, 5), 101);
        assert!(!ctx0.is_null() && ctx0 == ctx0b && ctx0 != ctx1);
        assert_eq!(push(std::ptr::null_mut()), 201);
        assert_eq!(push(0x1234 as Ptr), 201);

        assert_eq!(push(ctx0), 0);
        assert_eq!(get_current(&mut ctx), 0);
        assert_eq!(ctx, ctx0);
        assert_eq!(ctx_device(&mut dev), 0);
        assert_eq!(dev, 0);

        // Alloc / free / mem info on device 0.
        assert_eq!(mem_info(&mut free, &mut total), 0);
        assert_eq!((free, total), (24 * GIB, 24 * GIB));
        assert_eq!(mem_info(std::ptr::null_mut(), &mut total), 1);
        assert_eq!(mem_alloc(std::ptr::null_mut(), 1), 1);
        assert_eq!(mem_alloc(&mut dptr, 0), 1);
        assert_eq!(mem_alloc(&mut dptr, 1), 0);
        assert_ne!(dptr, 0);
        assert_eq!(dptr as usize % PAGE, 0);
        assert_eq!(used_bytes(0), PAGE as u64);
        assert_eq!(live_allocs(0), 1);
        assert_eq!(mem_info(&mut free, &mut total), 0);
        assert_eq!(free, 24 * GIB - PAGE);
        let mut big: Vec<u64> = Vec::new();
        loop {
            let mut p = 0;
            match mem_alloc(&mut p, 2 * GIB) {
                0 => big.push(p),
                2 => break,
                other => panic!("unexpected {other}"),
            }
        }
        assert_eq!(
            big.len(),
            11,
            "24 GiB less one page holds eleven 2 GiB blocks"
        );
        for p in big {
            assert_eq!(mem_free(p), 0);
        }
        assert_eq!(mem_free(dptr + 1), 1);
        assert_eq!(mem_free(dptr), 0);
        assert_eq!(mem_free(dptr), 1);
        assert_eq!(used_bytes(0), 0);
        assert_eq!(live_allocs(0), 0);

        // Switch to device 1 with cuCtxSetCurrent; free a device-0 pointer
        // from there.
        assert_eq!(mem_alloc(&mut dptr, 3 * PAGE), 0);
        assert_eq!(set_current(ctx1), 0);
        assert_eq!(ctx_device(&mut dev), 0);
        assert_eq!(dev, 1);
        let mut p1 = 0;
        assert_eq!(mem_alloc(&mut p1, 1), 0);
        assert_eq!(used_bytes(1), PAGE as u64);
        assert_eq!(mem_info(&mut free, &mut total), 0);
        assert_eq!((free, total), (8 * GIB - PAGE, 8 * GIB));
        assert_eq!(mem_free(dptr), 0);
        assert_eq!(mem_free(p1), 0);
        assert_eq!(used_bytes(0) + used_bytes(1), 0);

        // Streams and events on device 1.
        let mut s1: Ptr = std::ptr::null_mut();
        let mut s2: Ptr = std::ptr::null_mut();
        let mut e: Ptr = std::ptr::null_mut();
        assert_eq!(stream_create(&mut s1, 0), 0);
        assert_eq!(stream_create(&mut s2, 1), 0);
        assert_eq!(stream_create(&mut s2, 4), 1);
        assert_eq!(stream_create(&mut s2, 1), 0);
        assert_eq!(event_create(&mut e, 2), 0);
        assert_eq!(event_create(&mut e, 0x100), 1);
        assert!(!s1.is_null() && !e.is_null() && s1 != s2 && s1 != e);
        assert_eq!(event_query(e), 0);
        assert_eq!(enqueue(s1), 0);
        assert_eq!(stream_query(s1), 600);
        assert_eq!(event_record(e, s1), 0);
        assert_eq!(event_query(e), 600);
        assert_eq!(stream_wait(s2, e, 1), 1);
        assert_eq!(stream_wait(s2, e, 0), 0);
        assert_eq!(enqueue(s2), 0);
        assert_eq!(complete(s2), 0);
        assert_eq!(event_query(e), 0, "s2's work completed s1's first");
        assert_eq!(stream_query(s1), 0);
        assert_eq!(enqueue(std::ptr::null_mut()), 0);
        assert_eq!(stream_query(std::ptr::null_mut()), 600);
        assert_eq!(event_record(e, std::ptr::null_mut()), 0);
        assert_eq!(event_sync(e), 0);
        assert_eq!(stream_query(std::ptr::null_mut()), 0);
        assert_eq!(enqueue(s1), 0);
        assert_eq!(ctx_sync(), 0);
        assert_eq!(stream_query(s1), 0);
        assert_eq!(enqueue(s1), 0);
        assert_eq!(stream_sync(s1), 0);
        assert_eq!(stream_query(s1), 0);
        // Event of device 1, NULL stream of device 0: different contexts.
        assert_eq!(push(ctx0), 0);
        assert_eq!(event_record(e, std::ptr::null_mut()), 400);
        assert_eq!(
            event_record(e, s1),
            0,
            "explicit stream of the event's device"
        );
        assert_eq!(pop(std::ptr::null_mut()), 0);
        assert_eq!(stream_destroy(s1), 0);
        assert_eq!(stream_destroy(s1), 400);
        assert_eq!(stream_destroy(std::ptr::null_mut()), 400);
        assert_eq!(stream_query(s1), 400);
        assert_eq!(stream_destroy(s2), 0);
        assert_eq!(event_destroy(e), 0);
        assert_eq!(event_destroy(e), 400);
        assert_eq!(event_query(e), 400);

        // Contexts are per thread.
        let other = std::thread::spawn(move || {
            let mut p: u64 = 0;
            let mut c: Ptr = 1 as Ptr;
            let r1 = mem_alloc(&mut p, 1);
            let r2 = get_current(&mut c);
            (r1, r2, c.is_null())
        })
        .join()
        .unwrap();
        assert_eq!(other, (201, 0, true));

        // Pop everything; release the primary contexts.
        assert_eq!(pop(&mut ctx), 0);
        assert_eq!(ctx, ctx1);
        assert_eq!(get_current(&mut ctx), 0);
        assert!(ctx.is_null());
        assert_eq!(set_current(std::ptr::null_mut()), 0);
        assert_eq!(push(ctx0), 0);
        assert_eq!(release(0), 0);
        assert_eq!(mem_alloc(&mut dptr, 1), 0, "still retained once");
        assert_eq!(release(0), 0);
        assert_eq!(mem_alloc(&mut p1, 1), 201, "released context is not usable");
        assert_eq!(release(0), 201);
        assert_eq!(release(9), 101);
        assert_eq!(retain(&mut ctx, 0), 0);
        assert_eq!(ctx, ctx0);
        assert_eq!(mem_free(dptr), 0);
        assert_eq!(set_current(std::ptr::null_mut()), 0);
        assert_eq!(get_current(&mut ctx), 0);
        assert!(ctx.is_null());
        assert_eq!(release(0), 0);
        assert_eq!(release(1), 0);
        assert_eq!(used_bytes(0) + used_bytes(1), 0);
        assert_eq!(live_allocs(0), 0);
        assert_eq!(used_bytes(7), 0);
    }
}
