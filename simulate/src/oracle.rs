//! The oracle: the claimer's own code handed the true table instead of a history.

use super::input::Table;
use super::learned::{candidates, pins, Options};
use super::world::{JobRef, Policy, Shape};
use multiplexd::claim::{self, NodeGpus};
use multiplexd::config::{PolicyConfig, DEFAULT_UNKNOWN_PAIR_SPEED};
use multiplexd::placement::{Estimates, GpuState, Knobs, PairEstimate, Resident};

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

/// The claimer, knowing the table.
pub(crate) struct Oracle<'a> {
    table: &'a Table,
    truth: Estimates,
    shape: Shape,
    /// The daemon's default policy, with the run's `min_gain`.
    policy: PolicyConfig,
    lookahead: usize,
    fixed_gpu: bool,
    memory: claim::Memory,
}

impl<'a> Oracle<'a> {
    pub(crate) fn new(table: &'a Table, shape: Shape, options: Options) -> Result<Self, String> {
        let config = options.config("oracle", shape.jobs_per_gpu)?;
        Ok(Oracle {
            table,
            truth: truth(table),
            shape,
            policy: config.policy,
            lookahead: config.claim.lookahead,
            fixed_gpu: options.fixed_gpu,
            memory: claim::Memory::default(),
        })
    }

    /// The node's GPUs as placement reads them (the oracle knows each job's memory, where the
    /// table has memory).
    fn states(&self, gpus: &[Vec<JobRef>]) -> Vec<GpuState> {
        gpus.iter()
            .enumerate()
            .map(|(i, g)| GpuState {
                index: i as u32,
                model: self.table.model.clone(),
                memory_mb: self.table.gpu_memory().unwrap_or(u64::MAX),
                residents: g
                    .iter()
                    .map(|r| Resident {
                        job_id: r.id,
                        app: self.table.apps[r.app].clone(),
                        mem_mb: self.table.memory_of(r.app),
                    })
                    .collect(),
            })
            .collect()
    }
}

impl Policy for Oracle<'_> {
    fn claims(&self) -> bool {
        true
    }
    fn claim_lookahead(&self) -> usize {
        self.lookahead
    }
    fn look_again(&self) -> Option<f64> {
        self.memory.trials.next_end()
    }
    fn claim(
        &mut self,
        now: f64,
        cluster: &[Vec<Vec<JobRef>>],
        pending: &[JobRef],
    ) -> Result<Vec<(usize, usize, usize)>, String> {
        let nodes: Vec<NodeGpus> = cluster
            .iter()
            .enumerate()
            .map(|(n, gpus)| NodeGpus {
                node: format!("sim{n}"),
                gpus: self.states(gpus),
            })
            .collect();
        let fixed = self.fixed_gpu.then_some(self.shape.gpus_per_node);
        let candidates = candidates(self.table, pending, |app| self.table.memory_of(app), fixed);
        let knobs = Knobs {
            slots: self.shape.jobs_per_gpu,
            unknown_pair_speed: DEFAULT_UNKNOWN_PAIR_SPEED,
            min_gain: self.policy.min_gain,
            separate_below: self.policy.separate_below,
        };
        let choices = claim::choose(&nodes, &candidates, &mut self.truth, knobs, &mut self.memory, now);
        pins(&choices)
    }
    fn finished(&mut self, _: f64, _: usize, _: JobRef, _: bool) -> Result<(), String> {
        Ok(())
    }
}
