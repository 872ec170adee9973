//! Generates bindings from the Slurm headers installed on the build machine, and turns the
//! version differences the plugins care about into `cfg` flags, decided here and nowhere else.

use std::env;
use std::path::PathBuf;

fn main() {
    let include = env::var("SLURM_INCLUDE_DIR").unwrap_or_else(|_| "/usr/include".to_string());
    println!("cargo:rerun-if-env-changed=SLURM_INCLUDE_DIR");
    println!("cargo:rerun-if-changed=wrapper.h");
    println!("cargo:rerun-if-changed={include}/slurm/slurm_version.h");
    println!("cargo:rerun-if-changed={include}/slurm/slurm.h");
    let (major, minor) = slurm_version(&include);

    // job_modify gained `char **err_msg` in 23.02.
    println!("cargo:rustc-check-cfg=cfg(slurm_job_modify_err_msg)");
    if (major, minor) >= (23, 2) {
        println!("cargo:rustc-cfg=slurm_job_modify_err_msg");
    }

    // slurmctld's private job_record_t, read by layout (src/job_record.rs): checked on 22.05
    // through 24.11 (the magic cookie first) and on 26.05 (a slurm_step_id_t first, then the
    // cookie: SchedMD's src/common/job_record.h, 26.05.0 through 26.05.3).
    println!("cargo:rustc-check-cfg=cfg(slurm_job_record_checked)");
    println!("cargo:rustc-check-cfg=cfg(slurm_job_record_step_id)");
    if ((22, 5)..=(24, 11)).contains(&(major, minor)) || (major, minor) == (26, 5) {
        println!("cargo:rustc-cfg=slurm_job_record_checked");
    }
    if (major, minor) == (26, 5) {
        println!("cargo:rustc-cfg=slurm_job_record_step_id");
    }

    // slurm_load_job takes a slurm_step_id_t instead of a job id from 26.05 (read from the
    // header itself: the release that changed it is not one tested here).
    println!("cargo:rustc-check-cfg=cfg(slurm_load_job_step_id)");
    let slurm_h = std::fs::read_to_string(format!("{include}/slurm/slurm.h")).unwrap_or_default();
    if slurm_h.contains("slurm_load_job(job_info_msg_t **resp, slurm_step_id_t") {
        println!("cargo:rustc-cfg=slurm_load_job_step_id");
    }

    // job_desc_msg_t names its job by a slurm_step_id_t (`step_id.job_id`) from 26.05, by
    // `job_id` before.
    println!("cargo:rustc-check-cfg=cfg(slurm_job_desc_step_id)");
    let job_desc = slurm_h
        .split("typedef struct job_descriptor {")
        .nth(1)
        .and_then(|rest| rest.split("} job_desc_msg_t;").next())
        .unwrap_or("");
    if job_desc.contains("slurm_step_id_t step_id;") {
        println!("cargo:rustc-cfg=slurm_job_desc_step_id");
    }

    let bindings = bindings(&include);
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("bindings.rs");
    if let Err(e) = bindings.write_to_file(&out) {
        fail(&format!("cannot write {}: {e}", out.display()));
    }
}

/// The (major, minor) release of the Slurm headers in `include`.
fn slurm_version(include: &str) -> (u32, u32) {
    let version_h = format!("{include}/slurm/slurm_version.h");
    let version_text = std::fs::read_to_string(&version_h).unwrap_or_else(|e| {
        fail(&format!(
            "cannot read {version_h} ({e}): install the Slurm headers (Debian: apt-get install libslurm-dev) \
             or set SLURM_INCLUDE_DIR to the directory holding slurm/slurm.h"
        ))
    });
    let version = parse_version_number(&version_text).unwrap_or_else(|| {
        fail(&format!(
            "{version_h} has no SLURM_VERSION_NUMBER: is it Slurm's header?"
        ))
    });
    ((version >> 16) & 0xff, (version >> 8) & 0xff)
}

/// The types and constants the plugins use, from the Slurm headers in `include`.
fn bindings(include: &str) -> bindgen::Bindings {
    // bindgen panics with a backtrace when it finds no libclang; say what to install instead.
    if let Err(e) = clang_sys::load() {
        fail(&format!(
            "bindgen needs libclang to read the Slurm headers and found none: install it \
             (Debian: apt-get install libclang-dev) or set LIBCLANG_PATH to the directory holding libclang.so \
             (clang-sys said: {e})"
        ));
    }
    bindgen::Builder::default()
        .header("wrapper.h")
        .clang_arg(format!("-I{include}"))
        .allowlist_type("job_desc_msg_t")
        .allowlist_type("spank_t")
        .allowlist_type("spank_item_t")
        .allowlist_type("spank_err_t")
        .allowlist_type("spank_context_t")
        .allowlist_type("spank_option")
        .allowlist_type("spank_opt_cb_f")
        .allowlist_var("SLURM_VERSION_NUMBER")
        .allowlist_var("SLURM_SUCCESS")
        .allowlist_var("SLURM_ERROR")
        .allowlist_var("NO_VAL.*")
        .allowlist_var("SLURM_BATCH_SCRIPT")
        .allowlist_var("SLURM_EXTERN_CONT")
        .allowlist_var("SLURM_INTERACTIVE_STEP")
        .allowlist_var("ESPANK_.*")
        .allowlist_type("slurm_err_t")
        // The host functions' prototypes, as pointer types (wrapper.h).
        .allowlist_type("multiplex_.*_f")
        .prepend_enum_name(false)
        // Functions are resolved at run time (see `host`), so no extern block is generated.
        .blocklist_function(".*")
        .derive_default(false)
        .layout_tests(false)
        .generate()
        .unwrap_or_else(|e| {
            fail(&format!(
                "bindgen could not read the Slurm headers in {include} ({e}); if it names a missing header \
                 such as stddef.h, install clang's headers (Debian: apt-get install libclang-dev)"
            ))
        })
}

/// Stops the build with one sentence saying what is missing, not a panic and its backtrace.
fn fail(message: &str) -> ! {
    eprintln!("error: slurm-ffi: {message}");
    std::process::exit(1);
}

fn parse_version_number(text: &str) -> Option<u32> {
    text.lines().find_map(|line| {
        let rest = line.trim().strip_prefix("#define SLURM_VERSION_NUMBER")?;
        let hex = rest.trim().strip_prefix("0x")?;
        u32::from_str_radix(hex.trim(), 16).ok()
    })
}
