//! Slurm's books as the claimer reads them: the world's view (what holds which GPU, the first
//! pending jobs in Slurm's order) kept from one look to the next as a [`Slurm`] the daemon's
//! own [`Claimer::look`] runs over (Slurm's reasons, tags, gres types and pins as on a
//! cluster), which tells the claimer what changed since its last read ([`Slurm::jobs_since`])
//! and the gate, reservations and node list as the daemon's unit tests fake them ([`Fake`]).
//! The pins the claimer writes are read back as the world takes them. The simulated nodes are
//! `sim0`, `sim1`, ...; each job is tagged as job_submit tags it, its application its `app=`.

use super::input::Table;
use super::model::{Cluster, JobRef};
use multiplex_protocol::gres::{gpu_type, split_gpu_type, type_of};
use multiplex_protocol::spec::{put_back_note, with_note, Spec, GATE_LICENSE};
use multiplexd::claimer::{Claimer, Scorer};
use multiplexd::slurm::{
    Changes, Fake, FakeState, Gate, Job, JobRecord, NodeInfo, NodeRecord, Pin, ReadCost, Reservation, Slurm, SlurmError,
};
use std::collections::{HashMap, HashSet};
use std::sync::{Mutex, MutexGuard};

/// A simulated node's name.
pub(crate) fn node_name(n: usize) -> String {
    format!("sim{n}")
}

/// What the world shows one look.
pub(crate) struct View<'a> {
    /// The GPUs whose jobs changed since the look before, with what holds each now.
    pub cluster: &'a Cluster<'a>,
    /// The first pending jobs, in Slurm's order.
    pub pending: &'a [JobRef],
}

/// One look of `claimer` at `now` over what the world shows, on `books` (kept between looks),
/// scored by `scorer`: the claims as (pending index, node, GPU).
pub(crate) fn look(
    claimer: &mut Claimer,
    scorer: &dyn Scorer,
    books: &Books,
    view: View,
    now: f64,
) -> Result<Vec<(usize, usize, usize)>, String> {
    books.show(&view);
    let looked = claimer.look(books, scorer, now).map_err(|e| e.to_string())?;
    // Every job of the trace fits some GPU alone: none has a place in it refused.
    if let Some((job, reason)) = looked.refused.first() {
        return Err(format!("job {job} refused: {reason}"));
    }
    let pins = std::mem::take(&mut books.log().pins);
    pins.iter()
        .map(|pin| {
            let index = view.pending.iter().position(|j| j.id == pin.job);
            let node = pin.node.strip_prefix("sim").and_then(|n| n.parse().ok());
            let gpu = pin.gres.as_deref().and_then(type_of).and_then(split_gpu_type);
            match (index, node, gpu) {
                (Some(i), Some(n), Some((_, g))) => Ok((i, n, g as usize)),
                _ => Err(format!("the claimer wrote a pin the world cannot read: {pin:?}")),
            }
        })
        .collect()
}

/// Slurm's books for one policy's claimer, kept between looks: each GPU's jobs as the world
/// last showed them, what came and left since the claimer's last read, the pending jobs, and
/// the pins the claimer wrote. The gate, the reservations and the node list are a [`Fake`]'s.
pub(crate) struct Books {
    names: Names,
    /// Each job waits on one GPU index from its submission, as job_submit binds it where
    /// Slurm merges gres updates (22.05), and a claim chooses the node.
    fixed_gpu: bool,
    fake: Fake,
    log: Mutex<Log>,
}

#[derive(Default)]
struct Log {
    /// Per GPU (`node * gpus + gpu`), the jobs it holds.
    on: Vec<Vec<u32>>,
    /// Every job that holds a slot, as squeue would list it.
    running: HashMap<u32, Job>,
    /// Since the claimer's last read: jobs that came to a GPU, and jobs that left one.
    came: Vec<u32>,
    left: Vec<u32>,
    /// The mark the claimer's next read gives, if it read before.
    mark: u64,
    pending: Vec<Job>,
    /// Jobs waiting for a claim behind `pending`, which the world does not list.
    unlisted: usize,
    pins: Vec<Pin>,
}

impl Books {
    pub(crate) fn new(names: Names, fixed_gpu: bool) -> Books {
        let gpus = names.nodes.len() * names.shards.len();
        let fake = Fake::new(FakeState {
            nodes: names.nodes.clone(),
            merges: fixed_gpu,
            ..FakeState::default()
        });
        Books {
            names,
            fixed_gpu,
            fake,
            log: Mutex::new(Log {
                on: vec![Vec::new(); gpus],
                ..Log::default()
            }),
        }
    }

    fn log(&self) -> MutexGuard<'_, Log> {
        self.log.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// What the world shows now: the GPUs that changed, the pending jobs.
    fn show(&self, view: &View) {
        let names = &self.names;
        let gpus = names.shards.len();
        let mut log = self.log();
        let log = &mut *log;
        // What left a GPU first, then what came to one: a job that moved is running.
        for (gi, jobs) in view.cluster.changed {
            for id in &log.on[*gi] {
                if !jobs.iter().any(|j| j.id == *id) {
                    log.running.remove(id);
                    log.left.push(*id);
                }
            }
        }
        for (gi, jobs) in view.cluster.changed {
            let (n, g) = (gi / gpus, gi % gpus);
            for r in jobs {
                if log.on[*gi].contains(&r.id) {
                    continue;
                }
                log.running.insert(
                    r.id,
                    Job {
                        id: r.id,
                        pending: false,
                        reason: "None".into(),
                        node: Some(names.nodes[n].name.clone()),
                        excluded: None,
                        gres: names.shards[g].clone(),
                        licenses: String::new(),
                        admin_comment: names.admin_comment(r),
                    },
                );
                log.came.push(r.id);
            }
            log.on[*gi] = jobs.iter().map(|j| j.id).collect();
        }
        log.pending = view
            .pending
            .iter()
            .map(|j| Job {
                id: j.id,
                pending: true,
                reason: "Licenses".into(),
                node: None,
                excluded: None,
                // job_submit's rotation over the GPU indices, in submission order.
                gres: match self.fixed_gpu {
                    true => names.shards[(j.id as usize - 1) % gpus].clone(),
                    false => "shard:1".into(),
                },
                licenses: format!("{GATE_LICENSE}:1"),
                admin_comment: names.admin_comment(j),
            })
            .collect();
        log.unlisted = view.cluster.waiting.saturating_sub(view.pending.len());
    }

    /// The jobs that hold a slot, in the world's GPU order.
    fn every_running(log: &Log) -> Vec<Job> {
        log.on
            .iter()
            .flatten()
            .filter_map(|id| log.running.get(id).cloned())
            .collect()
    }

    fn pending_job(&self, id: u32) -> Result<(), SlurmError> {
        match self.log().pending.iter().any(|j| j.id == id) {
            true => Ok(()),
            false => Err(SlurmError::NotPending(id)),
        }
    }
}

/// The claimer's reads of the jobs come from the world's view; its pins go back to the world;
/// everything else is the [`Fake`]'s.
impl Slurm for Books {
    fn jobs(&self, _partition: &str) -> Result<Vec<Job>, SlurmError> {
        let log = self.log();
        let mut jobs = Books::every_running(&log);
        jobs.extend(log.pending.iter().cloned());
        Ok(jobs)
    }
    fn jobs_since(&self, _partition: &str, since: Option<u64>) -> Result<Option<Changes>, SlurmError> {
        let mut log = self.log();
        let log = &mut *log;
        let whole = since != Some(log.mark);
        let (came, left) = (std::mem::take(&mut log.came), std::mem::take(&mut log.left));
        log.mark += 1;
        let (running, gone) = if whole {
            (Books::every_running(log), Vec::new())
        } else {
            let mut seen = HashSet::new();
            let running = (came.iter())
                .filter(|id| seen.insert(**id))
                .filter_map(|id| log.running.get(id).cloned())
                .collect();
            let gone = left.into_iter().filter(|id| !log.running.contains_key(id)).collect();
            (running, gone)
        };
        Ok(Some(Changes {
            mark: log.mark,
            whole,
            pending: log.pending.clone(),
            unlisted: log.unlisted,
            running,
            gone,
        }))
    }
    fn nodes(&self, partition: &str) -> Result<Vec<NodeInfo>, SlurmError> {
        self.fake.nodes(partition)
    }
    fn claim(&self, pin: &Pin) -> Result<(), SlurmError> {
        self.pending_job(pin.job)?;
        self.log().pins.push(pin.clone());
        Ok(())
    }
    fn merges_gres_updates(&self) -> Result<bool, SlurmError> {
        Ok(self.fixed_gpu)
    }
    fn hold_gate(&self, gate: &Gate, lease_s: u64) -> Result<(), SlurmError> {
        self.fake.hold_gate(gate, lease_s)
    }
    fn reservations(&self) -> Result<Vec<Reservation>, SlurmError> {
        self.fake.reservations()
    }
    fn take_lease(&self, name: &str, license: &str, seconds: u64) -> Result<bool, SlurmError> {
        self.fake.take_lease(name, license, seconds)
    }
    fn renew_lease(&self, name: &str, seconds: u64) -> Result<bool, SlurmError> {
        self.fake.renew_lease(name, seconds)
    }
    fn delete_reservation(&self, name: &str) -> Result<(), SlurmError> {
        self.fake.delete_reservation(name)
    }
    fn switch_gate(&self, gate: &Gate, on: bool) -> Result<(), SlurmError> {
        self.fake.switch_gate(gate, on)
    }
    /// A job let through the gate unclaimed: the look says so.
    fn release(&self, job: u32, _licenses: &str, _admin_comment: &str) -> Result<(), SlurmError> {
        self.pending_job(job)
    }
    fn requeue(&self, job: u32) -> Result<(), SlurmError> {
        self.fake.requeue(job)
    }
    fn job_record(&self, id: u32) -> Result<JobRecord, SlurmError> {
        self.fake.job_record(id)
    }
    fn set_admin_comment(&self, id: u32, admin_comment: &str) -> Result<(), SlurmError> {
        self.fake.set_admin_comment(id, admin_comment)
    }
    fn running_here(&self, node: &str) -> Result<HashSet<u32>, SlurmError> {
        self.fake.running_here(node)
    }
    fn private_jobs(&self) -> Result<bool, SlurmError> {
        self.fake.private_jobs()
    }
    fn node_record(&self, node: &str) -> Result<NodeRecord, SlurmError> {
        self.fake.node_record(node)
    }
    fn hostnames(&self, list: &str) -> Result<Vec<String>, SlurmError> {
        self.fake.hostnames(list)
    }
    fn job_nodes(&self, id: u32) -> Result<Option<String>, SlurmError> {
        self.fake.job_nodes(id)
    }
    fn job_gpu(&self, id: u32) -> Result<Option<u32>, SlurmError> {
        self.fake.job_gpu(id)
    }
    fn license_total(&self, name: &str) -> Result<u32, SlurmError> {
        self.fake.license_total(name)
    }
    fn job_reads(&self) -> Result<Option<ReadCost>, SlurmError> {
        self.fake.job_reads()
    }
    fn held_whole(&self, partition: &str) -> Result<Vec<(String, String)>, SlurmError> {
        self.fake.held_whole(partition)
    }
}

/// What Slurm's books name, written once per run: each application's tag (job_submit's), the
/// put-back note naming each application, each GPU's shard gres, each node's name and record.
pub(crate) struct Names {
    tags: Vec<String>,
    put_back: Vec<String>,
    shards: Vec<String>,
    nodes: Vec<NodeInfo>,
}

impl Names {
    pub(crate) fn new(table: &Table, nodes: usize, gpus: usize, slots: u32) -> Names {
        let tags: Vec<String> = table.apps.iter().map(|app| tag(app)).collect();
        // A job the daemon put back after it ran out of memory beside a partner: its tag with
        // the note saying so.
        let put_back = table.apps.iter().map(|app| put_back_note(app, "sim", "0")).collect();
        Names {
            tags,
            put_back,
            shards: (0..gpus as u32)
                .map(|g| format!("shard:{}:1", gpu_type(&table.model, g)))
                .collect(),
            nodes: (0..nodes).map(|n| node_info(&table.model, n, gpus, slots)).collect(),
        }
    }

    /// A job's admin comment.
    fn admin_comment(&self, j: &JobRef) -> Option<String> {
        Some(match j.put_back {
            Some(beside) => with_note(&self.tags[j.app], &self.put_back[beside]),
            None => self.tags[j.app].clone(),
        })
    }
}

/// job_submit's tag of a job of `app`.
fn tag(app: &str) -> String {
    Spec {
        app: Some(app.to_string()),
        ..Spec::default()
    }
    .tag()
}

/// A simulated node as sinfo lists it.
fn node_info(model: &str, n: usize, gpus: usize, slots: u32) -> NodeInfo {
    let each = |kind: &'static str, count: u32| {
        (0..gpus as u32).map(move |g| format!("{kind}:{}:{count}", gpu_type(model, g)))
    };
    NodeInfo {
        name: node_name(n),
        state: "mixed".into(),
        gres: each("gpu", 1).chain(each("shard", slots)).collect::<Vec<_>>().join(","),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use multiplexd::config::ClaimConfig;
    use multiplexd::placement::{Estimates, Knobs, Wanted};
    use std::collections::HashMap;

    /// Knows nothing of any pair: the claimer spreads.
    struct Blank;

    impl Scorer for Blank {
        fn gpu_memory(&self) -> HashMap<String, u64> {
            HashMap::new()
        }
        fn app_memory(&self) -> Result<HashMap<String, u64>, String> {
            Ok(HashMap::new())
        }
        fn knobs(&self) -> Knobs {
            Knobs {
                slots: 2,
                unknown_pair_speed: 0.5,
                min_gain: 0.25,
                share_queue: 0.0,
                separate_below: 0.0,
            }
        }
        fn estimates(&self, _: &Wanted) -> Result<Estimates, String> {
            Ok(Estimates::default())
        }
    }

    fn table() -> Table {
        Table::parse("gpu,job_a,job_b,speed_a,speed_b\nv100,a,a,0.5,0.5\n", "t").unwrap()
    }

    #[test]
    fn the_claimer_reads_the_worlds_view_as_slurms_books_and_its_pins_come_back() {
        let table = table();
        // Two nodes of two GPUs: node 0's GPU 0 and node 1's GPU 1 hold a job each.
        let job = |id| JobRef {
            id,
            app: 0,
            put_back: None,
        };
        let changed = [(0, vec![job(1)]), (1, vec![]), (2, vec![]), (3, vec![job(2)])];
        let pending = [job(3), job(4), job(5)];
        let view = View {
            cluster: &two_by_two(&changed),
            pending: &pending,
        };
        let mut claimer = Claimer::new(ClaimConfig::default(), 1);
        let books = Books::new(Names::new(&table, 2, 2, 2), false);
        let pins = look(&mut claimer, &Blank, &books, view, 0.0).unwrap();
        // The two idle GPUs first, in Slurm's order, then a share of the first GPU that holds
        // one job (a pair never seen is tried).
        assert_eq!(pins, vec![(0, 0, 1), (1, 1, 0), (2, 0, 0)]);
    }

    #[test]
    fn where_jobs_are_bound_to_a_gpu_index_a_claim_chooses_only_the_node() {
        let table = table();
        let job = |id| JobRef {
            id,
            app: 0,
            put_back: None,
        };
        // Job 3 is bound to GPU 0 ((3 - 1) % 2), held on node 0 and idle on node 1.
        let changed = [(0, vec![job(1)]), (1, vec![]), (2, vec![]), (3, vec![job(2)])];
        let view = View {
            cluster: &two_by_two(&changed),
            pending: &[job(3)],
        };
        let mut claimer = Claimer::new(ClaimConfig::default(), 1);
        let books = Books::new(Names::new(&table, 2, 2, 2), true);
        let pins = look(&mut claimer, &Blank, &books, view, 0.0).unwrap();
        assert_eq!(pins, vec![(0, 1, 0)]);
    }

    /// The GPUs that changed; the pending jobs each test lists are all that wait.
    fn two_by_two(changed: &[(usize, Vec<JobRef>)]) -> Cluster<'_> {
        Cluster { changed, waiting: 0 }
    }

    #[test]
    fn a_look_shown_only_what_changed_keeps_what_earlier_looks_saw() {
        let table = table();
        let job = |id| JobRef {
            id,
            app: 0,
            put_back: None,
        };
        let mut claimer = Claimer::new(ClaimConfig::default(), 1);
        let books = Books::new(Names::new(&table, 2, 2, 2), false);
        let mut look_at = |now: f64, changed: &[(usize, Vec<JobRef>)], pending: &[JobRef]| {
            let view = View {
                cluster: &two_by_two(changed),
                pending,
            };
            look(&mut claimer, &Blank, &books, view, now).unwrap()
        };
        // Node 0's GPU 0 holds job 1; nothing waits.
        let every = [(0, vec![job(1)]), (1, vec![]), (2, vec![]), (3, vec![])];
        assert_eq!(look_at(0.0, &every, &[]), vec![]);
        // Job 2 starts on node 1's GPU 0, shown alone: job 3 takes the first GPU still idle
        // (node 0's GPU 1), not job 1's.
        assert_eq!(look_at(1.0, &[(2, vec![job(2)])], &[job(3)]), vec![(0, 0, 1)]);
        // Job 1 left and job 3 holds its claim: job 4 takes job 1's GPU, idle again, before
        // node 1's GPU 1.
        let changed = [(0, vec![]), (1, vec![job(3)])];
        assert_eq!(look_at(2.0, &changed, &[job(4)]), vec![(0, 0, 0)]);
    }

    #[test]
    fn a_table_whose_names_could_not_travel_in_a_tag_is_refused() {
        let bad = Table::parse("gpu,job_a,job_b,speed_a,speed_b\nv100,a b,a b,0.5,0.5\n", "t");
        assert!(bad.unwrap_err().contains("app name 'a b' is invalid"));
        let bad = Table::parse("gpu,job_a,job_b,speed_a,speed_b\nv 100,a,a,0.5,0.5\n", "t");
        assert!(bad.unwrap_err().contains("GPU model \"v 100\""));
    }
}
