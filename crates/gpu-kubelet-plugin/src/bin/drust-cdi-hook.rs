//! `drust-cdi-hook`: the plugin's CDI `createRuntime` hooks. The container runtime runs it on the
//! host with the container's OCI state on stdin.
//! - `memory-limit` (the `kernel` enforcement level): sets the share's GPU memory limit on the
//!   container's cgroup ([`gpu_kubelet_plugin::memory_limits`]). Exits 1 with the reason on
//!   stderr when it cannot, so the runtime does not start the container.
//! - `claim-user` (claims reserved for no pod): records the container's pod
//!   ([`gpu_kubelet_plugin::claim_users`]); always exits 0.

use std::path::Path;

use gpu_inventory::{FakeBackend, GpuBackend, NvmlBackend};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    if args.first().map(String::as_str) == Some(gpu_kubelet_plugin::claim_users::CLAIM_USER_COMMAND)
    {
        // Never fails the container: a missing record only leaves a pod unnamed in /usage.
        if let Err(e) = gpu_kubelet_plugin::claim_users::run_hook(&args, std::io::stdin().lock()) {
            eprintln!("drust-cdi-hook: {e}");
        }
        return;
    }
    let result = gpu_kubelet_plugin::memory_limits::run_hook(
        &args,
        std::io::stdin().lock(),
        Path::new("/proc"),
        |library, fake| -> Result<Box<dyn GpuBackend>, String> {
            match fake {
                Some((topology, state_dir)) => {
                    let mut backend =
                        FakeBackend::from_file(topology).map_err(|e| e.to_string())?;
                    if let Some(dir) = state_dir {
                        backend = backend.with_state_dir(dir);
                    }
                    Ok(Box::new(backend))
                }
                None => NvmlBackend::load(library.map(Path::as_os_str), "/sys".into())
                    .map(|b| Box::new(b) as Box<dyn GpuBackend>)
                    .map_err(|e| e.to_string()),
            }
        },
    );
    if let Err(e) = result {
        eprintln!("drust-cdi-hook: {e}");
        std::process::exit(1);
    }
}
