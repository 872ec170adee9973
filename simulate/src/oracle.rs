//! The oracle: the claimer's own code handed the true table instead of a history.

use super::books::{self, Books, Names, View};
use super::input::Table;
use super::learned::Options;
use super::world::{Cluster, JobRef, Policy, Shape};
use multiplexd::claimer::{Claimer, Scorer};
use multiplexd::config::DEFAULT_UNKNOWN_PAIR_SPEED;
use multiplexd::placement::{Estimates, Knobs, PairEstimate, Wanted};
use std::collections::HashMap;

/// The true table as placement's snapshot: every pair seen, infeasible pairs known.
fn truth(table: &Table) -> Estimates {
    let mut e = Estimates::default();
    for (a, app) in table.apps.iter().enumerate() {
        for (b, other) in table.apps.iter().enumerate() {
            let (s, o) = (table.speed(a, b), table.speed(b, a));
            e.insert_pair(
                &table.model,
                app,
                other,
                PairEstimate {
                    speed: s.unwrap_or(0.0),
                    other_speed: o.unwrap_or(0.0),
                    observations: 1,
                    oom: s.is_none() || o.is_none(),
                },
            );
        }
    }
    e
}

/// The claimer, knowing the table: the daemon's [`Claimer`] over Slurm's books ([`books`]),
/// scored by the truth.
pub(crate) struct Oracle {
    truth: Truth,
    claimer: Claimer,
    lookahead: usize,
    /// Slurm's books as the claimer reads them, kept between its looks.
    books: Books,
    put_back: bool,
}

impl Oracle {
    pub(crate) fn new(table: &Table, shape: Shape, options: Options) -> Result<Self, String> {
        let config = options.config("oracle", shape.jobs_per_gpu)?;
        let truth = Truth {
            estimates: truth(table),
            memory: (table.apps.iter().enumerate())
                .map(|(a, app)| (app.clone(), table.memory_of(a)))
                .collect(),
            gpu_memory: (table.gpu_memory().map(|m| (table.model.clone(), m)).into_iter()).collect(),
            knobs: Knobs {
                slots: shape.jobs_per_gpu,
                unknown_pair_speed: DEFAULT_UNKNOWN_PAIR_SPEED,
                min_gain: config.policy.min_gain,
                share_queue: config.policy.share_queue,
                separate_below: config.policy.separate_below,
            },
        };
        Ok(Oracle {
            truth,
            lookahead: config.claim.lookahead,
            claimer: Claimer::new(config.claim, 1),
            books: Books::new(
                Names::new(table, shape.nodes, shape.gpus_per_node, shape.jobs_per_gpu),
                options.fixed_gpu,
            ),
            put_back: config.policy.put_back,
        })
    }
}

/// What the oracle knows: every pair's speeds and every application's memory, where the
/// table has memory.
struct Truth {
    estimates: Estimates,
    memory: HashMap<String, Option<u64>>,
    gpu_memory: HashMap<String, u64>,
    knobs: Knobs,
}

impl Scorer for Truth {
    fn gpu_memory(&self) -> HashMap<String, u64> {
        self.gpu_memory.clone()
    }

    fn app_memory(&self) -> Result<HashMap<String, u64>, String> {
        Ok(self
            .memory
            .iter()
            .filter_map(|(app, m)| m.map(|m| (app.clone(), m)))
            .collect())
    }

    fn knobs(&self) -> Knobs {
        self.knobs
    }

    fn estimates(&self, _: &Wanted) -> Result<Estimates, String> {
        Ok(self.estimates.clone())
    }
}

impl Policy for Oracle {
    /// The node's daemon puts a job out of memory beside a partner back in the queue.
    fn puts_back(&self) -> bool {
        self.put_back
    }
    fn claims(&self) -> bool {
        true
    }
    fn claim_lookahead(&self) -> usize {
        self.lookahead
    }
    fn look_again(&self) -> Option<f64> {
        self.claimer.next_trial_end()
    }
    fn claim(&mut self, now: f64, cluster: &Cluster, pending: &[JobRef]) -> Result<Vec<(usize, usize, usize)>, String> {
        let view = View { cluster, pending };
        books::look(&mut self.claimer, &self.truth, &self.books, view, now)
    }
    fn finished(&mut self, _: f64, _: usize, _: JobRef, _: bool) -> Result<(), String> {
        Ok(())
    }
}
