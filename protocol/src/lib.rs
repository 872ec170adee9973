//! What the SPANK plugin, the job_submit plugin and `multiplexd` must agree on: the syntax of
//! `--multiplex[=SPEC]`, the messages on the daemon's Unix socket, and a blocking client for
//! code that runs inside Slurm processes.

pub mod claim;
pub mod client;
pub mod gres;
pub mod model;
pub mod spec;
pub mod srun;
pub mod user;
pub mod wire;

pub use claim::{Claim, ClaimError};
pub use client::{Client, ClientError};
pub use spec::{Spec, SpecError};
pub use wire::*;
