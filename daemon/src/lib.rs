//! `multiplexd`: the per-node daemon that decides which shared GPU each multiplexed job joins,
//! keeps the interference history, and learns from every finished job.

pub mod admission;
pub mod background;
pub mod check;
pub mod claim;
pub mod claimer;
pub mod command;
pub mod config;
pub mod gpus;
pub mod history;
pub mod inspect;
pub mod learn;
pub mod lessons;
pub mod metrics;
pub mod node;
pub mod nodeconf;
pub mod placement;
pub mod put_back;
pub mod reconcile;
pub mod separate;
pub mod serve;
pub mod server;
pub mod share;
pub mod slurm;
pub mod telemetry;
pub mod tools;
pub mod types;
