//! The policies compared, by name. `learned` is the daemon itself and `oracle` the claimer's
//! code handed the true table (both in [`crate::learned`]); the others are Slurm's own shard
//! placement with one rule or another for the GPU.

use super::input::{Rng, Table};
use super::world::{JobRef, Policy, Shape};
use multiplexd::history::Export;

/// The policies by name, in the order they are reported.
pub const ALL: [&str; 6] = ["exclusive", "first-fit", "least-loaded", "random", "learned", "oracle"];

use crate::learned::Learned;
pub use crate::learned::{Options, DEFAULT_SHARE_EVERY_S};
use crate::oracle::Oracle;

/// Makes the named policy for a cluster.
pub fn make<'a>(name: &str, table: &'a Table, shape: Shape, seed: u64) -> Result<Box<dyn Policy + 'a>, String> {
    make_with(name, table, shape, seed, Options::default())
}

/// [`make`], with the daemon's settings `options` for the learned policy and the oracle.
pub fn make_with<'a>(
    name: &str,
    table: &'a Table,
    shape: Shape,
    seed: u64,
    options: Options,
) -> Result<Box<dyn Policy + 'a>, String> {
    make_from(name, table, shape, seed, options, None)
}

/// [`make_with`], the learned policy's nodes starting from `history` (what `multiplexd
/// import` of a site's earlier export gives each node) instead of an empty one.
pub fn make_from<'a>(
    name: &str,
    table: &'a Table,
    shape: Shape,
    seed: u64,
    options: Options,
    history: Option<&Export>,
) -> Result<Box<dyn Policy + 'a>, String> {
    let k = shape.jobs_per_gpu as usize;
    Ok(match name {
        "exclusive" => Box::new(Exclusive),
        "first-fit" => Box::new(FirstFit(k)),
        "least-loaded" => Box::new(LeastLoaded(k)),
        "random" => Box::new(Random(Rng::new(seed ^ 0x7a4d), k)),
        "oracle" => Box::new(Oracle::new(table, shape, options)?),
        "learned" => {
            let mut learned = Learned::new(table, shape, options)?;
            if let Some(h) = history {
                learned.import(h)?;
            }
            Box::new(learned)
        }
        other => return Err(format!("unknown policy {other:?}: choose from {}", ALL.join(", "))),
    })
}

fn free_slot(gpus: &[Vec<JobRef>], slots: usize) -> impl Iterator<Item = usize> + '_ {
    gpus.iter()
        .enumerate()
        .filter(move |(_, g)| g.len() < slots)
        .map(|(i, _)| i)
}

/// Slurm offers a node only when it has a free slot.
fn offered(gpu: Option<usize>) -> Result<usize, String> {
    gpu.ok_or_else(|| "Slurm offered a node with no free slot".to_string())
}

/// One job per GPU: Slurm's plain `gpu` gres.
struct Exclusive;

impl Policy for Exclusive {
    fn slots(&self, _shape: &Shape) -> u32 {
        1
    }
    fn place(&mut self, _: f64, _: usize, _: JobRef, gpus: &[Vec<JobRef>]) -> Result<usize, String> {
        offered(free_slot(gpus, 1).next())
    }
    fn finished(&mut self, _: f64, _: usize, _: JobRef, _: bool) -> Result<(), String> {
        Ok(())
    }
}

/// Slurm's shard placement: the first GPU with a free shard.
struct FirstFit(usize);

impl Policy for FirstFit {
    fn place(&mut self, _: f64, _: usize, _: JobRef, gpus: &[Vec<JobRef>]) -> Result<usize, String> {
        offered(free_slot(gpus, self.0).next())
    }
    fn finished(&mut self, _: f64, _: usize, _: JobRef, _: bool) -> Result<(), String> {
        Ok(())
    }
}

/// Slurm 23.11's `LL_SHARED_GRES`: the least-loaded GPU (the first of equals).
struct LeastLoaded(usize);

impl Policy for LeastLoaded {
    fn place(&mut self, _: f64, _: usize, _: JobRef, gpus: &[Vec<JobRef>]) -> Result<usize, String> {
        offered(free_slot(gpus, self.0).min_by_key(|&g| gpus[g].len()))
    }
    fn finished(&mut self, _: f64, _: usize, _: JobRef, _: bool) -> Result<(), String> {
        Ok(())
    }
}

/// A GPU with a free slot, at random.
struct Random(Rng, usize);

impl Policy for Random {
    fn place(&mut self, _: f64, _: usize, _: JobRef, gpus: &[Vec<JobRef>]) -> Result<usize, String> {
        let free: Vec<usize> = free_slot(gpus, self.1).collect();
        offered((!free.is_empty()).then(|| free[self.0.below(free.len())]))
    }
    fn finished(&mut self, _: f64, _: usize, _: JobRef, _: bool) -> Result<(), String> {
        Ok(())
    }
}
