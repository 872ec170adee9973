//! `job_submit/multiplex`: the slurmctld plugin. This file is only the FFI shell: it copies
//! the job description into a [`rewrite::JobView`], asks [`rewrite::decide`], and writes the
//! answer back with Slurm's allocator. It runs with slurmctld's locks held: no I/O here
//! besides a `stat` of the policy file once a second, and
//! reading it when it changed.

pub mod modify;
pub mod plain;
pub mod policy;
pub mod rewrite;
pub mod tres;
pub mod view;

use libc::{c_char, c_int};
use policy::{Change, Policy, Watcher};
use rewrite::{JobView, Outcome, RejectKind, Rewrite};
use slurm_ffi::bindings::{self, job_desc_msg_t};
use slurm_ffi::{c_str, host, log};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

slurm_ffi::slurm_plugin!(
    "Multiplex: route --multiplex jobs to shared GPUs",
    "job_submit/multiplex"
);

const PREFIX: &str = "job_submit/multiplex";

/// How often job_submit looks at the policy file for changes (one `stat`).
const POLICY_CHECK: Duration = Duration::from_secs(1);

/// The policy in force (`None` after a broken policy file with no earlier good one) and the
/// watcher of its file. Calls may come concurrently (23.02+); the lock is held for a clock
/// read, and for a `stat` once a second.
struct State {
    policy: Option<Arc<Policy>>,
    watcher: Watcher,
}

static STATE: Mutex<Option<State>> = Mutex::new(None);

fn state() -> MutexGuard<'static, Option<State>> {
    STATE.lock().unwrap_or_else(|p| p.into_inner())
}

/// The policy to apply now, after reading the file if it changed.
fn current_policy(force: bool) -> Option<Arc<Policy>> {
    let mut guard = state();
    let st = guard.get_or_insert_with(|| State {
        policy: None,
        watcher: Watcher::new(Policy::path(), POLICY_CHECK),
    });
    let change = st.watcher.poll(Instant::now(), force, policy::SYSTEM);
    let path = st.watcher.path().display().to_string();
    match change {
        Change::Unchanged => {}
        Change::Loaded(Some((p, warnings))) => {
            log::info(&format!("{PREFIX}: policy from {path}: {}", p.summary()));
            for w in warnings {
                log::error(&format!("{PREFIX}: {path}: {w}"));
            }
            st.policy = Some(Arc::new(p));
        }
        Change::Loaded(None) => {
            let p = Policy::default();
            log::info(&format!(
                "{PREFIX}: no policy file at {path}; using the defaults: {}",
                p.summary()
            ));
            st.policy = Some(Arc::new(p));
        }
        Change::Broken(e) if st.policy.is_some() => log::error(&format!("{PREFIX}: {e}; keeping the previous policy")),
        Change::Broken(e) => log::error(&format!(
            "{PREFIX}: {e}; multiplexed jobs pass unchanged until it is fixed"
        )),
    }
    st.policy.clone()
}

/// Called when slurmctld loads the plugin (start and reconfigure): reads the policy.
#[no_mangle]
pub extern "C" fn init() -> c_int {
    slurm_ffi::guard(PREFIX, "init", bindings::SLURM_SUCCESS as c_int, || {
        current_policy(true);
        bindings::SLURM_SUCCESS as c_int
    })
}

/// Called when slurmctld unloads the plugin.
#[no_mangle]
pub extern "C" fn fini() -> c_int {
    bindings::SLURM_SUCCESS as c_int
}

/// `int job_submit(job_desc_msg_t *, uint32_t submit_uid, char **err_msg)`.
/// # Safety
/// Called by Slurm with the pointers its plugin API documents.
#[no_mangle]
pub unsafe extern "C" fn job_submit(
    job_desc: *mut job_desc_msg_t,
    submit_uid: u32,
    err_msg: *mut *mut c_char,
) -> c_int {
    slurm_ffi::guard(PREFIX, "job_submit", bindings::SLURM_ERROR, || {
        if job_desc.is_null() {
            return bindings::SLURM_SUCCESS as c_int;
        }
        // SAFETY: slurmctld passes a valid job description it owns for the duration of the call.
        let desc = unsafe { &mut *job_desc };
        submit(desc, submit_uid, err_msg)
    })
}

fn submit(desc: &mut job_desc_msg_t, submit_uid: u32, err_msg: *mut *mut c_char) -> c_int {
    // SAFETY: the pointers in `desc` are Slurm's strings and string array, valid during the call.
    let mut view = unsafe { view_of(desc) };
    let Some(policy) = current_policy(false) else {
        match rewrite::decide(&view, &Policy::default()) {
            Outcome::Untouched => {}
            // srun took a GPU model off its asks for its step: it goes back into the job's.
            Outcome::Plain { gpus: Some(g), .. } => apply_plain(desc, &g),
            _ => log::error(&format!(
                "{PREFIX}: no valid policy; multiplexed job of uid {submit_uid} passes unchanged"
            )),
        }
        return bindings::SLURM_SUCCESS as c_int;
    };
    shared_nodes_asked(&mut view, desc, &policy);
    match rewrite::decide(&view, &policy) {
        Outcome::Untouched => bindings::SLURM_SUCCESS as c_int,
        Outcome::Reject { kind, message } => {
            log::info(&format!("{PREFIX}: rejected a job of uid {submit_uid}: {message}"));
            if !err_msg.is_null() {
                // SAFETY: err_msg points to Slurm's `char *`, which it frees with xfree.
                unsafe { *err_msg = host::xstrdup(&message) };
            }
            reject_code(kind)
        }
        Outcome::Plain { exc_nodes, gpus } => {
            if let Some(exc_nodes) = exc_nodes {
                // SAFETY: exc_nodes is a Slurm-owned string or NULL (as in the rewrite below).
                unsafe { host::replace_string(&mut desc.exc_nodes, &exc_nodes) };
                log::verbose(&format!(
                    "{PREFIX}: uid {submit_uid}: a job without --multiplex asks for GPUs; kept off the shared nodes: exclude={exc_nodes}"
                ));
            }
            if let Some(g) = gpus {
                apply_plain(desc, &g);
                log::verbose(&format!(
                    "{PREFIX}: uid {submit_uid}: a job without --multiplex asks for {} GPUs: constraint={} tres_per_node={} tres_per_job={}",
                    g.model,
                    g.features.as_deref().unwrap_or("(as given)"),
                    g.tres_per_node.as_deref().unwrap_or(""),
                    g.tres_per_job.as_deref().unwrap_or("")
                ));
            }
            bindings::SLURM_SUCCESS as c_int
        }
        Outcome::Rewrite(r) => {
            apply(desc, &r);
            log::verbose(&format!(
                "{PREFIX}: uid {submit_uid} app={} -> partition={} tres_per_node={}",
                r.app,
                r.partition,
                r.tres_per_node.as_deref().unwrap_or("")
            ));
            bindings::SLURM_SUCCESS as c_int
        }
    }
}

/// Writes a rewrite into the job's request.
fn apply(desc: &mut job_desc_msg_t, r: &Rewrite) {
    // SAFETY: every field written is a Slurm-owned string (or NULL); replace_string
    // frees the old value with xfree and allocates the new one with xstrdup.
    unsafe {
        host::replace_string(&mut desc.partition, &r.partition);
        host::replace_string(&mut desc.admin_comment, &r.admin_comment);
        set_optional(&mut desc.tres_per_node, r.tres_per_node.as_deref());
        set_optional(&mut desc.tres_per_job, r.tres_per_job.as_deref());
        set_optional(&mut desc.tres_per_task, r.tres_per_task.as_deref());
        set_optional(&mut desc.tres_per_socket, r.tres_per_socket.as_deref());
        set_optional(&mut desc.cpus_per_tres, r.cpus_per_tres.as_deref());
        set_optional(&mut desc.mem_per_tres, r.mem_per_tres.as_deref());
        host::replace_string(&mut desc.licenses, &r.licenses);
    }
    if let Some(cpus) = r.min_cpus {
        desc.min_cpus = match count(desc.min_cpus) {
            Some(asked) => asked.max(cpus),
            None => cpus,
        };
    }
    if let Some(mb) = r.mem_per_node_mb {
        // Slurm refuses --mem and --mem-per-cpu beside --mem-per-gpu before job_submit.
        desc.pn_min_memory = mb;
    }
}

/// A plain job's GPU model as a node feature (or back in its request: [`plain`]).
fn apply_plain(desc: &mut job_desc_msg_t, g: &plain::PlainGpus) {
    // SAFETY: each field is a Slurm-owned string or NULL, as in `apply`.
    unsafe {
        set_optional(&mut desc.tres_per_node, g.tres_per_node.as_deref());
        set_optional(&mut desc.tres_per_job, g.tres_per_job.as_deref());
        set_optional(&mut desc.tres_per_task, g.tres_per_task.as_deref());
        set_optional(&mut desc.tres_per_socket, g.tres_per_socket.as_deref());
        if let Some(f) = &g.features {
            host::replace_string(&mut desc.features, f);
        }
        if let Some(c) = &g.admin_comment {
            host::replace_string(&mut desc.admin_comment, c);
        }
    }
}

fn reject_code(kind: RejectKind) -> c_int {
    (match kind {
        RejectKind::BadOption => bindings::ESLURM_BAD_NAME,
        RejectKind::NoGpu | RejectKind::TooManyGpus | RejectKind::MixedGres => bindings::ESLURM_INVALID_GRES,
        RejectKind::TooManyNodes => bindings::ESLURM_INVALID_NODE_COUNT,
        RejectKind::Exclusive => bindings::ESLURM_NOT_SUPPORTED,
        RejectKind::NotAllowed => bindings::ESLURM_ACCESS_DENIED,
        RejectKind::SharedPartition => bindings::ESLURM_INVALID_PARTITION_NAME,
        RejectKind::SharedNode => bindings::ESLURM_INVALID_NODE_NAME,
        RejectKind::UnknownModel => bindings::ESLURM_INVALID_GRES,
    }) as c_int
}

/// # Safety
/// `*field` must be NULL or owned by Slurm's allocator.
unsafe fn set_optional(field: &mut *mut c_char, value: Option<&str>) {
    // SAFETY: forwarded contract.
    unsafe {
        match value {
            Some(v) => host::replace_string(field, v),
            None => host::xfree(field),
        }
    }
}

fn count(v: u32) -> Option<u32> {
    (v != 0 && v != bindings::NO_VAL).then_some(v)
}

/// Fills in which shared nodes `desc`'s `--nodelist` names, where the policy names any: the
/// user's list is searched by Slurm's parser, never expanded (where Slurm cannot read it, the
/// names between its commas, a list Slurm refuses anyway).
fn shared_nodes_asked(view: &mut JobView, desc: &job_desc_msg_t, policy: &Policy) {
    let Some(shared) = policy.shared_nodes.as_deref() else {
        return;
    };
    // SAFETY: NULL or Slurm's string, valid during the call.
    let Some(list) = (unsafe { c_str(desc.req_nodes) }) else {
        return;
    };
    view.req_nodes = host::hostlist_names(&list, shared.hosts.iter().map(String::as_str)).unwrap_or_else(|| {
        list.split(',')
            .map(str::trim)
            .filter(|h| shared.hosts.contains(*h))
            .map(String::from)
            .collect()
    });
}

/// # Safety
/// The string pointers of `desc` must be NULL or valid C strings, and `spank_job_env` must
/// hold `spank_job_env_size` valid entries.
unsafe fn view_of(desc: &job_desc_msg_t) -> JobView {
    let mut spank_env = Vec::new();
    if !desc.spank_job_env.is_null() {
        for i in 0..desc.spank_job_env_size as usize {
            // SAFETY: the array has spank_job_env_size entries (caller's contract).
            if let Some(e) = unsafe { c_str(*desc.spank_job_env.add(i)) } {
                spank_env.push(e);
            }
        }
    }
    // SAFETY: each is NULL or a valid C string (caller's contract).
    unsafe {
        JobView {
            spank_env,
            user_id: desc.user_id,
            name: c_str(desc.name),
            partition: c_str(desc.partition),
            account: c_str(desc.account),
            admin_comment: c_str(desc.admin_comment),
            tres_per_node: c_str(desc.tres_per_node),
            tres_per_job: c_str(desc.tres_per_job),
            tres_per_task: c_str(desc.tres_per_task),
            tres_per_socket: c_str(desc.tres_per_socket),
            cpus_per_tres: c_str(desc.cpus_per_tres),
            mem_per_tres: c_str(desc.mem_per_tres),
            exclusive: desc.shared == 0,
            min_nodes: count(desc.min_nodes),
            max_nodes: count(desc.max_nodes),
            num_tasks: count(desc.num_tasks),
            req_nodes: Vec::new(),
            node_list: c_str(desc.req_nodes),
            exc_nodes: c_str(desc.exc_nodes),
            licenses: c_str(desc.licenses),
            features: c_str(desc.features),
        }
    }
}

fn modify(
    job_desc: *mut job_desc_msg_t,
    job_ptr: *mut libc::c_void,
    submit_uid: u32,
    err_msg: *mut *mut c_char,
) -> c_int {
    // A panic refuses the update, as one in job_submit rejects the job (the guard logs it).
    slurm_ffi::guard(PREFIX, "job_modify", bindings::SLURM_ERROR, || {
        if job_desc.is_null() {
            return bindings::SLURM_SUCCESS as c_int;
        }
        let Some(policy) = current_policy(false) else {
            return bindings::SLURM_SUCCESS as c_int;
        };
        // SAFETY: slurmctld passes its job record and the update request, valid during the call.
        let (tag, desc) = unsafe { (slurm_ffi::job_record::admin_comment(job_ptr), &mut *job_desc) };
        let Ok(tag) = tag else {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                log::error(&format!(
                    "{PREFIX}: this slurmctld's job records have an unknown layout; updates of multiplexed jobs are not checked"
                ))
            });
            return bindings::SLURM_SUCCESS as c_int;
        };
        // SAFETY: as in job_submit.
        let mut update = unsafe { view_of(desc) };
        shared_nodes_asked(&mut update, desc, &policy);
        // slurmctld runs as the Slurm user: root and it may let a job through the gate.
        // SAFETY: getuid(2) has no preconditions.
        let privileged = submit_uid == 0 || submit_uid == unsafe { libc::getuid() };
        match modify::check_modify(&update, tag.as_deref(), &policy, privileged) {
            Ok(modify::ModifyOk::AsAsked) => bindings::SLURM_SUCCESS as c_int,
            Ok(modify::ModifyOk::Licenses(licenses)) => {
                // SAFETY: the update's licenses is a Slurm-owned string.
                unsafe { host::replace_string(&mut desc.licenses, &licenses) };
                bindings::SLURM_SUCCESS as c_int
            }
            Ok(modify::ModifyOk::ExcNodes(exc_nodes)) => {
                // SAFETY: the update's exc_nodes is a Slurm-owned string.
                unsafe { host::replace_string(&mut desc.exc_nodes, &exc_nodes) };
                bindings::SLURM_SUCCESS as c_int
            }
            Err((kind, message)) => {
                // SAFETY: NULL or Slurm's string, valid during the call.
                let job = unsafe { c_str(desc.job_id_str) }
                    .or_else(|| count(slurm_ffi::job_desc_id(desc)).map(|id| id.to_string()))
                    .unwrap_or_else(|| "?".into());
                log::error(&format!(
                    "{PREFIX}: refused to update job {job} for uid {submit_uid}: {message}"
                ));
                if !err_msg.is_null() {
                    // SAFETY: err_msg points to Slurm's `char *` (23.02+), freed with xfree.
                    unsafe { *err_msg = host::xstrdup(&message) };
                }
                reject_code(kind)
            }
        }
    })
}

slurm_ffi::export_job_modify!(modify);
