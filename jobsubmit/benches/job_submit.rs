//! Benchmark: the cost of one `job_submit` call of the real plugin entry point, on realistic
//! job descriptions, with Slurm's own allocator (libslurmfull loaded into this process the
//! way slurmctld has it). Prints the median and 90th percentile per kind of job; the target is
//! under 20 µs median.
//!
//! cargo bench -p job_submit_multiplex --bench job_submit [-- CALLS]

use job_submit_multiplex as plugin;
use libc::c_char;
use slurm_ffi::bindings::job_desc_msg_t;
use slurm_ffi::host;
use std::ffi::CString;
use std::time::Instant;

const LIBSLURMFULL: &str = "/usr/lib/x86_64-linux-gnu/slurm-wlm/libslurmfull.so";

type InitJobDesc = unsafe extern "C" fn(*mut job_desc_msg_t);

/// A job description as sbatch sends it, with Slurm-allocated strings the plugin may replace.
struct Kind {
    name: &'static str,
    spank_env: Vec<&'static str>,
    partition: Option<&'static str>,
    tres_per_node: Option<&'static str>,
    tres_per_job: Option<&'static str>,
    cpus_per_tres: Option<&'static str>,
}

fn kinds() -> Vec<Kind> {
    let flag = "_SLURM_SPANK_OPTION_multiplex_multiplex=app=resnet50-bs64,mem=12G";
    let other = "_SLURM_SPANK_OPTION_x11_x11=batch";
    vec![
        Kind {
            name: "multiplexed --gres=gpu:1",
            spank_env: vec![other, flag],
            partition: None,
            tres_per_node: Some("gres:gpu:1"),
            tres_per_job: None,
            cpus_per_tres: None,
        },
        Kind {
            name: "multiplexed --gpus=1 --cpus-per-gpu=4",
            spank_env: vec![flag],
            partition: Some("gpu,shared"),
            tres_per_node: None,
            tres_per_job: Some("gres:gpu:v100:1"),
            cpus_per_tres: Some("gres:gpu:4"),
        },
        Kind {
            name: "plain --gres=gpu:2 (untouched)",
            spank_env: vec![other],
            partition: Some("gpu"),
            tres_per_node: Some("gres:gpu:2"),
            tres_per_job: None,
            cpus_per_tres: None,
        },
        Kind {
            name: "plain CPU job (untouched)",
            spank_env: vec![],
            partition: None,
            tres_per_node: None,
            tres_per_job: None,
            cpus_per_tres: None,
        },
    ]
}

fn dup(s: Option<&str>) -> *mut c_char {
    s.map_or(std::ptr::null_mut(), host::xstrdup)
}

fn main() {
    let calls: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(20_000);
    let lib = CString::new(LIBSLURMFULL).unwrap();
    // SAFETY: loading Slurm's library; RTLD_GLOBAL puts its symbols where the plugin's
    // dlsym(RTLD_DEFAULT) looks, as in slurmctld.
    let handle = unsafe { libc::dlopen(lib.as_ptr(), libc::RTLD_NOW | libc::RTLD_GLOBAL) };
    assert!(
        !handle.is_null(),
        "cannot load {LIBSLURMFULL} (apt-get install libslurm-dev?)"
    );
    // SAFETY: the symbol is slurm_init_job_desc_msg(job_desc_msg_t *).
    let init_desc: InitJobDesc = unsafe {
        let p = libc::dlsym(handle, c"slurm_init_job_desc_msg".as_ptr());
        assert!(!p.is_null());
        std::mem::transmute::<*mut libc::c_void, InitJobDesc>(p)
    };
    let policy = concat!(env!("CARGO_MANIFEST_DIR"), "/../etc/job_submit_multiplex.toml");
    std::env::set_var(plugin::policy::PATH_ENV, policy);
    assert_eq!(plugin::init(), 0);

    let kinds = kinds();
    let mut samples: Vec<Vec<f64>> = vec![Vec::with_capacity(calls); kinds.len()];
    let mut rewritten = vec![0usize; kinds.len()];
    // Interleaved in rounds so that noise falls on every kind alike.
    let round = 500;
    for _ in 0..calls.div_ceil(round) {
        for (k, kind) in kinds.iter().enumerate() {
            let env: Vec<CString> = kind.spank_env.iter().map(|e| CString::new(*e).unwrap()).collect();
            let mut env_ptrs: Vec<*mut c_char> = env.iter().map(|e| e.as_ptr() as *mut c_char).collect();
            for _ in 0..round {
                // SAFETY: all-zero is a valid job_desc_msg_t (null pointers, zero numbers), which
                // slurm_init_job_desc_msg then sets to "not given", as sbatch's arrives.
                let mut desc: job_desc_msg_t = unsafe {
                    let mut d = std::mem::zeroed();
                    init_desc(&mut d);
                    d
                };
                desc.user_id = 1000;
                desc.name = host::xstrdup("train");
                desc.partition = dup(kind.partition);
                desc.tres_per_node = dup(kind.tres_per_node);
                desc.tres_per_job = dup(kind.tres_per_job);
                desc.cpus_per_tres = dup(kind.cpus_per_tres);
                desc.spank_job_env = env_ptrs.as_mut_ptr();
                desc.spank_job_env_size = env_ptrs.len() as u32;
                let mut err: *mut c_char = std::ptr::null_mut();

                let t = Instant::now();
                // SAFETY: the entry point slurmctld calls, with a valid description.
                let rc = unsafe { plugin::job_submit(&mut desc, 1000, &mut err) };
                samples[k].push(t.elapsed().as_secs_f64() * 1e6);

                assert_eq!(rc, 0, "{}: rejected", kind.name);
                if !desc.admin_comment.is_null() {
                    rewritten[k] += 1;
                }
                // SAFETY: every field is NULL or allocated by Slurm's allocator.
                unsafe {
                    for f in [
                        &mut desc.name,
                        &mut desc.partition,
                        &mut desc.admin_comment,
                        &mut desc.tres_per_node,
                        &mut desc.tres_per_job,
                        &mut desc.tres_per_task,
                        &mut desc.tres_per_socket,
                        &mut desc.cpus_per_tres,
                        &mut desc.mem_per_tres,
                        &mut err,
                    ] {
                        host::xfree(f);
                    }
                }
            }
        }
    }
    println!("job_submit/multiplex: one job_submit call, {calls} calls per kind, interleaved");
    println!("{:<40} {:>10} {:>10} {:>10}", "job", "median µs", "p90 µs", "rewritten");
    for (k, kind) in kinds.iter().enumerate() {
        let s = &mut samples[k];
        s.sort_by(f64::total_cmp);
        let at = |q: f64| s[((s.len() as f64 * q) as usize).min(s.len() - 1)];
        println!(
            "{:<40} {:>10.2} {:>10.2} {:>10}",
            kind.name,
            at(0.5),
            at(0.9),
            format!("{}/{}", rewritten[k], s.len())
        );
    }
    println!("target: under 20 µs median per call");
}
